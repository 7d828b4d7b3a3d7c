"""The projection's ``results.md`` and its PNG plots (matplotlib's Agg canvas, no pyplot)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Callable, Optional, Sequence

from lightning_ddp import catalogue
from lightning_ddp.files import write_atomically
from lightning_ddp.profile import ComputeProfile
from lightning_ddp.projection.comm import Fabric
from lightning_ddp.projection.config import contention_of, copy_bandwidth
from lightning_ddp.projection.simulators import (
    PRESENCE_FLAG_BYTES,
    StepResult,
    best_by_world_size,
    model_settings,
    powersgd_plan,
    simulate_bucketed_powersgd,
    simulate_hsdp,
    simulated_by,
    simulated_names,
)
from lightning_ddp.reporting import variants
from lightning_ddp.reporting.tables import markdown_table

NO_COST_TOLERANCE = 0.05
"""A sharded strategy's memory saving is "at no step-time cost" where its step is within 5 % of the baseline's
(torch DDP, else the fastest unsharded strategy); why 5 %: docs/projection.md."""


def _ms(value: float) -> str:
    """A time to 3 or 4 significant figures: ``12.3 ms``, ``1.23 ms``."""
    return f"{value:,.1f} ms" if value >= 10 else f"{value:.2f} ms"


def _entry(variant: str) -> catalogue.Entry:
    return catalogue.get(variants.variant_strategy(variant))


def _title(variant: str) -> str:
    """A table row's name: a strategy with buckets is shown at its best size."""
    return f"{variant} (best size)" if _entry(variant).has_bucket_size else variant


def _at_size(result: StepResult) -> str:
    """`` @ 4 MiB`` for a strategy with buckets, ``""`` for one without."""
    return "" if result.bucket_size_mb is None else f" @ {result.bucket_size_mb:g} MiB"


def _step_and_share(result: StepResult) -> str:
    """A table cell: the step, its exposed comm share, and the bucket size it was best at."""
    return f"{_ms(result.step_ms)} ({100 * result.comm_share:.1f} %){_at_size(result)}"


def _stream(result: StepResult) -> str:
    """A table cell: busy communication, its calls, and the share of it hidden behind compute."""
    return f"{_ms(result.busy_comm_ms)}, {result.calls} calls, {100 * result.overlap:.0f} % hidden"


def _memory_and_step(result: StepResult) -> str:
    """A table cell: model state on the most loaded rank in GB, and the step; empty without a memory model."""
    return "" if result.memory_bytes is None else f"{result.memory_bytes / 1e9:.2f} GB, {_ms(result.step_ms)}"


def _variants(results: Sequence[StepResult]) -> list[str]:
    """The strategies (with their settings) in ``results``, in catalogue order, settings in first-seen order."""
    order = {name: i for i, name in enumerate(catalogue.STRATEGIES)}
    seen = list(dict.fromkeys(r.variant for r in results))
    return sorted(seen, key=lambda v: order.get(variants.variant_strategy(v), len(order)))  # stable


def build_markdown(config, profile: ComputeProfile, fabric: Fabric, results: Sequence[StepResult]) -> str:
    """results.md: inputs, the step/share table, the best bucket sizes, communication time, caveats."""
    best = best_by_world_size(results)
    sizes = sorted({r.world_size for r in results})
    names = _variants(results)
    lines = [f"# {config.name}", ""]
    lines += _inputs_section(config, profile, fabric)
    lines += ["## Step time (exposed communication share) per world size", ""]
    lines += _strategy_table(best, names, sizes, _step_and_share)
    lines += _fastest(best, names, sizes)
    lines += _memory_section(best, names, sizes)
    lines += _best_bucket_section(results, best, names, sizes, fabric)
    lines += ["", "## Communication stream: busy time and calls per step", ""]
    lines += _strategy_table(best, names, sizes, _stream)
    lines += _caveats(profile, results, best)
    return "\n".join(lines)


