"""``python -m lightning_ddp.projection.validate``: the projection against this project's own CPU sweep, written to
``cpu_sweep_validation.csv`` and ``.md`` (docs/projection.md)."""

from __future__ import annotations

import functools
import itertools
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from jsonargparse import auto_cli
from jsonargparse.typing import NonNegativeFloat

from lightning_ddp import catalogue
from lightning_ddp.files import write_atomically
from lightning_ddp.profile import ComputeProfile
from lightning_ddp.projection.comm import read_fit
from lightning_ddp.projection.simulators import (
    CONTENTION,
    StepModel,
    StepResult,
    model_settings,
    simulate,
    simulated_by,
    simulated_names,
)
from lightning_ddp.reporting import variants
from lightning_ddp.reporting.provenance import code_version
from lightning_ddp.reporting.tables import csv_text, markdown_table, read_csv

GOAL_MEDIAN_ABS_ERROR = 0.15
"""The goal: median |predicted - measured| / measured step time within 15 %."""
FIT_BATCH = 2
"""The fitting subset: cells with this per-rank batch size; the others are held out."""

S_MAX = 1.0
"""The largest ``s`` the fit considers: compute at half speed beside a collective (docs/projection.md)."""


def read_sweep(sweep: str | Path) -> tuple[list[dict[str, str]], dict[str, Any], Path]:
    """A sweep's ``(results.csv rows, profiles.json, the path of bucket_prediction.json)``."""
    sweep = Path(sweep)
    for name in ("results.csv", "profiles.json", "bucket_prediction.json"):
        if not (sweep / name).is_file():
            raise ValueError(f"{sweep / name} is missing; run the sweep first (python -m lightning_ddp.bench --config "
                             "configs/bench/cpu.yaml) or point at a sweep directory such as benchmarks/results/cpu")
    profiles = json.loads((sweep / "profiles.json").read_text(encoding="utf-8"))
    return read_csv(sweep / "results.csv"), profiles, sweep / "bucket_prediction.json"


def _float(value: str | None) -> float | None:
    """A CSV cell as a number; ``None`` for an empty cell or text that is not one."""
    try:
        return float(value) if value not in (None, "") else None
    except ValueError:
        return None


def measure_copy_bandwidth() -> float:
    """Bytes read + written per second of a 64 MiB contiguous ``copy_`` on this machine (median of 5)."""
    import timeit

    import torch

    src, dst = torch.ones(2**24), torch.empty(2**24)
    dst.copy_(src)  # warm-up: page faults
    copy = functools.partial(dst.copy_, src)
    return 2 * src.nbytes / statistics.median(timeit.repeat(copy, number=1, repeat=5))


def validate_cells(rows: list[dict[str, str]], profiles: dict[str, dict[str, Any]], fit_path: Path,
                   copy_Bps: float, contention: float = 0.0) -> list[dict[str, Any]]:
    """One dict per ok cell with a profile and a simulated strategy: measured and predicted step and (wait) share;
    a cell whose model needs shapes its profile lacks is left out, said on stderr."""
    comm = read_fit(fit_path).fabric()
    reference = {(r["precision"], r["batch_size"], r["context_length"]): profiles.get(r["cell_id"])
                 for r in rows if r["strategy"] == "reference"}
    simulated = simulated_names()
    out = []
    for r in rows:
        if r["status"] != "ok" or r["strategy"] not in simulated or r["cell_id"] not in profiles:
            continue
        size = _float(r.get("resolved_bucket_size_mb")) or _float(r.get("bucket_size_mb"))
        world = int(r["world_size"])
        own = ComputeProfile.from_dict(profiles[r["cell_id"]], origin=f"profile of {r['cell_id']}")
        modelled = model_settings(r["strategy"])
        settings = {k: v for k, v in variants.parse_settings(r.get("engine_settings") or "").items() if k in modelled}
        size_arg = size if catalogue.get(r["strategy"]).has_bucket_size else None

        def predict(profile: ComputeProfile) -> StepResult | None:
            """The cell simulated from ``profile``; None where the model needs shapes the profile lacks."""
            try:
                model = StepModel(profile=profile, comm=comm, world_size=world, copy_bandwidth_Bps=copy_Bps,
                                  contention=contention)
                return simulate(r["strategy"], model, size_arg, **settings)
            except ValueError as error:
                if profile.has_shapes:
                    raise
                if profile is own:
                    print(f"not simulated: {r['cell_id']}: {error}", file=sys.stderr)
                return None

        predicted = predict(own)
        if predicted is None:
            continue
        row: dict[str, Any] = {
            "cell_id": r["cell_id"], "strategy": r["strategy"], "bucket_size_mb": size or "",
            "engine_settings": r.get("engine_settings") or "",
            "batch_size": int(r["batch_size"]), "context_length": int(r["context_length"]),
            "precision": r["precision"],
            "measured_step_ms": float(r["step_ms_median"]), "measured_step_lo": _float(r.get("step_ms_lo")),
            "measured_step_hi": _float(r.get("step_ms_hi")), "measured_share": _float(r.get("comm_share")),
            "predicted_step_ms": predicted.step_ms, "predicted_share": predicted.wait_share,
        }
        row["step_error"] = row["predicted_step_ms"] / row["measured_step_ms"] - 1
        ref = reference.get((r["precision"], r["batch_size"], r["context_length"]))
        from_reference = predict(ComputeProfile.from_dict(ref, origin="reference profile")) if ref else None
        if from_reference is not None:
            row["predicted_step_ms_from_reference"] = from_reference.step_ms
            row["step_error_from_reference"] = from_reference.step_ms / row["measured_step_ms"] - 1
        out.append(row)
    return out


