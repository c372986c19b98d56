"""How fast can the transports move bytes at all, beside their baselines?

References for ``bench/kv_transfer.py``'s ratios, with no KV, no pool and no
leases in the way.

grpcio itself: what the library moves when it carries the messages both ways, the
ceiling of the ``grpc`` backend (grpcio's PushKV; the ``tcp`` backend does without
grpcio and its copies). The same 256 MiB (the same random bytes) in
1 MiB messages, already built as ``bytes`` before the clock starts, streamed over
one client-streaming call (and over 2 and 4 concurrent calls on separate
channels) to a server that only counts them: no KV, no pool, no parsing. Both
sides use the transport's own channel options (large HTTP/2 frames and
windows). Beside it, the plain TCP socket of ``kv_transfer.py``. Also prints
the CPU seconds each side spent, to show which side is the bottleneck.

NIXL, the ceiling for ``nixl_vs_shm``: two agents in two processes (progress
thread off, the target polling notifications, UCX choosing CMA on one host),
256 MiB registered once on each side, moved by one WRITE and by one READ, as
one descriptor, as 32 MiB descriptors (a layer) and as 64 KiB descriptors (one
KV block each, in order and reversed), beside one copy into POSIX shared memory.

Ends with ``RESULT bare_grpc_vs_tcp=<r> bare_nixl_vs_shm=<r>`` (the best of each;
nan where NIXL is not installed).

    .venv/bin/python bench/transport_ceiling.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import threading
import time
from concurrent import futures
from typing import Any

import grpc
import torch
from cpu_clock import cpu_seconds
from kv_transfer import NBYTES, ShmRun, TcpRun, _source

MSG = 1 << 20
METHOD = "/bench.Sink/Push"


def _server(requests: Any, replies: Any) -> None:
    from splitserve.grpc_options import SERVER_OPTIONS

    def push(messages: Any, context: Any) -> bytes:
        return str(sum(len(m) for m in messages)).encode()

    server = grpc.server(futures.ThreadPoolExecutor(8), options=SERVER_OPTIONS)
    handler = grpc.stream_unary_rpc_method_handler(push)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Sink", {"Push": handler}),)
    )
    replies.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    while requests.get() == "cpu":
        replies.put(cpu_seconds())
    server.stop(0)


class BareGrpc:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._req, self._rep = ctx.Queue(), ctx.Queue()
        self._p = ctx.Process(target=_server, args=(self._req, self._rep), daemon=True)
        self._p.start()
        self.address = f"127.0.0.1:{self._rep.get(timeout=120)}"
        # the bench's own random KV bytes: ``bytes(MSG)`` would be calloc'd zero pages,
        # all mapped to one physical page, so every copy of them would read from cache
        flat = _source().view(torch.uint8).reshape(-1).numpy()
        self.payload = [flat[i : i + MSG].tobytes() for i in range(0, NBYTES, MSG)]

    def server_cpu(self) -> float:
        self._req.put("cpu")
        return float(self._rep.get(timeout=30))

    def run(self, streams: int) -> tuple[float, float, float]:
        """(seconds, client CPU seconds, server CPU seconds) of one 256 MiB push."""
        from splitserve.grpc_options import CHANNEL_OPTIONS

        channels = [
            grpc.insecure_channel(self.address, options=[*CHANNEL_OPTIONS, ("bench.id", i)])
            for i in range(streams)
        ]
        calls = [ch.stream_unary(METHOD, None, None) for ch in channels]
        for call in calls:  # connect first
            call(iter([b"x"]))
        parts = [self.payload[i::streams] for i in range(streams)]
        s0, c0 = self.server_cpu(), cpu_seconds()
        t0 = time.perf_counter()
        threads = [
            threading.Thread(target=call, args=(iter(part),))
            for call, part in zip(calls, parts, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        dt = time.perf_counter() - t0
        c1, s1 = cpu_seconds(), self.server_cpu()
        for ch in channels:
            ch.close()
        return dt, c1 - c0, s1 - s0

    def close(self) -> None:
        self._req.put(None)
        self._p.join(10)


def _nixl_target(out: Any, stop: Any) -> None:
    import queue

    torch.set_num_threads(1)
    from splitserve_worker.kv.nixl_common import make_agent

    agent = make_agent("ceiling-target")
    buf = torch.zeros(NBYTES, dtype=torch.uint8)
    agent.register_memory(buf)
    out.put((agent.get_agent_metadata(), buf.data_ptr()))
    while True:  # no progress thread: notifications must be polled or transfers stall
        agent.get_new_notifs()
        try:
            stop.get_nowait()
            return
        except queue.Empty:
            time.sleep(0.0002)


def bare_nixl(src: torch.Tensor, repeats: int) -> dict[str, float]:
    """GB/s of each way of moving the 256 MiB between two NIXL agents."""
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_nixl_target, args=(out, stop), daemon=True)
    p.start()
    metadata, remote_base = out.get(timeout=120)
    from splitserve_worker.kv.nixl_common import make_agent

    agent = make_agent("ceiling-init")
    flat = src.view(torch.uint8).reshape(-1)
    agent.register_memory(flat)
    peer = agent.add_remote_agent(metadata)
    got: dict[str, float] = {}
    for op in ("WRITE", "READ"):
        for label, piece, reverse in (("one descriptor", NBYTES, False),
                                      ("32 MiB descriptors", 32 << 20, False),
                                      ("64 KiB descriptors", 64 << 10, False),
                                      ("64 KiB descriptors reversed", 64 << 10, True)):  # fmt: skip
            n = NBYTES // piece
            order = list(range(n))[::-1] if reverse else list(range(n))
            local = agent.get_xfer_descs(
                [(flat.data_ptr() + i * piece, piece, 0) for i in range(n)], "DRAM"
            )
            remote = agent.get_xfer_descs(
                [(remote_base + j * piece, piece, 0) for j in order], "DRAM"
            )
            best = float("inf")
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                handle = agent.initialize_xfer(op, local, remote, peer, b"ceiling")
                agent.transfer(handle)
                while agent.check_xfer_state(handle) == "PROC":
                    pass
                best = min(best, time.perf_counter() - t0)
                agent.release_xfer_handle(handle)
            got[f"{op} {label}"] = NBYTES / best / 1e9
    stop.put(None)
    p.join(10)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    src = _source()
    tcp = TcpRun(src, 1 + 3 * args.repeats)
    bare = BareGrpc()
    tcp.once()
    best_tcp = float("inf")
    best: dict[int, tuple[float, float, float]] = {}
    for _ in range(args.repeats):
        for streams in (1, 2, 4):
            run = bare.run(streams)
            if streams not in best or run[0] < best[streams][0]:
                best[streams] = run
            best_tcp = min(best_tcp, tcp.once())
    tcp_gbs = NBYTES / best_tcp / 1e9
    print(f"plain TCP: {tcp_gbs:.2f} GB/s")
    for streams, (dt, client, server) in best.items():
        print(f"bare gRPC, {streams} stream(s): {NBYTES / dt / 1e9:.2f} GB/s; CPU per push: "
              f"sender {client * 1e3:.0f} ms, receiver {server * 1e3:.0f} ms, "
              f"wall {dt * 1e3:.0f} ms")  # fmt: skip
    bare.close()
    tcp.close()
    top = NBYTES / min(dt for dt, _, _ in best.values()) / 1e9

    from splitserve_worker.kv.nixl_common import unavailable_reason

    reason = unavailable_reason()
    shm = ShmRun(src)
    shm.once()
    shm_gbs = NBYTES / min(shm.once() for _ in range(args.repeats)) / 1e9
    shm.close()
    print(f"shared-memory copy: {shm_gbs:.2f} GB/s")
    nixl = {} if reason else bare_nixl(src, args.repeats)
    if reason:
        print(f"bare NIXL skipped: {reason}")
    for label, gbs in nixl.items():
        print(f"bare NIXL {label}: {gbs:.2f} GB/s ({gbs / shm_gbs:.2f} of the copy)")
    nixl_top = max(nixl.values(), default=float("nan"))
    print(f"RESULT bare_grpc_vs_tcp={top / tcp_gbs:.3f} bare_nixl_vs_shm={nixl_top / shm_gbs:.3f}")


if __name__ == "__main__":
    main()
