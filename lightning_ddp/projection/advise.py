"""``python -m lightning_ddp advise RUN_DIR``: what to change, predicted from the run's own CommTimer files.

Calibrates the projection to the run, simulates every catalogue alternative and writes ``advice.json`` and
``advice.md`` into RUN_DIR: the projection, calibrated to one run. How each step works: docs/advice.md.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_ddp import catalogue, hardware
from lightning_ddp.files import write_atomically, write_json_atomically
from lightning_ddp.metrics.recording import SUMMARY_SCHEMA
from lightning_ddp.profile import ComputeProfile, read_profile
from lightning_ddp.projection.comm import MeasuredFit, get_fabric
from lightning_ddp.projection.run import project
from lightning_ddp.projection.simulators import (
    CONTENTION, CPU_COPY_GBPS, StepModel, StepResult, best_by_world_size, simulate, simulated_names,
)
from lightning_ddp.reporting import variants
from lightning_ddp.reporting.tables import markdown_table
from lightning_ddp.run_folders import run_folder
from lightning_ddp.sync.bucket_model import fit_latency_bandwidth, optimal_bucket_bytes
from lightning_ddp.sync.memory_model import MiB

RERUN = "re-run the fit with this version of lightning_ddp (its CommTimer writes what advise reads)"
"""The fix a ``RunError`` names for a CommTimer file that is missing, unreadable or of another schema."""


class RunError(ValueError):
    """RUN_DIR cannot be advised on; the message is the one line the command prints."""


@dataclass
class Run:
    """What advise needs from a CommTimer folder."""

    path: Path
    """The run's folder: where the CommTimer wrote timing_summary.json and compute_profile.json."""
    summary: dict[str, Any]
    """timing_summary.json as read (``SUMMARY_SCHEMA``): ``run``, ``steps``, ``summary``, ``collectives``."""
    profile: ComputeProfile
    """compute_profile.json: the run's step on one rank, each gradient's ready time in backward."""
    medians: dict[str, float]
    """CommTimer key -> its median over the measured steps, e.g. ``step/time_ms``."""

    @property
    def info(self) -> dict[str, Any]:
        """The summary's ``run`` record: strategy, world size, backend, device, bucket size, hparams."""
        return self.summary["run"]

    @property
    def device(self) -> hardware.DeviceSpec | None:
        """The run's device in the hardware table; ``None`` for a CPU or a device not in it."""
        return hardware.find_device(str(self.info.get("device") or ""))

    @property
    def step_ms(self) -> float:
        """The median measured step, ms."""
        return self.medians["step/time_ms"]

    @property
    def measured_steps(self) -> list[dict[str, float]]:
        """The steps the summary's medians are of: those after ``warmup_steps``."""
        return self.summary["steps"][self.summary["warmup_steps"]:]

    def straggler_rank(self) -> int | None:
        """The rank named ``straggler/rank`` in most measured steps."""
        ranks = [s["straggler/rank"] for s in self.measured_steps if "straggler/rank" in s]
        return int(Counter(ranks).most_common(1)[0][0]) if ranks else None

    def step_spread(self) -> float:
        """How widely the measured step times spread: their median absolute deviation from the median, times
        1.4826 (a normal distribution's sigma), over the median; robust to the odd slow step."""
        times = [s["step/time_ms"] for s in self.measured_steps if "step/time_ms" in s]
        middle = statistics.median(times)
        return 1.4826 * statistics.median(abs(t - middle) for t in times) / middle


def read_run(run_dir: str | Path) -> Run:
    """The run in ``run_dir`` (a logger's folder: its latest run with a ``timing_summary.json``,
    ``lightning_ddp.run_folders``); ``RunError`` (one line naming the fix) for a folder advise cannot read."""
    try:
        path = run_folder(run_dir, lambda folder: (folder / "timing_summary.json").is_file(), "timing_summary.json",
                          "pass the folder where the CommTimer wrote it (the fit's logger directory, e.g. "
                          "logs/<strategy>/version_0)")
    except ValueError as error:
        raise RunError(str(error)) from None
    summary_path, profile_path = path / "timing_summary.json", path / "compute_profile.json"
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
    return Run(path=path, summary=summary, profile=profile, medians=medians)


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