def _inputs_section(config, profile: ComputeProfile, fabric: Fabric) -> list[str]:
    """What the projection assumed: the compute profile, the gradients, the network, copies and contention."""
    contention, source = contention_of(config.network)
    return [
        "Projected by `python -m lightning_ddp.projection` (simulated, not measured). How to read each table and "
        "where the model is known to be wrong: docs/projection.md.",
        "",
        "## Inputs",
        "",
        f"- **Compute** ({profile.source}): {profile.label}; per rank forward {_ms(profile.forward_ms)}, backward "
        f"{_ms(profile.backward_span_ms)}, optimizer {_ms(profile.optimizer_ms)}: a compute-only step of "
        f"**{_ms(profile.compute_ms)}**, the same at every world size (the per-rank batch is fixed).",
        f"- **Gradients**: {len(profile.params)} tensors, {profile.grad_bytes / 1e9:.3f} GB per step.",
        f"- **Network** `{fabric.name}`: {fabric.description}. {fabric.describe()}.",
        f"- **Copies** (pack, unpack, casts): {copy_bandwidth(config.compute) / 1e9:,.0f} GB/s (memory bandwidth x "
        f"{config.compute.memory_efficiency:g}).",
        f"- **Contention**: compute runs {1 + contention:g} x slower while a collective is in flight "
        f"(s = {contention:g}, {source}).",
        "",
    ]


def _strategy_table(best: dict[tuple[str, int], StepResult], names: list[str], sizes: list[int],
                    cell: Callable[[StepResult], str]) -> list[str]:
    """One row per strategy variant, one column per world size; ``cell`` writes a result (empty where none)."""
    rows = []
    for name in names:
        rows.append([_title(name), *(cell(best[(name, n)]) if (name, n) in best else "" for n in sizes)])
    return markdown_table(["strategy", *(f"{n} ranks" for n in sizes)], rows, "l" + "r" * len(sizes))


def _best_bucket_section(results: Sequence[StepResult], best: dict[tuple[str, int], StepResult], names: list[str],
                         sizes: list[int], fabric: Fabric) -> list[str]:
    """Per world size, each strategy with buckets at its best bucket size and at its worst."""
    bucketed = [name for name in names if _entry(name).has_bucket_size]
    if not bucketed:
        return []
    rows = []
    for n in sizes:
        cells = [n, fabric.nodes(n)]
        for name in bucketed:
            fastest = best[(name, n)]
            slowest = max((r for r in results if r.variant == name and r.world_size == n), key=lambda r: r.step_ms)
            cells += [f"{fastest.bucket_size_mb:g} MiB", _ms(fastest.step_ms),
                      f"{slowest.bucket_size_mb:g} MiB, {_ms(slowest.step_ms)}"]
        rows.append(cells)
    header = ["world size", "nodes"]
    for name in bucketed:
        header += [f"{name}: best", "step", "worst cap, step"]
    return ["", "## Best bucket size per world size", "", *markdown_table(header, rows, "rr" + "rrl" * len(bucketed))]


