"""The memory benchmark's results, summarised per mode and written up (results.md, the plot); no torch.
docs/benchmarks.md states the statistics and the goals.
"""

from __future__ import annotations

import io
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable, Sequence

from lightning_ddp.bench.config import strategy_with_memory_model
from lightning_ddp.bench.stats import estimate, interval_text, ratio_estimate, verdict
from lightning_ddp.bench.study import markdown_table
from lightning_ddp.files import write_atomically

__all__ = ["BOOTSTRAP_SAMPLES", "MODE_LABELS", "PLOT_NAME", "POINTS", "STEP_GOAL", "family_summary", "format_report",
           "sent_bytes_per_rank", "summarise_modes", "write_memory_plot"]

POINTS: tuple[str, ...] = ("setup", "before_step", "after_step")
"""When snapshots are taken: after model and optimizer set-up; on the last step before and after ``step()``."""

MiB = 2**20

FSDP2 = strategy_with_memory_model("fully_sharded")
"""torch's FSDP2, the last mode (its catalogue name)."""

MODE_LABELS: dict[str, str] = {
    "unsharded": "DDP",
    "allreduce_broadcast": "ZeRO-1 (all-reduce + broadcast)",
    "reduce_scatter": "ZeRO-1 (reduce-scatter)",
    "zero2": "ZeRO-2",
    FSDP2: "FSDP2",
}
"""The family's names of the benchmark's modes, in the table and the plot."""

ZERO1 = "reduce_scatter"
"""The ZeRO-1 schedule the step-time goal compares ZeRO-2 with (the same communication volume)."""

STEP_GOAL = 1.10
"""ZeRO-2's step time may be at most 10 % over ZeRO-1's (``ZERO1``)."""

BOOTSTRAP_SAMPLES = 2000
"""Bootstrap draws of every step-time interval."""

PLOT_NAME = "memory_vs_step_time.png"
"""The plot's file name, next to results.md."""


def sent_bytes_per_rank(param_bytes: int, world_size: int, mode: str) -> float:
    """Bytes each rank sends per step with bandwidth-optimal collectives (ring model; docs/algorithms.md)."""
    n = world_size
    all_reduce = 2 * (n - 1) / n * param_bytes
    one_way = (n - 1) / n * param_bytes  # a reduce-scatter, an all-gather, or the N per-owner broadcasts/reduces
    return {"unsharded": all_reduce, "allreduce_broadcast": all_reduce + one_way, "reduce_scatter": 2 * one_way,
            "zero2": 2 * one_way, FSDP2: 3 * one_way}[mode]


def _largest(values: Iterable[int | None]) -> int | None:
    """The largest of the values that are not None (None if none is)."""
    present = [v for v in values if v is not None]
    return max(present) if present else None


