"""The CommTimer's two TensorBoard views: a custom-scalars layout to read a run, and the HPARAMS table to compare
runs (strategy and settings as hparams, medians as metrics). Pure Python; what to read in each: ``docs/tensorboard.md``.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

__all__ = ["HPARAM_NAMES", "LAYOUT", "MEDIAN_METRICS", "custom_scalars_layout", "run_hparams", "run_metrics",
           "strategy_settings"]

LAYOUT: tuple[tuple[str, tuple[tuple[str, tuple[str, ...]], ...]], ...] = (
    ("Where the step goes", (
        ("step time, exposed and busy communication (ms)", ("step/time_ms", "comm/exposed_ms", "comm/busy_ms")),
    )),
    ("Hidden or not", (
        ("share of the step exposed, share of communication hidden", ("comm/share", "comm/overlap")),
    )),
    ("Who made it wait", (
        ("exposed = wait for the last rank + transfer (ms)", ("comm/exposed_ms", "comm/wait_ms", "comm/transfer_ms")),
        ("straggler's launch lag, ranks' compute spread (ms)", ("straggler/lag_ms", "step/rank_spread_ms")),
    )),
    ("Wire", (
        ("bus and algorithm bandwidth (GB/s)", ("comm/busbw_GBps", "comm/algbw_GBps")),
        ("bytes per step", ("comm/bytes",)),
        ("collectives per step", ("comm/calls",)),
    )),
    ("Throughput and memory", (
        ("tokens per second, all ranks", ("step/tokens_per_s",)),
        ("model FLOPs utilisation", ("step/mfu",)),
        ("peak memory (MiB)", ("memory/peak_MiB", "memory/peak_reserved_MiB")),
    )),
)
"""Category -> charts, each chart a title and the CommTimer keys drawn on it, keys of one unit per chart."""

MEDIAN_METRICS: dict[str, str] = {
    key: f"median/{key}"
    for key in ("step/time_ms", "comm/exposed_ms", "comm/share", "comm/overlap", "memory/peak_MiB", "comm/wait_ms",
                "step/tokens_per_s")
}
"""CommTimer key -> the HPARAMS metric tag of its end-of-fit median, in the order TensorBoard shows them."""

HPARAM_NAMES: dict[str, str] = {
    "strategy": "grad_sync/strategy",
    "bucket_size_mb": "grad_sync/bucket_size_mb",
    "engine_settings": "grad_sync/engine_settings",
    "world_size": "run/world_size",
    "precision": "run/precision",
    "batch_size": "run/batch_size",
    "preset": "run/preset",
}
"""``run_hparams``' arguments -> the hparams' names in TensorBoard; every run writes all of them."""

NOT_APPLICABLE = "n/a"
ONE_BUCKET = "one bucket"
TORCH_DDP_BUCKET_CAP_MB = 25.0
"""torch ``DistributedDataParallel``'s ``bucket_cap_mb`` when it is not given."""
ENGINE_ATTRIBUTES = ("schedule", "grad_sync", "collectives", "buckets_in_flight", "reshard_after_forward",
                     "mixed_precision")
"""Strategy attributes that are engine settings (the sharded strategies'), read where present."""


def custom_scalars_layout(logged: Iterable[str], prefix: str = "") -> dict[str, dict[str, list[Any]]]:
    """``LAYOUT`` reduced to the keys the run ``logged``, in ``SummaryWriter.add_custom_scalars``' format; each tag
    escaped, anchored at its end and preceded by ``prefix``.

    >>> layout = custom_scalars_layout(["step/time_ms", "comm/exposed_ms"])
    >>> layout["Where the step goes"]["step time, exposed and busy communication (ms)"]
    ['Multiline', ['step/time_ms$', 'comm/exposed_ms$']]
    """
    logged = set(logged)
    head = f"{prefix}-" if prefix else ""
    layout: dict[str, dict[str, list[Any]]] = {}
    for category, charts in LAYOUT:
        kept = {title: ["Multiline", [re.escape(head + key) + "$" for key in keys if key in logged]]
                for title, keys in charts if any(key in logged for key in keys)}
        if kept:
            layout[category] = kept
    return layout


def run_metrics(summary: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """The run's HPARAMS metrics: ``MEDIAN_METRICS`` of the keys in ``summary`` (``TimingSummary.summarize``)."""
    return {tag: float(summary[key]["median"]) for key, tag in MEDIAN_METRICS.items() if key in summary}


def strategy_settings(strategy: Any, resolved_bucket_size_mb: float | None) -> tuple[float | str, str]:
    """(bucket size in MiB, engine settings as ``name=value, ...``) of a Lightning strategy for the HPARAMS table:
    ``ONE_BUCKET`` for a bucket size of ``null``, ``NOT_APPLICABLE`` without buckets, ``default`` without settings.
    """
    algorithm = getattr(strategy, "algorithm", None)
    # Lightning's DDPStrategy keeps what it passes to torch DDP; a subclass that declares what its own communication
    # lets the timer see (fsdp2) wraps the model in something else.
    ddp_kwargs = getattr(strategy, "_ddp_kwargs", None) if not hasattr(strategy, "comm_recording") else None
    settings = {name: getattr(strategy, name) for name in ENGINE_ATTRIBUTES if hasattr(strategy, name)}
    if algorithm is not None:
        settings.update(getattr(strategy, "engine_settings", None) or {})
    elif isinstance(ddp_kwargs, Mapping):
        settings.update({k: v for k, v in ddp_kwargs.items() if k != "bucket_cap_mb"})
    if resolved_bucket_size_mb is not None:
        bucket: float | str = float(resolved_bucket_size_mb)
    elif algorithm is not None:
        one = getattr(algorithm, "has_bucket_size", False) and getattr(strategy, "bucket_size_mb", "") is None
        bucket = ONE_BUCKET if one else NOT_APPLICABLE
    elif isinstance(ddp_kwargs, Mapping):
        bucket = float(ddp_kwargs.get("bucket_cap_mb") or TORCH_DDP_BUCKET_CAP_MB)
    else:
        bucket = NOT_APPLICABLE
    return bucket, ", ".join(f"{k}={v}" for k, v in settings.items()) or "default"


def run_hparams(**values: Any) -> dict[str, Any]:
    """Every one of ``HPARAM_NAMES`` from ``values``: numbers and strings kept, ``None`` as ``NOT_APPLICABLE``.

    >>> run_hparams(strategy="naive_ddp", bucket_size_mb="n/a", engine_settings="default", world_size=2,
    ...             precision="32-true", batch_size=8, preset=None)["run/preset"]
    'n/a'
    """
    unknown, missing = set(values) - set(HPARAM_NAMES), set(HPARAM_NAMES) - set(values)
    if unknown or missing:
        raise TypeError(f"run_hparams takes exactly {', '.join(HPARAM_NAMES)}; unknown: {sorted(unknown)}, missing: "
                        f"{sorted(missing)}")
    return {name: _hparam_value(values[key]) for key, name in HPARAM_NAMES.items()}


def _hparam_value(value: Any) -> float | int | str:
    if value is None:
        return NOT_APPLICABLE
    if isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
