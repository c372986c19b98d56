"""KV transfer throughput and overlap, measured side by side in one run on 127.0.0.1.

1. The ``tcp`` backend (the fast path) vs a plain TCP socket, the same backend over TLS,
   and the ``grpc`` backend (grpcio's PushKV): the same 256 MiB (the KV of 8 layers,
   8 KV heads, head dim 128, float32, 4,096 tokens) sent from this process into a
   receiver process. The KV lands in a pool of twice that size, in a block table the
   engine's own allocator hands out after churn (sequences of random lengths allocated
   and freed until the free list is mixed): ``--blocks reversed`` or ``ascending`` fix
   the order instead. The backends run the real transports: ``send_layer`` per layer
   (4 MiB spans) to the decode side's tcp KV port (the worker's ``TcpServer``, receiving
   each payload into the reserved blocks) or its gRPC server. TCP: ``sendall`` of 1 MiB
   slices, ``recv_into`` one preallocated buffer, one byte back when all arrived. The
   runs of all four are interleaved, so load on the host hits them alike. Beside them,
   the ``tcp`` backend with the workers' default sampled checksums (one span in
   ``--checksum-every``, 64, carries its crc32) and with every span checksummed
   (``--checksums``), against it with none.
2. ``nixl`` backend vs a shared-memory copy: the same 256 MiB written by
   ``NixlSender`` into the receiver process's registered pool (UCX picks CMA or TCP on
   one host), against one ``copy_`` of the bytes into a POSIX shared-memory segment.
   Beside each pair, the CPU time both processes spent per push, and the ratio that
   CPU alone allows on this host's cores.
3. Overlap (``bench/kv_overlap.py``): real ``splitserve worker`` processes (prefill
   and decode, one thread each) on the built-in model; for a 2,000-token prompt, the
   transfer time still exposed after prefill compute ends (tcp), as a fraction of the
   whole transfer time (both from the PrefillResponse timings, summed over repeats).

Ends with ``RESULT tcp_vs_raw=<r> tls_vs_tcp=<r> grpc_vs_tcp=<r> nixl_vs_shm=<r>
exposed_fraction=<f> sampled_crc_vs_off=<r> all_crc_vs_off=<r>`` (targets: tcp_vs_raw >=
0.8, nixl_vs_shm >= 0.5, exposed_fraction <= 0.2, sampled_crc_vs_off >= 0.97; TLS, grpc
and full checksums are reported, their cost is what they buy).

``--streams N`` pushes over N connections (default: what a worker on this host uses,
2 on 8 or more cores, else 1).

    .venv/bin/python bench/kv_transfer.py [--repeats 3] [--model smollm2-135m] [--skip-model]
        [--blocks churn|reversed|ascending] [--streams N]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing as mp
import os
import socket
import tempfile
import time
from multiprocessing import shared_memory
from typing import Any

import torch
from cpu_clock import CpuClock, Measured, cpu_report
from kv_overlap import TOKEN, bench_exposed
from splitserve_worker.kv.nixl_common import loopback_env

loopback_env()  # before any NIXL agent, here and in the processes started from here

LAYERS, HEADS, DIM, TOKENS, BLOCK = 8, 8, 128, 4096, 16
NBYTES = LAYERS * 2 * TOKENS * HEADS * DIM * 4  # 256 MiB
POOL_BLOCKS = 2 * TOKENS // BLOCK
CHUNK = 1 << 20


def _compat() -> Any:
    from splitserve.kv_compat import Compat

    return Compat("bench", "float32", BLOCK, LAYERS, HEADS, DIM, "LKBTHD-v1")


def _pool() -> torch.Tensor:
    return torch.zeros(LAYERS, 2, POOL_BLOCKS, BLOCK, HEADS, DIM)


def block_table(order: str, seed: int = 0) -> list[int]:
    """The blocks one 4,096-token reservation gets in the receiver's pool."""
    import random

    from splitserve_worker.engine.block_pool import BlockPool

    need = TOKENS // BLOCK
    if order == "ascending":
        return list(range(need))
    if order == "reversed":
        return list(range(need))[::-1]
    # churn: sequences of 1-64 blocks come and go (each freed tail first, as the
    # engine frees them) until a third of the pool has been reused several times
    rng = random.Random(seed)
    pool = BlockPool(POOL_BLOCKS)
    live: list[list[int]] = []
    for _ in range(400):
        n = rng.randint(1, 64)
        while live and (pool.free_blocks < n or rng.random() < 0.5):
            pool.free(reversed(live.pop(rng.randrange(len(live)))))
        live.append(pool.allocate(n))
    for seq in live:
        pool.free(reversed(seq))
    return pool.allocate(need)


