"""The model against the published 2-GPU xl runs (``PUBLISHED_RUNS``): naive, overlap, flat and bucketed; writes
``published_xl_2gpu.md`` and ``.csv`` (docs/projection.md)."""

from __future__ import annotations

import dataclasses
import functools
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from lightning_ddp.files import write_atomically
from lightning_ddp.profile import ComputeProfile
from lightning_ddp.projection.comm import Fabric, get_fabric
from lightning_ddp.projection.flops import ADAMW_BYTES_PER_PARAM, ModelShape, get_gpu, modelled_profile
from lightning_ddp.projection.simulators import CONTENTION, StepModel, simulate, simulated_by
from lightning_ddp.projection.validate import contention_lines
from lightning_ddp.reporting.provenance import code_version
from lightning_ddp.reporting.tables import Column, csv_text, csv_value, markdown_table, read_csv, table, text_cell

XL_SHAPE = ModelShape.from_preset("xl")
"""The write-ups' xl: the preset ``lightning_ddp.model.PRESETS["xl"]`` itself (reading it imports torch)."""


@dataclass(frozen=True)
class PublishedRun:
    """One published run: the ``total time train``, ``total time grad all reduce`` and their ratio it printed."""

    strategy: str
    """The catalogue name of the engine the write-up ran (``STRATEGIES``)."""
    batch_size: int
    seq_len: int
    bucket_size_mb: Optional[float]
    """The bucket cap the bucketed run printed, MB; ``None`` for the others."""
    total_s: float
    """``total time train`` of one step, seconds."""
    comm_s: float
    """``total time grad all reduce`` of one step, seconds."""
    ratio: float
    """``comm_s / total_s`` as the write-up printed it (rounded there)."""
    source: str
    """The write-up it was transcribed from, by topic (``SOURCES``)."""


RUNS_CSV = Path(__file__).resolve().parents[2] / "configs" / "projection" / "published_xl_2gpu_runs.csv"
"""Every published measurement, one row per printed run (seconds per step), transcribed from the write-ups in their
order, each citing its write-up by topic. Naive at batch 4, context 512 ran out of memory and has no row."""


def _read_runs(path: Path) -> tuple[PublishedRun, ...]:
    """``RUNS_CSV``'s rows as ``PublishedRun``s, in its order."""
    runs = []
    for row in read_csv(path):
        runs.append(PublishedRun(
            strategy=row["strategy"], batch_size=int(row["batch_size"]), seq_len=int(row["seq_len"]),
            bucket_size_mb=float(row["bucket_size_mb"]) if row["bucket_size_mb"] else None,
            total_s=float(row["total_s"]), comm_s=float(row["comm_s"]), ratio=float(row["ratio"]),
            source=row["source"]))
    return tuple(runs)


PUBLISHED_RUNS = _read_runs(RUNS_CSV)
"""``RUNS_CSV`` read once at import, in its order."""
SOURCES = tuple(dict.fromkeys(run.source for run in PUBLISHED_RUNS))
"""The write-ups the numbers come from, one per strategy (``PublishedRun.source``)."""
STRATEGIES = tuple(simulated_by(layout)[0] for layout in ("none", "per_tensor", "packed", "bucketed"))
"""The published strategies by catalogue name (the entries these algorithms' models simulate)."""
NAIVE_DDP, OVERLAP_DDP, FLAT_DDP, BUCKETED_DDP = STRATEGIES


GPU = "a100-pcie-40gb"
"""The GPU assumed for the optimizer's and copies' memory bandwidth: the write-ups name none; a 40-48 GB PCIe card
fits their ~20 GB/s link and memory limit. At 80 % of its bandwidth; gradients fp32 (bf16-mixed)."""
MEMORY_EFFICIENCY = 0.8
"""The share of ``GPU``'s memory bandwidth the optimizer and the copies are taken to reach."""
LINKS = ("pcie_gen4", "nvlink4")
"""Links to predict on; the first is compared with the published runs (also with their per-call cost)."""


def calibrated_compute_ms() -> dict[tuple[int, int], tuple[float, bool]]:
    """(batch, context) -> (compute-only step in ms, extrapolated?), from naive's total minus its all-reduce time."""
    measured = {(r.batch_size, r.seq_len): 1e3 * (r.total_s - r.comm_s) for r in PUBLISHED_RUNS
                if r.strategy == NAIVE_DDP}
    tokens = [batch * context for batch, context in measured]
    slope, intercept = statistics.linear_regression(tokens, list(measured.values()))  # ms = intercept + slope * tokens
    compute = {}
    for batch, context in sorted({(r.batch_size, r.seq_len) for r in PUBLISHED_RUNS}):
        if (batch, context) in measured:
            compute[(batch, context)] = (measured[(batch, context)], False)
        else:
            compute[(batch, context)] = (intercept + slope * batch * context, True)
    return compute


