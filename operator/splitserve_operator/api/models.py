"""The pydantic models of an ``InferenceService`` spec, field by field.

Each model checks its own fields (and the rules that tie a few of them
together); :func:`splitserve_operator.api.parse.parse_spec` turns their errors into
``spec.path: what is wrong`` lines. camelCase on the wire, snake_case in Python.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from splitserve_operator.api.base import NonEmpty, Quantity, SpecModel
from splitserve_operator.api.durations import Duration
from splitserve_operator.api.pods import (
    DnsLabel,
    PodSecurity,
    PodTemplateOverlay,
    Rdma,
    Rollout,
)
from splitserve_operator.api.routes import HttpRouteSpec
from splitserve_operator.api.settings import EngineSettings, RouterSettings
from splitserve_operator.api.values import (
    ENV_NAME_PATTERN,
    EXTENDED_RESOURCE_PATTERN,
    GPU_RESOURCE,
    LABEL_KEY_PATTERN,
    LABEL_VALUE_PATTERN,
    MAX_GPUS_PER_POD,
    MAX_KV_STREAMS,
    MAX_REPLICAS,
    MODEL_MOUNT,
    PVC_SOURCE,
    QUANTITY_PATTERN,
    SUBDOMAIN_PATTERN,
    URL_PATTERN,
    Dtype,
    KvBackend,
    Pool,
    PullPolicy,
    ServiceType,
    TaintEffect,
    TolerationOperator,
    quantity_bytes,
)


class ModelCache(SpecModel):
    """A PersistentVolumeClaim the pods share as their download folder."""

    claim_name: DnsLabel
    """The claim, in the InferenceService's namespace: ReadWriteMany where pods of a pool
    run on several nodes (ReadWriteOnce serves only pods on one node)."""


class ModelSpec(SpecModel):
    name: Annotated[str, StringConstraints(min_length=1, max_length=253)]
    """The model's name as served (``/v1/models``)."""
    source: Annotated[str, StringConstraints(min_length=1, max_length=2048)] | None = None
    """Where the weights come from: a Hugging Face id, a folder in the image,
    ``pvc://CLAIM/PATH`` (a folder on a PersistentVolumeClaim of the namespace, mounted
    read-only), or a built-in name. ``None``: the same as ``name``."""
    dtype: Dtype = Dtype.AUTO
    cache: ModelCache | None = None
    """A shared download folder: the first worker pod fetches the model into it (an init
    container), later pods find it there. ``None``: each pod downloads into its own
    ``emptyDir``."""
    download_size_limit: Quantity | None = None
    """The ``sizeLimit`` of each pod's own download folder (an ``emptyDir``); the kubelet
    evicts a pod that writes more. ``None``: as much as the node's disk allows."""

    @field_validator("download_size_limit")
    @classmethod
    def _size(cls, value: Quantity | None) -> Quantity | None:
        if value is not None and quantity_bytes(value) < 1 << 20:
            raise ValueError(f"must be at least 1Mi (got {value!r})")
        return value

    @model_validator(mode="after")
    def _one_download_folder(self) -> ModelSpec:
        if self.cache is not None and self.download_size_limit is not None:
            raise ValueError(
                "downloadSizeLimit bounds each pod's own download folder; with cache the "
                "claim's size bounds it: set one of them"
            )
        if self.cache is not None and self.claim is not None:
            raise ValueError(
                "a pvc:// source is read where it is, nothing is downloaded: drop cache"
            )
        return self

    @field_validator("source")
    @classmethod
    def _claim_path(cls, value: str | None) -> str | None:
        if value is not None and value.startswith("pvc://"):
            found = PVC_SOURCE.fullmatch(value)
            path = (found.group(4) or "") if found else ""
            if found is None or ".." in path.split("/"):
                raise ValueError(
                    "a pvc:// source is pvc://CLAIM/PATH: CLAIM a PersistentVolumeClaim "
                    "in this namespace (a DNS label), PATH the checkpoint folder in it "
                    "(no '..')"
                )
        return value

    @property
    def claim(self) -> tuple[str, str] | None:
        """A ``pvc://`` source's claim and the folder's path in it; else ``None``."""
        found = PVC_SOURCE.fullmatch(self.source or "")
        return (found.group(1), (found.group(4) or "").strip("/")) if found else None

    @property
    def weights(self) -> str:
        """What the workers load: ``source`` (a ``pvc://`` one as the path it is mounted
        at), or ``name`` when no source is given."""
        if self.claim is not None:
            path = self.claim[1]
            return f"{MODEL_MOUNT}/{path}" if path else MODEL_MOUNT
        return self.source or self.name