def all_reduce_fit(fits: dict[str, tuple[float, float]]) -> tuple[float, float]:
    """The all-reduce's ``(o, w)``; a run that issued none (ZeRO's reduce-scatter and all-gather): its first op's."""
    return fits.get("all_reduce") or next(iter(fits.values()))


@dataclass(frozen=True)
class FittedComm:
    """The projection's ``CommCost`` from the run's own fits, at the run's world size. An op the run did not issue
    is priced from the all-reduce fit as a ring does: ``o + S / (2 w)`` for reduce-scatter and all-gather.
    ``factor`` scales every time (the busy-time calibration)."""

    fits: dict[str, tuple[float, float]]
    """Op -> ``(o seconds, w bytes/s)``, fitted to the run's own collectives (``fit_calls``)."""
    factor: float = 1.0
    """Multiplies every time (``Calibration.comm_factor``); 1: the fits as they are."""

    def collective_s(self, op: str, nbytes: float, n: int) -> float:
        """Seconds for one ``op`` of ``nbytes`` on ``n`` ranks; 0 on one rank."""
        if n <= 1:
            return 0.0
        o, w = self.fits.get(op) or all_reduce_fit(self.fits)
        ring = 2 if op in ("reduce_scatter", "all_gather") and op not in self.fits else 1  # half an all-reduce
        return self.factor * (o + nbytes / (ring * w))


def step_model(run: Run, comm: Any) -> StepModel:
    """One step of ``run`` as the projection models it, copies at its device's memory bandwidth (a CPU: measured)."""
    spec = run.device
    copy_GBps = spec.memory_GBps if spec is not None else CPU_COPY_GBPS
    contention = CONTENTION.get(str(run.info.get("backend")), 0.0)
    return StepModel(profile=run.profile, comm=comm, world_size=run.info["world_size"],
                     copy_bandwidth_Bps=copy_GBps * 1e9, contention=contention)


BUCKET_SIZES_MB: tuple[float, ...] = (1, 2, 4, 8, 16, 25, 50)  # tried for every strategy that takes one, and auto
# Half-width of every interval, relative, for a quiet run: the median |error| of self-calibrated predictions in the
# committed CPU validation (benchmarks/results/projection/cpu_sweep_validation.csv; test_advice.py recomputes it).
PROJECTION_ERROR = 0.119
# The step spread (Run.step_spread) of quiet runs: the median and the largest over the committed straggler
# benchmark's 24 quickstart runs on 2 otherwise idle cores (benchmarks/results/straggler/steps.csv; test_advice.py
# recomputes both). A run that spreads more widens its intervals in proportion; one above NOISY_SPREAD is not advised.
QUIET_SPREAD = 0.099
NOISY_SPREAD = 0.156
STRAGGLER_SHARE = 0.5  # a straggler is named when waiting for the slowest rank is over this share of exposed time ...
STRAGGLER_STEP_SHARE = 0.05  # ... and of the step: a few ms of jitter behind a well-hidden sync is no straggler
MEMORY_NEAR = 0.8  # sharding is priced when the run's peak memory is above this share of the device's


def fit_arguments(run: Run, name: str, bucket: float | str | None) -> dict[str, Any]:
    """How to apply a strategy: ``fit_args`` for our CLI, a YAML fragment, and ``Trainer(strategy=...)``."""
    value = catalogue.get(name).strategy_argument(bucket_size_mb=bucket)
    text = json.dumps(value)
    arguments = ", ".join(f"{k}={v!r}" for k, v in value["init_args"].items())
    return {"fit_args": ["--trainer.strategy", text] if run.info.get("cli") else [],
            "yaml": f"trainer:\n  strategy: {text}\n",
            "python": f"Trainer(strategy={value['class_path']}({arguments}))"}


def interval_half_width(step_spread: float) -> float:
    """``PROJECTION_ERROR``, widened by how much more the run's steps spread than a quiet run's."""
    return PROJECTION_ERROR * max(1.0, step_spread / QUIET_SPREAD)