def runs(blocks: list[int]) -> int:
    """How many runs of consecutive ascending ids the table holds."""
    return 1 + sum(b != a + 1 for a, b in itertools.pairwise(blocks))


def _source() -> torch.Tensor:
    return torch.randn(LAYERS, 2, TOKENS, HEADS, DIM, generator=torch.Generator().manual_seed(0))


# ---------------------------------------------------------------- receiver processes


def _tcp_receiver(port_q: Any, repeats: int) -> None:
    buf = torch.empty(NBYTES, dtype=torch.uint8)
    view = memoryview(buf.numpy())  # type: ignore[arg-type]
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port_q.put(srv.getsockname()[1])
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            for _ in range(repeats):
                got = 0
                while got < NBYTES:
                    n = conn.recv_into(view[got:], NBYTES - got)
                    if n == 0:
                        return
                    got += n
                conn.sendall(b"k")


def _kv_receiver(backend: str, tls: tuple[str, str] | None, q_out: Any, q_in: Any) -> None:
    """A decode-side transport over a raw pool: leases added here, KV received into it."""
    torch.set_num_threads(1)
    asyncio.run(_kv_receiver_async(backend, tls, q_out, q_in))


async def _kv_receiver_async(
    backend: str, tls: tuple[str, str] | None, q_out: Any, q_in: Any
) -> None:
    import grpc
    from splitserve.grpc_options import SERVER_OPTIONS
    from splitserve.metric_registry import Metrics
    from splitserve.tls import TlsConfig
    from splitserve_worker.kv.layout import PoolView
    from splitserve_worker.kv.lease import LeaseTable
    from splitserve_worker.kv.transport import BackendContext, create_receiver_backend
    from splitserve_worker.server.auth import TokenAuthInterceptor
    from splitserve_worker.server.handoff import DecodeHandoff
    from splitserve_worker.server.service import WorkerService, add_to_server
    from splitserve_worker.server.tcp_sink import start_tcp_server

    pool = _pool()
    leases = LeaseTable()
    ctx = BackendContext(compat=_compat(), token=TOKEN, pool=PoolView(pool), leases=leases)
    names = {backend, "tcp"} if backend != "nixl" else {"nixl"}
    receivers = {name: create_receiver_backend(name, ctx) for name in names}
    handoff = DecodeHandoff(None, ctx.compat, PoolView(pool), leases, receivers,  # type: ignore[arg-type]
                            default_backend=backend, lease_seconds=600, address="",
                            metrics=Metrics())  # fmt: skip
    server = grpc.aio.server(interceptors=[TokenAuthInterceptor(TOKEN)], options=SERVER_OPTIONS)
    service = WorkerService(role="decode", engine=None, compat=ctx.compat, handoff=handoff,
                            prefill=None, events=None, kv_backends=sorted(names))  # type: ignore[arg-type]  # fmt: skip
    add_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    tcp = None
    if "tcp" in names:
        context = TlsConfig(*tls).server_context() if tls else None
        tcp = start_tcp_server(handoff, "127.0.0.1", 0, TOKEN, context)
    receiver = receivers[backend]
    q_out.put((f"127.0.0.1:{port}", receiver.backend_metadata()))
    loop = asyncio.get_running_loop()
    while True:
        msg = await loop.run_in_executor(None, q_in.get)
        if msg is None:
            break
        if isinstance(msg, str):  # "check:<rid>"
            lease = leases.get(msg[6:])
            # as Commit does: the data is in place once every layer is reported arrived
            ok = await asyncio.to_thread(receiver.wait_layers, lease, 30)
            leases.pop(msg[6:])
            k, v = PoolView(pool).read(LAYERS - 1, lease.block_ids, 0, TOKENS)
            q_out.put((ok, float(k.sum() + v.sum())))
            continue
        rid, blocks = msg
        lease = leases.add(rid, blocks, num_tokens=TOKENS, num_layers=LAYERS, ttl=600,
                           backend=backend)  # fmt: skip
        q_out.put(lease.lease_id)
    if tcp is not None:
        tcp.close()
    for r in receivers.values():
        r.close()
    await server.stop(0)


# ---------------------------------------------------------------- measurements


class TcpRun:
    """A receiver process reading each 256 MiB into one preallocated buffer."""

    def __init__(self, src: torch.Tensor, repeats: int) -> None:
        ctx = mp.get_context("spawn")
        port_q = ctx.Queue()
        self._p = ctx.Process(target=_tcp_receiver, args=(port_q, repeats), daemon=True)
        self._p.start()
        port = port_q.get(timeout=120)
        self._data = memoryview(src.view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]
        self._s = socket.create_connection(("127.0.0.1", port))
        self._s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        self.cpu = CpuClock(self._p.pid)

    def once(self) -> float:
        with self.cpu:
            t0 = time.perf_counter()
            for off in range(0, NBYTES, CHUNK):
                self._s.sendall(self._data[off : off + CHUNK])
            assert self._s.recv(1) == b"k"
            return time.perf_counter() - t0

    def close(self) -> None:
        self._s.close()
        self._p.join(10)


