"""The worker and router command lines, ports, mounts and probes, in one place.

The ``splitserve worker`` and ``splitserve router`` flags are defined by the
worker package; when they change, this file is the only one to align.
"""

from __future__ import annotations

from typing import Any

from splitserve_operator.api.models import InferenceServiceSpec
from splitserve_operator.api.settings import RouterTimeouts
from splitserve_operator.api.values import Pool, quantity_bytes

EXECUTABLE = "splitserve"
"""The console script the worker image puts on PATH."""

WORKER_GRPC_PORT = 50051
"""Workers' gRPC port: Reserve, Prefill, Commit, Generate and the rest of the contract."""
WORKER_KV_PORT = 50052
"""Decode workers' KV push port (``grpc`` backend): prefill workers stream KV layers there."""
WORKER_METRICS_PORT = 9100
"""Workers' Prometheus ``/metrics`` port."""
POD_GRACE_SECONDS = 60
"""Every pod's terminationGracePeriodSeconds: a drain or rolling update gives it this long."""
WORKER_DRAIN_SECONDS = POD_GRACE_SECONDS - 10
"""How long a stopping worker lets running streams finish (``--drain-seconds``): most end
where they are instead of moving to another worker; the rest move when it is up."""
ROUTER_HTTP_PORT = 8000
"""The router's OpenAI-compatible HTTP port (its ``/metrics`` there needs the API key
when one is set)."""
ROUTER_METRICS_PORT = 9100
"""The router's ``/metrics`` alone, without the API key: what Prometheus scrapes (the
Service port named ``metrics``)."""

WORKER_STARTUP_SECONDS = 1800
"""How long a worker may take to listen (its startup probe's budget): pulling and loading
the weights of a large model from the hub can take most of half an hour."""
ROUTER_STARTUP_SECONDS = 600
"""How long a router may take to listen (it fetches the tokenizer first)."""
ROLLOUT_SLACK_SECONDS = 600
"""Added to a pool's startup budget for its Deployment's progress deadline: scheduling
and an image pull come before the probe starts counting."""
PROBE_PERIOD_SECONDS = {Pool.PREFILL: 10, Pool.DECODE: 10, Pool.ROUTER: 5}

CONFIG_DIR = "/etc/splitserve"
CONFIG_FILE = "splitserve.json"
TOKEN_DIR = "/var/run/secrets/splitserve"
TOKEN_KEY = "token"
TOKEN_FILE = f"{TOKEN_DIR}/{TOKEN_KEY}"
TLS_DIR = "/var/run/secrets/splitserve-tls"
"""Where ``spec.tls.secretName`` is mounted: ``tls.crt``, ``tls.key``, ``ca.crt``."""
TLS_KEYS = ("tls.crt", "tls.key", "ca.crt")
TMP_DIR = "/tmp"
CACHE_DIR = "/cache"
SHM_DIR = "/dev/shm"
BIND_ALL = "0.0.0.0"
"""Workers and router listen on every interface of the pod (the CLIs default to loopback)."""
POD_IP_ENV = "POD_IP"
"""Set from the downward API; ``$(POD_IP)`` in args expands to the pod's address."""
ROLE_LABEL = "splitserve.io/role"
"""Pod label the router's Kubernetes discovery reads a worker's role from."""
FLEX_START_ROLE = "both"
"""The role a switchable pod starts in until the planner labels it otherwise: it serves
whole requests alone, so a fresh pod is never in a role nobody asked for."""
PODINFO_DIR = "/etc/podinfo"
"""Where a switchable pod's own labels are mounted (the downward API)."""
LABELS_FILE = f"{PODINFO_DIR}/labels"
"""The pod's labels as the kubelet writes them: the worker takes its starting role from
:data:`ROLE_LABEL` there, so a restarted container keeps the role its pod was given."""


def fetch_model_args(spec: InferenceServiceSpec) -> list[str]:
    """``splitserve model`` arguments: fetch the weights into the download folder (the
    shared cache) and check them, before the worker starts."""
    return ["model", spec.model.weights]


