"""The commands' mistakes end in one ``error:`` line that says what to fix, not a
traceback: a model that is not there, a port that is taken, a setting that is not one."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def splitserve(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPLITSERVE_WORKER_TOKEN": "t"}
    return subprocess.run(
        [sys.executable, "-m", "splitserve.cli", *args],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip


def said(p: subprocess.CompletedProcess[str], rc: int, words: str) -> None:
    assert p.returncode == rc, p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and words in errors[0], p.stderr[-2000:]


def test_a_model_that_is_not_there(tmp_path: Path) -> None:
    missing = str(tmp_path / "nothing-here")
    said(splitserve("worker", "--role", "decode", "--model", missing), 2, "nothing-here")
    said(splitserve("up", "--model", missing, "--port", "0"), 1, "is neither the built-in")


def test_a_port_that_is_taken(tiny_model_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = splitserve("worker", "--role", "decode", "--model", str(tiny_model_path),
                       "--port", str(port), "--threads", "1")  # fmt: skip
    said(p, 2, f"cannot listen on 127.0.0.1:{port}")


def test_a_router_setting_that_is_not_one(tiny_model_path: Path) -> None:
    base = ["router", "--model", str(tiny_model_path), "--workers", "decode=127.0.0.1:9"]
    said(splitserve(*base, "--set", "queues.max_wait=1"), 2,
         "unknown setting(s) ['max_wait'] in queues;")  # fmt: skip
    said(splitserve(*base, "--set", "timeouts.request_s=-1"), 2, "timeouts.request_s must be > 0")


def test_an_attention_backend_that_cannot_run_here(tiny_model_path: Path) -> None:
    p = splitserve("worker", "--role", "both", "--model", str(tiny_model_path),
                   "--attention-backend", "flashinfer", "--threads", "1")  # fmt: skip
    said(p, 2, "attention backend flashinfer: flashinfer runs on CUDA only")


def test_tls_files_that_cannot_be_used_stop_every_part_at_start(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    from tls_kit import make_tls_files

    files = make_tls_files(tmp_path)
    absent = str(tmp_path / "absent.pem")
    model = ["--model", str(tiny_model_path)]
    worker = ["worker", "--role", "decode", *model, "--threads", "1"]
    said(splitserve(*worker, "--tls-cert", absent, "--tls-key", str(files.key)), 2,
         f"cannot load --tls-cert {absent}")  # fmt: skip
    said(splitserve(*worker, "--tls-cert", str(files.cert)), 2,
         "--tls-cert and --tls-key go together")  # fmt: skip
    said(splitserve(*worker, "--tls-ca", str(files.ca), "--tls-mutual"), 2,
         "--tls-mutual needs --tls-cert, --tls-key and --tls-ca")  # fmt: skip
    router = ["router", *model, "--workers", "decode=127.0.0.1:9"]
    said(splitserve(*router, "--tls-ca", absent), 2, f"cannot load --tls-ca {absent}")
    said(splitserve(*router, "--tls-cert", str(files.cert), "--tls-key", str(files.key)), 2,
         "give --tls-ca too")  # fmt: skip
    said(splitserve("up", *model, "--port", "0", "--tls-ca", str(files.ca)), 1,
         "a TLS stack needs --tls-cert, --tls-key and --tls-ca")  # fmt: skip


def test_a_tensor_parallel_size_the_model_or_role_cannot_take(tiny_model_path: Path) -> None:
    base = ["worker", "--model", str(tiny_model_path), "--threads", "1"]
    # 4 attention heads, 2 KV heads: 3 ranks cannot split them; no rank is started for it
    said(splitserve(*base, "--role", "both", "--tensor-parallel-size", "3"), 2,
         "--tensor-parallel-size may be 1, 2, 4")  # fmt: skip
    said(splitserve(*base, "--role", "both", "--tensor-parallel-size", "0"), 2,
         "--tensor-parallel-size must be >= 1")  # fmt: skip
    said(splitserve("up", "--model", str(tiny_model_path), "--port", "0", "--decode-tp", "0"), 1,
         "--decode-tp must be >= 1")  # fmt: skip