def _caveats(profile: ComputeProfile, results: Sequence[StepResult],
             best: dict[tuple[str, int], StepResult]) -> list[str]:
    """The unmodelled strategies, ZeRO-1's padding and PowerSGD's compressed matrices (docs/projection.md)."""
    lines = ["", "## Caveats", ""]
    unmodelled = simulated_names(modelled=False)
    if unmodelled:
        lines.append(f"- Not projected: {', '.join(f'`{n}`' for n in unmodelled)}, in the catalogue but with no "
                     "timeline model (`projection` in its entry) yet.")
    zero1 = sorted((r for r in best.values() if r.strategy in simulated_by("zero1")),
                   key=lambda r: r.world_size)
    if zero1 and profile.grad_bytes:
        flags = PRESENCE_FLAG_BYTES * len(profile.params)
        padding = ", ".join(f"{(r.comm_bytes - flags) / 2 / profile.grad_bytes:.2g}x at {r.world_size}" for r in zero1)
        lines.append(f"- `{zero1[0].strategy}` pads every rank's segment to the most loaded owner's: its buffers grow "
                     f"to {padding} the gradient bytes. Its exposed time is net of the optimizer time sharding saves "
                     "(shares below zero; \"hidden\" near 100 %: paid for, not overlapped).")
    powersgd = [r for r in results if r.strategy in simulated_by(simulate_bucketed_powersgd)]
    if powersgd and profile.has_shapes:
        settings = {**model_settings(powersgd[0].strategy), **powersgd[0].settings}
        plan = powersgd_plan([q.shape for q in profile.params], settings["rank"], settings["min_compression_rate"])
        lines.append(f"- `{powersgd[0].strategy}`: lossy steady state, optimistic: kernels as rooflines, no launch "
                     f"latency of its ~10 kernels and 2 QRs per compressed matrix ({sum(1 for m in plan if m)} here).")
    hsdp = [r for r in results if r.strategy in simulated_by(simulate_hsdp)]
    if hsdp:
        lines.append(f"- `{hsdp[0].strategy}`: shard groups of one node's GPUs assumed (on a one-level fabric, every "
                     "rank: fsdp2's step); each gradient shard's all-reduce across the nodes queued behind the "
                     "reduce-scatters and all-gathers on the one communication stream (torch gives it a stream of its "
                     "own): pessimistic where that all-reduce is long.")
    return lines + [""]


def _fastest(best: dict[tuple[str, int], StepResult], names: list[str], sizes: list[int]) -> list[str]:
    """The fastest strategy per world size, against torch DDP and bucketed (each at its best bucket size)."""
    baselines = simulated_by("full_buckets") + simulated_by("bucketed")  # torch DDP, then ours
    rows = []
    for n in sizes:
        candidates = [best[(name, n)] for name in names if (name, n) in best]
        if not candidates:
            continue
        winner = min(candidates, key=lambda r: r.step_ms)
        ratios = []
        for baseline in baselines:
            other = best.get((baseline, n))
            ratios.append(f"{winner.step_ms / other.step_ms:.3f}" if other and other.step_ms > 0 else "-")
        rows.append([n, f"{winner.variant}{_at_size(winner)}", _ms(winner.step_ms), *ratios])
    header = ["world size", "fastest", "step"]
    for baseline in baselines:
        header.append(f"/ {baseline} (best)" if _entry(baseline).has_bucket_size else f"/ {baseline}")
    return ["", "## Fastest per world size", "", *markdown_table(header, rows, "rlr" + "r" * len(baselines))]


def _memory_section(best: dict[tuple[str, int], StepResult], names: list[str], sizes: list[int]) -> list[str]:
    """Model-state memory per rank of every strategy; per sharded strategy (the catalogue's ``sharded``) and world
    size, its memory and step against the baseline's (torch DDP, else the fastest unsharded strategy), and whether the
    saving comes at no step-time cost."""
    if not any(r.memory_bytes is not None for r in best.values()):
        return []
    lines = ["", "## Memory per rank against step time", ""]
    lines += _strategy_table(best, names, sizes, _memory_and_step)
    rows: list[list] = []
    for n in sizes:
        unsharded = [best[(v, n)] for v in names if (v, n) in best and not _entry(v).sharded]
        torch_ddp = [best[(v, n)] for v in simulated_by("full_buckets") if (v, n) in best]
        baseline = torch_ddp[0] if torch_ddp else min(unsharded, key=lambda r: r.step_ms, default=None)
        if baseline is None or baseline.memory_bytes is None:
            continue
        for v in names:
            r = best.get((v, n))
            if r is None or not _entry(v).sharded or r.memory_bytes is None:
                continue
            slower = r.step_ms / baseline.step_ms - 1
            saved = baseline.memory_bytes - r.memory_bytes
            rows.append([n, _title(v), f"{r.memory_bytes / 1e9:.2f} GB",
                         f"{saved / 1e9:.2f} GB ({100 * saved / baseline.memory_bytes:.0f} % of {baseline.variant}'s)",
                         _ms(r.step_ms), f"{100 * slower:+.1f} %", _saving_verdict(saved, slower)])
    if rows:
        lines += ["", f"**Memory saving at no step-time cost** (step within {100 * NO_COST_TOLERANCE:.0f} % of the "
                  "baseline's):", ""]
        header = ["world size", "strategy", "memory", "saved vs baseline", "step", "vs baseline", "verdict"]
        lines += markdown_table(header, rows, "rlrrrrl")
    return lines


