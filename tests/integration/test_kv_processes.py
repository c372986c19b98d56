"""The KV handoff between real ``splitserve worker`` processes on 127.0.0.1.

A request prefilled in one worker process and decoded in another must give the same
greedy tokens as the same request on one ``both`` worker, over ``tcp``, ``grpc`` and
``nixl``; killing either side mid-way (stopped at a fault-hold point, so the kill lands
exactly there) must leave no block held on the other.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.client import WorkerClient
from splitserve_worker.kv.faults import ENV_HOLD_DIR, hold_files
from splitserve_worker.kv.nixl_common import loopback_tls
from splitserve_worker.kv.transport import unavailable_reason
from worker_kit import all_free, collect, prompt_of, split_request

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "process-token"
NIXL_SKIP = unavailable_reason("nixl")
SP = pb.SamplingParams(max_tokens=12, ignore_eos=True)
BACKENDS = ["tcp", "grpc", pytest.param("nixl", marks=[pytest.mark.nixl, pytest.mark.skipif(
    NIXL_SKIP is not None, reason=NIXL_SKIP or "")])]  # fmt: skip


@dataclass
class Proc:
    role: str
    popen: subprocess.Popen[str]
    address: str = ""
    lines: list[str] = field(default_factory=list)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=10)


def spawn(model: Path, role: str, *extra: str, holds: Path | None = None) -> Proc:
    env = dict(os.environ, SPLITSERVE_WORKER_TOKEN=TOKEN, OMP_NUM_THREADS="1",
               UCX_TLS=loopback_tls(), UCX_NET_DEVICES="lo",
               TOKENIZERS_PARALLELISM="false")  # fmt: skip
    if holds is not None:
        env[ENV_HOLD_DIR] = str(holds)
    cmd = [sys.executable, "-m", "splitserve.cli", "worker", "--role", role,
           "--model", str(model), "--port", "0", "--threads", "1", "--num-blocks", "600",
           *extra]  # fmt: skip
    popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=env, stdin=subprocess.DEVNULL)  # fmt: skip
    proc = Proc(role, popen)
    ready = threading.Event()

    def read() -> None:
        assert popen.stdout is not None
        for line in popen.stdout:
            proc.lines.append(line.rstrip())
            if line.startswith("READY ") and not ready.is_set():
                proc.address = line.split()[1]
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(120) or not proc.address:
        proc.kill()
        raise AssertionError(f"{role} worker never printed READY:\n" + "\n".join(proc.lines[-30:]))
    return proc


@pytest.fixture(scope="module")
def trio(tiny_model_path: Path) -> Iterator[dict[str, Proc]]:
    backend = "tcp" if NIXL_SKIP else "nixl"
    procs: dict[str, Proc] = {}
    try:
        for role in ("prefill", "decode", "both"):
            procs[role] = spawn(tiny_model_path, role, "--kv-backend", backend, "--checksums")
        yield procs
    finally:
        for p in procs.values():
            p.popen.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


async def arrived(reached: Path, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not reached.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def push_to_frozen_decode(
    p: WorkerClient, victim: Proc, rid: str, backend: str, holds: Path
) -> grpc.aio.AioRpcError:
    """A 4,000-token prefill on ``p`` whose decode worker ``victim`` stops once the push
    has begun (tcp, grpc: held once the first span landed, so it never acknowledges;
    nixl, whose writes need no help from it: frozen once the prefill runs), then killed:
    the error the prefill ends with."""
    d = WorkerClient(victim.address, TOKEN)
    prompt = prompt_of(4000)
    handle = await d.reserve(rid, len(prompt), (await p.health()).compat, kv_backend=backend)
    armed, reached = (Path(f) for f in hold_files(str(holds), victim.popen.pid, "receive"))
    armed.parent.mkdir(parents=True, exist_ok=True)
    armed.touch()
    try:
        prefill = asyncio.ensure_future(p.prefill(rid, prompt, SP, handle))
        if backend == "nixl":
            while not (await p.health()).prefilling:
                await asyncio.sleep(0.01)
            victim.popen.send_signal(signal.SIGSTOP)
        else:
            await arrived(reached, "the decode worker to hold mid-push")
            assert not prefill.done()  # the decode worker holds: nothing can acknowledge
    finally:
        victim.kill()
        await d.close()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await asyncio.wait_for(prefill, 60)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE
    return e.value


@pytest.mark.parametrize("backend", BACKENDS)
def test_tokens_across_processes_match_one_both_worker(trio: dict[str, Proc], backend: str) -> None:
    async def scenario() -> None:
        p, d, b = (WorkerClient(trio[r].address, TOKEN) for r in ("prefill", "decode", "both"))
        for n in (3, 40, 1000, 4000):
            prompt = prompt_of(n)
            ref = await collect(b.generate(f"ref-{backend}-{n}", prompt, SP))
            got, resp = await split_request(p, d, f"split-{backend}-{n}", prompt, SP, backend)
            assert len(ref) == 12
            assert got == ref, f"{backend} n={n}"
            assert resp.first_token == ref[0]
        for c in (p, d):
            h = await all_free(c, 10)
            assert (h.free_blocks, h.leases) == (h.total_blocks, 0)
        for c in (p, d, b):
            await c.close()

    asyncio.run(scenario())


def test_a_push_over_two_streams_matches_and_a_killed_decode_leaves_nothing_held(
    trio: dict[str, Proc], tiny_model_path: Path, tmp_path: Path
) -> None:
    """``--kv-streams 2`` (the default on hosts of 8 or more cores): each layer's spans
    arrive over two connections, out of order; the tokens are one ``both`` worker's, and
    a decode worker killed mid-push leaves the prefill worker holding nothing."""
    sender = spawn(tiny_model_path, "prefill", "--kv-streams", "2")
    holds = tmp_path / "holds"
    victim = spawn(tiny_model_path, "decode", holds=holds)

    async def scenario() -> None:
        p = WorkerClient(sender.address, TOKEN)
        d, b = (WorkerClient(trio[r].address, TOKEN) for r in ("decode", "both"))
        for n in (1000, 4000):
            prompt = prompt_of(n)
            ref = await collect(b.generate(f"ref2-{n}", prompt, SP))
            got, _ = await split_request(p, d, f"two-{n}", prompt, SP)
            assert got == ref, n
        err = await push_to_frozen_decode(p, victim, "doomed-2", "tcp", holds)
        assert "push failed" in (err.details() or ""), err.details()
        for c in (p, d):
            h = await all_free(c, 10)
            assert (h.free_blocks, h.leases) == (h.total_blocks, 0)
        for c in (p, d, b):
            await c.close()

    try:
        asyncio.run(scenario())
    finally:
        victim.kill()
        sender.kill()


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_killed_mid_transfer_leaves_prefill_holding_nothing(
    trio: dict[str, Proc], tiny_model_path: Path, backend: str, tmp_path: Path
) -> None:
    holds = tmp_path / "holds"
    victim = spawn(tiny_model_path, "decode", "--kv-backend", backend, holds=holds)

    async def scenario() -> None:
        p = WorkerClient(trio["prefill"].address, TOKEN)
        err = await push_to_frozen_decode(p, victim, "doomed", backend, holds)
        # tcp, grpc: the stream breaks; nixl: the writes fail, or they land and Commit cannot
        details = err.details() or ""
        assert "push failed" in details or (backend == "nixl" and "Commit" in details), details
        h = await all_free(p, 10)
        assert h.free_blocks == h.total_blocks
        await p.close()

    try:
        asyncio.run(scenario())
    finally:
        victim.kill()


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_killed_mid_prefill_leaves_decode_holding_nothing(
    trio: dict[str, Proc], tiny_model_path: Path, backend: str, tmp_path: Path
) -> None:
    holds = tmp_path / "holds"
    victim = spawn(tiny_model_path, "prefill", "--kv-backend", backend, holds=holds)

    async def scenario() -> None:
        p = WorkerClient(victim.address, TOKEN)
        d = WorkerClient(trio["decode"].address, TOKEN)
        prompt = prompt_of(4000)
        before = await d.health()
        rid = f"orphan-{backend}"
        compat = (await p.health()).compat
        handle = await d.reserve(rid, len(prompt), compat, kv_backend=backend, lease_seconds=3)
        held = await d.health()
        assert held.free_blocks == before.free_blocks - 250 and held.leases == before.leases + 1
        gen = asyncio.ensure_future(collect(d.generate(rid, prompt, SP, expect_remote_kv=True)))
        armed, reached = (Path(f) for f in hold_files(str(holds), victim.popen.pid, "push"))
        armed.parent.mkdir(parents=True, exist_ok=True)
        armed.touch()
        prefill = asyncio.ensure_future(p.prefill(rid, prompt, SP, handle))
        await arrived(reached, "the prefill worker to hold after its first layer")
        victim.kill()  # mid-push: the first layer went to the transport, the rest never
        with pytest.raises(grpc.aio.AioRpcError):
            await asyncio.wait_for(prefill, 30)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(gen, 30)
        assert e.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED)
        # tcp, grpc: freed as the connection breaks; nixl: after the lease (3 s) and its
        # grace, as the decode worker cannot tell a dead writer from a slow one
        h = await all_free(d, 30)
        assert (h.free_blocks, h.leases) == (h.total_blocks, 0)
        await p.close()
        await d.close()

    try:
        asyncio.run(scenario())
    finally:
        victim.kill()


def test_a_stopping_worker_lets_running_streams_finish_and_refuses_new_calls(
    tiny_model_path: Path,
) -> None:
    """SIGTERM (a rolling update, a drain): the stream under way runs to its end within
    ``--drain-seconds`` rather than being cut and moved; a new call is refused at once,
    so the router sends it elsewhere; the worker then exits by itself."""
    proc = spawn(tiny_model_path, "both", "--drain-seconds", "60")
    want = 160
    stopping = "stopping: running calls have 60 s to finish"

    async def go() -> tuple[list[int], grpc.StatusCode | None]:
        c = WorkerClient(proc.address, TOKEN)
        got: list[int] = []
        refused: grpc.StatusCode | None = None
        sp = pb.SamplingParams(max_tokens=want, ignore_eos=True)
        async for chunk in c.generate("drain-1", prompt_of(24), sp):
            got += list(chunk.token_ids)
            if refused is None and len(got) >= 4:
                proc.popen.send_signal(signal.SIGTERM)
                # the worker says it stops, then stops taking calls: wait for its word
                deadline = time.monotonic() + 60
                while stopping not in proc.lines and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                try:
                    await collect(c.generate("drain-2", prompt_of(8), sp))
                except grpc.aio.AioRpcError as e:
                    refused = e.code()
        await c.close()
        return got, refused

    try:
        got, refused = asyncio.run(go())
        assert len(got) == want  # every token of the running stream came
        assert refused == grpc.StatusCode.UNAVAILABLE
        assert proc.popen.wait(timeout=30) == 0  # long before the 60 s: nothing left to wait on
        assert stopping in proc.lines
    finally:
        proc.kill()