@dataclass(frozen=True)
class Calibration:
    """The model of the run's step, and the factors that make it reproduce the run (docs/advice.md)."""

    fits: dict[str, tuple[float, float]]  # per op, (o seconds, w bytes/s)
    notes: list[str]
    """What the fits and the calibration had to assume, one line each, for advice.md."""
    model: StepModel  # the run's step, every collective's time multiplied by comm_factor
    comm_factor: float
    """Measured busy communication (less waiting for a late rank) over the simulated; 1 when
    the strategy has no projection model or nothing was busy."""
    scale: float  # measured step / the current strategy's simulated step
    auto_bucket_mb: float  # what bucket_size_mb auto comes to with the run's o and w
    current_bucket: float | str | None  # the run's bucket size (its strategy's default if unrecorded); None: none
    current: StepResult | None  # the run's strategy simulated; None when it has no projection model


def current_bucket_size(run: Run) -> float | str | None:
    """The run's bucket size as recorded (its strategy's default where it was not); ``None``: no buckets."""
    entry = catalogue.get(run.info["strategy"])
    if not entry.has_bucket_size:
        return None
    size = run.info.get("bucket_size_mb")
    return entry.default_bucket_size_mb if size is None else size


def calibrate(run: Run) -> Calibration:
    """Fit the run's collectives, then scale the communication to its busy time and every step to its step."""
    fits, notes = fit_calls(run.summary["collectives"])
    strategy, bucket = run.info["strategy"], current_bucket_size(run)
    modelled = strategy in simulated_names()
    # the current strategy's busy time as measured, less waiting for a late rank (no cost of the wire)
    busy_ms = (run.medians.get("comm/busy_ms") or 0.0) - (run.medians.get("comm/wait_ms") or 0.0)
    comm_factor = 1.0
    if modelled and busy_ms > 0:
        comm_factor = busy_ms / simulate(strategy, step_model(run, FittedComm(fits)), bucket).busy_comm_ms
    model = step_model(run, FittedComm(fits, comm_factor))
    o, w = all_reduce_fit(fits)
    auto_mb = optimal_bucket_bytes(run.profile.grad_bytes, o, w, max(p.bytes for p in run.profile.params)) / MiB
    current = simulate(strategy, model, bucket) if modelled else None
    if current is None:
        notes.append(f"{strategy} has no projection model: predictions are not calibrated to the run")
    return Calibration(fits=fits, notes=notes, model=model, comm_factor=comm_factor,
                       scale=run.step_ms / current.step_ms if current else 1.0, auto_bucket_mb=auto_mb,
                       current_bucket=bucket, current=current)


def candidates(run: Run, calibration: Calibration) -> list[tuple[str, float | str | None, float | None]]:
    """``(strategy, bucket size applied, bucket size simulated)``: every simulated strategy, those with buckets at
    each of ``BUCKET_SIZES_MB`` and ``auto``, and the run's own if no other is it (e.g. a resolved ``auto``)."""
    found: list[tuple[str, float | str | None, float | None]] = []
    for name in simulated_names():
        if catalogue.get(name).has_bucket_size:
            found += [(name, size, float(size)) for size in BUCKET_SIZES_MB]
            found.append((name, "auto", calibration.auto_bucket_mb))
        else:
            found.append((name, None, None))
    strategy, bucket = run.info["strategy"], calibration.current_bucket
    if calibration.current is not None and not any(
            name == strategy and size_equal(size, bucket) for name, size, _ in found):
        found.append((strategy, bucket, bucket))
    return found


def prediction_row(run: Run, calibration: Calibration, name: str, bucket: float | str | None, result: StepResult,
                   half_width: float) -> dict[str, Any]:
    """One row of ``recommendations`` (docs/advice.md defines every field)."""
    entry = catalogue.get(name)
    predicted = result.step_ms * calibration.scale
    interval = [predicted * (1 - half_width), predicted * (1 + half_width)]
    current = (calibration.current is not None and name == run.info["strategy"]
               and size_equal(bucket, calibration.current_bucket))
    return {"strategy": name, "settings": {"bucket_size_mb": bucket} if bucket is not None else {},
            "exact": entry.exact, "sharded": entry.sharded, "current": current,
            "predicted_step_ms": predicted, "predicted_step_interval": interval,
            # the share as the CommTimer measures comm/share: time waited for communication over the step (compute
            # slowed beside a collective is in the step, not in the share)
            "predicted_share": result.wait_share, "measured_share": run.medians.get("comm/share") if current else None,
            "gain": run.step_ms / predicted - 1, "gain_interval": [run.step_ms / hi - 1 for hi in interval[::-1]],
            "memory_GiB": result.memory_bytes / 2**30, **fit_arguments(run, name, bucket)}