def published_call_overhead_s(fabric: Fabric, copy_Bps: float, grad_bytes: int, tensors: int) -> float:
    """The per-call cost ``c`` with ``naive_comm - (flat_comm - copies) = (tensors - 1)(c + 2 alpha)`` at 2 ranks."""
    naive = {(r.batch_size, r.seq_len): r.comm_s for r in PUBLISHED_RUNS if r.strategy == NAIVE_DDP}
    flat = {(r.batch_size, r.seq_len): r.comm_s for r in PUBLISHED_RUNS if r.strategy == FLAT_DDP}
    copies_s = 4 * grad_bytes / copy_Bps
    differences = [naive[cell] - (flat[cell] - copies_s) for cell in naive if cell in flat]
    return max(0.0, _mean(differences) / (tensors - 1) - 2 * fabric.intra.latency_s)


def prediction_fabrics(gpu: str = GPU) -> dict[str, Fabric]:
    """Label -> fabric of every prediction column: the ``LINKS`` presets, the first also with the per-call cost the
    published runs imply (``published_call_overhead_s``)."""
    first = get_fabric(LINKS[0])
    sample = _profile(1, 1, 10_000.0, gpu)
    c = published_call_overhead_s(first, _copy_Bps(gpu), sample.grad_bytes, len(sample.params))
    described = f"{first.description}, per-call cost {c * 1e6:.0f} us from naive - flat"
    published = dataclasses.replace(first, call_overhead_s=c, description=described)
    return {LINKS[0]: first, f"{LINKS[0]}+published_c": published, **{name: get_fabric(name) for name in LINKS[1:]}}


def _copy_Bps(gpu: str) -> float:
    """Bytes per second of the copies (and the optimizer) on ``gpu``: its memory bandwidth at ``MEMORY_EFFICIENCY``."""
    return get_gpu(gpu).memory_Bps * MEMORY_EFFICIENCY


def _profile(batch_size: int, seq_len: int, compute_ms: float, gpu: str) -> ComputeProfile:
    """The xl's modelled profile on 2 ranks of ``gpu``, its compute-only step calibrated to ``compute_ms``."""
    return modelled_profile(XL_SHAPE, batch_size, seq_len, gpu=gpu, memory_efficiency=MEMORY_EFFICIENCY,
                            calibrate_step_ms=compute_ms, preset="xl", world_size=2)


def compare_with_published(gpu: str = GPU, contention: float = 0.0,
                           fabrics: Optional[dict[str, Fabric]] = None) -> list[dict[str, Any]]:
    """Every published run as a row of ``published_xl_2gpu.csv`` (unrounded): what it printed, its calibrated
    compute, the unexplained time (published step minus compute and the run's own communication) and, per fabric
    ``<label>`` (default ``prediction_fabrics``; ``+`` as ``_``), the model's ``<label>_step_ms``, ``_exposed_ms``
    (waited) and ``_share``."""
    compute = calibrated_compute_ms()
    fabrics = fabrics or prediction_fabrics(gpu)
    rows = []
    for run in PUBLISHED_RUNS:
        compute_ms, extrapolated = compute[(run.batch_size, run.seq_len)]
        profile = _profile(run.batch_size, run.seq_len, compute_ms, gpu)
        row = {"strategy": run.strategy, "bucket_size_mb": run.bucket_size_mb, "batch_size": run.batch_size,
               "seq_len": run.seq_len, "published_step_ms": 1e3 * run.total_s, "published_comm_ms": 1e3 * run.comm_s,
               "published_share": run.ratio, "compute_ms": compute_ms, "compute_extrapolated": extrapolated,
               "unexplained_ms": 1e3 * (run.total_s - run.comm_s) - compute_ms, "source": run.source}
        for label, fabric in fabrics.items():
            model = StepModel(profile=profile, comm=fabric, world_size=2, copy_bandwidth_Bps=_copy_Bps(gpu),
                              contention=contention)
            r = simulate(run.strategy, model, run.bucket_size_mb)
            name = label.replace("+", "_")
            row.update({f"{name}_step_ms": r.step_ms, f"{name}_exposed_ms": r.waited_comm_ms,
                        f"{name}_share": r.wait_share})
        rows.append(row)
    return rows


def _mean(values: Sequence[float]) -> float:
    """The mean of ``values``; NaN for none."""
    return statistics.fmean(values) if values else float("nan")


