"""What the installed packages may import, read from their source (AST, nothing is
imported): no test-only library and no read of the source tree in the product, no
private name imported from another module; and the whole operator imports with only
the ``operator`` extra installed."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = {
    "splitserve_operator": ROOT / "operator" / "splitserve_operator",
    "splitserve_worker": ROOT / "worker" / "splitserve_worker",
    "splitserve": ROOT / "proto" / "splitserve",
}
SUPPORT = ROOT / "tests" / "support"
TEST_ONLY = {
    "kmock",
    "jsonschema",
    "celpy",
    "hypothesis",
    "pytest",
    "_pytest",
    "pytest_asyncio",
    "kubernetes_validate",
    "grpc_tools",
}
"""Libraries of the ``test`` extra that product code must never import."""


def modules(package: str) -> Iterator[tuple[str, Path]]:
    """(dotted name, file) of every module of a product package, generated ones included."""
    base = PRODUCT[package]
    for path in sorted(base.rglob("*.py")):
        parts = path.relative_to(base.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path


def imported(tree: ast.AST, here: str, is_package: bool) -> Iterator[tuple[int, str, str | None]]:
    """(line, module, name or None) for every import in ``tree``; relative imports are
    resolved against ``here``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = here.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join([*base, module] if module else base)
            for alias in node.names:
                yield node.lineno, module, alias.name


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@pytest.mark.parametrize("package", sorted(PRODUCT))
def test_the_product_imports_no_test_library_and_reads_no_source_tree(package: str) -> None:
    problems = []
    for name, path in modules(package):
        tree = ast.parse(path.read_text(), str(path))
        for line, module, _ in imported(tree, name, path.name == "__init__.py"):
            if module.split(".")[0] in TEST_ONLY:
                problems.append(f"{path.relative_to(ROOT)}:{line}: imports {module}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id == "__file__":
                problems.append(
                    f"{path.relative_to(ROOT)}:{node.lineno}: __file__ (the source tree is "
                    "not there once installed; use importlib.resources for package data)"
                )
    assert problems == [], "\n".join(problems)


def own(module: str) -> bool:
    """Whether ``module`` is one of this repository's (a product package or test support)."""
    top = module.split(".")[0]
    return top in PRODUCT or (SUPPORT / f"{top}.py").exists()


def sources() -> Iterator[tuple[str, Path]]:
    for package in sorted(PRODUCT):
        yield from modules(package)
    for path in sorted((ROOT / "tests").rglob("*.py")):
        yield path.stem, path


def test_no_module_imports_a_private_name_from_another_module() -> None:
    """``from x import _name`` reaches into another module's internals: make the name
    public where it lives (or move the code that needs it there). Dunders and
    ``__future__`` are fine; so are a third-party package's own private module paths."""
    problems = []
    for name, path in sources():
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        tree = ast.parse(path.read_text(), str(path))
        for line, module, what in imported(tree, name, path.name == "__init__.py"):
            where = f"{path.relative_to(ROOT)}:{line}"
            if what is not None and private(what):
                problems.append(f"{where}: from {module} import {what}")
            elif own(module) and any(private(part) for part in module.split(".")):
                problems.append(f"{where}: imports the private module {module}")
    assert problems == [], "\n".join(problems)


def definitions() -> dict[str, set[str]]:
    """Names each product module defines at its top level (functions, classes,
    assignments), and the submodules of each package."""
    defined: dict[str, set[str]] = {}
    for package in sorted(PRODUCT):
        for name, path in modules(package):
            parent, _, leaf = name.rpartition(".")
            if parent:
                defined.setdefault(parent, set()).add(leaf)
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                defined[name] = {"*"}  # generated: whatever protoc wrote
                continue
            names = defined.setdefault(name, set())
            for node in ast.parse(path.read_text(), str(path)).body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(node.name)
                elif isinstance(node, ast.Assign):
                    names.update(t.id for t in node.targets if isinstance(t, ast.Name))
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names.add(node.target.id)
    return defined


def test_every_name_is_imported_from_the_module_that_defines_it() -> None:
    """No re-export facades: ``from pkg import Name`` where ``pkg`` only imports ``Name``
    itself hides where it lives and ties the caller to the facade. Import it from its
    own module."""
    defined = definitions()
    problems = []
    for name, path in sources():
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        tree = ast.parse(path.read_text(), str(path))
        for line, module, what in imported(tree, name, path.name == "__init__.py"):
            names = defined.get(module)
            if what is None or names is None or "*" in names or what in names:
                continue
            problems.append(f"{path.relative_to(ROOT)}:{line}: from {module} import {what}")
    assert problems == [], "\n".join(problems)


def requirement_closure(extras: set[str]) -> set[str]:
    """Canonical names of the distributions installed for ``splitserve[extras]``: its
    requirements for those extras, and theirs, recursively (what is installed here)."""
    seen: set[str] = set()
    todo: list[tuple[str, set[str]]] = [("splitserve", extras)]
    while todo:
        dist, wanted = todo.pop()
        try:
            requires = importlib.metadata.requires(dist) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional dependency not installed here
        seen.add(canonicalize_name(dist))
        for text in requires:
            req = Requirement(text)
            markers = [{"extra": e} for e in wanted | {""}]
            if req.marker is not None and not any(req.marker.evaluate(m) for m in markers):
                continue
            if canonicalize_name(req.name) not in seen:
                todo.append((req.name, set(req.extras)))
    return seen


def test_the_operator_imports_with_only_the_operator_extra() -> None:
    """Every module of the operator (the simulator and ``advise`` too) and of the contract
    imports in an interpreter where nothing outside ``splitserve[operator]`` can be
    imported: no torch, transformers, grpc, fastapi, nor ``splitserve_worker``."""
    allowed = requirement_closure({"operator"})
    blocked = {"splitserve_worker"}
    for top, dists in importlib.metadata.packages_distributions().items():
        if not any(canonicalize_name(d) in allowed for d in dists):
            blocked.add(top)
    blocked -= {"splitserve", "splitserve_operator"}
    assert {"torch", "transformers", "grpc", "fastapi"} <= blocked
    assert not {"kopf", "kubernetes", "httpx", "pydantic"} & blocked
    wanted = [
        name
        for package in ("splitserve_operator", "splitserve")
        for name, path in modules(package)
        if path.stem != "__main__" and not name.startswith("splitserve.v1")
    ]
    code = (
        "import importlib, json, sys\n"
        "blocked, wanted = json.loads(sys.argv[1]), json.loads(sys.argv[2])\n"
        "for name in blocked:\n"
        "    if name not in sys.modules:\n"
        "        sys.modules[name] = None  # as if not installed: import fails, find_spec is None\n"
        "for name in wanted:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(sorted(blocked)), json.dumps(wanted)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = set(json.loads(done.stdout.splitlines()[-1]))
    assert {"splitserve_operator.control.runtime", "splitserve_operator.sim.advise", "kopf"} <= (
        loaded
    )
