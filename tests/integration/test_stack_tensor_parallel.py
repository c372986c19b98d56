"""Tensor-parallel workers through the router's API: prefill and decode workers of any
tensor-parallel sizes (P(TP2)->D(TP1), P(TP1)->D(TP2), P(TP2)->D(TP2)), over tcp, grpc
and NIXL, and a colocated worker over two ranks give transformers' greedy tokens, and
the same seeded samples as each other; a decode worker over two ranks gets each rank's
heads straight into that rank's pool (a port per rank and backend), its blocks all come
back, each rank is named at Reserve for every backend (over NIXL by its own agent), and a rank's own
gRPC port refuses a push without the worker token or into a lease it does not hold,
leaving the free blocks as they were; the ranks' processes end with their worker."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from splitserve.roles import Role
from splitserve.v1 import worker_pb2 as pb
from splitserve_worker.client import WorkerClient
from splitserve_worker.commands.up import WorkerProcs
from splitserve_worker.kv.grpc_sender import GrpcSenderBackend, push_address
from splitserve_worker.kv.tcp_wire import parse_metadata
from splitserve_worker.kv.transport import BackendContext, TransferError, unavailable_reason
from splitserve_worker.models import torch_dtype
from splitserve_worker.router.discovery import WorkerEndpoint
from splitserve_worker.server.convert import compat_from_proto, target_from_handle
from stack_kit import (  # noqa: F401  (fixtures)
    ALWAYS_REMOTE,
    PROMPTS,
    alive,
    child_pids,
    complete,
    decisions,
    generate_reference,
    reference_fixture,
    router,
    tokenizer_fixture,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = secrets.token_hex(8)
NIXL_SKIP = unavailable_reason("nixl")
KV_BACKEND = "nixl" if NIXL_SKIP is None else "tcp"
"""What the workers are started with: a decode worker takes tcp and grpc always, and
NIXL when told (where it installs)."""
NIXL = pytest.mark.skipif(NIXL_SKIP is not None, reason=NIXL_SKIP or "")
TP = {Role.PREFILL: 2, Role.DECODE: 1, Role.BOTH: 2}
TP_DECODE = {Role.PREFILL: 1, Role.DECODE: 2}
PIDS: dict[str, int] = {}
"""Each worker's rank 0 process, by name (its other ranks are its children)."""


def _start(model: Path, roles: list[Role], tp: dict[Role, int]) -> Any:
    return WorkerProcs(str(model), roles, TOKEN, threads=1, echo=False, tensor_parallel=tp,
                       kv_backend=KV_BACKEND)  # fmt: skip


@pytest.fixture(scope="module")
def tp_workers(tiny_model_path: Path) -> Iterator[dict[str, WorkerEndpoint]]:
    """``p2``, ``d1``, ``c2`` (prefill over two ranks, decode over one, colocated over
    two) and ``p1``, ``d2`` (prefill over one, decode over two)."""
    first = _start(tiny_model_path, [Role.PREFILL, Role.DECODE, Role.BOTH], TP)
    second = _start(tiny_model_path, [Role.PREFILL, Role.DECODE], TP_DECODE)
    with first, second:
        eps = first.start(timeout_s=300) + second.start(timeout_s=300)
        procs = first.procs + second.procs
        ranks = [c for wp in procs for c in child_pids(wp.proc.pid)]
        assert len(ranks) == 3  # one more rank each for p2, c2 and d2
        names = ["p2", "d1", "c2", "p1", "d2"]
        PIDS.update(zip(names, (wp.proc.pid for wp in procs), strict=True))
        yield dict(zip(names, eps, strict=True))
    assert not [p for p in ranks if alive(p)]


PAIRS = {"p2d1": ("p2", "d1"), "p1d2": ("p1", "d2"), "p2d2": ("p2", "d2"), "colocated": ("c2",)}


def _stack(eps: dict[str, WorkerEndpoint], pair: str) -> list[WorkerEndpoint]:
    return [eps[n] for n in PAIRS[pair]]