def predict(run: Run, calibration: Calibration, half_width: float) -> tuple[list[dict[str, Any]], list[str]]:
    """Every candidate's row, fastest first, and a line per candidate the projection cannot simulate."""
    rows, not_predicted = [], []
    for name, bucket, size in candidates(run, calibration):
        try:
            result = simulate(name, calibration.model, size)
        except ValueError as error:  # e.g. FSDP2's blocks on a model without numbered layers
            not_predicted.append(f"{name}: {error}")
            continue
        rows.append(prediction_row(run, calibration, name, bucket, result, half_width))
    rows.sort(key=lambda row: row["predicted_step_ms"])
    return rows, not_predicted


def reading_order(rows: list[dict[str, Any]], verdict: dict[str, Any]) -> list[dict[str, Any]]:
    """What the verdict recommends first (its change, else the current row), then the exact rows, then the lossy
    ones, each fastest first."""
    first = verdict["top"] or next((row for row in rows if row["current"]), None)
    rest = sorted((row for row in rows if row is not first), key=lambda row: not row["exact"])  # stable: by step
    return [first, *rest] if first is not None else rest


def _scales(run: Run, calibration: Calibration, world_sizes: Sequence[int], network: str | None) -> dict[str, list]:
    """The best variants at other world sizes: the all-reduce fit extrapolated, or a fabric preset (not scaled)."""
    o, w = all_reduce_fit(calibration.fits)
    comm = get_fabric(network) if network else MeasuredFit(o, w, run.info["world_size"]).fabric()
    model = step_model(run, comm)
    factor = 1.0 if network else calibration.scale
    results = project(run.profile, comm, simulated_names(), list(world_sizes), BUCKET_SIZES_MB,
                      model.copy_bandwidth_Bps, contention=model.contention)
    out: dict[str, list] = {}
    for (variant, n), r in sorted(best_by_world_size(results).items(), key=lambda item: item[1].step_ms):
        out.setdefault(str(n), []).append({"strategy": variant, "bucket_size_mb": r.bucket_size_mb,
                                           "predicted_step_ms": r.step_ms * factor, "predicted_share": r.wait_share})
    return out


def advise(run: Run, world_sizes: Sequence[int] = (), network: str | None = None,
           device_memory_gib: float | None = None) -> dict[str, Any]:
    """advice.json's document for ``run`` (docs/advice.md defines every field)."""
    calibration = calibrate(run)
    spread = run.step_spread()
    half_width = interval_half_width(spread)
    rows, not_predicted = predict(run, calibration, half_width)
    current_bytes = calibration.current.memory_bytes if calibration.current is not None else None
    verdict = _verdict(run, rows, current_bytes, device_memory_gib)
    document = {"run": {"path": str(run.path), "strategy": run.info["strategy"],
                        "bucket_size_mb": run.info.get("bucket_size_mb"), "world_size": run.info["world_size"],
                        "backend": run.info.get("backend"), "cli": bool(run.info.get("cli")), "step_ms": run.step_ms,
                        "exposed_ms": run.medians.get("comm/exposed_ms"), "share": run.medians.get("comm/share"),
                        "measured_steps": len(run.measured_steps), "step_spread": spread},
                "calibration": {"fits": {op: {"overhead_s": o, "bandwidth_Bps": w}
                                         for op, (o, w) in calibration.fits.items()},
                                "comm_factor": calibration.comm_factor, "scale": calibration.scale,
                                "contention": calibration.model.contention,
                                "auto_bucket_mb": calibration.auto_bucket_mb, "projection_error": PROJECTION_ERROR,
                                "quiet_spread": QUIET_SPREAD, "interval_half_width": half_width,
                                "notes": calibration.notes},
                "recommendations": reading_order(rows, verdict), "not_predicted": not_predicted, "verdict": verdict}
    if world_sizes:
        document["scales"] = _scales(run, calibration, world_sizes, network)
    return document


