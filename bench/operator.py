"""How fast the operator turns new InferenceServices into Deployments.

Starts the Kubernetes API emulator (kmock, in its own process so that it has a
core of its own, as an API server would), runs the operator in this process,
creates N InferenceServices as fast as the client can, and measures the time
from the first create until every one of them has its three Deployments.

    python bench/operator.py [--count 200] [--workers 16]

Ends with ``RESULT ms_per_cr=<x>`` (target: <= 50).
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

import kubernetes.client
from splitserve_operator.control.config import OperatorConfig
from splitserve_operator.control.k8s import DEPLOYMENT, KubeClient

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


def run(count: int, workers: int, in_process: bool) -> float:
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
        with OperatorThread(config, kubernetes.client.Configuration(host=url)):
            watcher = DeploymentCounter(client, 3 * count)
            start = time.perf_counter()
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda i: client.create(manifest(i)), range(count)))
            created = time.perf_counter()
            if not watcher.done.wait(max(60.0, count * 0.5)):
                raise SystemExit(f"timed out: {len(watcher.names)} of {3 * count} Deployments")
            done = watcher.finished_at
            # read here, printed after: kopf's runner holds stdout while it runs
            cpu = (_cpu_seconds(proc.pid), time.process_time()) if proc is not None else None
        client.close()
        if cpu is not None:
            print(f"CPU seconds: emulator {cpu[0]:.1f}, operator and client {cpu[1]:.1f}")
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
    return (done - start) * 1000 / count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--workers", type=int, default=OperatorConfig().workers)
    parser.add_argument(
        "--in-process", action="store_true", help="serve the emulator from a thread of this process"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    ms = run(args.count, args.workers, args.in_process)
    print(f"RESULT ms_per_cr={ms:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