def summarise_modes(
    modes: Sequence[str], world_size: int, per_mode: list[list[dict[str, Any]]], warmup_steps: int = 1,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One summary per mode from ``per_mode[m][r]`` (rank ``r``'s result in mode ``modes[m]``); docs/benchmarks.md
    lists what it holds."""
    summaries = []
    for mode, ranks in zip(modes, per_mode):
        matches = True
        for entry in ranks:
            full = entry["expected"]
            # Before any step: parameters only (AdamW allocates its state lazily, .grad is None).
            entry["expected_at"] = {
                "setup": {"parameters": full["parameters"], "gradients": 0, "optimizer_state": 0},
                "before_step": full,
                "after_step": full,
            }
            for point in POINTS:
                snap = entry["snapshots"][point]
                for key, value in entry["expected_at"][point].items():
                    matches &= snap[key] == value
            # the measured peak: the largest max_allocated (CUDA) or max_rss (CPU) of the snapshots
            entry["peak"] = _largest(snap.get("max_allocated", snap.get("max_rss"))
                                     for snap in entry["snapshots"].values())
            entry["expected_peak"] = sum(full.values()) + entry.get("expected_transient", 0)
        summary = {"mode": mode, "ranks": ranks, "warmup_steps": warmup_steps}
        step = estimate([_measured_steps(summary)], BOOTSTRAP_SAMPLES, seed, key=mode)
        full_parameters = ranks[0].get("full_parameter_bytes", ranks[0]["expected"]["parameters"])
        summaries.append({**summary, "step_ms_median": step.point, "step_ms": asdict(step),
                          "matches_expected": matches,
                          "sent_bytes_per_rank": sent_bytes_per_rank(full_parameters, world_size, mode)})
    return summaries


def _most_loaded(mode: dict[str, Any], key: str) -> int | None:
    """The largest of ``key`` over the mode's ranks (a snapshot category at ``before_step``, or a rank's entry)."""
    return _largest(r["snapshots"]["before_step"][key] if key in r["snapshots"]["before_step"] else r.get(key)
                    for r in mode["ranks"])


def _measured_steps(mode: dict[str, Any]) -> list[float]:
    """Rank 0's step times (already the max over ranks) after the warm-up."""
    return mode["ranks"][0]["step_ms"][mode.get("warmup_steps", 1):]


def family_summary(results: dict[str, Any]) -> dict[str, Any]:
    """The data-parallel family's table (``rows``: one per measured mode, the most loaded rank's bytes, measured and
    expected) and the goals (``goals``), from ``results`` with ``config`` and summarised ``modes``."""
    config = results["config"]
    modes = {m["mode"]: m for m in results["modes"]}
    seed = config.get("seed", 0)
    rows = []
    for name, mode in modes.items():
        row: dict[str, Any] = {"mode": name, "label": MODE_LABELS.get(name, name), "step_ms": mode["step_ms"]}
        for key in ("parameters", "gradients", "optimizer_state"):
            row[key] = _most_loaded(mode, key)
            row[f"expected_{key}"] = max(r["expected"][key] for r in mode["ranks"])
        row["peak"] = _most_loaded(mode, "peak")
        row["expected_peak"] = max(r["expected_peak"] for r in mode["ranks"])
        if ZERO1 in modes:
            ratio = ratio_estimate([_measured_steps(mode)], [_measured_steps(modes[ZERO1])], BOOTSTRAP_SAMPLES,
                                   seed, keys=(name, ZERO1))
            row["step_ratio_to_zero1"] = asdict(ratio)
        rows.append(row)
    return {"rows": rows, "goals": _goals(config, modes, {row["mode"]: row for row in rows})}


def _goals(config: dict[str, Any], modes: dict[str, dict[str, Any]],
           rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The two goals' verdicts; the step goal reads ZeRO-2's row (its ratio to ZeRO-1 is bootstrapped there)."""
    n = config["devices"]
    gradients: dict[str, Any] = {"goal": "ZeRO-2 gradients per rank <= DDP's / N + one bucket",
                                 "verdict": "not measurable"}
    if "zero2" in modes and "unsharded" in modes:
        full = _most_loaded(modes["unsharded"], "gradients")
        cap = config.get("bucket_size_mb")
        bucket = full if cap is None else min(int(cap * MiB), full)  # null: one bucket of every gradient
        target = full / n + bucket
        measured = _most_loaded(modes["zero2"], "gradients")
        gradients.update(measured_MiB=measured / MiB, target_MiB=target / MiB,
                         verdict="met" if measured <= target else "missed")
    step: dict[str, Any] = {"goal": f"ZeRO-2 step time / ZeRO-1's ({ZERO1}) <= {STEP_GOAL:.2f}",
                            "verdict": "not measurable"}
    if "zero2" in modes and ZERO1 in modes:
        ratio = rows["zero2"]["step_ratio_to_zero1"]
        step.update(ratio=ratio, target=STEP_GOAL, verdict=verdict((ratio["lo"], ratio["hi"]), STEP_GOAL))
    return [gradients, step]


def _tensors(snapshot: dict[str, Any]) -> int:
    return snapshot["parameters"] + snapshot["gradients"] + snapshot["optimizer_state"]


def _mib(value: int | float | None) -> str:
    return "" if value is None else f"{value / MiB:,.2f}"


def _interval(value: dict[str, float] | None, fmt: str) -> str:
    return "" if value is None else interval_text(value["point"], value["lo"], value["hi"], fmt)


def _family_lines(results: dict[str, Any]) -> list[str]:
    config = results["config"]
    family = results.get("family") or family_summary(results)
    rows = [[row["label"], *(f"{_mib(row[k])} ({_mib(row[f'expected_{k}'])})"
                             for k in ("parameters", "gradients", "optimizer_state", "peak")),
             _interval(row["step_ms"], ",.1f"), _interval(row.get("step_ratio_to_zero1"), ".3f")]
            for row in family["rows"]]
    goals = []
    for goal in family["goals"]:
        if "ratio" in goal:
            measured, target = _interval(goal["ratio"], ".3f"), f"{goal['target']:.2f}"
        elif "measured_MiB" in goal:
            measured, target = f"{goal['measured_MiB']:,.2f} MiB", f"{goal['target_MiB']:,.2f} MiB"
        else:
            measured = target = ""
        goals.append([goal["goal"], measured, target, f"**{goal['verdict']}**"])
    return [
        "## The data-parallel family",
        "",
        f"Per rank (the most loaded rank), MiB: measured (expected). Step: median ms over steps "
        f"{config.get('warmup_steps', 1) + 1}..{config['steps']} (max over ranks) [95 % interval].",
        "",
        *markdown_table(["mode", "parameters", "gradients", "optimizer state", "peak", "step ms",
                         "step / ZeRO-1 (reduce-scatter)"], rows),
        "",
        *markdown_table(["goal", "measured", "target", "verdict"], goals, "lrrl"),
    ]


def write_memory_plot(results: dict[str, Any], path: str | Path) -> Path:
    """Peak memory per rank (the most loaded rank, MiB) against step time (median, 95 % interval as error bars), one
    labelled point per mode; a PNG written atomically. Needs matplotlib (the study's plots only)."""
    from matplotlib.figure import Figure  # a Figure saves through the Agg canvas without pyplot

    config = results["config"]
    rows = (results.get("family") or family_summary(results))["rows"]
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    for row in rows:
        step, peak = row["step_ms"], row["peak"]
        if peak is None or not all(math.isfinite(step[k]) for k in ("point", "lo", "hi")):
            continue
        ax.errorbar([step["point"]], [peak / MiB], xerr=[[step["point"] - step["lo"]], [step["hi"] - step["point"]]],
                    fmt="o", capsize=4, label=row["label"])
        ax.annotate(row["label"], (step["point"], peak / MiB), textcoords="offset points", xytext=(6, 6), fontsize=8)
    ax.set_xlabel("step time, ms (median, 95 % interval)")
    ax.set_ylabel("peak memory per rank, MiB" + (" (max allocated)" if config["accelerator"] == "cuda"
                                                 else " (peak RSS)"))
    ax.set_title(f"{config['preset']}, {config['devices']} ranks, {config['accelerator']}")
    ax.grid(alpha=0.3)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return write_atomically(path, buffer.getvalue())


def _rank_lines(results: dict[str, Any]) -> list[str]:
    """One row per mode and rank: optimizer state, tensors before the step, step time, bytes."""
    rows = []
    for mode in results["modes"]:
        for per_rank in mode["ranks"]:
            before = per_rank["snapshots"]["before_step"]
            rows.append([mode["mode"], per_rank["rank"],
                         f"{_mib(before['optimizer_state'])} ({_mib(per_rank['expected']['optimizer_state'])})",
                         _mib(_tensors(before)), f"{mode['step_ms_median']:,.1f}",
                         _mib(per_rank["comm_bytes_recorded"]), _mib(mode["sent_bytes_per_rank"])])
    header = ["mode", "rank", "optimizer state MiB (expected)", "tensors before step MiB",
              "step ms (median, max over ranks)", "recorded comm MiB/step", "sent per rank MiB/step (ring model)"]
    return ["## Every rank", "", *markdown_table(header, rows)]


def _mode_lines(mode: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """One mode's snapshots: a row per rank and point."""
    cuda = config["accelerator"] == "cuda"
    memory = ["allocated", "max_allocated", "reserved", "max_reserved", "rest"] if cuda else ["rss", "rest"]
    rows = []
    for per_rank in mode["ranks"]:
        for point in POINTS:
            snap = per_rank["snapshots"][point]
            rows.append([per_rank["rank"], point, _mib(snap["parameters"]), _mib(snap["gradients"]),
                         _mib(snap["optimizer_state"]), _mib(_tensors(snap)),
                         _mib(sum(per_rank["expected_at"][point].values())), *(_mib(snap[k]) for k in memory)])
    header = ["rank", "point", "parameters", "gradients", "optimizer state", "tensors", "expected",
              *(["allocated", "max allocated", "reserved", "max reserved", "rest"] if cuda else ["RSS", "rest"])]
    return [
        "",
        f"## {mode['mode']}",
        "",
        f"Step time: median {mode['step_ms_median']:,.1f} ms over steps {mode.get('warmup_steps', 1) + 1}.."
        f"{config['steps']} (max over ranks). "
        f"Measured tensors equal the analytic expectation: **{'yes' if mode['matches_expected'] else 'NO'}**.",
        "",
        *markdown_table(header, rows, "rl" + "r" * (len(header) - 2)),
    ]


def format_report(results: dict[str, Any]) -> str:
    """``results.md``: a summary table across modes, then one table per mode (a row per rank and point)."""
    config, env = results["config"], results["environment"]
    lines = [
        f"# Memory benchmark of the data-parallel family: {config['preset']}, {config['devices']} ranks, "
        f"{config['accelerator']}",
        "",
        f"torch {env['torch']}, {env['device']}, {env['cpu_count']} CPUs, backend {env['backend']}; batch "
        f"{config['batch_size']} x {config['seq_len']} tokens per rank, {config['steps']} steps per mode, engine "
        f"{config['grad_sync']}, each mode in {'fresh' if config['separate_processes'] else 'shared'} processes. "
        "Bytes are MiB (2^20); the columns are defined in docs/benchmarks.md, \"Reading the memory report\".",
        "",
        *_family_lines(results),
        "",
        *_rank_lines(results),
    ]
    for mode in results["modes"]:
        lines += _mode_lines(mode, config)
    return "\n".join(lines) + "\n"