def worker_args(spec: InferenceServiceSpec, pool: Pool) -> list[str]:
    """``splitserve worker`` arguments for a prefill or decode pod."""
    if pool not in (Pool.PREFILL, Pool.DECODE):
        raise ValueError(f"{pool} is not a worker pool")
    return [
        "worker",
        "--role",
        pool.value,
        "--model",
        spec.model.weights,
        "--dtype",
        spec.model.dtype.value,
        "--host",
        BIND_ALL,
        "--port",
        str(WORKER_GRPC_PORT),
        "--advertise-address",
        f"$({POD_IP_ENV}):{WORKER_GRPC_PORT}",
        "--kv-backend",
        spec.kv_transfer.backend.value,
        "--lease-seconds",
        number(spec.kv_transfer.lease),
        "--token-file",
        TOKEN_FILE,
        "--metrics-port",
        str(WORKER_METRICS_PORT),
        "--kv-port",
        str(WORKER_KV_PORT),
        "--drain-seconds",
        str(WORKER_DRAIN_SECONDS),
        *(["--checksums"] if spec.kv_transfer.checksums else []),
        *(["--kv-streams", str(spec.kv_transfer.streams)] if spec.kv_transfer.streams else []),
        *tls_args(spec, worker=True),
        *device_args(spec, pool),
        *tensor_parallel_args(spec, pool),
        *engine_args(spec, pool),
    ]


def flex_args(args: list[str]) -> list[str]:
    """A fixed pool's worker arguments made a switchable worker's: ``--switchable``,
    starting as :data:`FLEX_START_ROLE` unless its pod's :data:`ROLE_LABEL` (read from
    :data:`LABELS_FILE`) says another role."""
    at = args.index("--role")
    out = [*args[: at + 1], FLEX_START_ROLE, *args[at + 2 :]]
    return [*out, "--switchable", "--role-labels-file", LABELS_FILE, "--role-label", ROLE_LABEL]


def tls_args(spec: InferenceServiceSpec, *, worker: bool) -> list[str]:
    """The TLS flags from ``spec.tls`` (none when it is unset): every pod presents the
    Secret's certificate and checks its peers against its CA and the server name; workers
    with ``mutual`` take only callers the CA signed."""
    tls = spec.tls
    if tls is None:
        return []
    cert, key, ca = (f"{TLS_DIR}/{k}" for k in TLS_KEYS)
    out = ["--tls-cert", cert, "--tls-key", key, "--tls-ca", ca,
           "--tls-server-name", tls.server_name]  # fmt: skip
    return [*out, "--tls-mutual"] if worker and tls.mutual else out


