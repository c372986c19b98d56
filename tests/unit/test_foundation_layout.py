"""The repository's shape: packages live inside the design's folders and none
shadows the standard library."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_stdlib_operator_resolves_from_repo_root() -> None:
    code = "import operator, sys; print(operator.__file__); print(operator.itemgetter(1)([0, 7]))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert "site-packages" not in out[0]
    assert not out[0].startswith(str(ROOT)), f"'operator' resolved into the repo: {out[0]}"
    assert out[1] == "7"


def test_stdlib_operator_resolves_inside_pytest() -> None:
    import operator

    assert operator.add(2, 3) == 5
    assert not Path(str(operator.__file__)).is_relative_to(ROOT)


def test_no_folder_is_importable_as_operator() -> None:
    assert not (ROOT / "operator" / "__init__.py").exists()
    named_operator = [p for p in (ROOT / "tests").rglob("operator") if p.is_dir()]
    assert named_operator == []
    assert list((ROOT / "tests").rglob("__init__.py")) == []


def test_packages_live_in_design_folders() -> None:
    import splitserve.v1.worker_pb2 as pb
    import splitserve_operator
    import splitserve_worker

    assert Path(next(iter(splitserve_worker.__path__))).parent == ROOT / "worker"
    assert Path(next(iter(splitserve_operator.__path__))).parent == ROOT / "operator"
    assert Path(pb.__file__).parents[2] == ROOT / "proto"


@pytest.mark.parametrize(
    "path",
    ["operator", "worker", "proto", "charts", "crds", "tests", "bench", "pyproject.toml",
     "Dockerfile.worker", "Dockerfile.operator", "Makefile", ".ci/run", "README.md"],
)  # fmt: skip
def test_design_layout_exists(path: str) -> None:
    assert (ROOT / path).exists(), f"{path} is part of the design's layout"


def test_readme_opens_with_the_two_commands() -> None:
    head = (ROOT / "README.md").read_text().split("\n## ")[0]
    assert "make run" in head and "make test" in head


def test_ci_runs_make_test() -> None:
    text = (ROOT / ".ci" / "run").read_text()
    assert "make test" in text
    assert "CI time" in text
