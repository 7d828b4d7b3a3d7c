"""A run's folder in, a calibrated step model out: compute from ``compute_profile.json``, ``t = o + S / w`` per
collective from the timer's recorded calls (docs/advice.md, "Calibration")."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_ddp import hardware
from lightning_ddp.metrics.recording import SUMMARY_SCHEMA
from lightning_ddp.profile import ComputeProfile, read_profile
from lightning_ddp.projection.contention import CONTENTION, CPU_COPY_GBPS
from lightning_ddp.projection.simulators import StepModel
from lightning_ddp.sync.bucket_model import fit_latency_bandwidth

RERUN = "re-run the fit with this version of lightning_ddp (its CommTimer writes what advise reads)"


class RunError(ValueError):
    """RUN_DIR cannot be advised on; the message is the one line the command prints."""


@dataclass
class Run:
    """What advise needs from a CommTimer folder."""

    path: Path
    summary: dict[str, Any]
    profile: ComputeProfile
    medians: dict[str, float] = field(default_factory=dict)

    @property
    def info(self) -> dict[str, Any]:
        return self.summary["run"]

    @property
    def step_ms(self) -> float:
        return self.medians["step/time_ms"]

    def straggler_rank(self) -> int | None:
        """The rank named ``straggler/rank`` in most measured steps."""
        ranks = [s["straggler/rank"] for s in self.summary["steps"][self.summary["warmup_steps"]:]
                 if "straggler/rank" in s]
        return int(Counter(ranks).most_common(1)[0][0]) if ranks else None


def read_run(run_dir: str | Path) -> Run:
    """The run in ``run_dir``; ``RunError`` (one line naming the fix) for a folder advise cannot read."""
    path = Path(run_dir)
    if not path.is_dir():
        raise RunError(f"{path} is not a folder; pass the folder where the CommTimer wrote timing_summary.json")
    summary_path, profile_path = path / "timing_summary.json", path / "compute_profile.json"
    if not summary_path.is_file():
        raise RunError(f"{path} has no timing_summary.json: not a CommTimer folder (the fit's logger directory, e.g. "
                       "logs/<strategy>/version_0)")
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RunError(f"{summary_path} is unreadable ({error}); {RERUN}") from None
    if not isinstance(summary, dict) or summary.get("schema") != SUMMARY_SCHEMA:
        found = summary.get("schema", "none (version 1)") if isinstance(summary, dict) else "not an object"
        raise RunError(f"{summary_path} has schema {found}, advise reads {SUMMARY_SCHEMA}: {RERUN}")
    if not summary["collectives"] or summary["run"].get("world_size", 1) < 2:
        raise RunError(f"{summary_path} recorded no collectives (one rank, or a strategy whose calls the timer "
                       "cannot see): nothing to calibrate the network from")
    try:
        profile = read_profile(profile_path)
    except (OSError, ValueError) as error:
        raise RunError(f"{profile_path}: {error}; {RERUN}") from None
    medians = {key: value["median"] for key, value in summary["summary"].items()}
    return Run(path, summary, profile, medians)


def fit_calls(calls: list[dict[str, Any]]) -> tuple[dict[str, tuple[float, float]], list[str]]:
    """``{op: (o seconds, w bytes/s)}`` from the recorded calls (each size weighed by its count), and a note per op
    fitted on one size only."""
    by_op: dict[str, list[tuple[int, float]]] = {}
    for call in calls:
        if call["median_ms"] > 0 and call["bytes"] > 0:
            by_op.setdefault(call["op"], []).extend([(call["bytes"], call["median_ms"] / 1e3)] * call["count"])
    fits, notes, single = {}, [], {}
    for op, points in by_op.items():
        sizes, times = zip(*points)
        if len(set(sizes)) >= 2:
            o, w = fit_latency_bandwidth(sizes, times)
            if w != float("inf"):
                fits[op] = (o, w)
                continue
        single[op] = (statistics.median(sizes), statistics.median(times))
    for op, (size, seconds) in single.items():
        # One size cannot split o from w: keep the overhead of an op that was fitted (else none) and put the rest
        # of the time on bandwidth (docs/advice.md).
        o = min((f[0] for f in fits.values()), default=0.0)
        o = o if o < seconds else 0.0
        fits[op] = (o, size / (seconds - o))
        notes.append(f"{op}: one message size ({size / 2**20:.3g} MiB) only; o = {o * 1e3:.3g} ms taken from the "
                     "other collectives, the rest of its time counted as bandwidth")
    return fits, notes


@dataclass(frozen=True)
class FittedComm:
    """The projection's ``CommCost`` from the run's own fits, at the run's world size. An op the run did not issue
    is priced from the all-reduce fit as a ring does: ``o + S / (2 w)`` for reduce-scatter and all-gather.
    ``factor`` scales every time (the busy-time calibration)."""

    fits: dict[str, tuple[float, float]]
    factor: float = 1.0

    def _seconds(self, op: str, nbytes: float, n: int, half: bool = False) -> float:
        if n <= 1:
            return 0.0
        if op in self.fits:
            o, w = self.fits[op]
            return self.factor * (o + nbytes / w)
        o, w = self.fits.get("all_reduce", next(iter(self.fits.values())))
        return self.factor * (o + nbytes / (2 * w if half else w))

    def all_reduce_s(self, nbytes: float, n: int) -> float:
        return self._seconds("all_reduce", nbytes, n)

    def reduce_scatter_s(self, nbytes: float, n: int) -> float:
        return self._seconds("reduce_scatter", nbytes, n, half=True)

    def all_gather_s(self, nbytes: float, n: int) -> float:
        return self._seconds("all_gather", nbytes, n, half=True)

    def broadcast_s(self, nbytes: float, n: int) -> float:
        return self._seconds("broadcast", nbytes, n)


def copy_Bps(run: Run) -> float:
    """Buffer-copy bandwidth: the device table's memory bandwidth on a GPU, the CPU validation's on a CPU."""
    spec = hardware.find_device(str(run.info.get("device") or ""))
    return spec.memory_GBps * 1e9 if spec is not None else CPU_COPY_GBPS * 1e9


def step_model(run: Run, comm: Any, world_size: int | None = None) -> StepModel:
    """The projection's model of one step of ``run``: its compute profile, ``comm``, its backend's contention."""
    contention = CONTENTION.get(str(run.info.get("backend")), 0.0)
    return StepModel(run.profile, comm, world_size or run.info["world_size"], copy_Bps(run), contention=contention)
