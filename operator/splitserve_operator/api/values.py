"""The closed vocabularies and hard limits of an ``InferenceService`` spec.

Enums for every field that takes one of a fixed set of values, the patterns that
names, quantities and labels must match, and the bounds on replicas and GPUs.
Pure constants: the models in :mod:`splitserve_operator.api.models` use them.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from enum import StrEnum

GROUP = "splitserve.io"
"""The API group of the InferenceService, and the prefix of the operator's own labels
and annotations."""
GPU_RESOURCE = "nvidia.com/gpu"
"""The extended resource a pool's ``gpus`` becomes (requests and limits) unless the pool
names another (``acceleratorResource``: ``amd.com/gpu``, ``gpu.intel.com/i915``)."""
EXTENDED_RESOURCE_PATTERN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
"""An extended resource name: a domain, ``/``, a name (``nvidia.com/gpu``, ``rdma/hca``)."""

RESERVED_LABELS = frozenset(
    {
        "app.kubernetes.io/name",
        "app.kubernetes.io/instance",
        "app.kubernetes.io/component",
        "app.kubernetes.io/managed-by",
        "app.kubernetes.io/part-of",
    }
)
"""Pod labels the operator sets itself (its Deployments select pods by some of them);
keys under ``splitserve.io/`` are its own as well (the router finds workers by one)."""
RESERVED_VOLUMES = frozenset({"config", "token", "tmp", "cache", "model", "dshm"})
"""Names of the volumes the operator puts in every pod (a test keeps them equal)."""
RESERVED_MOUNT_PATHS = frozenset(
    {"/", "/etc/splitserve", "/var/run/secrets/splitserve", "/tmp", "/cache", "/models", "/dev/shm"}
)
"""Where the operator mounts its volumes (a test keeps them equal)."""

MAX_NAME_LENGTH = 48
"""Longest InferenceService name: the operator appends suffixes such as
``-prefill`` and the result must stay a DNS-1035 label (63 characters) because
it names a Service."""

NAME_PATTERN = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
"""DNS-1035 label: what a Service name must be."""

QUANTITY_PATTERN = re.compile(
    r"^[+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
"""A Kubernetes resource quantity (``500m``, ``4Gi``, ``1e3``)."""

ENV_NAME_PATTERN = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
LABEL_KEY_PATTERN = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
LABEL_VALUE_PATTERN = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
URL_PATTERN = re.compile(r"^https?://[^\s/$.?#][^\s]*$")
SUBDOMAIN_PATTERN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
"""DNS-1123 subdomain: what a PriorityClass or RuntimeClass name must be."""

PVC_SOURCE = re.compile(r"^pvc://([a-z0-9]([-a-z0-9]*[a-z0-9])?)(/(.*))?$")
"""``pvc://CLAIM/PATH``: a checkpoint folder on a PersistentVolumeClaim of the namespace."""
MODEL_MOUNT = "/models"
"""Where a ``pvc://`` source's claim is mounted (read-only) in every pod."""

DNS_LABEL_PATTERN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
"""DNS-1123 label: what a PersistentVolumeClaim or volume name must be."""
PERCENT_PATTERN = re.compile(r"^(100|[1-9]?[0-9])%$")
"""A share of a Deployment's replicas, ``0%`` to ``100%`` (``maxSurge: 25%``)."""

MAX_REPLICAS = 1000
MAX_KV_STREAMS = 8
"""The worker's most connections per ``grpc`` KV push (a test keeps it equal)."""
MAX_GPUS_PER_POD = 16

ENGINE_MAX_NUM_SEQS = 64
ENGINE_MAX_BATCH_TOKENS = 2048
"""The worker's own defaults for ``--max-num-seqs`` / ``--max-batch-tokens``: a pool's
``engine`` that sets one is checked against the other's default (a test keeps these
equal to the worker's)."""

_QUANTITY_SUFFIX = {
    **{s: 1024**i for i, s in enumerate(("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: 1000**i for i, s in enumerate(("", "k", "M", "G", "T", "P", "E")) if s},
    "m": Decimal("0.001"),
    "u": Decimal("0.000001"),
    "n": Decimal("0.000000001"),
}


def quantity_value(quantity: int | str) -> Decimal:
    """A Kubernetes quantity (``8Gi``, ``500m``, ``1e9``, ``4096``) as its exact value, so
    that two spellings of one amount compare equal (the API server stores the canonical
    one: ``1024Mi`` comes back as ``1Gi``, ``1`` as ``"1"``). Raises ValueError when it is
    not one."""
    if isinstance(quantity, bool):
        raise ValueError(f"{quantity!r} is not a quantity such as 4Gi")
    if isinstance(quantity, int):
        return Decimal(quantity)
    if not isinstance(quantity, str) or not QUANTITY_PATTERN.match(quantity):
        raise ValueError(f"{quantity!r} is not a quantity such as 4Gi")
    number = quantity.rstrip("KMGTPEikmun")
    suffix = quantity[len(number) :]
    return Decimal(number) * Decimal(_QUANTITY_SUFFIX[suffix])


def quantity_bytes(quantity: int | str) -> int:
    """A Kubernetes quantity as a whole number, rounded up as Kubernetes rounds memory.
    Raises ValueError when it is not one."""
    return math.ceil(quantity_value(quantity))


class Pool(StrEnum):
    """The three Deployments of an InferenceService."""

    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"


WORKER_POOLS: tuple[Pool, ...] = (Pool.PREFILL, Pool.DECODE)
FLEX_COMPONENT = "flex"
"""The component of a service's switchable workers (``spec.flex``): one Deployment whose
pods change role in place, sized by the spec (the planner switches them, never scales
them)."""
SCALED_POOLS: tuple[Pool, ...] = WORKER_POOLS
"""Pools the planner may rescale (the router is sized by hand)."""


class Dtype(StrEnum):
    AUTO = "auto"
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class KvBackend(StrEnum):
    TCP = "tcp"
    GRPC = "grpc"
    NIXL = "nixl"


class Disaggregation(StrEnum):
    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"


class ServiceType(StrEnum):
    CLUSTER_IP = "ClusterIP"
    NODE_PORT = "NodePort"
    LOAD_BALANCER = "LoadBalancer"


class PullPolicy(StrEnum):
    ALWAYS = "Always"
    IF_NOT_PRESENT = "IfNotPresent"
    NEVER = "Never"


class TolerationOperator(StrEnum):
    EXISTS = "Exists"
    EQUAL = "Equal"


class WhenUnsatisfiable(StrEnum):
    DO_NOT_SCHEDULE = "DoNotSchedule"
    SCHEDULE_ANYWAY = "ScheduleAnyway"


class InclusionPolicy(StrEnum):
    HONOR = "Honor"
    IGNORE = "Ignore"


class FsGroupChangePolicy(StrEnum):
    ON_ROOT_MISMATCH = "OnRootMismatch"
    ALWAYS = "Always"


class TaintEffect(StrEnum):
    ANY = ""
    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"
