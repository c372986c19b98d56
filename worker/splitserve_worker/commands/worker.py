"""``splitserve worker``: one worker process (prefill, decode or both) serving ``splitserve.v1``.

Prints one line ``READY <host:port>`` on stdout once it serves (preceded by
``METRICS <port>`` when it serves Prometheus metrics), then runs until SIGTERM or SIGINT,
when it stops taking calls, lets running ones finish for up to ``--drain-seconds``, and
exits. A bad setting, or ``--device cuda`` where no CUDA device is visible, ends it at
start with one ``error:`` line and status 2; a sticky device error while serving ends it
with one ``error:`` line and status 3, for Kubernetes to restart it, as does a lost
tensor-parallel rank (``--tensor-parallel-size N`` runs N rank processes; the others are
ended with this one).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import signal
import sys
from pathlib import Path

from splitserve.tls import TlsError

from splitserve_worker.commands.tls_flags import add_tls_arguments, tls_from_args
from splitserve_worker.engine.config import ATTENTION_BACKENDS
from splitserve_worker.kv.faults import FaultConfig
from splitserve_worker.server.auth import TOKEN_ENV, TokenError, load_token
from splitserve_worker.server.config import (
    DEFAULT_CHECKSUM_EVERY,
    KV_BACKENDS,
    ROLES,
    TP_ALLREDUCE,
    ConfigError,
    WorkerConfig,
)
from splitserve_worker.server.pod_labels import role_from_labels

READY_PREFIX = "READY "
METRICS_PREFIX = "METRICS "


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=ROLES, required=True, help="what this worker does")
    p.add_argument("--model", required=True, help="built-in model name or checkpoint folder")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    p.add_argument(
        "--advertise-address",
        default=None,
        help="host:port others reach this worker at (default: host:port)",
    )
    p.add_argument("--metrics-port", type=int, default=None, help="serve /metrics on this port")
    p.add_argument(
        "--kv-port",
        type=int,
        default=0,
        help="port a decode worker receives tcp KV pushes on (0: any free port; Reserve "
        "answers name it); over N tensor-parallel ranks, rank r > 0 takes tcp on this + r "
        "and grpc on this + N - 1 + r",
    )
    p.add_argument(
        "--kv-backend",
        choices=KV_BACKENDS,
        default="tcp",
        help="KV transport a decode worker offers in Reserve by default (tcp: the fast "
        "path; grpc: PushKV for any gRPC peer; nixl: NVIDIA NIXL); a prefill worker pushes "
        "over whichever the Reserve answer names",
    )
    add_tls_arguments(p, worker=True)
    p.add_argument(
        "--lease-seconds",
        type=float,
        default=30.0,
        help="reserved blocks are freed if their KV is not committed in this time",
    )
    p.add_argument(
        "--max-lease-seconds",
        type=float,
        default=300.0,
        help="longest lease a Reserve gets, whatever it asks for (--lease-seconds when longer)",
    )
    p.add_argument(
        "--token-file",
        default=None,
        help=f"file holding the shared worker token (default: ${TOKEN_ENV})",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--kv-cache-memory", type=int, default=None, help="KV pool size in bytes")
    size.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in a batch")
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=2048,
        help="most tokens (prefill and decode together) computed in one step",
    )
    p.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=512,
        help="prompt tokens per step while others decode (long prompts go in chunks)",
    )
    p.add_argument(
        "--gpu-memory-fraction",
        type=float,
        default=0.5,
        help="share of the GPU memory left after the weights that the KV pool takes "
        "(unless --kv-cache-memory or --num-blocks)",
    )
    p.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="how attention reads the KV pool (auto: flex on CUDA, sdpa on the CPU)",
    )
    p.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="run decode steps eagerly on CUDA instead of replaying captured CUDA graphs",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="rank processes this worker runs its engine over, each with its share of the "
        "attention heads, KV heads and MLP (one GPU each on CUDA); rank 0 serves gRPC",
    )
    p.add_argument(
        "--tp-allreduce",
        choices=TP_ALLREDUCE,
        default="auto",
        help="how the ranks sum their partials (auto: NCCL on CUDA, shared memory on the CPU)",
    )
    p.add_argument(
        "--checksums",
        action="store_true",
        help="crc32 every pushed KV span, and each layer again at Commit",
    )
    p.add_argument(
        "--checksum-every",
        type=int,
        default=DEFAULT_CHECKSUM_EVERY,
        metavar="N",
        help=f"without --checksums, one pushed KV span in N carries its crc32 (tcp, grpc; "
        f"default {DEFAULT_CHECKSUM_EVERY}; 0: none)",
    )
    p.add_argument(
        "--switchable",
        action="store_true",
        help="let SwitchRole change this worker's role in place (weights stay loaded; it "
        "drains for up to --drain-seconds first); the KV port is open whatever the role",
    )
    p.add_argument(
        "--role-labels-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="a downward-API file of the pod's labels: start in the role its --role-label "
        "names (a restarted container keeps the role its pod was given; --role when the "
        "pod has no such label) and, with --switchable, switch whenever the label changes",
    )
    p.add_argument(
        "--role-label",
        default="splitserve.io/role",
        help="the label --role-labels-file is read for (default splitserve.io/role)",
    )
    p.add_argument(
        "--kv-streams",
        type=int,
        default=0,
        help="concurrent connections a tcp or grpc KV push uses (0: 2 on 8 or more cores, else 1)",
    )
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=2.0,
        help="on SIGTERM, how long running calls (streams) may go on before the worker "
        "exits; new calls are refused at once",
    )
    p.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="exit when this process exits (Linux parent-death signal; set by launchers)",
    )


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when ``parent_pid`` (its parent) exits, and exit now if it has.

    Launchers pass their own pid instead of arming the signal in a ``preexec_fn``: a
    ``preexec_fn`` forces a full fork that runs gRPC's fork handlers in the child, which
    can crash it before ``exec`` (grpc/grpc#43055).
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(1, signal.SIGTERM) != 0:  # PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        raise SystemExit(f"error: parent process {parent_pid} is gone; exiting")


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    role = args.role
    if args.role_labels_file is not None:
        role = role_from_labels(args.role_labels_file, args.role_label, ROLES, args.role)
    return WorkerConfig(
        role=role,
        model=args.model,
        token=load_token(args.token_file),
        port=args.port,
        host=args.host,
        advertise_address=args.advertise_address,
        metrics_port=args.metrics_port,
        kv_port=args.kv_port,
        dtype=args.dtype,
        device=args.device,
        kv_backend=args.kv_backend,
        lease_seconds=args.lease_seconds,
        max_lease_seconds=args.max_lease_seconds,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        num_blocks=args.num_blocks,
        threads=args.threads,
        checksums=args.checksums,
        checksum_every=args.checksum_every,
        switchable=args.switchable,
        role_labels_file=None if args.role_labels_file is None else str(args.role_labels_file),
        role_label=args.role_label,
        kv_streams=args.kv_streams,
        tls=tls_from_args(args),
        max_num_seqs=args.max_num_seqs,
        max_batch_tokens=args.max_batch_tokens,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        gpu_memory_fraction=args.gpu_memory_fraction,
        drain_seconds=args.drain_seconds,
        faults=FaultConfig.from_env(),
        attention_backend=args.attention_backend,
        cuda_graphs=args.cuda_graphs,
        tensor_parallel_size=args.tensor_parallel_size,
        tp_allreduce=args.tp_allreduce,
    )


async def serve(config: WorkerConfig) -> int:
    from splitserve_worker.kv.nixl_common import loopback_env
    from splitserve_worker.models import ModelError
    from splitserve_worker.server.app import start_worker
    from splitserve_worker.server.device_health import DEVICE_FAILED_EXIT, DeviceUnavailable

    if config.kv_backend == "nixl" and config.host in ("127.0.0.1", "localhost"):
        loopback_env()
    try:
        worker = await start_worker(config)
    except (ModelError, OSError, ValueError, DeviceUnavailable) as e:  # the fix is said
        print(f"error: {e}", file=sys.stderr)
        return 2
    if worker.metrics_port is not None:
        print(f"{METRICS_PREFIX}{worker.metrics_port}", flush=True)
    print(f"{READY_PREFIX}{worker.address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(worker.device_failed.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    if worker.device.failure is not None:
        # nothing running here can finish on this device: stop now, for a restart
        print(f"error: {worker.device.failure}", file=sys.stderr, flush=True)
        await worker.stop(grace=0)
        return DEVICE_FAILED_EXIT
    print(f"stopping: running calls have {config.drain_seconds:g} s to finish", flush=True)
    await worker.stop(grace=config.drain_seconds)
    return 0


def run(args: argparse.Namespace) -> int:
    # the engine says at start what runs (attention backend, CUDA graphs, matmuls)
    logging.basicConfig(level=logging.WARNING, format="[splitserve] %(message)s")
    logging.getLogger("splitserve_worker.engine").setLevel(logging.INFO)
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    try:
        config = config_from_args(args)
    except (TokenError, ConfigError, TlsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    code = asyncio.run(serve(config))
    from splitserve_worker.server.device_health import DEVICE_FAILED_EXIT

    if code == DEVICE_FAILED_EXIT:
        # Everything of ours is stopped (the ranks ended, ports closed), but a failed device
        # or a lost rank leaves native threads behind (gloo's, NCCL's, CUDA's) whose
        # destructors can abort the interpreter's teardown and turn this status into
        # SIGABRT: leave without that teardown, so Kubernetes sees the status it restarts on.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
