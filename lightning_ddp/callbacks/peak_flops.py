"""Dense peak FLOP/s per device and compute dtype: the denominator of MFU. Pure Python.

The figures live in one table, ``lightning_ddp.hardware.DEVICES`` (its docstring lists every device, its sources,
and how names and MIG slices are matched); this module keeps the names the ``CommTimer`` and older code use:

- ``dense_peak_flops(device_name, dtype, threads=1, sm_count=None)``: one device's peak, a MIG slice's share
  of its GPU (by SMs when ``sm_count`` is given, else N/7 of an ``Ng`` profile), or the CPU estimate.
- ``job_peak_flops``: the sum over a job's distinct devices.
- ``DENSE_PEAK_TFLOPS``: the GPU rows as (words, {dtype: dense TFLOP/s}), in matching order.
- ``CPU_TFLOPS_PER_THREAD``: the CPU estimate per core.

``fp32`` is what a ``32-true`` run gets unless TF32 is allowed for matmuls
(``torch.set_float32_matmul_precision("high")``); then ``tf32``. Anything not in the table: no MFU, unless
the ``CommTimer``'s ``peak_tflops`` gives the figure.
"""

from __future__ import annotations

from lightning_ddp import hardware

__all__ = ["CPU_TFLOPS_PER_THREAD", "DENSE_PEAK_TFLOPS", "dense_peak_flops", "job_peak_flops"]

DENSE_PEAK_TFLOPS: tuple[tuple[tuple[str, ...], dict[str, float]], ...] = tuple(
    (pattern, dict(spec.dense_tflops)) for spec in hardware.DEVICES.values() for pattern in spec.patterns
)
"""(words that must all be words of the lower-cased device name, {dtype: dense TFLOP/s}); first match wins.
Derived from ``lightning_ddp.hardware.DEVICES``."""

CPU_TFLOPS_PER_THREAD = hardware.CPU_FP32_TFLOPS_PER_CORE
"""fp32 matmul throughput of one CPU core, an estimate (``lightning_ddp.hardware.CPU_FP32_TFLOPS_PER_CORE``, which
says where the figure comes from)."""


def dense_peak_flops(device_name: str, dtype: str, threads: int = 1, sm_count: int | None = None) -> float | None:
    """Dense peak FLOP/s of one device for ``dtype`` (``fp32``, ``tf32``, ``bf16``, ``fp16``), or ``None``.

    ``device_name`` is ``torch.cuda.get_device_name()`` for a GPU, or ``"cpu"`` (then ``threads`` cores);
    ``sm_count`` its ``multi_processor_count``, which makes a MIG slice's share exact. The figures and the
    examples are ``lightning_ddp.hardware.dense_peak_flops``'s.
    """
    return hardware.dense_peak_flops(device_name, dtype, threads=threads, sm_count=sm_count)


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