def _inputs_lines(gpu: str, fabrics: dict[str, Fabric]) -> list[str]:
    """The model, the calibrated compute per (batch, context), the split of the step and the links."""
    link = next(iter(fabrics))
    spec = get_gpu(gpu)
    sample = _profile(2, 128, 10_000.0, gpu)
    grad_gb = sample.grad_bytes / 1e9
    flat = [r for r in PUBLISHED_RUNS if r.strategy == FLAT_DDP]
    implied = _mean([sample.grad_bytes / r.comm_s / 1e9 for r in flat])
    lines = [
        "## Inputs",
        "",
        f"- **Model**: xl, {len(sample.params)} gradient tensors, {grad_gb:.3f} GB of fp32 gradients per step.",
        "- **Compute, calibrated to the published runs** (naive's step minus its all-reduce time):",
        "",
    ]
    note = " (extrapolated linearly in tokens: naive ran out of memory)"
    rows = [[b, t, f"{ms:.1f} ms" + (note if extrapolated else "")]
            for (b, t), (ms, extrapolated) in calibrated_compute_ms().items()]
    lines += ["  " + line for line in markdown_table(["batch", "context", "compute-only step"], rows, "rrr")]
    lines += [
        "",
        f"- **Split of that step**: optimizer {sample.optimizer_ms:.1f} ms (foreach AdamW, "
        f"{ADAMW_BYTES_PER_PARAM:g} B/param at {MEMORY_EFFICIENCY:g} x "
        f"{spec.memory_Bps / 1e9:,.0f} GB/s of an assumed {spec.name}); forward and backward share the rest 1 : 2.",
        f"- **Link**: the published flat all-reduce of {grad_gb:.2f} GB took {_mean([r.comm_s for r in flat]):.3f} s "
        f"on average, {implied:.1f} GB/s including the pack copies: the comparison is `{link}`.",
    ]
    for label, fabric in fabrics.items():
        described = f"  - `{label}`: {fabric.describe()}"
        if "+" in label:  # a preset changed by what the published runs imply: say how
            described += f" ({fabric.description})"
        lines.append(described)
    return lines + [""]


LinkCell = tuple[str, Callable[[dict[str, Any], str], str]]
"""A column of ``published``'s or a link's numbers: its header and its cell of (row, the numbers' key prefix)."""


def _number(suffix: str, spec: str, scale: float = 1, unit: str = "") -> Callable[[dict[str, Any], str], str]:
    """The cell of a row's ``<name><suffix>`` number, times ``scale``, in ``spec``, then ``unit``."""
    return lambda row, name: f"{scale * row[name + suffix]:{spec}}{unit}"


def _share_minus_published(row: dict[str, Any], name: str) -> str:
    """A link's predicted comm share minus the published one, in percentage points."""
    return f"{100 * (row[name + '_share'] - row['published_share']):+.1f}"


STEP: LinkCell = ("step", _number("_step_ms", ".0f", unit=" ms"))
SHARE: LinkCell = ("share", _number("_share", ".1f", 100, " %"))
EXPOSED: LinkCell = ("exposed", _number("_exposed_ms", ".0f", unit=" ms"))
SHARE_ERROR: LinkCell = ("error", _number("_error", ".1f", 100, " pts"))
PUBLISHED = [STEP, ("comm", _number("_comm_ms", ".0f", unit=" ms")), SHARE]


def _columns(label: str, cells: Sequence[LinkCell]) -> list[Column]:
    """``cells`` of the columns named ``label`` (``+`` as ``_``), the first header prefixed with ``label``."""
    name = label.replace("+", "_")
    columns = []
    for title, cell in cells:
        header = title if columns else f"{label}: {title}"
        columns.append(Column(header, functools.partial(cell, name=name)))
    return columns


def _runs_table(comparisons: Sequence[dict[str, Any]], labels: list[str]) -> list[str]:
    """One row per published run: what it printed, the prediction on each link, the unexplained time."""
    compared = [STEP, EXPOSED, SHARE, ("share - published", _share_minus_published)]
    columns = [Column("strategy", text_cell("strategy"), "l"), Column("bucket", _bucket),
               Column("batch", text_cell("batch_size")), Column("context", text_cell("seq_len")),
               *_columns("published", PUBLISHED), *_columns(labels[0], compared)]
    for label in labels[1:]:
        columns += _columns(label, [STEP, SHARE])
    columns.append(Column("unexplained", _unexplained))
    footnote = "\\* compute extrapolated (naive ran out of memory at batch 4, context 512)."
    return ["## Every published run beside the prediction", "", *table(columns, comparisons), "", footnote, ""]


def _bucket(row: dict[str, Any]) -> str:
    """The row's bucket size as the tables print it; empty for a strategy without one."""
    return "" if row["bucket_size_mb"] is None else f"{row['bucket_size_mb']:g}"