def size_equal(a: float | str | None, b: float | str | None) -> bool:
    """Two bucket sizes are the same setting: equal, or numbers within 1e-6 MiB."""
    return a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) < 1e-6)


def _verdict(run: Run, rows: list[dict[str, Any]], current_bytes: int | None,
             device_memory_gib: float | None) -> dict[str, Any]:
    """``action`` (change, keep, noisy or straggler), one line saying why, and the straggler and memory findings;
    ``rows`` fastest first."""
    better = [r for r in rows if r["exact"] and not r["current"] and r["predicted_step_interval"][1] < run.step_ms]
    verdict: dict[str, Any] = {"action": "change" if better else "keep", "top": better[0] if better else None}
    verdict["text"] = (f"change to {_label(better[0])}: {better[0]['gain']:+.0%} predicted" if better else
                       "keep: no exact alternative is predicted faster beyond its interval")
    spread = run.step_spread()
    if spread > NOISY_SPREAD:
        verdict.update(action="noisy", top=None, text=(
            f"too noisy to advise from: its {len(run.measured_steps)} measured steps spread +-{spread:.0%} (quiet "
            f"runs: +-{QUIET_SPREAD:.0%}, at most +-{NOISY_SPREAD:.0%}); was something else running? Fit again on "
            "a quiet machine and advise on that run"))
    exposed, wait = run.medians.get("comm/exposed_ms") or 0.0, run.medians.get("comm/wait_ms") or 0.0
    rank = run.straggler_rank()
    if wait > STRAGGLER_SHARE * exposed and wait > STRAGGLER_STEP_SHARE * run.step_ms and rank is not None:
        verdict.update(action="straggler", top=None, straggler={"rank": rank, "wait_ms": wait, "exposed_ms": exposed})
        verdict["text"] = (f"straggler: rank {rank} makes the others wait {wait:.1f} of {exposed:.1f} exposed ms; "
                           "no strategy fixes a straggler: find what slows that rank")
    device_gib = device_memory_gib or (run.device.memory_GB * 1e9 / 2**30 if run.device is not None else None)
    peak_gib = (run.medians.get("memory/peak_MiB") or 0.0) / 1024
    if device_gib and peak_gib >= MEMORY_NEAR * device_gib and current_bytes is not None:
        saves: dict[str, float] = {}  # per sharded strategy, at its setting that keeps the least
        for r in rows:
            if r["sharded"]:
                saves[r["strategy"]] = max(saves.get(r["strategy"], -1e9), current_bytes / 2**30 - r["memory_GiB"])
        verdict["memory"] = {"peak_GiB": peak_gib, "device_GiB": device_gib, "sharding_saves_GiB": saves}
    return verdict


def _label(row: dict[str, Any]) -> str:
    """The row's variant with its bucket size, as advice.md names it."""
    return variants.variant_label(row["strategy"], row["settings"].get("bucket_size_mb"))


SHOWN = 12  # rows of advice.md's table, each strategy at its best setting and the current one (advice.json has all)


def _row(r: dict[str, Any]) -> list[str]:
    """A row of advice.md's table: the variant, its flags, predicted step, share, gain and memory."""
    lo, hi = r["predicted_step_interval"]
    glo, ghi = r["gain_interval"]
    flags = " ".join(flag for flag, on in (("current", r["current"]), ("lossy", not r["exact"]),
                                            ("sharded", r["sharded"])) if on)
    share = f"{r['predicted_share']:.1%}"
    if r["measured_share"] is not None:
        share = f"{r['measured_share']:.1%} measured (model {share})"
    return [_label(r), flags or "-", f"{r['predicted_step_ms']:.1f} [{lo:.1f}, {hi:.1f}]", share,
            f"{r['gain']:+.0%} [{glo:+.0%}, {ghi:+.0%}]", f"{r['memory_GiB']:.3f}"]


