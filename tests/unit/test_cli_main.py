"""The ``splitserve`` console command: a thin dispatcher over the ``splitserve.commands``
entry points, importing only the subcommand it runs."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from splitserve import cli

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
EVERY_COMMAND = {"up", "worker", "router", "model", "operator", "advise"}


def test_help_lists_available_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in EVERY_COMMAND:
        assert name in out
    assert "should this model and workload disaggregate" in out  # advise's summary


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


def test_every_subcommand_is_an_entry_point_of_the_installed_package() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert set(declared[cli.GROUP]) == EVERY_COMMAND
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=cli.GROUP)}
    assert installed == declared[cli.GROUP], "reinstall: pip install -e ."
    extras = set(importlib.metadata.metadata(cli.DISTRIBUTION).get_all("Provides-Extra") or [])
    for command in cli.commands().values():
        module = command.load()
        assert callable(module.add_arguments) and callable(module.run), command.module
        if command.module.startswith(("splitserve_worker", "splitserve_operator")):
            assert command.extra in extras, f"{command.name}: no extra named {command.extra}"


def run_without(blocked: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``splitserve ARGV`` in a fresh interpreter where ``blocked`` cannot be imported,
    as when the extra that brings it is not installed."""
    code = (
        "import sys\n"
        f"sys.modules[{blocked!r}] = None  # import raises ModuleNotFoundError\n"
        "from splitserve import cli\n"
        f"sys.exit(cli.main({list(argv)!r}))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_a_missing_extra_is_named_in_one_line() -> None:
    done = run_without("kopf", "operator", "--kubeconfig", "/nonexistent")
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == (
        "error: splitserve operator needs kopf, which is not installed: "
        "pip install 'splitserve[operator]'"
    )


def test_a_missing_extra_of_the_worker_is_named_too() -> None:
    done = run_without("grpc", "worker", "--role", "decode", "--model", "/nonexistent")
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == (
        "error: splitserve worker needs grpc, which is not installed: "
        "pip install 'splitserve[worker]'"
    )


def test_running_one_command_imports_no_other() -> None:
    code = (
        "import sys\n"
        "from splitserve import cli\n"
        "try:\n"
        "    cli.main(['advise', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('splitserve_worker', 'torch', 'grpc', 'kopf', 'kubernetes')\n"
        "print([m for m in heavy if m in sys.modules])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-2000:]


def test_a_missing_part_of_splitserve_itself_is_a_bug_not_an_extra() -> None:
    command = cli.Command("ghost", "splitserve_operator.commands.ghost")
    with pytest.raises(ModuleNotFoundError):
        command.load()
