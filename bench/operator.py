"""How fast the operator turns new InferenceServices into Deployments, and what a
reconcile of an unchanged one costs the API server.

Starts the Kubernetes API emulator (kmock, in its own process so that it has a
core of its own, as an API server would), runs the operator in this process,
creates N InferenceServices as fast as the client can, and measures the time
from the first create until every one of them has its three Deployments. Then it
marks the pools of a sample of them ready (as the Deployment controller would), waits
for them to report Ready, and counts the API requests of one more reconcile of each
(an unchanged object: the resync's case, and every Deployment event's).

    python bench/operator.py [--count 200] [--workers 16] [--sample 20]

Ends with ``RESULT ms_per_cr=<x> reads_per_idle_reconcile=<r>
writes_per_idle_reconcile=<w> cpu_ms_per_cr_operator=<o> cpu_ms_per_cr_emulator=<e>``
(targets: <= 50 ms, 0 writes). The CPU figures cover the same window as ``ms_per_cr``
(first create to last Deployment): on a shared host the wall time follows the load, the
CPU each side spends per service much less so. The operator's includes this process's
own creates and Deployment watch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import kubernetes.client
from splitserve_operator.control.config import OperatorConfig
from splitserve_operator.control.k8s import DEPLOYMENT, INFERENCE_SERVICE, KubeClient

# The API emulator and the operator thread are test support, not part of the package.
SUPPORT = Path(__file__).resolve().parents[1] / "tests" / "support"
sys.path.insert(0, str(SUPPORT))

from emulator_thread import EmulatorThread  # noqa: E402
from operator_thread import OperatorThread  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_emulator_process() -> tuple[subprocess.Popen[str], str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, str(SUPPORT / "kube_emulator.py"), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("serving on "):
        proc.kill()
        raise RuntimeError(f"the emulator did not start: {line!r}")
    return proc, line.split()[-1]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (0 where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class DeploymentCounter:
    """Counts Deployments from one watch stream (cheaper for the emulator than polling
    lists of hundreds of Deployments); sets ``done`` when ``expected`` exist."""

    def __init__(self, client: KubeClient, expected: int) -> None:
        self.expected = expected
        self.names: set[tuple[str, str]] = set()
        self.done = threading.Event()
        self.finished_at = 0.0
        url = client.configuration.host + DEPLOYMENT.path() + "?watch=true"
        self._response = client.api.rest_client.pool_manager.request(
            "GET", url, preload_content=False
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buffer = b""
        for chunk in self._response.stream(65536):
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if not line.strip():
                    continue
                event = json.loads(line)
                meta = event.get("object", {}).get("metadata", {})
                if event.get("type") == "ADDED":
                    self.names.add((meta.get("namespace"), meta.get("name")))
            if len(self.names) >= self.expected and not self.done.is_set():
                self.finished_at = time.perf_counter()
                self.done.set()
                return


def manifest(i: int) -> dict[str, object]:
    return {
        "apiVersion": "splitserve.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": f"bench-{i:04d}", "namespace": f"ns-{i % 10}"},
        "spec": {
            "model": {"name": "smollm2-135m", "dtype": "float32"},
            "image": "splitserve/worker:0.1.0",
            "prefill": {"replicas": 1, "gpus": 0},
            "decode": {"replicas": 2, "gpus": 0},
        },
    }


WRITES = ("POST", "PATCH", "PUT", "DELETE")


def _mark_ready(client: KubeClient, namespace: str, name: str) -> None:
    for pool in ("prefill", "decode", "router"):
        d = client.get(DEPLOYMENT, namespace, f"{name}-{pool}")
        assert d is not None
        n = d["spec"].get("replicas", 1)
        status = {"observedGeneration": d["metadata"]["generation"], "replicas": n,
                  "readyReplicas": n, "updatedReplicas": n, "availableReplicas": n}  # fmt: skip
        client.patch(DEPLOYMENT, namespace, f"{name}-{pool}", {"status": status},
                     subresource="status")  # fmt: skip


def _ready(client: KubeClient, namespace: str, name: str) -> bool:
    body = client.get(INFERENCE_SERVICE, namespace, name) or {}
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (body.get("status") or {}).get("conditions") or []
    )


def idle_reconcile_cost(op: OperatorThread, client: KubeClient, sample: int) -> tuple[float, float]:
    """Mean (reads, writes) of one reconcile of each of ``sample`` unchanged, ready services."""
    keys = [(f"ns-{i % 10}", f"bench-{i:04d}") for i in range(sample)]
    for namespace, name in keys:
        _mark_ready(client, namespace, name)
    deadline = time.monotonic() + 60
    while not all(_ready(client, *key) for key in keys):
        if time.monotonic() > deadline:
            raise SystemExit("the sampled services did not report Ready within 60 s")
        time.sleep(0.2)
    reads = writes = 0
    operator_client = op.operator.client
    for namespace, name in keys:
        body = client.get(INFERENCE_SERVICE, namespace, name)
        assert body is not None
        before = dict(operator_client.calls)
        op.controller.reconcile(body)
        after = operator_client.calls
        reads += after["GET"] - before.get("GET", 0)
        writes += sum(after[m] - before.get(m, 0) for m in WRITES)
    return reads / sample, writes / sample


def run(count: int, workers: int, in_process: bool, sample: int) -> Figures:
    proc = None
    emulator = None
    if in_process:
        emulator = EmulatorThread().start()
        url = emulator.url
    else:
        proc, url = _start_emulator_process()
    try:
        configuration = kubernetes.client.Configuration(host=url)
        configuration.connection_pool_maxsize = 32
        client = KubeClient(configuration)
        config = OperatorConfig(workers=workers, resync_seconds=0, watch_timeout=None)
        with OperatorThread(config, kubernetes.client.Configuration(host=url)) as op:
            watcher = DeploymentCounter(client, 3 * count)
            cpu_start = (_cpu_seconds(proc.pid) if proc is not None else 0.0, time.process_time())
            start = time.perf_counter()
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda i: client.create(manifest(i)), range(count)))
            created = time.perf_counter()
            if not watcher.done.wait(max(60.0, count * 0.5)):
                raise SystemExit(f"timed out: {len(watcher.names)} of {3 * count} Deployments")
            done = watcher.finished_at
            # read here, printed after: kopf's runner holds stdout while it runs
            cpu_end = (_cpu_seconds(proc.pid) if proc is not None else 0.0, time.process_time())
            reads, writes = idle_reconcile_cost(op, client, min(sample, count))
        client.close()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        if emulator is not None:
            emulator.stop()
    print(
        f"created {count} InferenceServices in {created - start:.2f} s; "
        f"all {3 * count} Deployments after {done - start:.2f} s"
    )
    print(
        f"one reconcile of an unchanged, ready InferenceService ({min(sample, count)} sampled): "
        f"{reads:.1f} reads, {writes:.1f} writes"
    )
    # the in-process emulator's CPU is the operator's too: it counts as the operator's
    cpu_emulator, cpu_operator = (
        (e - s) * 1000 / count for e, s in zip(cpu_end, cpu_start, strict=True)
    )
    print(
        f"CPU per InferenceService while creating: operator (and this client) "
        f"{cpu_operator:.1f} ms, emulator {cpu_emulator:.1f} ms"
    )
    return Figures((done - start) * 1000 / count, reads, writes, cpu_operator, cpu_emulator)


class Figures(NamedTuple):
    ms_per_cr: float
    reads: float
    writes: float
    cpu_operator: float
    cpu_emulator: float


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--workers", type=int, default=OperatorConfig().workers)
    parser.add_argument(
        "--in-process", action="store_true", help="serve the emulator from a thread of this process"
    )
    parser.add_argument(
        "--sample", type=int, default=20, help="services whose idle reconcile is counted"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    f = run(args.count, args.workers, args.in_process, args.sample)
    print(
        f"RESULT ms_per_cr={f.ms_per_cr:.1f} reads_per_idle_reconcile={f.reads:.1f} "
        f"writes_per_idle_reconcile={f.writes:.1f} cpu_ms_per_cr_operator={f.cpu_operator:.1f} "
        f"cpu_ms_per_cr_emulator={f.cpu_emulator:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