class ResourceRequirements(SpecModel):
    requests: dict[str, Quantity] | None = None
    limits: dict[str, Quantity] | None = None

    @field_validator("requests", "limits")
    @classmethod
    def _quantities(cls, value: dict[str, Quantity] | None) -> dict[str, Quantity] | None:
        for key, quantity in (value or {}).items():
            if isinstance(quantity, bool) or (
                isinstance(quantity, str) and not QUANTITY_PATTERN.match(quantity)
            ):
                raise ValueError(f"{key}: {quantity!r} is not a quantity such as 500m or 4Gi")
            if isinstance(quantity, int) and quantity < 0:
                raise ValueError(f"{key}: must not be negative (got {quantity})")
        return value


class Toleration(SpecModel):
    key: str | None = None
    operator: TolerationOperator | None = None
    value: str | None = None
    effect: TaintEffect | None = None
    toleration_seconds: int | None = None

    @model_validator(mode="after")
    def _exists_has_no_value(self) -> Toleration:
        if self.operator == TolerationOperator.EXISTS and self.value:
            raise ValueError("a toleration with operator Exists must not set value")
        if not self.key and self.operator != TolerationOperator.EXISTS:
            raise ValueError("a toleration without a key must use operator Exists")
        return self


class EnvVar(SpecModel):
    name: NonEmpty
    value: str | None = None
    value_from: dict[str, Any] | None = None

    @field_validator("name")
    @classmethod
    def _env_name(cls, value: str) -> str:
        if not ENV_NAME_PATTERN.match(value):
            raise ValueError(f"{value!r} is not a valid environment variable name")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise ValueError(f"env {self.name}: set value or valueFrom, not both")
        return self

    def manifest(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.value_from is not None:
            out["valueFrom"] = self.value_from
        else:
            out["value"] = self.value or ""
        return out


class Affinity(SpecModel):
    """Kept as the user wrote it (the API server checks the inside)."""

    node_affinity: dict[str, Any] | None = None
    pod_affinity: dict[str, Any] | None = None
    pod_anti_affinity: dict[str, Any] | None = None


def _check_selector(value: dict[str, str] | None) -> dict[str, str] | None:
    for key, val in (value or {}).items():
        if not LABEL_KEY_PATTERN.match(key) or len(key.split("/")[-1]) > 63:
            raise ValueError(f"{key!r} is not a valid label key")
        if len(val) > 63 or not LABEL_VALUE_PATTERN.match(val):
            raise ValueError(f"{key}: {val!r} is not a valid label value")
    return value


ClassName = Annotated[str, StringConstraints(max_length=253, pattern=SUBDOMAIN_PATTERN.pattern)]


class PoolSpec(SpecModel):
    replicas: Annotated[int, Field(ge=0, le=MAX_REPLICAS)] = 1
    gpus: Annotated[int, Field(ge=0, le=MAX_GPUS_PER_POD)] = 1
    """Accelerators per pod: requests and limits of ``accelerator_resource``; 0 runs on the
    CPU."""
    accelerator_resource: Annotated[
        str, StringConstraints(max_length=253, pattern=EXTENDED_RESOURCE_PATTERN.pattern)
    ] = GPU_RESOURCE
    """The extended resource ``gpus`` counts (``amd.com/gpu`` on AMD nodes)."""
    resources: ResourceRequirements | None = None
    node_selector: dict[str, str] | None = None
    tolerations: list[Toleration] | None = None
    affinity: Affinity | None = None
    env: list[EnvVar] | None = None
    priority_class_name: ClassName | None = None
    """The pods' PriorityClass (serving usually outranks batch work)."""
    runtime_class_name: ClassName | None = None
    """The pods' RuntimeClass (``nvidia`` where GPUs need that container runtime)."""
    pod_template: PodTemplateOverlay | None = None
    """Labels, annotations, topology spread, volumes, service account, scheduler and DRA
    claims added to the pods (the deprecated ``podAnnotations`` lands here)."""
    rollout: Rollout | None = None
    """How the Deployment replaces pods; defaults depend on whether the pool has GPUs."""

    _check_node_selector = field_validator("node_selector")(_check_selector)

    @field_validator("env")
    @classmethod
    def _unique_env(cls, value: list[EnvVar] | None) -> list[EnvVar] | None:
        seen: set[str] = set()
        for var in value or []:
            if var.name in seen:
                raise ValueError(f"environment variable {var.name!r} is listed twice")
            seen.add(var.name)
        return value

    @model_validator(mode="after")
    def _rollout_progresses(self) -> PoolSpec:
        if self.rollout is not None:
            self.rollout.check(self.gpus)
        return self

    @model_validator(mode="after")
    def _accelerators_by_gpus(self) -> PoolSpec:
        for kind in ("requests", "limits"):
            held = getattr(self.resources, kind, None) or {}
            if self.accelerator_resource in held:
                raise ValueError(
                    f"set accelerators with the pool's gpus field, not as "
                    f"resources.{kind}[{self.accelerator_resource!r}]"
                )
        return self


class WorkerPoolSpec(PoolSpec):
    tensor_parallel_size: Annotated[int, Field(ge=1, le=MAX_GPUS_PER_POD)] | None = None
    """Tensor-parallel ranks of each worker (``--tensor-parallel-size``): one engine over
    this many of the pod's GPUs, or over CPU ranks when ``gpus`` is 0. Must divide
    ``gpus``. ``None``: :attr:`tensor_parallel` decides (every GPU of the pod)."""
    engine: EngineSettings | None = None
    rdma: Rdma | None = None
    """An RDMA device per pod (and ``IPC_LOCK``), for NIXL over InfiniBand or RoCE."""

    @model_validator(mode="after")
    def _ranks_divide_gpus(self) -> WorkerPoolSpec:
        tp = self.tensor_parallel_size
        if tp is not None and self.gpus > 0 and self.gpus % tp:
            fits = ", ".join(str(n) for n in range(1, self.gpus + 1) if self.gpus % n == 0)
            raise ValueError(
                f"tensorParallelSize {tp} does not divide gpus {self.gpus}: set it to one "
                f"of {fits}, or leave it out to run one engine over all {self.gpus} GPUs"
            )
        return self

    @property
    def tensor_parallel(self) -> int:
        """The worker's tensor-parallel size: ``tensorParallelSize``, else the pod's GPUs
        (one engine over all of them), else 1 on the CPU."""
        if self.tensor_parallel_size is not None:
            return self.tensor_parallel_size
        return max(1, self.gpus)


class RouterSpec(PoolSpec):
    gpus: Annotated[int, Field(ge=0, le=MAX_GPUS_PER_POD)] = 0
    service_type: ServiceType = ServiceType.CLUSTER_IP
    settings: RouterSettings | None = None
    http_route: HttpRouteSpec | None = None
    """A Gateway API HTTPRoute to the router Service; ``None``: none."""

    @model_validator(mode="after")
    def _own_account(self) -> RouterSpec:
        if self.pod_template is not None and self.pod_template.service_account_name:
            raise ValueError(
                "podTemplate.serviceAccountName: the router runs as the operator's "
                "<name>-router account, which may read its workers' pods; set a service "
                "account on the prefill and decode pools only"
            )
        return self


class KvTransferSpec(SpecModel):
    backend: KvBackend = KvBackend.TCP
    lease: Annotated[float, Duration(at_least=1, at_most=3600)] = 30.0
    """How long a decode worker holds blocks reserved for a transfer that has not
    finished; an expired lease frees them."""
    checksums: bool = False
    """A crc32 on every pushed span and per layer at Commit (catches any corruption; costs
    a pass). Off, the workers still check a sampled one span in 64 (``tcp``, ``grpc``)."""
    streams: Annotated[int, Field(ge=0, le=MAX_KV_STREAMS)] = 0
    """Connections a ``grpc`` push uses; 0: by the prefill pod's cores (2 on 8 or more)."""


DEFAULT_TLS_SERVER_NAME = "splitserve-worker"
"""The name every worker's certificate carries unless ``tls.serverName`` says another
(pods are addressed by IP, so callers check one name)."""


class TlsSpec(SpecModel):
    secret_name: ClassName
    """The Secret holding ``tls.crt``, ``tls.key`` and ``ca.crt`` (cert-manager's form),
    mounted in every worker and router pod."""
    mutual: bool = True
    """Workers take only callers presenting a certificate the CA signed."""
    server_name: ClassName = DEFAULT_TLS_SERVER_NAME
    """The DNS name in the workers' certificate, which every caller checks."""


class SloSpec(SpecModel):
    ttft: Annotated[float, Duration(at_most=600)] | None = None
    """Time to first token objective, seconds, at ``percentile``."""
    tpot: Annotated[float, Duration(at_most=60)] | None = None
    """Time per output token objective, seconds, at ``percentile``."""
    percentile: Annotated[int, Field(ge=1, le=99)] = 90
    """The percentile the objectives apply to: 90 is p90."""

    @property
    def quantile(self) -> float:
        """``percentile`` as a fraction (0.9 for p90), as PromQL takes it."""
        return self.percentile / 100


class ReplicaBounds(SpecModel):
    min_replicas: Annotated[int, Field(ge=0, le=MAX_REPLICAS)] = 1
    max_replicas: Annotated[int, Field(ge=1, le=MAX_REPLICAS)] = 8

    @model_validator(mode="after")
    def _ordered(self) -> ReplicaBounds:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"minReplicas ({self.min_replicas}) must not exceed maxReplicas "
                f"({self.max_replicas})"
            )
        return self

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))


