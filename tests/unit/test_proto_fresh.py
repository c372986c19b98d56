"""The committed generated gRPC code matches what the committed .proto generates."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "proto"
PROTO = Path("splitserve/v1/worker.proto")
GENERATED = ("worker_pb2.py", "worker_pb2_grpc.py", "worker_pb2.pyi")


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is a [test] extra")
    # in its own process: the compiler extension must not share one with torch and grpc
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            str(PROTO_ROOT / PROTO),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"protoc failed on the committed worker.proto: {done.stderr}"
    stale = [
        name
        for name in GENERATED
        if not filecmp.cmp(
            tmp_path / PROTO.parent / name, PROTO_ROOT / PROTO.parent / name, shallow=False
        )
    ]
    assert not stale, f"generated files are stale: {stale}; run 'make proto' and commit them"


def test_contract_has_the_handoff_calls() -> None:
    from splitserve.v1 import worker_pb2

    service = worker_pb2.DESCRIPTOR.services_by_name["Worker"]
    methods = {m.name: m for m in service.methods}
    for name in ("Health", "Events", "Cancel", "Reserve", "Release", "PushKV", "Commit",
                 "Generate", "Prefill"):  # fmt: skip
        assert name in methods, name
    assert methods["PushKV"].client_streaming and not methods["PushKV"].server_streaming
    assert methods["Generate"].server_streaming