def _blocks(ep: WorkerEndpoint) -> tuple[int, int, int]:
    async def go() -> tuple[int, int, int]:
        h = await WorkerClient(ep.address, TOKEN).health()
        return h.free_blocks, h.total_blocks, h.leases

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("pair", "backend"),
    [
        *((pair, backend) for pair in ("p2d1", "p1d2", "p2d2") for backend in ("tcp", "grpc")),
        *(
            pytest.param(pair, "nixl", marks=[NIXL, pytest.mark.nixl])
            for pair in ("p2d1", "p1d2", "p2d2")
        ),
        ("colocated", "tcp"),
    ],
)
def test_tp_stacks_give_transformers_greedy_tokens(
    pair: str, backend: str, tp_workers: Any, tokenizer: Any, reference: list[list[int]]
) -> None:
    stack = _stack(tp_workers, pair)
    remote = pair != "colocated"
    extra: dict[str, Any] = {"disaggregation": ALWAYS_REMOTE} if remote else {}
    before = [_blocks(ep) for ep in stack]
    with router(TOKEN, tokenizer, stack, kv_backend=backend, **extra) as base:
        for prompt, want in zip(PROMPTS, reference, strict=True):
            assert complete(base, prompt, stream=False) == want
            assert complete(base, prompt, stream=True) == want
        made = decisions(base)
    kind = "remote" if remote else "local"
    assert made.get(kind, 0) == 2 * len(PROMPTS)
    after = [_blocks(ep) for ep in stack]
    # the decode (or colocated) worker holds nothing once its requests are done
    assert after[-1] == before[-1] and after[-1][0] == after[-1][1] and after[-1][2] == 0


def test_seeded_samples_agree_across_tp_stacks(tp_workers: Any, tokenizer: Any) -> None:
    got = []
    for pair in PAIRS:
        extra = {"disaggregation": ALWAYS_REMOTE} if pair != "colocated" else {}
        with router(TOKEN, tokenizer, _stack(tp_workers, pair), **extra) as base:
            got.append([complete(base, p, stream=False, temperature=0.9, seed=11) for p in PROMPTS])
    assert all(g == got[0] for g in got[1:]), got