def _unexplained(row: dict[str, Any]) -> str:
    """The published step minus its compute and its own communication; ``*`` where the compute is extrapolated."""
    text = f"{row['unexplained_ms']:+.0f} ms"
    return text + " *" if row.get("compute_extrapolated") else text


def _summary_table(comparisons: Sequence[dict[str, Any]], labels: list[str]) -> list[str]:
    """Per strategy, means over its runs (batch 4 x context 512, extrapolated, left out) on every link, with the share
    error on the compared one."""
    rows = []
    for strategy in (NAIVE_DDP, FLAT_DDP, OVERLAP_DDP, BUCKETED_DDP):
        cs = [c for c in comparisons if c["strategy"] == strategy and not c["compute_extrapolated"]]
        if not cs:
            continue
        row: dict[str, Any] = {"strategy": strategy}
        for key, value in cs[0].items():
            if type(value) is not float:  # a number (not a flag, a name or a missing bucket size)
                continue
            row[key] = _mean([c[key] for c in cs])
            if key.endswith("_share"):  # <label>_error: the mean |share - published share|
                row[key.replace("_share", "_error")] = _mean([abs(c[key] - c["published_share"]) for c in cs])
        rows.append(row)
    columns = [Column("strategy", text_cell("strategy"), "l"), *_columns("published", PUBLISHED)]
    for label in labels:  # the share error on the compared link (and its variant with the published per-call cost)
        compared = label.startswith(labels[0])
        columns += _columns(label, [STEP, SHARE, SHARE_ERROR] if compared else [STEP, SHARE])
    columns.append(Column("unexplained", _unexplained))
    return ["## Summary per strategy (batch 4 x context 512 left out)", "", *table(columns, rows)]


def pcie_rows(contention: float) -> list[dict[str, Any]]:
    """The published runs whose compute was not extrapolated as measured rows (as ``validate``'s cells) beside their
    prediction on ``pcie_gen4`` with ``contention``."""
    comparisons = compare_with_published(contention=contention, fabrics={"pcie_gen4": get_fabric("pcie_gen4")})
    return [{"strategy": c["strategy"], "batch_size": c["batch_size"], "measured_step_ms": c["published_step_ms"],
             "measured_share": c["published_share"], "predicted_step_ms": c["pcie_gen4_step_ms"],
             "predicted_share": c["pcie_gen4_share"]} for c in comparisons if not c["compute_extrapolated"]]


def write_comparison(out: str | Path = "benchmarks/results/projection", gpu: str = GPU) -> list[Path]:
    """Compare the projection with the published 2-GPU xl runs and write published_xl_2gpu.md and .csv.

    Args:
        out: Directory for published_xl_2gpu.md and published_xl_2gpu.csv.
        gpu: The GPU assumed for the optimizer's and copies' memory bandwidth (the write-ups do not name theirs).
    """
    comparisons = compare_with_published(gpu)
    rows = [{column: _csv_cell(column, value) for column, value in c.items()} for c in comparisons]
    fabrics = prediction_fabrics(gpu)
    s = CONTENTION["nccl"]
    command = f"python -m lightning_ddp.projection.published --out {out}"
    if gpu != GPU:
        command += f" --gpu {gpu}"
    markdown = "\n".join([
        "# The projection against the published 2-GPU xl runs", "",
        f"Generated by `{command}`, at {code_version()}. The recipe, the columns and what the comparison shows: "
        "docs/projection.md.", "",
        *_inputs_lines(gpu, fabrics), *_runs_table(comparisons, list(fabrics)),
        *_summary_table(comparisons, list(fabrics)), "",
        *contention_lines("NCCL", s, "runs' wait shares on `pcie_gen4`; batch 4 x context 512 left out",
                          pcie_rows(0.0), pcie_rows(s), ["mean \\|share error\\|", "mean step error"],
                          by_strategy=True),
    ])
    return [write_atomically(Path(out) / "published_xl_2gpu.md", markdown),
            write_atomically(Path(out) / "published_xl_2gpu.csv", csv_text(rows, list(rows[0])))]


def _csv_cell(column: str, value: Any) -> Any:
    """A comparison's value as ``published_xl_2gpu.csv`` writes it: ms to 2 decimals, shares to 4."""
    if column == "bucket_size_mb" and value is not None:
        return f"{value:g}"
    return csv_value(value, 4 if column.endswith("_share") else 2)


if __name__ == "__main__":
    from jsonargparse import auto_cli

    for path in auto_cli(write_comparison, prog="python -m lightning_ddp.projection.published"):
        print(path)
