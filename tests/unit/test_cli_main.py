"""The ``splitserve`` console command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from splitserve_worker import cli

pytestmark = pytest.mark.unit


def test_help_lists_available_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "model" in out


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "usage: splitserve" in capsys.readouterr().out


def test_model_command_explains_a_bad_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["model", str(tmp_path / "nope")]) == 1
    out = capsys.readouterr().out
    assert "neither the built-in name" in out


def test_console_script_is_installed() -> None:
    exe = Path(sys.executable).parent / "splitserve"
    assert exe.exists(), "pip install -e . creates the splitserve command"
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("splitserve ")