def _saving_verdict(saved_bytes: float, slower: float) -> str:
    """Whether a sharded strategy's memory saving comes at no step-time cost (``slower``: its step over the
    baseline's, minus 1)."""
    if saved_bytes <= 0:
        return "no saving"
    if slower <= NO_COST_TOLERANCE:
        return "**saving at no step-time cost**"
    return f"saving costs {100 * slower:+.1f} % step time"


def _save(fig, path: Path) -> Path:
    """``fig`` written to ``path`` as a PNG, whole or not at all; returns ``path``."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return write_atomically(path, buffer.getvalue())


def _style(ax, xlabel: str, ylabel: str, compute_ms: Optional[float] = None, base: int = 10) -> None:
    """A plot's shared styling: log x axis, labels, grid; ``compute_ms``: the compute-only step as a dashed line."""
    if compute_ms is not None:
        ax.axhline(compute_ms, color="grey", linestyle="--", label="compute only")
    ax.set_xscale("log", base=base)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def write_plots(out_dir: Path, results: Sequence[StepResult], profile: ComputeProfile) -> list[Path]:
    """``share_vs_world.png`` and (with a bucketed strategy) ``step_vs_bucket.png``; returns their paths."""
    from matplotlib.figure import Figure  # a Figure saves through the Agg canvas without pyplot

    best = best_by_world_size(results)
    sizes = sorted({r.world_size for r in results})
    names = _variants(results)
    files = []

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    ax_share, ax_step = fig.subplots(1, 2)
    for name in names:
        points = [best[(name, n)] for n in sizes if (name, n) in best]
        xs = [r.world_size for r in points]
        ax_share.plot(xs, [100 * r.comm_share for r in points], marker="o", label=_title(name))
        ax_step.plot(xs, [r.step_ms for r in points], marker="o", label=_title(name))
    _style(ax_share, "world size (ranks)", "exposed communication share of step (%)", base=2)
    _style(ax_step, "world size (ranks)", "step time (ms)", profile.compute_ms, base=2)
    for ax in (ax_share, ax_step):
        ax.set_xticks(sizes, [str(n) for n in sizes])
    ax_step.set_ylim(bottom=0)
    ax_share.legend(fontsize=8)
    fig.suptitle(f"Projected step and communication share: {profile.label}")
    files.append(_save(fig, out_dir / "share_vs_world.png"))

    bucketed = [s for s in names if _entry(s).has_bucket_size]
    if bucketed:
        fig = Figure(figsize=(6 * len(bucketed), 4.5), layout="constrained")
        axes = fig.subplots(1, len(bucketed), squeeze=False)[0]
        for ax, name in zip(axes, bucketed):
            for n in sizes:
                points = sorted((r for r in results if r.variant == name and r.world_size == n),
                                key=lambda r: r.bucket_size_mb)
                line = ax.plot([r.bucket_size_mb for r in points], [r.step_ms for r in points], marker=".",
                               label=f"{n} ranks")
                b = best[(name, n)]
                ax.plot([b.bucket_size_mb], [b.step_ms], marker="*", markersize=12, color=line[0].get_color())
            _style(ax, "bucket size cap (MiB)", "step time (ms)", profile.compute_ms)
            ax.set_title(f"{name} (star: best size)")
            ax.legend(fontsize=8)
        files.append(_save(fig, out_dir / "step_vs_bucket.png"))
    return files