def _groups(cells: Iterable[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    """``cells`` by (precision, batch size, context length): the cells that ran the same model step."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault((c["precision"], c["batch_size"], c["context_length"]), []).append(c)
    return groups


def ranking_agreement(cells: list[dict[str, Any]]) -> tuple[int, int, list[str]]:
    """``(agree, pairs, disagreements)`` over the pairs of a group's cells whose measured intervals do not overlap."""
    agree = pairs = 0
    disagreements = []
    for a, b in (pair for group in _groups(cells).values() for pair in itertools.combinations(group, 2)):
        if None in (a["measured_step_lo"], a["measured_step_hi"], b["measured_step_lo"], b["measured_step_hi"]):
            continue
        if a["measured_step_hi"] < b["measured_step_lo"]:
            faster, slower = a, b
        elif b["measured_step_hi"] < a["measured_step_lo"]:
            faster, slower = b, a
        else:
            continue  # the measurement cannot order them
        pairs += 1
        if faster["predicted_step_ms"] < slower["predicted_step_ms"]:
            agree += 1
        else:
            disagreements.append(f"{_name(faster)} < {_name(slower)} (b{faster['batch_size']} "
                                 f"t{faster['context_length']})")
    return agree, pairs, disagreements


def _name(cell: dict[str, Any]) -> str:
    """A cell as the report names it: ``bucketed_ddp@4 rank=4``."""
    name = cell["strategy"]
    if isinstance(cell["bucket_size_mb"], float):
        name += f"@{cell['bucket_size_mb']:g}"
    if cell.get("engine_settings"):
        name += f" {cell['engine_settings']}"
    return name


def compare_auto(cells: list[dict[str, Any]], profiles: dict[str, dict[str, Any]], fit_path: Path, copy_Bps: float,
                 sqrt_rule_mb: float | None) -> list[list[str]]:
    """The ``bucket_size_mb: auto`` table's rows: per group, the square-root rule's size and the projection's best
    power of 2 from 0.25 to 32 MiB, each with the step measured at the nearest measured size; the best measured."""
    comm = read_fit(fit_path).fabric()
    bucketed = simulated_by("bucketed")[0]
    rows = []
    sized = [c for c in cells if c["strategy"] == bucketed and isinstance(c["bucket_size_mb"], float)]
    for (precision, batch, context), group in _groups(sized).items():
        best_measured = min(group, key=lambda c: c["measured_step_ms"])
        profile = ComputeProfile.from_dict(profiles[best_measured["cell_id"]])
        model = StepModel(profile=profile, comm=comm, world_size=2, copy_bandwidth_Bps=copy_Bps)
        predicted = {size: simulate(bucketed, model, size).step_ms for size in (0.25, 0.5, 1, 2, 4, 8, 16, 32)}
        projection_mb = min(predicted, key=predicted.get)

        def measured_at(size: float | None) -> str:
            if size is None:
                return "-"
            return _measured(min(group, key=lambda c: abs(math.log(c["bucket_size_mb"]) - math.log(size))))

        rows.append([f"{precision} b{batch} t{context}", f"{_fmt(sqrt_rule_mb, '.3g')} MiB", measured_at(sqrt_rule_mb),
                     f"{projection_mb:g} MiB", measured_at(projection_mb), _measured(best_measured)])
    return rows


def _fmt(value: float | None, spec: str) -> str:
    """``value`` in ``spec``; ``-`` for ``None``."""
    return "-" if value is None else format(value, spec)


def build_markdown(cells: list[dict[str, Any]], auto: list[list[str]], copy_Bps: float, command: str,
                   fit: dict[str, Any]) -> str:
    """cpu_sweep_validation.md: the step-time error against the goal, its bias, the ranking, every cell, and the
    square-root rule's bucket size against the projection's."""
    signed = [c["step_error"] for c in cells]
    errors = [abs(e) for e in signed]
    ref_errors = [abs(c["step_error_from_reference"]) for c in cells if "step_error_from_reference" in c]
    agree, pairs, disagreements = ranking_agreement(cells)
    not_agreeing = f"; not: {'; '.join(disagreements)}." if disagreements else "."
    headline = "No cell could be predicted (no profiles)."
    bias = ""
    if cells:
        median_error = statistics.median(errors)
        verdict = "met" if median_error <= GOAL_MEDIAN_ABS_ERROR else "missed"
        headline = (f"**Median |predicted - measured| / measured step time: {100 * median_error:.1f} %** over "
                    f"{len(errors)} cells (goal: within {100 * GOAL_MEDIAN_ABS_ERROR:.0f} %: **{verdict}**); largest "
                    f"{100 * max(errors):.1f} %.")
        bias = (f"Bias: {sum(1 for e in signed if e < 0)} of {len(signed)} cells are predicted faster than measured "
                f"(median signed error {100 * statistics.median(signed):+.1f} %), with contention "
                "(docs/projection.md).")
    from_reference = ""
    if ref_errors:
        median_from_reference = 100 * statistics.median(ref_errors)
        from_reference = f"From the group's reference profile instead: median error {median_from_reference:.1f} %."
    lines = [
        "# The projection against the CPU sweep", "",
        f"Command: `{command}`, at {code_version()}. All-reduce fit of the sweep: o = "
        f"{fit['overhead_s'] * 1e3:.3f} ms per call, w = {fit['bandwidth_Bps'] / 1e9:.3f} GB/s; copies at "
        f"{copy_Bps / 1e9:.2f} GB/s (read + written, measured here). How to read this report: docs/projection.md.", "",
        headline, "",
        bias, "",
        from_reference, "",
        f"**Ranking**: of the {pairs} pairs of cells whose measured 95 % intervals do not overlap, the prediction "
        f"orders {agree} the same way{not_agreeing}", "",
    ]
    header = ["cell", "measured step ms [95 %]", "predicted", "error", "from reference", "measured share",
              "predicted share"]
    lines += markdown_table(header, [_cell_row(c) for c in cells], "lrrrrrr")
    lines += ["", "## `bucket_size_mb: auto`: the square-root rule against the projection's choice", ""]
    header = ["group", "sqrt rule", "measured there", "projection", "measured there", "best measured"]
    return "\n".join(lines + markdown_table(header, auto, "lrrrrr")) + "\n"


def _cell_row(c: dict[str, Any]) -> list[str]:
    """A row of the cells' table: measured and predicted step, the errors, measured and predicted share."""
    from_reference = 100 * c["step_error_from_reference"] if "step_error_from_reference" in c else None
    measured_share = 100 * c["measured_share"] if c["measured_share"] is not None else None
    return [f"{_name(c)} b{c['batch_size']} t{c['context_length']}", _interval(c), f"{c['predicted_step_ms']:.1f}",
            f"{100 * c['step_error']:+.1f} %", f"{_fmt(from_reference, '+.1f')} %",
            f"{_fmt(measured_share, '.1f')} %", f"{100 * c['predicted_share']:.1f} %"]


def _interval(cell: dict[str, Any]) -> str:
    """The measured step with its 95 % interval: ``12.3 [11.9, 12.8]``."""
    low, high = _fmt(cell["measured_step_lo"], ".1f"), _fmt(cell["measured_step_hi"], ".1f")
    return f"{cell['measured_step_ms']:.1f} [{low}, {high}]"


def _measured(cell: dict[str, Any]) -> str:
    return f"{_interval(cell)} ({_name(cell)})"


def validate_sweep(sweep: str = "benchmarks/results/cpu", out: str = "benchmarks/results/projection",
                   copy_GBps: Optional[float] = None, contention: NonNegativeFloat = CONTENTION["gloo"]) -> int:
    """Simulate every ok cell of a sweep and compare with what it measured; write cpu_sweep_validation.{csv,md}.

    Args:
        sweep: A sweep's output directory (``results.csv``, ``profiles.json``, ``bucket_prediction.json``).
        out: Where the validation goes.
        copy_GBps: Copy bandwidth, GB/s (read + written); default: measured here.
        contention: Compute slowed by ``1 + contention`` while a collective runs; default: gloo's fitted value
            (``simulators.CONTENTION``). The report also gives the errors without it.
    """
    command = f"python -m lightning_ddp.projection.validate --sweep {sweep} --out {out}"
    if copy_GBps:
        command += f" --copy_GBps {copy_GBps:g}"
    if contention != CONTENTION["gloo"]:
        command += f" --contention {contention:g}"
    try:
        rows, profiles, fit_path = read_sweep(sweep)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    fit = json.loads(fit_path.read_text())
    copy_Bps = copy_GBps * 1e9 if copy_GBps else measure_copy_bandwidth()
    before = validate_cells(rows, profiles, fit_path, copy_Bps)
    cells = validate_cells(rows, profiles, fit_path, copy_Bps, contention)
    for cell, plain in zip(cells, before):
        cell["predicted_step_ms_without_contention"] = plain["predicted_step_ms"]
    sqrt_mb = fit["bucket_bytes"] / 2**20 if fit.get("bucket_bytes") else None
    auto = compare_auto(cells, profiles, fit_path, copy_Bps, sqrt_mb)
    out_dir = Path(out)
    columns = list(dict.fromkeys(k for c in cells for k in c))
    write_atomically(out_dir / "cpu_sweep_validation.csv", csv_text(cells, columns))
    markdown = build_markdown(cells, auto, copy_Bps, command, fit)
    markdown += "\n" + "\n".join(contention_lines(
        "gloo", contention, "cells' step times", before, cells,
        ["too fast", "median \\|step error\\|", "mean \\|step error\\|", "mean \\|share error\\|"], by_strategy=False))
    write_atomically(out_dir / "cpu_sweep_validation.md", markdown)
    print(markdown)
    return 0


# ---- contention before and after, for both validations: rows with predicted_/measured_ step_ms and share ---------


Rows = Sequence[dict[str, Any]]
"""Rows with ``predicted_step_ms``, ``measured_step_ms``, ``predicted_share`` and ``measured_share`` (``None``: not
measured), from either validation."""


def error_metrics(rows: Rows) -> dict[str, str]:
    """What the before -> after tables can show of ``rows``, by column title. A step error is predicted / measured
    - 1 (negative: predicted too fast); a share error, |predicted - measured| comm share over the rows that measured
    one (``-`` where none did)."""
    step_errors = [r["predicted_step_ms"] / r["measured_step_ms"] - 1 for r in rows]
    share_errors = [abs(r["predicted_share"] - r["measured_share"]) for r in rows if r["measured_share"] is not None]
    mean_share_error = f"{100 * statistics.fmean(share_errors):.1f} pts" if share_errors else "-"
    return {
        "too fast": f"{sum(1 for e in step_errors if e < 0)}/{len(rows)}",
        "median \\|step error\\|": f"{100 * statistics.median(map(abs, step_errors)):.1f} %",
        "mean \\|step error\\|": f"{100 * statistics.fmean(map(abs, step_errors)):.1f} %",
        "mean step error": f"{100 * statistics.fmean(step_errors):+.1f} %",
        "mean \\|share error\\|": mean_share_error,
    }


SUBSETS = (("all", None), (f"fitting subset (batch {FIT_BATCH})", True), ("held out (other batches)", False))
"""The before -> after tables' rows: all, the fitting subset and the held-out rows (on the fitting batch or not)."""


def contention_lines(backend: str, s: float, fitted_on: str, before: Sequence[dict[str, Any]],
                     after: Sequence[dict[str, Any]], metrics: Sequence[str], by_strategy: bool) -> list[str]:
    """Markdown: ``metrics`` (titles of ``error_metrics``) of the rows predicted without contention (``before``) ->
    with ``s`` (``after``, the same rows in the same order) on all rows, the fitting subset and the held-out rows (per
    strategy if ``by_strategy``)."""
    strategies = list(dict.fromkeys(r["strategy"] for r in before)) if by_strategy else ["all"]
    rows = []
    for subset, on_fitting_batch in SUBSETS:
        for strategy in strategies:
            was, now = [], []
            for row_before, row_after in zip(before, after):
                in_subset = on_fitting_batch is None or (row_before["batch_size"] == FIT_BATCH) == on_fitting_batch
                if in_subset and strategy in ("all", row_before["strategy"]):
                    was.append(row_before)
                    now.append(row_after)
            metrics_before, metrics_after = error_metrics(was), error_metrics(now)
            rows.append([subset, strategy, len(was), *(f"{metrics_before[m]} -> {metrics_after[m]}" for m in metrics)])
    return [
        "## Contention: compute slowed while collectives run", "",
        f"{backend}'s `s` = {s:g}, fitted on the batch-{FIT_BATCH} {fitted_on} (at most `S_MAX` = {S_MAX:g}; "
        "docs/projection.md, \"Contention\"). Before (s = 0) -> after:", "",
        *markdown_table(["subset", "strategy", "rows", *metrics], rows, "llr" + "r" * len(metrics)), "",
    ]


if __name__ == "__main__":
    sys.exit(auto_cli(validate_sweep, prog="python -m lightning_ddp.projection.validate"))