def number(value: float) -> str:
    """A number for a command line: ``30`` rather than ``30.0``, ``0.25`` as it is."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def device_args(spec: InferenceServiceSpec, pool: Pool) -> list[str]:
    """``--device cuda`` for a pool with GPUs (a pod without a visible GPU then exits
    with an error instead of serving on the CPU), ``--device cpu`` for one without (it
    never takes a GPU the node's runtime happens to expose)."""
    return ["--device", "cuda" if spec.worker_pool(pool).gpus > 0 else "cpu"]


def tensor_parallel_args(spec: InferenceServiceSpec, pool: Pool) -> list[str]:
    """``--tensor-parallel-size N`` for a pool with GPUs (N ranks in the pod, one engine
    over them), and for a CPU pool that asks for ranks; nothing for a plain CPU pool."""
    worker = spec.worker_pool(pool)
    if worker.gpus == 0 and worker.tensor_parallel_size is None:
        return []
    return ["--tensor-parallel-size", str(worker.tensor_parallel)]


SHM_BYTES_PER_RANK = 1 << 30
"""``/dev/shm`` per tensor-parallel rank (the ``sizeLimit`` of its memory-backed
``emptyDir``): NCCL's shared-memory transport and the CPU ranks' collectives put their
buffers there (a few hundred MiB per peer at most), and the container runtime's
default of 64 MiB is too small. It counts against the pod's memory."""


def shared_memory_limit(tensor_parallel: int) -> str:
    """The ``sizeLimit`` of a worker's ``/dev/shm`` with ``tensor_parallel`` ranks."""
    return f"{tensor_parallel * SHM_BYTES_PER_RANK >> 30}Gi"


def engine_args(spec: InferenceServiceSpec, pool: Pool) -> list[str]:
    """The pool's ``engine`` settings as ``splitserve worker`` flags (one per field set;
    ``kvCacheMemory`` in bytes, ``gpuMemoryPercent`` as the worker's fraction)."""
    engine = spec.worker_pool(pool).engine
    if engine is None:
        return []
    out: list[str] = []
    for name, value in engine.model_dump(exclude_none=True).items():
        if name == "kv_cache_memory":
            value = quantity_bytes(value)
        if name == "gpu_memory_percent":
            name, value = "gpu_memory_fraction", number(value / 100)
        out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def router_args(spec: InferenceServiceSpec, namespace: str, selector: str) -> list[str]:
    """``splitserve router`` arguments: discover the instance's workers through the API
    (pods matching ``selector``, role from the :data:`ROLE_LABEL` label)."""
    return [
        "router",
        "--model",
        spec.model.weights,
        "--served-model-name",
        spec.model.name,
        "--host",
        BIND_ALL,
        "--port",
        str(ROUTER_HTTP_PORT),
        "--discovery",
        "kubernetes",
        "--namespace",
        namespace,
        "--selector",
        selector,
        "--role-label",
        ROLE_LABEL,
        "--kv-backend",
        spec.kv_transfer.backend.value,
        "--lease-seconds",
        number(spec.kv_transfer.lease),
        "--token-file",
        TOKEN_FILE,
        "--metrics-port",
        str(ROUTER_METRICS_PORT),
        *tls_args(spec, worker=False),
        *router_setting_args(spec),
    ]


def router_setting_args(spec: InferenceServiceSpec) -> list[str]:
    """``spec.router.settings`` as ``splitserve router`` flags (a flag per field set; a
    change rolls the router pods only). A section (``queues``, ``timeouts``) becomes
    ``--set section.key=value`` per field, its ``...Seconds`` fields the config's ``..._s``."""
    settings = spec.router.settings
    if settings is None:
        return []
    out: list[str] = []
    for name, value in settings.model_dump(exclude_none=True).items():
        if isinstance(value, dict):
            for key, v in value.items():
                shown = number(v) if isinstance(v, float) else str(v)
                out += ["--set", f"{router_config_key(name, key)}={shown}"]
        else:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


DURATION_FIELDS = {
    "queues": {"max_wait", "retry_after"},
    "timeouts": set(RouterTimeouts.model_fields),
}
"""The settings sections' durations: the router's config has them in seconds, ``..._s``."""


def router_config_key(section: str, field: str) -> str:
    """The router config's dotted key for a field of a settings section."""
    if field in DURATION_FIELDS.get(section, ()):
        field += "_s"
    return f"{section}.{field}"


def base_env() -> list[dict[str, Any]]:
    """Environment every container gets: its address, writable caches on a read-only root."""
    return [
        {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "HOME", "value": TMP_DIR},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "SPLITSERVE_CACHE", "value": f"{CACHE_DIR}/splitserve"},
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "SPLITSERVE_CONFIG", "value": f"{CONFIG_DIR}/{CONFIG_FILE}"},
    ]


def worker_ports() -> list[dict[str, Any]]:
    return [
        {"name": "grpc", "containerPort": WORKER_GRPC_PORT, "protocol": "TCP"},
        {"name": "kv-push", "containerPort": WORKER_KV_PORT, "protocol": "TCP"},
        {"name": "metrics", "containerPort": WORKER_METRICS_PORT, "protocol": "TCP"},
    ]


def router_ports() -> list[dict[str, Any]]:
    return [
        {"name": "http", "containerPort": ROUTER_HTTP_PORT, "protocol": "TCP"},
        {"name": "metrics", "containerPort": ROUTER_METRICS_PORT, "protocol": "TCP"},
    ]


def startup_seconds(pool: Pool) -> int:
    """The startup probe's budget of a pool's container."""
    return ROUTER_STARTUP_SECONDS if pool == Pool.ROUTER else WORKER_STARTUP_SECONDS


def _startup(pool: Pool) -> dict[str, int]:
    period = PROBE_PERIOD_SECONDS[pool]
    return {"periodSeconds": period, "failureThreshold": startup_seconds(pool) // period}


def worker_probes() -> dict[str, Any]:
    """TCP probes on the gRPC port; the startup probe allows 30 minutes to load weights."""
    tcp = {"tcpSocket": {"port": "grpc"}}
    return {
        "startupProbe": {**tcp, **_startup(Pool.DECODE)},
        "readinessProbe": {**tcp, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**tcp, "periodSeconds": 20, "failureThreshold": 3},
    }


def router_probes() -> dict[str, Any]:
    """Liveness only once it listens: before that the router fetches the tokenizer (a hub
    id) or converts the built-in model, which may take longer than liveness allows."""
    tcp = {"tcpSocket": {"port": "http"}}
    return {
        "startupProbe": {**tcp, **_startup(Pool.ROUTER)},
        "readinessProbe": {**tcp, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**tcp, "periodSeconds": 20, "failureThreshold": 3},
    }