class AutoscalingSpec(SpecModel):
    enabled: bool = False
    prometheus_url: str | None = None
    interval: Annotated[float, Duration(at_least=5, at_most=3600)] = 30.0
    """Seconds between two planner ticks of this service."""
    prefill: ReplicaBounds = ReplicaBounds()
    decode: ReplicaBounds = ReplicaBounds()

    @field_validator("prometheus_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not URL_PATTERN.match(value):
            raise ValueError(f"{value!r} is not an http(s) URL")
        return value

    @model_validator(mode="after")
    def _needs_prometheus(self) -> AutoscalingSpec:
        if self.enabled and not self.prometheus_url:
            raise ValueError("prometheusUrl is required when autoscaling is enabled")
        return self

    def bounds(self, pool: Pool) -> ReplicaBounds:
        if pool == Pool.PREFILL:
            return self.prefill
        if pool == Pool.DECODE:
            return self.decode
        raise ValueError(f"pool {pool} is not autoscaled")


class NetworkPolicySpec(SpecModel):
    enabled: bool = True
    metrics_from: list[dict[str, Any]] | None = None
    """NetworkPolicy peers allowed to scrape the metrics port. ``None``: any pod in
    any namespace; ``[]``: nobody."""


class InferenceServiceSpec(SpecModel):
    model: ModelSpec
    image: Annotated[str, StringConstraints(min_length=1, max_length=1024, pattern=r"^\S+$")]
    image_pull_policy: PullPolicy | None = None
    image_pull_secrets: list[dict[str, str]] | None = None
    prefill: WorkerPoolSpec = WorkerPoolSpec()
    decode: WorkerPoolSpec = WorkerPoolSpec()
    flex: WorkerPoolSpec | None = None
    """A pool of switchable workers (``--switchable``) beside or instead of the fixed
    pools: each pod starts as ``both`` and the planner switches it between prefill and
    decode in place; ``None``: none."""
    router: RouterSpec = RouterSpec()
    kv_transfer: KvTransferSpec = KvTransferSpec()
    tls: TlsSpec | None = None
    """TLS on the workers' gRPC and KV ports and on every call to them; ``None``: plain."""
    slo: SloSpec = SloSpec()
    autoscaling: AutoscalingSpec = AutoscalingSpec()
    network_policy: NetworkPolicySpec = NetworkPolicySpec()
    pod_security_context: PodSecurity | None = None
    """User and group IDs of every pod; ``None``: the image's user, IDs left to the
    platform (``runAsNonRoot`` is always set)."""

    @field_validator("image_pull_secrets")
    @classmethod
    def _pull_secrets(cls, value: list[dict[str, str]] | None) -> list[dict[str, str]] | None:
        for ref in value or []:
            if set(ref) != {"name"} or not ref["name"]:
                raise ValueError("each imagePullSecrets entry must be {name: SECRET}")
        return value

    @model_validator(mode="after")
    def _cross_field(self) -> InferenceServiceSpec:
        if self.autoscaling.enabled and (self.slo.ttft is None or self.slo.tpot is None):
            raise ValueError("autoscaling needs its targets: set slo.ttft and slo.tpot")
        if self.autoscaling.decode.min_replicas < 1 and self.autoscaling.enabled:
            raise ValueError("autoscaling.decode.minReplicas must be at least 1")
        return self

    def worker_pool(self, pool: Pool) -> WorkerPoolSpec:
        if pool not in (Pool.PREFILL, Pool.DECODE):
            raise ValueError(f"{pool} is not a worker pool")
        return self.prefill if pool == Pool.PREFILL else self.decode

    def pool(self, pool: Pool) -> PoolSpec:
        return {Pool.PREFILL: self.prefill, Pool.DECODE: self.decode, Pool.ROUTER: self.router}[
            pool
        ]