class BackendRun:
    """A receiver process holding a pool; each run pushes all layers into fresh leases."""

    def __init__(
        self, backend: str, src: torch.Tensor, blocks: list[int], streams: int = 0,
        tls: tuple[str, str, str] | None = None, checksum_every: int = 0,
        checksums: bool = False,
    ) -> None:  # fmt: skip
        from splitserve.tls import TlsConfig
        from splitserve_worker.kv.transport import BackendContext, create_sender_backend

        self._blocks = blocks
        ctx = mp.get_context("spawn")
        self._q_out, self._q_in = ctx.Queue(), ctx.Queue()
        served = (tls[0], tls[1]) if tls else None
        self._p = ctx.Process(target=_kv_receiver,
                              args=(backend, served, self._q_out, self._q_in),
                              daemon=True)  # fmt: skip
        self._p.start()
        self._address, self._metadata = self._q_out.get(timeout=120)
        self._compat = _compat()
        sender_tls = TlsConfig(ca_file=tls[2]) if tls else None
        sender_ctx = BackendContext(compat=self._compat, token=TOKEN, streams=streams,
                                    tls=sender_tls, checksum_every=checksum_every,
                                    checksums=checksums)  # fmt: skip
        self._sender = create_sender_backend(backend, sender_ctx)
        self._backend, self._i = backend, 0
        # per layer, fresh K and V tensors: what the engine's layer-wise prefill hands over
        self._layers = [(src[i, 0].clone(), src[i, 1].clone()) for i in range(LAYERS)]
        self._expect = float(src[LAYERS - 1].sum())
        self.cpu = CpuClock(self._p.pid)

    def once(self) -> float:
        from splitserve_worker.kv.transport import TransferTarget

        self._i += 1
        rid = f"{self._backend}-{self._i}"
        self._q_in.put((rid, self._blocks))
        lease_id = self._q_out.get(timeout=60)
        target = TransferTarget(rid, lease_id, self._address, tuple(self._blocks), TOKENS,
                                self._compat.hash, self._metadata)  # fmt: skip
        with self.cpu:
            t0 = time.perf_counter()
            sender = self._sender.open(target)
            for layer, (k, v) in enumerate(self._layers):
                sender.send_layer(layer, k, v, 0)
            sender.finish(120)
            dt = time.perf_counter() - t0
        self._q_in.put(f"check:{rid}")
        ok, total = self._q_out.get(timeout=60)
        if not ok:
            raise SystemExit(f"{self._backend}: not every layer arrived")
        if abs(total - self._expect) > 1e-3 * max(1.0, abs(self._expect)):
            raise SystemExit(f"{self._backend}: the received KV differs from what was sent")
        return dt

    def close(self) -> None:
        self._q_in.put(None)
        self._p.join(15)
        self._sender.close()


class ShmRun:
    """One copy of the bytes into a POSIX shared-memory segment."""

    def __init__(self, src: torch.Tensor) -> None:
        self._shm = shared_memory.SharedMemory(create=True, size=NBYTES)
        self._dst: torch.Tensor | None = torch.frombuffer(self._shm.buf, dtype=torch.uint8)
        self._flat = src.view(torch.uint8).reshape(-1)
        self._dst.copy_(self._flat)  # first touch maps the pages
        self.cpu = CpuClock(None)

    def once(self) -> float:
        assert self._dst is not None
        with self.cpu:
            t0 = time.perf_counter()
            self._dst.copy_(self._flat)
            return time.perf_counter() - t0

    def close(self) -> None:
        self._dst = None
        self._shm.close()
        self._shm.unlink()


def side_by_side(runs: list[Any], repeats: int) -> list[Measured]:
    """Best GB/s of each, their runs interleaved so that load on the host hits all alike."""
    for _ in range(2):  # warm-up: connections, page faults, registrations
        for r in runs:
            r.once()
    for r in runs:
        r.cpu.reset()
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, r in enumerate(runs):
            best[i] = min(best[i], r.once())
    for r in runs:
        r.close()

    def measured(r: Any, t: float) -> Measured:
        n = r.cpu.spans
        return Measured(NBYTES / t / 1e9, r.cpu.wall / n, r.cpu.send / n, r.cpu.recv / n)

    return [measured(r, t) for r, t in zip(runs, best, strict=True)]


