"""Every catalogue alternative simulated for a run, scaled so the current strategy matches its measured step, with
intervals, the arguments that apply it, and the verdict (docs/advice.md, "Predictions" and "Verdict")."""

from __future__ import annotations

import json
import statistics
from typing import Any, Sequence

from lightning_ddp import catalogue, hardware
from lightning_ddp.advice.calibrate import FittedComm, Run, fit_calls, step_model
from lightning_ddp.projection.comm import MeasuredFit, get_fabric
from lightning_ddp.projection.memory import state_bytes
from lightning_ddp.projection.run import project
from lightning_ddp.projection.simulators import MiB, best_by_world_size, simulate, simulated_names
from lightning_ddp.sync.bucket_model import optimal_bucket_bytes

__all__ = ["BUCKET_SIZES_MB", "PROJECTION_ERROR", "advise", "calibrated_error", "fit_arguments"]

BUCKET_SIZES_MB: tuple[float, ...] = (1, 2, 4, 8, 16, 25, 50)
"""Bucket sizes tried for every strategy that takes one, besides ``auto``."""

PROJECTION_ERROR = 0.099
"""Half-width of every interval, relative: the median |error| of self-calibrated predictions in the committed CPU
validation (``calibrated_error`` of benchmarks/results/projection/cpu_sweep_validation.csv; a test recomputes it)."""

STRAGGLER_SHARE = 0.5
"""A straggler is named when waiting for the slowest rank is more than this share of the exposed time ..."""

STRAGGLER_STEP_SHARE = 0.05
"""... and more than this share of the step: a few ms of jitter behind a well-hidden sync is no straggler."""

MEMORY_NEAR = 0.8
"""Sharding is priced when the run's peak memory is above this share of the device's."""


def calibrated_error(rows: Sequence[dict[str, str]]) -> float:
    """Median |error| of predicting one cell from another of its group scaled to the other's measured step (what
    advise does): ``(1 + e_b) / (1 + e_a) - 1`` over every ordered pair of the validation's ``step_error``."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault((r["precision"], r["batch_size"], r["context_length"]), []).append(float(r["step_error"]))
    return statistics.median(abs((1 + b) / (1 + a) - 1) for errors in groups.values()
                             for i, a in enumerate(errors) for j, b in enumerate(errors) if i != j)


def fit_arguments(run: Run, name: str, bucket: float | str | None) -> dict[str, Any]:
    """How to apply a strategy: ``fit_args`` for our CLI, a YAML fragment, and ``Trainer(strategy=...)``."""
    value = catalogue.get(name).strategy_argument(bucket_size_mb=bucket)
    text = json.dumps(value)
    arguments = ", ".join(f"{k}={v!r}" for k, v in value["init_args"].items())
    return {"fit_args": ["--trainer.strategy", text] if run.info.get("cli") else [],
            "yaml": f"trainer:\n  strategy: {text}\n",
            "python": f"Trainer(strategy={value['class_path']}({arguments}))"}


def _candidates(auto_mb: float) -> list[tuple[str, float | str | None, float | None]]:
    """``(strategy, bucket size as applied, size simulated)`` for every simulated catalogue entry."""
    out = []
    for name in simulated_names():
        if catalogue.get(name).has_bucket_size:
            out += [(name, size, float(size)) for size in BUCKET_SIZES_MB] + [(name, "auto", auto_mb)]
        else:
            out.append((name, None, None))
    return out


def _current_size(run: Run) -> float | None:
    entry = catalogue.get(run.info["strategy"])
    size = run.info.get("bucket_size_mb")
    return (size if size is not None else entry.default_bucket_size_mb) if entry.has_bucket_size else None


def _interval(value: float) -> list[float]:
    return [value * (1 - PROJECTION_ERROR), value * (1 + PROJECTION_ERROR)]


def _scales(run: Run, fits: dict, scale: float, world_sizes: Sequence[int], network: str | None) -> dict[str, list]:
    """The best variants at other world sizes: the all-reduce fit extrapolated, or a fabric preset (not scaled)."""
    o, w = fits.get("all_reduce", next(iter(fits.values())))
    comm = get_fabric(network) if network else MeasuredFit(o, w, run.info["world_size"]).fabric()
    model = step_model(run, comm)
    factor = 1.0 if network else scale
    results = project(run.profile, comm, simulated_names(), list(world_sizes), BUCKET_SIZES_MB,
                      model.copy_bandwidth_Bps, contention=model.contention)
    out: dict[str, list] = {}
    for (variant, n), r in sorted(best_by_world_size(results).items(), key=lambda item: item[1].step_ms):
        out.setdefault(str(n), []).append({"strategy": variant, "bucket_size_mb": r.bucket_size_mb,
                                           "predicted_step_ms": r.step_ms * factor, "predicted_share": r.comm_share})
    return out


def advise(run: Run, world_sizes: Sequence[int] = (), network: str | None = None,
           device_memory_gib: float | None = None) -> dict[str, Any]:
    """advice.json's document for ``run`` (docs/advice.md defines every field)."""
    fits, notes = fit_calls(run.summary["collectives"])
    current, scale, factor = run.info["strategy"], 1.0, 1.0
    calibrated = current in simulated_names()
    # first the communication: the current strategy's busy time as measured, less waiting for a late rank
    busy_ms = (run.medians.get("comm/busy_ms") or 0.0) - (run.medians.get("comm/wait_ms") or 0.0)
    if calibrated and busy_ms > 0:
        factor = busy_ms / simulate(current, step_model(run, FittedComm(fits)), _current_size(run)).busy_comm_ms
    model = step_model(run, FittedComm(fits, factor))
    params = run.profile.params
    o, w = fits.get("all_reduce", next(iter(fits.values())))
    auto_mb = optimal_bucket_bytes(run.profile.grad_bytes, o, w, max(p.bytes for p in params)) / MiB
    simulated: dict[tuple, Any] = {}
    not_predicted = []
    candidates = _candidates(auto_mb)
    if calibrated and not any(name == current and size_equal(bucket, _current_size(run))
                              for name, bucket, _ in candidates):  # a size not tried, e.g. a resolved `auto`
        candidates.append((current, _current_size(run), _current_size(run)))
    for name, bucket, size in candidates:
        try:
            result = simulate(name, model, size)
        except ValueError as error:  # e.g. FSDP2's blocks on a model without numbered layers
            not_predicted.append(f"{name}: {error}")
            continue
        result.memory_bytes = state_bytes(result, model)
        simulated[(name, bucket)] = result
    if calibrated:  # then the step: every prediction scaled so the current one is the measured step
        mine = simulate(current, model, _current_size(run))
        scale = run.step_ms / mine.step_ms
        current_bytes = state_bytes(mine, model)
    else:
        notes.append(f"{current} has no projection model: predictions are not calibrated to the run")
        current_bytes = None
    rows = []
    for (name, bucket), r in simulated.items():
        entry = catalogue.get(name)
        predicted = r.step_ms * scale
        row = {"strategy": name, "settings": {"bucket_size_mb": bucket} if bucket is not None else {},
               "exact": entry.exact, "sharded": entry.sharded,
               "current": calibrated and name == current and size_equal(bucket, _current_size(run)),
               "predicted_step_ms": predicted, "predicted_step_interval": _interval(predicted),
               "predicted_share": r.comm_share, "gain": run.step_ms / predicted - 1,
               "gain_interval": [run.step_ms / hi - 1 for hi in _interval(predicted)[::-1]],
               "memory_GiB": r.memory_bytes / 2**30, **fit_arguments(run, name, bucket)}
        rows.append(row)
    rows.sort(key=lambda row: row["predicted_step_ms"])
    document = {"run": {"path": str(run.path), "strategy": current, "bucket_size_mb": run.info.get("bucket_size_mb"),
                        "world_size": run.info["world_size"], "backend": run.info.get("backend"),
                        "cli": bool(run.info.get("cli")), "step_ms": run.step_ms,
                        "exposed_ms": run.medians.get("comm/exposed_ms"), "share": run.medians.get("comm/share")},
                "calibration": {"fits": {op: {"overhead_s": f[0], "bandwidth_Bps": f[1]} for op, f in fits.items()},
                                "comm_factor": factor, "scale": scale,
                                "contention": model.contention, "auto_bucket_mb": auto_mb,
                                "projection_error": PROJECTION_ERROR, "notes": notes},
                "recommendations": rows, "not_predicted": not_predicted,
                "verdict": _verdict(run, rows, current_bytes, device_memory_gib)}
    if world_sizes:
        document["scales"] = _scales(run, fits, scale, world_sizes, network)
    return document


