"""A launched worker dies with its launcher, without a ``preexec_fn`` in the launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from splitserve.roles import Role
from splitserve_worker.commands.up import WorkerProcs

pytestmark = pytest.mark.unit

# A child that arms the parent-death signal the way a worker does, then waits.
CHILD = (
    "import os, sys, time\n"
    "from splitserve_worker.commands.worker import die_with_parent\n"
    "die_with_parent(int(sys.argv[1]))\n"
    "print(os.getpid(), flush=True)\n"
    "time.sleep(120)\n"
)
# A middle process that starts CHILD with its own pid, prints the child's pid, and waits.
MIDDLE = (
    "import os, subprocess, sys, time\n"
    "p = subprocess.Popen([sys.executable, '-c', sys.argv[1], str(os.getpid())],\n"
    "                     stdout=subprocess.PIPE, text=True)\n"
    "print(p.stdout.readline().strip(), flush=True)\n"
    "time.sleep(120)\n"
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); read its state
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux")
def test_worker_child_gets_sigterm_when_its_launcher_is_killed() -> None:
    middle = subprocess.Popen(
        [sys.executable, "-c", MIDDLE, CHILD], stdout=subprocess.PIPE, text=True
    )
    try:
        assert middle.stdout is not None
        child_pid = int(middle.stdout.readline())
        assert _alive(child_pid)
        middle.send_signal(signal.SIGKILL)
        middle.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child_pid), "the child outlived its killed parent"
    finally:
        middle.kill()
        middle.wait(10)


def test_worker_exits_when_the_named_parent_is_already_gone() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, "1"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0
    assert "parent process 1 is gone" in out.stderr


def test_launcher_names_itself_as_the_workers_parent() -> None:
    procs = WorkerProcs("smollm2-135m", [Role.DECODE], token="t" * 32, echo=False)
    try:
        cmd = procs.command(Role.DECODE)
        assert cmd[cmd.index("--parent-pid") + 1] == str(os.getpid())
    finally:
        procs.stop()
