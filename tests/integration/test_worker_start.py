"""A worker that cannot start leaves nothing behind: whichever step fails (the gRPC port,
the KV push port or the metrics port already taken), the engine thread, the servers and
their sockets started before it are closed again, and the error says what to change.
A worker that starts and stops also leaves nothing."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from splitserve_worker.server.app import start_worker
from splitserve_worker.server.config import WorkerConfig

pytestmark = pytest.mark.integration

TOKEN = "start-token"


@pytest.fixture(scope="module")
def loaded(tiny_model_path: Path) -> Any:
    from splitserve_worker.models import load_model

    return load_model(str(tiny_model_path))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def taken(port: int) -> Iterator[None]:
    """``port`` held by another listener meanwhile."""
    with socket.create_server(("127.0.0.1", port)):
        yield


def can_bind(port: int) -> bool:
    try:
        with socket.create_server(("127.0.0.1", port)):
            return True
    except OSError:
        return False


def live_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.is_alive()}


def config(tiny_model_path: Path, **ports: int) -> WorkerConfig:
    return WorkerConfig(role="both", model=str(tiny_model_path), token=TOKEN, num_blocks=64,
                        threads=1, **ports)  # type: ignore[arg-type]  # fmt: skip


@pytest.mark.parametrize(
    ("step", "message"),
    [
        ("port", "cannot listen on 127.0.0.1:.*choose another --port"),
        ("kv_port", "cannot listen for KV pushes on 127.0.0.1:.*choose another"),
        ("metrics_port", "cannot serve metrics on 127.0.0.1:.*choose another --metrics-port"),
    ],
)
def test_a_step_that_fails_closes_what_started_before_it(
    tiny_model_path: Path, loaded: Any, step: str, message: str
) -> None:
    ports = {"port": free_port(), "kv_port": free_port(), "metrics_port": free_port()}
    before = live_threads()

    async def scenario() -> None:
        with taken(ports[step]), pytest.raises(OSError, match=message):
            await start_worker(config(tiny_model_path, **ports), loaded=loaded)

    asyncio.run(scenario())
    left = live_threads() - before
    assert not left, f"threads left running after a failed start: {left}"
    for name, port in ports.items():
        assert can_bind(port), f"{name} {port} is still held after a failed start"


def test_a_worker_that_stops_leaves_nothing(tiny_model_path: Path, loaded: Any) -> None:
    ports = {"port": free_port(), "kv_port": free_port(), "metrics_port": free_port()}
    before = live_threads()

    async def scenario() -> None:
        w = await start_worker(config(tiny_model_path, **ports), loaded=loaded)
        assert "splitserve-engine" in live_threads()
        assert not any(can_bind(p) for p in ports.values())
        await w.stop(0.1)

    asyncio.run(scenario())
    left = live_threads() - before
    assert not left, f"threads left running after stop: {left}"
    assert all(can_bind(p) for p in ports.values())
