"""What a pool may add to its pods and how it rolls: the ``podTemplate`` overlay (labels,
annotations, topology spread, volumes, service account, scheduler, DRA resource
claims), the ``rollout`` strategy, an RDMA device, and the pods' user and group IDs.

The overlay adds to what the operator renders and never replaces it: keys, volume
names and mount paths the operator uses itself are refused here (and by the CRD) with
a message that says so.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, StringConstraints, field_validator, model_validator

from splitserve_operator.api.base import SpecModel
from splitserve_operator.api.durations import Duration
from splitserve_operator.api.values import (
    DNS_LABEL_PATTERN,
    EXTENDED_RESOURCE_PATTERN,
    GROUP,
    LABEL_KEY_PATTERN,
    LABEL_VALUE_PATTERN,
    PERCENT_PATTERN,
    RESERVED_LABELS,
    RESERVED_MOUNT_PATHS,
    RESERVED_VOLUMES,
    SUBDOMAIN_PATTERN,
    FsGroupChangePolicy,
    InclusionPolicy,
    WhenUnsatisfiable,
)

Subdomain = Annotated[str, StringConstraints(max_length=253, pattern=SUBDOMAIN_PATTERN.pattern)]
DnsLabel = Annotated[str, StringConstraints(max_length=63, pattern=DNS_LABEL_PATTERN.pattern)]
Annotation = Annotated[str, StringConstraints(max_length=4096)]

VOLUME_SOURCES = (
    "configMap",
    "secret",
    "persistentVolumeClaim",
    "emptyDir",
    "ephemeral",
    "csi",
    "projected",
    "downwardAPI",
)
"""The volume kinds the "restricted" Pod Security Standard allows: a pool may add these."""


def check_key(key: str, what: str) -> None:
    """A label or annotation key's syntax; ValueError naming ``what`` otherwise."""
    if not LABEL_KEY_PATTERN.match(key) or len(key.split("/")[-1]) > 63:
        raise ValueError(f"{key!r} is not a valid {what} key")


def _operator_key(key: str) -> bool:
    return key.split("/")[0] == GROUP if "/" in key else False


class TopologySpread(SpecModel):
    """One ``topologySpreadConstraints`` entry, as in a Pod spec."""

    max_skew: Annotated[int, Field(ge=1)]
    topology_key: Annotated[str, StringConstraints(min_length=1, max_length=316)]
    when_unsatisfiable: WhenUnsatisfiable
    label_selector: dict[str, Any] | None = None
    """``None``: this pool's own pods (the operator fills in its selector)."""
    match_label_keys: list[str] | None = None
    min_domains: Annotated[int, Field(ge=1)] | None = None
    node_affinity_policy: InclusionPolicy | None = None
    node_taints_policy: InclusionPolicy | None = None


class Volume(SpecModel):
    """A volume of one of the kinds in :data:`VOLUME_SOURCES`, kept as written."""

    name: DnsLabel
    config_map: dict[str, Any] | None = None
    secret: dict[str, Any] | None = None
    persistent_volume_claim: dict[str, Any] | None = None
    empty_dir: dict[str, Any] | None = None
    ephemeral: dict[str, Any] | None = None
    csi: dict[str, Any] | None = None
    projected: dict[str, Any] | None = None
    downward_api: dict[str, Any] | None = Field(default=None, alias="downwardAPI")

    @model_validator(mode="after")
    def _one_source(self) -> Volume:
        set_ = [k for k in self.model_dump(by_alias=True, exclude_none=True) if k != "name"]
        if len(set_) != 1:
            raise ValueError(
                f"volume {self.name}: give exactly one of {', '.join(VOLUME_SOURCES)} "
                f"(got {', '.join(set_) or 'none'})"
            )
        if self.name in RESERVED_VOLUMES:
            raise ValueError(
                f"volume name {self.name!r} is the operator's own "
                f"({', '.join(sorted(RESERVED_VOLUMES))}): pick another"
            )
        return self


class VolumeMount(SpecModel):
    """Where a volume of this ``podTemplate`` appears in the pool's container."""

    name: DnsLabel
    mount_path: Annotated[str, StringConstraints(min_length=2, max_length=4096, pattern=r"^/")]
    read_only: bool | None = None
    sub_path: str | None = None
    sub_path_expr: str | None = None

    @field_validator("mount_path")
    @classmethod
    def _not_ours(cls, value: str) -> str:
        if value.rstrip("/") in RESERVED_MOUNT_PATHS:
            raise ValueError(
                f"{value!r} is where the operator mounts its own volumes "
                f"({', '.join(sorted(RESERVED_MOUNT_PATHS - {'/'}))}): mount elsewhere"
            )
        return value


class ResourceClaim(SpecModel):
    """A dynamic resource allocation (DRA) claim the pool's pods and container use: a
    ResourceClaim shared by the pods, or a ResourceClaimTemplate (one claim per pod)."""

    name: DnsLabel
    resource_claim_name: Subdomain | None = None
    resource_claim_template_name: Subdomain | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ResourceClaim:
        if (self.resource_claim_name is None) == (self.resource_claim_template_name is None):
            raise ValueError(
                f"resource claim {self.name}: give resourceClaimName or "
                "resourceClaimTemplateName (one of them)"
            )
        return self


