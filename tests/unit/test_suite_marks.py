"""The suite's own marks mean what they say: a ``pytest.mark`` sits on a test (or a
fixture), never on a helper that pytest does not collect, where it does nothing."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parents[1]


def _is_pytest_mark(node: ast.expr) -> bool:
    """``@pytest.mark.X`` or ``@pytest.mark.X(...)``."""
    target = node.func if isinstance(node, ast.Call) else node
    return (
        isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Attribute)
        and target.value.attr == "mark"
        and isinstance(target.value.value, ast.Name)
        and target.value.value.id == "pytest"
    )


def _is_fixture(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return isinstance(target, ast.Attribute) and target.attr == "fixture"


def marked_helpers(source: str) -> list[tuple[int, str]]:
    """(line, name) of every function carrying a pytest mark that pytest never collects."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if node.name.startswith("test") or any(_is_fixture(d) for d in node.decorator_list):
            continue
        if any(_is_pytest_mark(d) for d in node.decorator_list):
            found.append((node.lineno, node.name))
    return found


def test_the_check_finds_a_mark_on_a_helper() -> None:
    source = (
        "import pytest\n"
        "@pytest.mark.skipif(True, reason='x')\n"
        "def _helper(): ...\n"
        "@pytest.mark.slow\n"
        "def test_real(): ...\n"
        "@pytest.fixture\n"
        "def fx(): ...\n"
    )
    assert marked_helpers(source) == [(3, "_helper")]


def test_no_pytest_mark_sits_on_a_function_pytest_does_not_collect() -> None:
    found = [
        f"{path.relative_to(TESTS)}:{line} {name}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, name in marked_helpers(path.read_text())
    ]
    assert found == [], f"marks that do nothing (move them onto the tests): {found}"