def tls_files(folder: str) -> tuple[str, str, str]:
    """A CA and a certificate for 127.0.0.1 (certificate, key, CA), as a Secret would hold."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    paths = tuple(os.path.join(folder, n) for n in ("tls.crt", "tls.key", "ca.crt"))
    cert.cert_chain_pems[0].write_to_path(paths[0])
    cert.private_key_pem.write_to_path(paths[1])
    ca.cert_pem.write_to_path(paths[2])
    return paths  # type: ignore[return-value]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--skip-model", action="store_true", help="skip the overlap measurement")
    ap.add_argument(
        "--blocks",
        choices=("churn", "reversed", "ascending"),
        default="churn",
        help="the receiving block table: the allocator's after churn, or fixed",
    )
    ap.add_argument("--streams", type=int, default=0, help="connections per push (0: as a worker)")
    ap.add_argument("--checksum-every", type=int, default=64,
                    help="spans per sampled crc32, as the workers' --checksum-every")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(1)
    from splitserve_worker.kv.transport import unavailable_reason

    src = _source()
    blocks = block_table(args.blocks)
    print(f"payload: {NBYTES / 2**20:.0f} MiB ({LAYERS} layers x {TOKENS} tokens) into "
          f"{len(blocks)} blocks of a {POOL_BLOCKS}-block pool ({args.blocks}: {runs(blocks)} "
          f"runs of consecutive blocks)", flush=True)  # fmt: skip
    from splitserve_worker.kv.span_sender import default_streams

    streams = args.streams or default_streams()
    with tempfile.TemporaryDirectory() as folder:
        tcp, raw, tls, grpc = side_by_side([
            BackendRun("tcp", src, blocks, streams), TcpRun(src, args.repeats + 2),
            BackendRun("tcp", src, blocks, streams, tls=tls_files(folder)),
            BackendRun("grpc", src, blocks, streams)], args.repeats)  # fmt: skip
    plural = "s" * (streams > 1)
    print(f"tcp backend {tcp.gbs:.2f} GB/s ({streams} stream{plural} on {os.cpu_count()} "
          f"cores)   plain TCP {raw.gbs:.2f} GB/s   tcp over TLS {tls.gbs:.2f} GB/s   "
          f"grpc backend {grpc.gbs:.2f} GB/s", flush=True)  # fmt: skip
    print(cpu_report("tcp", tcp, "plain TCP", raw, NBYTES), flush=True)
    print(cpu_report("TLS", tls, "tcp", tcp, NBYTES), flush=True)
    print(cpu_report("grpc", grpc, "tcp", tcp, NBYTES), flush=True)
    off, sampled, every = side_by_side([
        BackendRun("tcp", src, blocks, streams),
        BackendRun("tcp", src, blocks, streams, checksum_every=args.checksum_every),
        BackendRun("tcp", src, blocks, streams, checksums=True)], args.repeats)  # fmt: skip
    print(f"tcp backend, checksums off {off.gbs:.2f} GB/s   one span in {args.checksum_every} "
          f"checksummed {sampled.gbs:.2f} GB/s   every span {every.gbs:.2f} GB/s",
          flush=True)  # fmt: skip
    print(cpu_report("sampled crc32", sampled, "none", off, NBYTES), flush=True)
    print(cpu_report("every crc32", every, "none", off, NBYTES), flush=True)
    nixl_reason = unavailable_reason("nixl")
    if nixl_reason:
        nixl_gbs, shm = float("nan"), side_by_side([ShmRun(src)], args.repeats)[0]
    else:
        nixl, shm = side_by_side([BackendRun("nixl", src, blocks), ShmRun(src)], args.repeats)
        nixl_gbs = nixl.gbs
    print(f"nixl backend {nixl_gbs:.2f} GB/s   shared-memory copy {shm.gbs:.2f} GB/s"
          + (f"  (nixl skipped: {nixl_reason})" if nixl_reason else ""), flush=True)  # fmt: skip
    if not nixl_reason:
        print(cpu_report("nixl", nixl, "the copy", shm, NBYTES), flush=True)
    exposed = float("nan")
    if not args.skip_model:
        exposed = bench_exposed(args.model, "tcp", args.repeats, args.prompt_len)
        print(f"exposed transfer after prefill (tcp, {args.prompt_len} tokens): "
              f"{exposed:.4f} of the transfer time", flush=True)  # fmt: skip
    print(f"RESULT tcp_vs_raw={tcp.gbs / raw.gbs:.3f} tls_vs_tcp={tls.gbs / tcp.gbs:.3f} "
          f"grpc_vs_tcp={grpc.gbs / tcp.gbs:.3f} nixl_vs_shm={nixl_gbs / shm.gbs:.3f} "
          f"exposed_fraction={exposed:.4f} sampled_crc_vs_off={sampled.gbs / off.gbs:.3f} "
          f"all_crc_vs_off={every.gbs / off.gbs:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