class PodTemplateOverlay(SpecModel):
    """Added to the pool's pod template; the operator's own keys and names are refused."""

    labels: dict[str, Annotated[str, StringConstraints(max_length=63)]] | None = Field(
        default=None, max_length=64
    )
    annotations: dict[str, Annotation] | None = Field(default=None, max_length=64)
    service_account_name: Subdomain | None = None
    scheduler_name: Subdomain | None = None
    topology_spread_constraints: list[TopologySpread] | None = Field(default=None, max_length=16)
    volumes: list[Volume] | None = Field(default=None, max_length=32)
    volume_mounts: list[VolumeMount] | None = Field(default=None, max_length=32)
    resource_claims: list[ResourceClaim] | None = Field(default=None, max_length=16)

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, val in (value or {}).items():
            check_key(key, "label")
            if not LABEL_VALUE_PATTERN.match(val):
                raise ValueError(f"{key}: {val!r} is not a valid label value")
            if key in RESERVED_LABELS or _operator_key(key):
                raise ValueError(
                    f"label {key!r} is the operator's own (it selects the pool's pods by "
                    f"the app.kubernetes.io labels and keys under {GROUP}/): pick another key"
                )
        return value

    @field_validator("annotations")
    @classmethod
    def _annotations(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key in value or {}:
            check_key(key, "annotation")
            if _operator_key(key):
                raise ValueError(f"annotation {key!r}: keys under {GROUP}/ are the operator's")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> PodTemplateOverlay:
        names = [v.name for v in self.volumes or []]
        if len(names) != len(set(names)):
            raise ValueError("each volume name may appear once")
        for mount in self.volume_mounts or []:
            if mount.name not in names:
                raise ValueError(
                    f"volumeMount {mount.name!r} names no volume of this podTemplate: "
                    "add it to volumes"
                )
        paths = [m.mount_path for m in self.volume_mounts or []]
        if len(paths) != len(set(paths)):
            raise ValueError("each mountPath may appear once")
        claims = [c.name for c in self.resource_claims or []]
        if len(claims) != len(set(claims)):
            raise ValueError("each resource claim name may appear once")
        return self


def _replicas_or_percent(value: int | str) -> int | str:
    if isinstance(value, str) and not PERCENT_PATTERN.match(value):
        raise ValueError(f"{value!r} is neither a number of pods nor a percent such as 25%")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"must not be negative (got {value})")
    return value


def _is_zero(value: int | str | None) -> bool:
    return value == 0 or value == "0%"


GPU_ROLLOUT: tuple[int | str, int | str] = (0, 1)
"""maxSurge and maxUnavailable of a GPU pool: replace a pod before adding one (a surge
pod would wait for a spare GPU of the right kind)."""
CPU_ROLLOUT: tuple[int | str, int | str] = ("25%", "25%")
"""maxSurge and maxUnavailable of a pool without GPUs: Kubernetes' own defaults."""


class Rollout(SpecModel):
    """How the pool's Deployment replaces its pods."""

    max_surge: int | str | None = None
    """Pods over ``replicas`` during a rollout. Default: 0 on a GPU pool (a new pod would
    need a spare GPU), else 25%."""
    max_unavailable: int | str | None = None
    """Pods under ``replicas`` during a rollout. Default: 1 on a GPU pool, else 25%."""
    progress_deadline: Annotated[float, Duration(at_least=60, at_most=86_400)] | None = None
    """Seconds without progress before the Deployment reports ``ProgressDeadlineExceeded``
    (``Degraded RolloutStalled``). Default: the pool's startup budget plus 10 minutes."""

    @field_validator("max_surge", "max_unavailable")
    @classmethod
    def _replicas(cls, value: int | str | None) -> int | str | None:
        return value if value is None else _replicas_or_percent(value)

    def effective(self, gpus: int) -> tuple[int | str, int | str]:
        """maxSurge and maxUnavailable with the defaults of a pool of ``gpus`` per pod."""
        surge, unavailable = GPU_ROLLOUT if gpus > 0 else CPU_ROLLOUT
        return (
            surge if self.max_surge is None else self.max_surge,
            unavailable if self.max_unavailable is None else self.max_unavailable,
        )

    def check(self, gpus: int) -> None:
        """ValueError when the rollout could never replace a pod."""
        surge, unavailable = self.effective(gpus)
        if _is_zero(surge) and _is_zero(unavailable):
            defaulted = "maxSurge defaults to 0 on a GPU pool; " if self.max_surge is None else ""
            raise ValueError(
                f"rollout: {defaulted}maxSurge and maxUnavailable cannot both be 0: the "
                "rollout could never replace a pod"
            )


class Rdma(SpecModel):
    """An RDMA device for the pool's pods (NIXL's UCX transports use it)."""

    resource: Annotated[str, StringConstraints(pattern=EXTENDED_RESOURCE_PATTERN.pattern)]
    """The device plugin's extended resource (``rdma/hca``, ``rdma/rdma_shared_device_a``)."""
    count: Annotated[int, Field(ge=1, le=16)] = 1
    ipc_lock: bool = True
    """Add the ``IPC_LOCK`` capability (memory registration pins pages)."""


class PodSecurity(SpecModel):
    """User and group IDs of every pod; each one left out is left to the image and the
    platform (OpenShift's restricted-v2 assigns them per namespace)."""

    run_as_user: Annotated[int, Field(ge=1, le=2_147_483_647)] | None = None
    run_as_group: Annotated[int, Field(ge=0, le=2_147_483_647)] | None = None
    fs_group: Annotated[int, Field(ge=0, le=2_147_483_647)] | None = None
    fs_group_change_policy: FsGroupChangePolicy | None = None
    supplemental_groups: list[Annotated[int, Field(ge=0, le=2_147_483_647)]] | None = Field(
        default=None, max_length=32
    )
