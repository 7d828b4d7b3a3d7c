"""One hardware table, pure Python, read by the ``CommTimer``'s MFU and the projection; the matching rules:
``docs/comm_timer.md``, "MFU and the peak FLOP/s".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DTYPES: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16")  # the compute dtypes with a peak in the table

MIG_COMPUTE_SLICES = 7  # compute slices of a MIG-capable GPU: a `Ng` profile holds N of them

CPU_FP32_TFLOPS_PER_CORE = 0.078  # fp32 matmul TFLOP/s of one CPU core (measured on our CI machine): CPUs' estimate


@dataclass(frozen=True)
class DeviceSpec:
    """One device kind: its key (the projection's ``compute.gpu``), display name, the word sets any of which names
    it (all their words in the lower-cased device name), dense peak TFLOP/s by dtype, memory bandwidth (GB/s) and
    size (GB, 10**9 bytes), the full (non-MIG) product's SM count, and the datasheet."""

    key: str
    name: str
    patterns: tuple[tuple[str, ...], ...]
    dense_tflops: dict[str, float] = field(compare=False)
    memory_GBps: float
    memory_GB: float
    sm_count: int
    source: str


def _peaks(fp32: float, tf32: float, bf16: float) -> dict[str, float]:
    return {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": bf16}  # every row's dense fp16 peak is its bf16 one


_HOPPER_SXM = _peaks(67.0, 494.7, 989.4)
_HOPPER_NVL = _peaks(60.0, 417.5, 835.5)
_AMPERE = _peaks(19.5, 156.0, 312.0)

DEVICES: dict[str, DeviceSpec] = {
    spec.key: spec
    for spec in (
        DeviceSpec("h100-nvl", "NVIDIA H100 NVL 94GB", (("h100", "nvl"),), _HOPPER_NVL, 3900, 94, 132,
                   "NVIDIA H100 NVL product brief: 1,671 TFLOPS bf16 with sparsity, 3.9 TB/s HBM3"),
        DeviceSpec("h100-pcie", "NVIDIA H100 PCIe 80GB", (("h100", "pcie"),), _peaks(51.0, 378.0, 756.0), 2000, 80,
                   114, "NVIDIA H100 datasheet: 756 TFLOPS bf16 dense, 2.0 TB/s HBM2e"),
        DeviceSpec("gh200-144gb", "NVIDIA GH200 144GB HBM3e",
                   (("gh200", "hbm3e"), ("gh200", "144g"), ("gh200", "144gb")), _HOPPER_SXM, 4900, 144, 132,
                   "NVIDIA GH200 datasheet: H100 SXM compute, 144 GB HBM3e at 4.9 TB/s"),
        DeviceSpec("gh200", "NVIDIA GH200 96GB HBM3", (("gh200",),), _HOPPER_SXM, 4000, 96, 132,
                   "NVIDIA GH200 datasheet: H100 SXM compute, 96 GB HBM3 at 4 TB/s"),
        DeviceSpec("h100-sxm", "NVIDIA H100 SXM 80GB", (("h100",),), _HOPPER_SXM, 3350, 80, 132,
                   "NVIDIA H100 datasheet: 989 TFLOPS bf16 dense, 3.35 TB/s HBM3"),
        DeviceSpec("h200-nvl", "NVIDIA H200 NVL 141GB", (("h200", "nvl"),), _HOPPER_NVL, 4800, 141, 132,
                   "NVIDIA H200 datasheet, NVL column: 1,671 TFLOPS bf16 with sparsity, 4.8 TB/s HBM3e"),
        DeviceSpec("h200-sxm", "NVIDIA H200 SXM 141GB", (("h200",),), _HOPPER_SXM, 4800, 141, 132,
                   "NVIDIA H200 datasheet: 989 TFLOPS bf16 dense, 4.8 TB/s HBM3e"),
        DeviceSpec("b200", "NVIDIA B200 180GB", (("b200",),), _peaks(75.0, 1100.0, 2250.0), 7700, 180, 148,
                   "NVIDIA HGX B200 specifications, per GPU: 4.5 PFLOPS bf16 and 2.2 PFLOPS tf32 with sparsity, "
                   "75 TFLOPS fp32, 180 GB HBM3e at 7.7 TB/s"),
        DeviceSpec("a100-sxm-80gb", "NVIDIA A100 SXM 80GB", (("a100", "sxm4", "80gb"), ("a100", "sxm", "80gb")),
                   _AMPERE, 2039, 80, 108, "NVIDIA A100 datasheet: 312 TFLOPS bf16, 2,039 GB/s"),
        DeviceSpec("a100-pcie-80gb", "NVIDIA A100 PCIe 80GB", (("a100", "pcie", "80gb"),), _AMPERE, 1935, 80, 108,
                   "NVIDIA A100 datasheet: 312 TFLOPS bf16, 1,935 GB/s"),
        DeviceSpec("a100-pcie-40gb", "NVIDIA A100 PCIe 40GB", (("a100", "pcie"),), _AMPERE, 1555, 40, 108,
                   "NVIDIA A100 datasheet: 312 TFLOPS bf16, 1,555 GB/s"),
        # Last of the A100s: any other A100 name gets its (shared) compute figures from here.
        DeviceSpec("a100-sxm-40gb", "NVIDIA A100 SXM 40GB", (("a100",),), _AMPERE, 1555, 40, 108,
                   "NVIDIA A100 datasheet: 312 TFLOPS bf16, 1,555 GB/s"),
        DeviceSpec("l4", "NVIDIA L4 24GB", (("l4",),), _peaks(30.3, 60.0, 121.0), 300, 24, 58,
                   "NVIDIA L4 datasheet: 242 TFLOPS bf16 with sparsity, 300 GB/s GDDR6"),
    )
}
"""Every GPU by key, in matching order (more specific rows first; first match wins)."""

_MIG = re.compile(r"\bmig\b\s*(?:(\d+)c\.)?(\d+)g\.(\d+)gb")


def mig_profile(device_name: str) -> tuple[int, int] | None:
    """(compute slices, memory GB) of a MIG slice's ``Ng.Mgb`` (or ``Cc.Ng.Mgb``) profile; None for a whole device."""
    match = _MIG.search(device_name.lower())
    return None if match is None else (int(match.group(1) or match.group(2)), int(match.group(3)))


def find_device(device_name: str) -> DeviceSpec | None:
    """The table's row for ``device_name`` (a MIG slice: its whole GPU's row), or None if not in the table."""
    name = device_name.lower()
    match = _MIG.search(name)
    if match is not None:
        name = name[: match.start()]  # the profile's "10gb" must not match a memory size of the GPU itself
    words = set(re.split(r"[^a-z0-9]+", name))
    for spec in DEVICES.values():
        if any(all(word in words for word in pattern) for pattern in spec.patterns):
            return spec
    return None


def compute_share(device_name: str, sm_count: int | None = None) -> float:
    """The fraction of its GPU's compute a device (or MIG slice, by ``sm_count`` or else N/7) has."""
    profile = mig_profile(device_name)
    if profile is None:
        return 1.0
    spec = find_device(device_name)
    if sm_count is not None and sm_count > 0 and spec is not None:
        return min(1.0, sm_count / spec.sm_count)
    return min(1.0, profile[0] / MIG_COMPUTE_SLICES)


def dense_peak_flops(device_name: str, dtype: str, threads: int = 1, sm_count: int | None = None) -> float | None:
    """Dense peak FLOP/s of one device (or MIG slice) for ``dtype``, or None if unknown; ``"cpu"``: ``threads``
    cores, fp32 only."""
    if device_name.lower() == "cpu":
        return CPU_FP32_TFLOPS_PER_CORE * 1e12 * threads if dtype == "fp32" else None
    spec = find_device(device_name)
    tflops = None if spec is None else spec.dense_tflops.get(dtype)
    return None if tflops is None else tflops * 1e12 * compute_share(device_name, sm_count)


def job_peak_flops(per_rank: list[tuple[object, float | None]]) -> float | None:
    """The whole job's peak from ``(device identity, peak)`` per rank: each device once; ``None`` if any is unknown."""
    if any(peak is None for _, peak in per_rank):
        return None
    return float(sum(dict(per_rank).values()))
