"""``splitserve up``: the demo streams an answer with TTFT/TPOT; Ctrl-C leaves no process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def up(model: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "splitserve.cli",
            "up",
            "--model",
            str(model),
            "--prefill",
            "1",
            "--decode",
            "1",
            "--port",
            "0",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def test_demo_streams_an_answer_and_reports_ttft_tpot(tiny_model_path: Path) -> None:
    proc = up(tiny_model_path, "--demo")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "router: OpenAI API on http://127.0.0.1:" in out
    assert "> What is the capital of France?" in out
    assert "TTFT " in out and " TPOT " in out and "(64 tokens)" in out
    assert out.rstrip().endswith("stopped")


def test_ctrl_c_stops_router_and_every_worker(tiny_model_path: Path) -> None:
    proc = up(tiny_model_path, "--colocated", "1")
    assert proc.stdout is not None
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        if "press Ctrl-C to stop" in line or time.monotonic() > deadline:
            break
    workers = children_of(proc.pid)
    assert len(workers) == 3 and all(alive(p) for p in workers)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
    t0 = time.monotonic()
    while any(alive(p) for p in workers) and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert not any(alive(p) for p in workers)