def size_equal(a: float | str | None, b: float | str | None) -> bool:
    return a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) < 1e-6)


def _verdict(run: Run, rows: list[dict[str, Any]], current_bytes: int | None,
             device_memory_gib: float | None) -> dict[str, Any]:
    """``action`` (change, keep or straggler), one line saying why, and the straggler and memory findings."""
    better = [r for r in rows if r["exact"] and not r["current"] and r["predicted_step_interval"][1] < run.step_ms]
    verdict: dict[str, Any] = {"action": "change" if better else "keep", "top": better[0] if better else None}
    verdict["text"] = (f"change to {_label(better[0])}: {better[0]['gain']:+.0%} predicted" if better else
                       "keep: no exact alternative is predicted faster beyond its interval")
    exposed, wait = run.medians.get("comm/exposed_ms") or 0.0, run.medians.get("comm/wait_ms") or 0.0
    rank = run.straggler_rank()
    if wait > STRAGGLER_SHARE * exposed and wait > STRAGGLER_STEP_SHARE * run.step_ms and rank is not None:
        verdict.update(action="straggler", straggler={"rank": rank, "wait_ms": wait, "exposed_ms": exposed})
        verdict["text"] = (f"straggler: rank {rank} makes the others wait {wait:.1f} of {exposed:.1f} exposed ms; "
                           "no strategy fixes a straggler: find what slows that rank")
    spec = hardware.find_device(str(run.info.get("device") or ""))
    device_gib = device_memory_gib or (spec.memory_GB * 1e9 / 2**30 if spec is not None else None)
    peak_gib = (run.medians.get("memory/peak_MiB") or 0.0) / 1024
    if device_gib and peak_gib >= MEMORY_NEAR * device_gib and current_bytes is not None:
        saves: dict[str, float] = {}  # per sharded strategy, at its setting that keeps the least
        for r in rows:
            if r["sharded"]:
                saves[r["strategy"]] = max(saves.get(r["strategy"], -1e9), current_bytes / 2**30 - r["memory_GiB"])
        verdict["memory"] = {"peak_GiB": peak_gib, "device_GiB": device_gib, "sharding_saves_GiB": saves}
    return verdict


def _label(row: dict[str, Any]) -> str:
    return catalogue.variant_label(row["strategy"], row["settings"].get("bucket_size_mb"))
