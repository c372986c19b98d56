#!/usr/bin/env bash
# Everything in splitserve that needs a GPU, in one run on one GPU host (README.md beside
# this file): install the carried wheels, `pytest -m gpu tests/gpu` within a time budget,
# then `bench/engine.py --device cuda`, and a summary. From the repository root:
#   bash tests/gpu/device_check.sh [WHEEL_DIR]          (default .whl)
# Where torch sees no CUDA device it says so and checks only what needs none: the wheel
# folder installs for the GPU host's Python, and every GPU test skips with its reason.
# Logs go to $OUT (or /tmp/splitserve-device-check). Exit status: the tests'.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root" || exit 2
wheels="${1:-.whl}"
py="${PYTHON:-python3}"
site="${SITE_DIR:-/tmp/splitserve-site}"
tests_budget="${TESTS_BUDGET_S:-330}"
bench_budget="${BENCH_BUDGET_S:-100}"
logs="${OUT:-/tmp/splitserve-device-check}"
mkdir -p "$logs"
t0=$(date +%s)
say() { echo "[device-check $(($(date +%s) - t0))s] $*"; }
export PYTHONUNBUFFERED=1

read -r cuda about < <("$py" -c '
import torch
ok = torch.cuda.is_available()
name = torch.cuda.get_device_name(0) if ok else "no CUDA device"
print("yes" if ok else "no", f"torch {torch.__version__}, CUDA {torch.version.cuda}, {name}")
') || { say "error: $py cannot import torch"; exit 2; }
say "$about"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
  --format=csv,noheader | sed 's/^/[device-check] nvidia-smi: /'

# ---- the wheels ----
whls=("$wheels"/*.whl)
if [ ! -e "${whls[0]}" ]; then
  say "no wheels in $wheels (tests/gpu/wheels.sh makes them); using what is installed"
  whls=()
fi
theirs=()
for w in "${whls[@]}"; do
  case "$(basename "$w")" in splitserve-*) ;; *) theirs+=("$w") ;; esac
done
if [ "$cuda" = yes ]; then
  rm -rf "$site"
  if [ ${#theirs[@]} -gt 0 ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "${theirs[@]}" || { say "error: the carried wheels did not install"; exit 2; }
  fi
  # splitserve itself from this tree; the carried wheel where the host cannot build it
  if ! "$py" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
      --target "$site" . 2>"$logs/build.log"; then
    own=("$wheels"/splitserve-*.whl)
    say "the tree did not build here ($(tail -1 "$logs/build.log")); installing ${own[0]}"
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "${own[0]}" \
      || { say "error: splitserve did not install"; exit 2; }
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  say "installed $(ls "$site" | grep -c 'dist-info$') packages into $site"
  "$py" -c 'import fastapi, uvicorn, pydantic, splitserve_worker
from splitserve_worker.kv.transport import unavailable_reason
print("[device-check] NIXL:", unavailable_reason("nixl") or "importable")'
else
  say "SKIP: no CUDA device visible to torch here; nothing that needs a GPU runs"
  if [ ${#theirs[@]} -gt 0 ]; then
    dry="$(mktemp -d)"
    if "$py" -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: \
        --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux2014_x86_64 --target "$dry" "${whls[@]}"; then
      say "the wheel folder installs for CPython 3.12 on x86-64: $(du -sm "$dry" | cut -f1) MiB"
    else
      say "error: the wheel folder does not install for CPython 3.12 on x86-64"
      rm -rf "$dry"
      exit 2
    fi
    rm -rf "$dry"
  fi
  say "wheel folder: $(du -cb "${whls[@]:-/dev/null}" 2>/dev/null | tail -1 | cut -f1) bytes"
fi

# ---- the tests ----
say "pytest -m gpu tests/gpu (budget ${tests_budget} s)"
timeout --kill-after=10 "$tests_budget" "$py" -m pytest -m gpu tests/gpu -p no:cacheprovider \
  -q -rfEs --durations=12 -W ignore::pytest.PytestConfigWarning \
  --junitxml="$logs/gpu-tests.xml" 2>&1 | tee "$logs/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
[ "$tests_rc" = 124 ] && say "the tests ran past their ${tests_budget} s budget and were stopped"
# pytest exits 5 when it selected nothing to run: every GPU test skipped is not a failure
[ "$cuda" = no ] && [ "$tests_rc" = 5 ] && tests_rc=0

# ---- the bench ----
if [ "$cuda" = yes ]; then
  say "bench/engine.py --device cuda (budget ${bench_budget} s)"
  timeout --kill-after=10 "$bench_budget" "$py" bench/engine.py --device cuda 2>&1 \
    | tee "$logs/bench-engine.log"
  bench_rc=${PIPESTATUS[0]}
else
  bench_rc=skipped
fi

# ---- the summary ----
tally="$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)' "$logs/gpu-tests.log" | tail -1)"
result="$(grep -h '^RESULT' "$logs/bench-engine.log" 2>/dev/null | tail -1)"
say "SUMMARY cuda=$cuda tests_rc=$tests_rc bench_rc=$bench_rc"
say "SUMMARY tests: ${tally:-no tally (see $logs/gpu-tests.log)}"
say "SUMMARY bench: ${result:-no RESULT line}"
say "SUMMARY took $(($(date +%s) - t0)) s; logs in $logs"
exit "$tests_rc"