def test_a_split_decode_pool_names_its_ranks_for_every_backend_it_takes(
    tp_workers: Any,
) -> None:
    async def go() -> None:
        d2 = WorkerClient(tp_workers["d2"].address, TOKEN)
        compat = (await WorkerClient(tp_workers["p1"].address, TOKEN).health()).compat
        free = (await d2.health()).free_blocks
        h = await d2.reserve("ranks-tcp", 40, compat, kv_backend="tcp")
        heads = [(r.rank, r.kv_head_start, r.kv_head_stop) for r in h.kv_ranks]
        assert heads == [(0, 0, compat.kv_heads // 2), (1, compat.kv_heads // 2, compat.kv_heads)]
        assert len({r.backend_metadata for r in h.kv_ranks}) == 2  # a port per rank
        await d2.release("ranks-tcp")
        g = await d2.reserve("ranks-grpc", 40, compat, kv_backend="grpc")
        assert [(r.rank, r.kv_head_start, r.kv_head_stop) for r in g.kv_ranks] == heads
        # rank 0 on the worker's own gRPC port, rank 1 on a port of its own
        assert g.kv_ranks[0].backend_metadata == b"" and g.kv_ranks[1].backend_metadata
        await d2.release("ranks-grpc")
        if NIXL_SKIP is None:  # each rank's own agent, its pool registered
            n = await d2.reserve("ranks-nixl", 40, compat, kv_backend="nixl")
            assert [(r.rank, r.kv_head_start, r.kv_head_stop) for r in n.kv_ranks] == heads
            agents = {json.loads(r.backend_metadata.partition(b"\n")[0])["agent"]
                      for r in n.kv_ranks}  # fmt: skip
            assert len(agents) == 2
            await d2.release("ranks-nixl")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await d2.reserve("ranks-rdma", 40, compat, kv_backend="rdma")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not 'rdma'" in (e.value.details() or "")
        h2 = await d2.health()
        assert (h2.free_blocks, h2.leases) == (free, 0)

    asyncio.run(go())


def _push_rank(handle: pb.TransferHandle, rank: int, token: str) -> str:
    """Push every layer of the handle's prompt, rank ``rank``'s heads, straight to that
    rank over grpc with ``token``: how it ended (``ok`` or the error)."""
    compat = compat_from_proto(handle.compat)
    r = handle.kv_ranks[rank]
    target = replace(target_from_handle(handle), kv_ranks=(),
                     backend_metadata=r.backend_metadata)  # fmt: skip
    shape = (handle.num_prompt_tokens, r.kv_head_stop - r.kv_head_start, compat.head_dim)
    backend = GrpcSenderBackend(BackendContext(compat=compat, token=token, streams=1))
    try:
        sender = backend.open(target)
        for layer in range(compat.num_layers):
            kv = torch.ones(shape, dtype=torch_dtype(compat.dtype))
            sender.send_layer(layer, kv, kv, 0)
        sender.finish(30)
        return "ok"
    except TransferError as e:
        return str(e)
    finally:
        backend.close()


def test_a_rank_refuses_grpc_pushes_without_the_token_or_into_a_lease_it_does_not_hold(
    tp_workers: Any,
) -> None:
    async def go() -> None:
        d2 = WorkerClient(tp_workers["d2"].address, TOKEN)
        compat = (await d2.health()).compat
        start = await d2.health()
        h = await d2.reserve("rank-refusals", 12, compat, kv_backend="grpc")
        said = await asyncio.to_thread(_push_rank, h, 1, "not-the-token")
        assert "UNAUTHENTICATED: missing or wrong worker token" in said, said
        stranger = pb.TransferHandle()
        stranger.CopyFrom(h)
        stranger.lease_id = "0" * 16  # a lease no rank holds
        said = await asyncio.to_thread(_push_rank, stranger, 1, TOKEN)
        assert "NOT_FOUND" in said and "holds lease" in said, said
        await d2.release("rank-refusals")
        said = await asyncio.to_thread(_push_rank, h, 1, TOKEN)  # released: no longer held
        assert "NOT_FOUND" in said and "no reservation for request" in said, said
        end = await d2.health()
        assert (end.free_blocks, end.leases) == (start.free_blocks, 0)
        # a lease it holds, with the token, is taken (and released again)
        h = await d2.reserve("rank-accepts", 12, compat, kv_backend="grpc")
        assert await asyncio.to_thread(_push_rank, h, 1, TOKEN) == "ok"
        await d2.release("rank-accepts")
        end = await d2.health()
        assert (end.free_blocks, end.leases) == (start.free_blocks, 0)

    asyncio.run(go())


def _tcp_peers(pid: int) -> set[int]:
    """The remote ports of the established TCP connections process ``pid`` holds (IPv6
    ones too: grpcio's sockets are dual-stack, 127.0.0.1 as a v4-mapped address)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "01" and f[9] in inodes:  # ESTABLISHED
                ports.add(int(f[2].split(":")[1], 16))
    return ports


@pytest.mark.parametrize("backend", ["tcp", "grpc"])
@pytest.mark.parametrize("pair", ["p2d2", "p2d1"])
def test_each_prefill_rank_pushes_its_heads_to_each_decode_rank_itself(
    tp_workers: Any, tokenizer: Any, reference: list[list[int]], backend: str, pair: str
) -> None:
    """Nothing is gathered on the prefill worker's rank 0: into a decode worker over two
    ranks, each prefill rank pushes to the decode rank holding its heads alone; into one
    of one pool, both push there, each its own heads."""
    decode = PAIRS[pair][1]

    async def rank_ports() -> list[int]:
        d = WorkerClient(tp_workers[decode].address, TOKEN)
        compat = (await d.health()).compat
        h = await d.reserve("ports", 8, compat, kv_backend=backend)
        await d.release("ports")
        target = target_from_handle(h)
        metadata = [r.backend_metadata for r in h.kv_ranks] or [h.backend_metadata]
        if backend == "grpc":  # rank 0's on the worker's own gRPC port, rank 1's its own
            return [int(push_address(replace(target, backend_metadata=m)).rpartition(":")[2])
                    for m in metadata]  # fmt: skip
        return [parse_metadata(m)[0] for m in metadata]

    ports = asyncio.run(rank_ports())
    with router(TOKEN, tokenizer, _stack(tp_workers, pair), disaggregation=ALWAYS_REMOTE,
                kv_backend=backend) as base:  # fmt: skip
        assert complete(base, PROMPTS[0], stream=False) == reference[0]
    rank0 = PIDS["p2"]
    (rank1,) = child_pids(rank0)
    # the pushes' connections stay pooled a while: who holds which shows who pushed
    if len(ports) == 1:
        assert ports[0] in _tcp_peers(rank0) and ports[0] in _tcp_peers(rank1)
    else:
        assert ports[0] in _tcp_peers(rank0) and ports[1] not in _tcp_peers(rank0)
        assert ports[1] in _tcp_peers(rank1) and ports[0] not in _tcp_peers(rank1)


def test_replicated_kv_heads_hand_off_between_two_rank_workers(
    tiny_model_path_kv1: Path, tokenizer: Any
) -> None:
    """One KV head, two ranks on each side: each prefill rank holds a replica of the head
    and one of them pushes it, to each decode rank (each holds its own replica); the
    greedy tokens are transformers' own and the decode worker's blocks all come back."""
    want = generate_reference(tiny_model_path_kv1)
    procs = _start(tiny_model_path_kv1, [Role.PREFILL, Role.DECODE],
                   {Role.PREFILL: 2, Role.DECODE: 2})  # fmt: skip
    with procs:
        eps = procs.start(timeout_s=300)
        before = _blocks(eps[1])
        with router(TOKEN, tokenizer, eps, disaggregation=ALWAYS_REMOTE, kv_backend="tcp") as base:
            for prompt, ref in zip(PROMPTS, want, strict=True):
                assert complete(base, prompt, stream=True) == ref
        after = _blocks(eps[1])
        assert after == before and after[0] == after[1] and after[2] == 0
