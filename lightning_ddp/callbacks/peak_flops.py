"""Dense peak FLOP/s per device and compute dtype: the denominator of MFU. Pure Python.

Datasheet figures *without* structured sparsity (NVIDIA quotes the sparse ones, twice as large, first; Lightning's
own table also gives about 2x the dense peak for H100 NVL and has no H200). In TFLOP/s, per GPU:

============================  ======  ======  ======  ======  =======================================
device (matched in order)     fp32    tf32    bf16    fp16    source
============================  ======  ======  ======  ======  =======================================
H100 NVL                      60      417.5   835.5   835.5   H100 NVL product brief (sparse / 2)
H100 PCIe                     51      378     756     756     H100 datasheet, PCIe column
H100 (SXM5, "HBM3")           67      494.7   989.4   989.4   H100 datasheet, SXM column
H200 NVL                      60      417.5   835.5   835.5   H200 datasheet, NVL column
H200 (SXM)                    67      494.7   989.4   989.4   H200 datasheet, SXM column
A100 (SXM4 and PCIe)          19.5    156     312     312     A100 datasheet
L4                            30.3    60      121     121     L4 datasheet (sparse / 2)
CPU, per thread               0.078   -       -       -       measured: one core of this project's CI
                                                              machine, fp32 matmul (an estimate only)
============================  ======  ======  ======  ======  =======================================

``fp32`` is what a ``32-true`` run gets unless TF32 is allowed for matmuls
(``torch.set_float32_matmul_precision("high")``); then ``tf32``. Anything not in the table: no MFU, unless
the ``CommTimer``'s ``peak_tflops`` gives the figure.
"""

from __future__ import annotations

import re

__all__ = ["CPU_TFLOPS_PER_THREAD", "DENSE_PEAK_TFLOPS", "dense_peak_flops", "job_peak_flops"]

DENSE_PEAK_TFLOPS: tuple[tuple[tuple[str, ...], dict[str, float]], ...] = (
    (("h100", "nvl"), {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    (("h100", "pcie"), {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    (("h100",), {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    (("h200", "nvl"), {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    (("h200",), {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    (("a100",), {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (("l4",), {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
)
"""(words that must all be words of the lower-cased device name, {dtype: dense TFLOP/s}); first match wins."""

CPU_TFLOPS_PER_THREAD = 0.078
"""fp32 matmul throughput of one core of our 2-core CI machine (~78 GFLOP/s, measured): an estimate for CPUs."""


def dense_peak_flops(device_name: str, dtype: str, threads: int = 1) -> float | None:
    """Dense peak FLOP/s of one device for ``dtype`` (``fp32``, ``tf32``, ``bf16``, ``fp16``), or ``None``.

    ``device_name`` is ``torch.cuda.get_device_name()`` for a GPU, or ``"cpu"`` (then ``threads`` cores).

    >>> dense_peak_flops("NVIDIA H100 80GB HBM3", "bf16") / 1e12
    989.4
    >>> dense_peak_flops("NVIDIA H100 NVL", "bf16") / 1e12
    835.5
    >>> dense_peak_flops("NVIDIA H200", "tf32") / 1e12
    494.7
    >>> dense_peak_flops("cpu", "fp32", threads=2) / 1e9
    156.0
    >>> dense_peak_flops("NVIDIA L40S", "bf16") is None  # not an L4: names are matched word by word
    True
    """
    name = device_name.lower()
    if name == "cpu":
        return CPU_TFLOPS_PER_THREAD * 1e12 * threads if dtype == "fp32" else None
    words_of_name = set(re.split(r"[^a-z0-9]+", name))
    for words, peaks in DENSE_PEAK_TFLOPS:
        if all(word in words_of_name for word in words):
            return peaks[dtype] * 1e12 if dtype in peaks else None
    return None


def job_peak_flops(per_rank: list[tuple[object, float | None]]) -> float | None:
    """The whole job's peak: the sum over its *distinct* devices of each one's peak.

    ``per_rank`` holds, for every rank, ``(device identity, that device's peak)``. Ranks sharing a device (two
    ranks over gloo on one GPU) count it once, so MFU is not halved by the sharing. ``None`` if any peak is
    unknown.

    >>> job_peak_flops([(("host", "GPU-0"), 1e15), (("host", "GPU-0"), 1e15)])  # 2 ranks, 1 GPU
    1000000000000000.0
    >>> job_peak_flops([(("host", "GPU-0"), 1e15), (("host", "GPU-1"), 1e15)])  # 2 ranks, 2 GPUs
    2000000000000000.0
    """
    if any(peak is None for _, peak in per_rank):
        return None
    return float(sum(dict(per_rank).values()))
