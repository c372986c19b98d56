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


def test_up_runs_the_stack_over_mutual_tls(tiny_model_path: Path, tmp_path: Path) -> None:
    from tls_kit import SERVER_NAME, make_tls_files

    files = make_tls_files(tmp_path)
    proc = up(tiny_model_path, "--demo", "--tls-cert", str(files.cert), "--tls-key",
              str(files.key), "--tls-ca", str(files.ca), "--tls-server-name", SERVER_NAME,
              "--tls-mutual")  # fmt: skip
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "workers over mutual TLS" in out
    assert "TTFT " in out and "(64 tokens)" in out  # the answer came through the TLS stack


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


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def wait_for(proc: subprocess.Popen[str], words: str, timeout_s: float = 300) -> list[str]:
    """The lines ``proc`` printed up to one holding ``words``."""
    assert proc.stdout is not None
    lines = []
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        lines.append(line)
        if words in line or time.monotonic() > deadline:
            break
    assert any(words in line for line in lines), "".join(lines)
    return lines


@pytest.mark.parametrize("where", ["file", "environment"])
def test_up_takes_the_api_key_from_a_file_or_the_environment_never_a_command_line(
    tiny_model_path: Path, tmp_path: Path, where: str
) -> None:
    """``up`` had only ``--api-key`` (the key in ``ps``) and ignored SPLITSERVE_API_KEY
    (its router was open). Now the key comes from ``--api-key-file`` or the environment,
    the router requires it, and no process of the stack has a secret on its command line
    (the workers' token travels in a private file)."""
    import httpx

    key = "sk-up-" + os.urandom(8).hex()
    env = {k: v for k, v in os.environ.items() if k != "SPLITSERVE_API_KEY"}
    extra: list[str] = []
    if where == "file":
        (tmp_path / "key").write_text(key + "\n")
        extra = ["--api-key-file", str(tmp_path / "key")]
    else:
        env["SPLITSERVE_API_KEY"] = key
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitserve.cli", "up", "--model", str(tiny_model_path),
         "--prefill", "0", "--decode", "1", "--port", "0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip
    try:
        lines = wait_for(proc, "press Ctrl-C to stop")
        base = next(line.split(" on ")[1].split("/v1")[0] for line in lines if "OpenAI API" in line)
        workers = children_of(proc.pid)
        assert workers, "the stack started no worker process"
        lines_of = {pid: cmdline(pid) for pid in [proc.pid, *workers]}
        tokens = []
        for args in lines_of.values():
            if "--token-file" in args:
                tokens.append(Path(args[args.index("--token-file") + 1]).read_text().strip())
        assert len(tokens) == len(workers) and all(tokens)
        for pid, args in lines_of.items():
            for secret in (key, *tokens):
                assert not any(secret in a for a in args), f"a secret on {pid}'s command line"
            if pid != proc.pid:
                environ = Path(f"/proc/{pid}/environ").read_bytes()
                assert key.encode() not in environ, "a worker was handed the API key"
        models = f"{base}/v1/models"
        assert httpx.get(models, timeout=30).status_code == 401
        ok = httpx.get(models, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert ok.status_code == 200, ok.text
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)


def test_up_flex_switches_a_worker_to_the_side_that_misses_its_slo(tiny_model_path: Path) -> None:
    """Three switchable workers (one prefill, two decode); a TTFT objective no request can
    meet and a TPOT objective every one meets: the rebalancer moves a decode worker to
    prefill, once (the dwell is longer than the test), and requests keep completing."""
    import queue
    import re
    import threading

    import httpx

    proc = subprocess.Popen(
        [sys.executable, "-m", "splitserve.cli", "up", "--model", str(tiny_model_path),
         "--flex", "3", "--port", "0", "--flex-ttft-slo", "0.00001", "--flex-tpot-slo", "10",
         "--flex-dwell", "1000", "--flex-drain", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()

    def until(pattern: str, timeout: float, tick: object = None) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.05)
            except queue.Empty:
                if callable(tick):
                    tick()
                continue
            seen.append(line)
            if m := re.search(pattern, line):
                return m
        raise AssertionError(f"never saw {pattern!r}: {''.join(seen)}")

    try:
        base = until(r"OpenAI API on (http://127\.0\.0\.1:\d+)/v1", 300)[1]
        statuses: list[int] = []

        def request() -> None:
            body = {"prompt": [5, 17, 99, 3, 42], "max_tokens": 4, "temperature": 0}
            statuses.append(httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code)

        switched = until(r"worker (\w+)@\S+ now serves (\w+)", 120, tick=request)
        assert (switched[1], switched[2]) == ("decode", "prefill"), switched[0]
        for _ in range(5):
            request()
        assert statuses and set(statuses) == {200}, statuses
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, "".join(seen) + out
    assert sum("now serves" in s for s in [*seen, *out.splitlines()]) == 1