def shown_rows(recommendations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table's rows: the current one and each other strategy's first (its best setting), in reading order."""
    shown, seen = [], set()
    for row in recommendations:
        if row["current"]:
            shown.append(row)
        elif row["strategy"] not in seen:
            seen.add(row["strategy"])
            shown.append(row)
    return shown[:SHOWN]


def interval_note(calibration: dict[str, Any], run: dict[str, Any]) -> str:
    """How wide the intervals are and why."""
    half, error, spread = calibration["interval_half_width"], calibration["projection_error"], run["step_spread"]
    widened = (f"the projection's +-{error:.1%} widened x{half / error:.2f}, as this run's steps spread "
               f"+-{spread:.0%} against a quiet run's +-{calibration['quiet_spread']:.0%}" if half > error else
               f"the projection's error (this run's steps spread +-{spread:.0%}, a quiet run's +-"
               f"{calibration['quiet_spread']:.0%})")
    return f"Intervals: +-{half:.1%}, {widened} (docs/advice.md)."


def render_markdown(document: dict[str, Any]) -> str:
    """The verdict, how to apply it, and the recommended row first."""
    run, calibration, verdict = document["run"], document["calibration"], document["verdict"]
    lines = [f"# Advice for {run['path']}", "",
             f"Current: {run['strategy']} on {run['world_size']} ranks ({run['backend']}), step {run['step_ms']:.1f} "
             f"ms, exposed communication {run['exposed_ms'] or 0:.1f} ms.", "", f"**Verdict: {verdict['text']}.**", ""]
    top = verdict.get("top")
    if top is not None and verdict["action"] == "change":
        applied = " ".join(top["fit_args"][:1] + [f"'{a}'" for a in top["fit_args"][1:]])
        lines += [f"Apply: `{applied}`" if applied else f"Apply: `{top['python']}`", "",
                  "```yaml", top["yaml"].rstrip(), "```", ""]
    for name, saved in verdict.get("memory", {}).get("sharding_saves_GiB", {}).items():
        lines.append(f"- memory: {name} saves {saved:.2f} GiB per rank")
    lines += markdown_table(["strategy", "", "predicted step ms [interval]", "exposed share (comm/share)",
                             "gain [interval]", "state GiB/rank"], map(_row, shown_rows(document["recommendations"])),
                            align="llrrrr")
    lines += ["", f"{interval_note(calibration, run)} Communication scaled x{calibration['comm_factor']:.3g} to the "
              f"measured busy time, the step x{calibration['scale']:.3g} to the measured step; the shares are the "
              "model's (the step is calibrated, the split of it is not).",
              *[f"- {note}" for note in calibration["notes"]]]
    for n, best in document.get("scales", {}).items():
        lines.append(f"- {n} ranks: " + "; ".join(
            f"{b['strategy']} {b['predicted_step_ms']:.1f} ms" for b in best[:3]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Advise on RUN_DIR: print advice.md, write it and advice.json there; a bad folder is one line, exit 2."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog="python -m lightning_ddp advise", description=__doc__)
    parser.add_argument("run_dir", help="the folder where the CommTimer wrote timing_summary.json")
    parser.add_argument("--world_sizes", type=list[int], default=[], help="also project to these world sizes")
    parser.add_argument("--network", type=Optional[str], default=None,
                        help="a fabric preset for --world_sizes (default: the run's all-reduce fit)")
    parser.add_argument("--device_memory_gib", type=Optional[float], default=None,
                        help="the device's memory (a CPU run's is not known)")
    args = parser.parse_args(argv)
    try:
        document = advise(read_run(args.run_dir), args.world_sizes, args.network, args.device_memory_gib)
    except ValueError as error:  # RunError: RUN_DIR; else an option (an unknown --network)
        print(f"error: {error}", file=sys.stderr)
        return 2
    markdown = render_markdown(document)
    write_json_atomically(Path(args.run_dir) / "advice.json", document, allow_nan=False)
    write_atomically(Path(args.run_dir) / "advice.md", markdown)
    print(markdown)
    return 0
