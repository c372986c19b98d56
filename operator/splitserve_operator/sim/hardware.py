"""GPU kinds and interconnects: the numbers the roofline cost model runs on.

Every figure is a nominal datasheet number in SI units (FLOP/s, bytes/s, bytes;
1 GB = 1e9 bytes). Achievable fractions of them are the cost model's business
(:class:`~splitserve_operator.sim.cost.RooflineCost`), not this module's.
"""

from __future__ import annotations

from dataclasses import dataclass


class HardwareError(ValueError):
    """An unknown GPU or link name; the message lists the known ones."""


@dataclass(frozen=True)
class GpuSpec:
    """One GPU kind."""

    name: str
    """Short name used on the command line (``h100``)."""
    description: str
    """What exactly is meant (form factor, memory size)."""
    peak_flops: float
    """Peak dense bf16 tensor-core throughput, FLOP/s (no sparsity)."""
    hbm_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    memory_bytes: float
    """Device memory, bytes."""
    tp_link_bandwidth: float
    """One-way GPU-to-GPU bandwidth inside a server, bytes/s: what tensor-parallel
    all-reduces run over (NVLink where the part has it, PCIe otherwise)."""


@dataclass(frozen=True)
class LinkSpec:
    """The path the KV cache takes from a prefill GPU to a decode GPU."""

    name: str
    description: str
    bandwidth: float
    """Nominal one-way bandwidth, bytes/s: a raw lower bound on transfer time."""
    latency_s: float = 0.0
    """Fixed cost per handoff, seconds, on top of the bytes; it does not occupy
    the link (0 for the nominal links: the seed article's figures are bandwidth
    only; the local stack's calibration sets it)."""

    def transfer_time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` over this link alone, nothing overlapped."""
        return self.latency_s + nbytes / self.bandwidth


GB = 1e9
TB = 1e12

GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("h100", "NVIDIA H100 SXM5 80GB", 989e12, 3.35 * TB, 80 * GB, 450 * GB),
        GpuSpec("h200", "NVIDIA H200 SXM 141GB", 989e12, 4.8 * TB, 141 * GB, 450 * GB),
        GpuSpec("a100", "NVIDIA A100 SXM4 80GB", 312e12, 2.039 * TB, 80 * GB, 300 * GB),
        GpuSpec("l40s", "NVIDIA L40S 48GB (PCIe, no NVLink)", 362e12, 0.864 * TB, 48 * GB, 32 * GB),
    )
}
"""GPU kinds by name. Peak FLOP/s are the dense bf16 datasheet figures (H100/H200
989 TFLOP/s, A100 312, L40S 362); bandwidths HBM3 3.35 TB/s, HBM3e 4.8 TB/s,
HBM2e 2.039 TB/s, GDDR6 864 GB/s."""

LINKS: dict[str, LinkSpec] = {
    ln.name: ln
    for ln in (
        LinkSpec("pcie4", "PCIe Gen4 x16", 32 * GB),
        LinkSpec("pcie5", "PCIe Gen5 x16", 64 * GB),
        LinkSpec("roce400", "GPUDirect RDMA over 400GbE RoCE", 50 * GB),
        LinkSpec("nvlink", "NVLink 4 via NVSwitch (900 GB/s bidirectional)", 450 * GB),
    )
}
"""KV links by name, with the one-way bandwidths the seed article uses: PCIe Gen4
x16 about 32 GB/s, Gen5 x16 about 64 GB/s, 400GbE RoCE about 50 GB/s at line
rate, NVLink about 450 GB/s one way (900 GB/s bidirectional per H100 SXM)."""


def get_gpu(name: str) -> GpuSpec:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise HardwareError(f"unknown GPU kind {name!r}: choose one of {', '.join(GPUS)}") from None


def get_link(name: str) -> LinkSpec:
    try:
        return LINKS[name.lower()]
    except KeyError:
        raise HardwareError(f"unknown link {name!r}: choose one of {', '.join(LINKS)}") from None
