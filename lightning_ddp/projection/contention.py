"""Compute slowed while collectives run: the contention factor ``s`` per backend, and the fit that gives it.

``CONTENTION`` holds what ``python -m lightning_ddp.projection.contention_fit`` prints (``test_project.py`` refits it).
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Optional, Sequence

CONTENTION: dict[str, float] = {"gloo": 1.0, "nccl": 0.36}
"""Fitted ``s`` per backend (``python -m lightning_ddp.projection.contention_fit`` prints them)."""

CPU_COPY_GBPS = 24.03
"""Copy bandwidth of the CPU validation (GB/s read + written, measured once on the sweep's machine and recorded in
``benchmarks/results/projection/cpu_sweep_validation.md``); fixed so that the fit is reproducible anywhere."""

FIT_BATCH = 2
"""The fitting subset: cells with this per-rank batch size; the others are held out."""

S_MAX = 1.0
"""The largest ``s`` the fit considers: compute at half speed beside a collective (docs/projection.md)."""

GRID = (0.0, S_MAX, 0.05)
"""Coarse grid of ``s``: start, stop, step; refined to 0.01 around the best point (within ``[0, S_MAX]``)."""


def backend_contention(backend: str) -> float:
    """The fitted ``s`` of ``backend`` (``gloo``, ``nccl``); an unknown one names the known ones."""
    try:
        return CONTENTION[backend]
    except KeyError:
        raise ValueError(f"no fitted contention for backend {backend!r}; known: {', '.join(CONTENTION)} (or give "
                         "`network.contention` as a number)") from None


def fit_contention(loss: Callable[[float], float]) -> float:
    """The ``s`` of ``GRID`` (then 0.01 steps around the best) with the smallest ``loss(s)``, rounded to 0.01.

    >>> fit_contention(lambda s: (s - 0.37) ** 2)
    0.37
    """
    start, stop, step = GRID
    coarse = [start + k * step for k in range(int(round((stop - start) / step)) + 1)]
    best = min(coarse, key=loss)
    fine = [round(best + k * 0.01, 2) for k in range(-5, 6) if 0 <= best + k * 0.01 <= stop + 1e-9]
    return round(min(fine, key=loss), 2)


def _mean_squared_log(pairs: Sequence[tuple[float, float]]) -> float:
    return statistics.fmean(math.log(p / m) ** 2 for p, m in pairs) if pairs else 0.0


# ---- before and after, for the validation reports ----------------------------------------------------------------


def _errors(pairs: Sequence[tuple[float, float]]) -> str:
    """``k/N too fast, median |error| x %, mean |error| y %`` of (predicted, measured) step times."""
    if not pairs:
        return "no cells"
    errors = [p / m - 1 for p, m in pairs]
    fast = sum(1 for e in errors if e < 0)
    median = statistics.median(map(abs, errors))
    return (f"{fast}/{len(errors)} predicted too fast, median |error| {100 * median:.1f} %, "
            f"mean |error| {100 * statistics.fmean(map(abs, errors)):.1f} %")


def cpu_contention_lines(before: Sequence[dict[str, Any]], after: Sequence[dict[str, Any]],
                         contention: float) -> list[str]:
    """Markdown lines: the CPU validation's step errors without and with contention, on all cells and held out."""
    def pairs(cells: Sequence[dict[str, Any]], held_out: Optional[bool]) -> list[tuple[float, float]]:
        return [(c["predicted_step_ms"], c["measured_step_ms"]) for c in cells
                if held_out is None or (c["batch_size"] != FIT_BATCH) == held_out]

    def share(cells: Sequence[dict[str, Any]]) -> str:
        errors = [abs(c["predicted_share"] - c["measured_share"]) for c in cells if c["measured_share"] is not None]
        return f"{100 * statistics.fmean(errors):.1f} points" if errors else "-"

    return [
        "## Contention: compute slowed while collectives run", "",
        f"gloo's `s` = {contention:g} (fitted on the batch-{FIT_BATCH} cells' step times, at most `S_MAX` = "
        f"{S_MAX:g}; the table above is with it; docs/projection.md, \"Contention\"). Before (s = 0) -> after:", "",
        f"- all {len(after)} cells: {_errors(pairs(before, None))} -> {_errors(pairs(after, None))}",
        f"- fitting subset (batch {FIT_BATCH}): {_errors(pairs(before, False))} -> {_errors(pairs(after, False))}",
        f"- held out (the other batch sizes): {_errors(pairs(before, True))} -> {_errors(pairs(after, True))}",
        f"- mean |share error| (the CommTimer's wait share): {share(before)} -> {share(after)}", "",
    ]
