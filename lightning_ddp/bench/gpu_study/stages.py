"""The GPU study's ``STAGES``: each one's ``run`` (``StudyContext`` -> ``StageResult``, its processes stopped at
``ctx.stage_deadline()``), estimates and results.md caption and tables; docs/gpu.md says what each measures."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple, Union

import torch

from lightning_ddp import catalogue
from lightning_ddp.bench.gpu_study import GPUStudyConfig, Scale
from lightning_ddp.bench.gpu_study.processes import FitResult, FitSpec, run_fits
from lightning_ddp.bench.launch import REFERENCE, base_environment, error_line, run_processes, strategy_argument
from lightning_ddp.bench.study import read_json
from lightning_ddp.files import write_json_atomically
from lightning_ddp.projection.published import PUBLISHED_RUNS, calibrated_compute_ms
from lightning_ddp.provenance import COMMIT_VARIABLE

DOCS = "../../../docs/gpu.md"
"""docs/gpu.md from results.md in ``benchmarks/results/gpu-<h100|h200>/``, where the recipe puts it."""


class Ran(NamedTuple):
    """How a process ended: its exit code, whether it ran out of time, its error line, the JSON it wrote."""

    code: int | None
    timed_out: bool
    error: str
    data: Any = None


@dataclass
class StudyContext:
    """What every stage gets: the config, where to write, the clock, and how to start processes."""

    config: GPUStudyConfig
    scale: Scale
    out: Path
    root: Path  # the repository checkout (configs/, tests/)
    cuda: bool  # whether a child process saw a CUDA device (the study's own process holds no CUDA context)
    deadline: float  # time.monotonic() at which the budget ends
    log: Callable[[str], None] = print
    stage_estimate_s: float = 0.0  # the running stage's estimate and start, set by the study
    stage_started: float = 0.0

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def stage_deadline(self) -> float:
        """Seconds this stage's processes may still run: the budget left, at most max(1.5 x, 60 s +) its estimate."""
        allowed = max(1.5 * self.stage_estimate_s, self.stage_estimate_s + 60.0)
        return max(0.0, min(self.remaining(), self.stage_started + allowed - time.monotonic()))

    def stage_dir(self, name: str) -> Path:
        path = self.out / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def relative(self, path: Path) -> str:
        """``path`` relative to the study's folder, as stages.json lists files."""
        return path.resolve().relative_to(self.out.resolve()).as_posix()

    def threads(self, ranks: int) -> int | None:
        """``OMP_NUM_THREADS`` of each of ``ranks`` CPU processes (the cores shared out); unset on a GPU."""
        return max(1, (os.cpu_count() or 1) // ranks) if self.scale.device == "cpu" else None

    def env(self) -> dict[str, str]:
        """Every process's extra environment: the checkout first on PYTHONPATH, ``--commit`` (a copy has no .git)."""
        path = os.pathsep.join(p for p in (str(self.root), os.environ.get("PYTHONPATH", "")) if p)
        return {"PYTHONPATH": path, **({COMMIT_VARIABLE: self.config.commit} if self.config.commit else {})}

    def run_python(self, args: list[str], log: Path, result: Path | None = None) -> Ran:
        """``python ARGS`` in the checkout until the stage's deadline, output to ``log``; it writes ``result``."""
        log.parent.mkdir(parents=True, exist_ok=True)
        ended = run_processes([sys.executable, *args], [base_environment(self.threads(1), extra=self.env())], [log],
                              max(self.stage_deadline(), 1.0), cwd=str(self.root))
        code = ended.returncodes[0]
        if code == 0:
            data = read_json(result, missing_ok=True) if result else None
            return Ran(0, False, f"no {result.name}" if result and data is None else "", data)
        line = error_line(log.read_text(encoding="utf-8", errors="replace") if log.exists() else "")
        return Ran(code, ended.timed_out, line or ("timed out" if ended.timed_out else f"exited {code}"))

    def fits(self, name: str, specs: list[FitSpec], ranks: int = 1) -> list[FitResult]:
        """``run_fits`` into ``<out>/<name>/``, bounded by the stage's deadline."""
        return run_fits(specs, self.stage_dir(name), ranks=ranks, timeout_s=self.stage_deadline(),
                        cwd=str(self.root), env=self.env(), threads=self.threads(ranks))


@dataclass
class StageResult:
    """What a stage produced: ``data`` for results.md, the ``files`` it wrote (relative to ``out``), ``problems``."""

    data: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


Cell = Union[str, Callable[[dict[str, Any], dict[str, Any]], Any]]  # a row's key, or f(row, stage data)


class Table(NamedTuple):
    """A table of results.md: its rows in the stage's data (a ``str.format`` field or ``f(data)``; a dict's rows get
    their key as ``name``), its columns (header, ``Cell``, format spec: Python's, ``GiB`` for bytes), a line before."""

    rows: Union[str, Callable[[dict[str, Any]], Any]]
    columns: tuple[tuple[str, Cell, str], ...]
    intro: str = ""


@dataclass(frozen=True)
class Stage:
    """One stage: seconds on one H100 or H200 and in the dry run on 2 cores (start-up included), whether it needs a
    GPU, and how results.md renders its data: ``caption`` (``str.format`` over it) and ``tables``."""

    name: str
    title: str
    estimate_s: float
    dry_run_estimate_s: float
    needs_cuda: bool
    run: Callable[[StudyContext], StageResult]
    caption: str = ""
    tables: tuple[Table, ...] = ()

    def estimate(self, dry_run: bool) -> float:
        return self.dry_run_estimate_s if dry_run else self.estimate_s


# ---- shared pieces ---------------------------------------------------------------------------------------------


def fit_args(ctx: StudyContext, *, preset: str, batch: int, seq_len: int, steps: int, warmup: int, strategy: str,
             precision: str | None = None, ranks: int = 1, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The arguments after ``fit`` of one fit on the study's device, every step timed; ``ranks`` share it over gloo."""
    return (
        "--seed_everything", "0", "--model.preset", preset, "--model.context_length", str(seq_len),
        "--data.source", "synthetic", "--data.seq_len", str(seq_len), "--data.batch_size", str(batch),
        "--trainer.accelerator", ctx.scale.device, "--trainer.devices", "1", "--trainer.num_nodes", str(ranks),
        "--trainer.strategy", strategy_argument(strategy, ctx.scale.backend if ranks == 1 else "gloo"),
        "--trainer.precision", precision or ctx.scale.precision,
        "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
        "--trainer.log_every_n_steps", "1", "--trainer.enable_checkpointing", "false",
        "--timer.warmup_steps", str(warmup), "--timer.every_n_steps", "1", *extra,
    )


def _failures(results: list[FitResult], where: str = "") -> list[str]:
    return [f"{r.name}{where}: {r.status}: {r.error}" for r in results if not r.ok]


def published(batch: int = 0, seq_len: int = 0) -> Cell:
    """A cell: ``step ms, comm share`` of the published 2-GPU xl run of the row's strategy at (batch, context), else
    at the row's (else the stage's), at its best bucket size; ``–`` where there is none."""

    def cell(row: dict[str, Any], data: dict[str, Any]) -> str:
        at = (row.get("strategy") or row.get("name"), batch or int(row.get("batch_size") or data.get("batch") or 0),
              seq_len or int(row.get("context_length") or data.get("seq_len") or 0))
        runs = [r for r in PUBLISHED_RUNS if (r.strategy, r.batch_size, r.seq_len) == at]
        if not runs:
            return "–"
        best = min(runs, key=lambda r: r.total_s)
        bucket = f" ({best.bucket_size_mb:g} MB)" if best.bucket_size_mb is not None else ""
        return f"{best.total_s * 1e3:,.0f} ms, {best.ratio:.0%} comm{bucket}"

    return cell


STATUS = ("status", lambda row, data: "ok" if row.get("status") == "ok"
          else f"{row.get('status')}: {row.get('error') or row.get('reason')}", "")  # a sweep row's error: reason


# ---- the stages -----------------------------------------------------------------------------------------------


def environment(ctx: StudyContext) -> StageResult:
    path = ctx.out / "environment.json"
    ran = ctx.run_python(["-m", "lightning_ddp.bench.gpu_study.processes", "environment", str(path.resolve()),
                          "--device", ctx.scale.device], ctx.out / "logs" / "environment.log", path)
    return StageResult(data=ran.data or {}, problems=[] if ran.data else [ran.error])  # the study writes <name>.json


def _tally(outcomes: list[tuple[str, str, str]]) -> dict[str, Any]:
    """The counts of each outcome and the failures (``{"test", "message"}``) of (test, outcome, message) triples."""
    counts = {key: sum(o == key for _, o, _ in outcomes) for key in ("passed", "failed", "errors", "skipped")}
    failures = [{"test": test, "message": message} for test, outcome, message in outcomes
                if outcome in ("failed", "errors")]
    return {"tests": len(outcomes), **counts, "failures": failures}


def read_junit(path: Path) -> dict[str, Any]:
    """The counts and failures (``_tally``) of a pytest ``--junitxml`` report."""
    outcomes = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag, key in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            element = case.find(tag)
            if element is not None:
                lines = (element.get("message") or element.text or "").strip().splitlines()
                outcome, message = key, lines[0][:300] if lines else ""
                break
        outcomes.append((f"{case.get('classname', '')}::{case.get('name', '')}", outcome, message))
    return _tally(outcomes)


# A -v line: "tests/a.py::test_x PASSED [ 50%]", or under pytest-xdist "[gw0] [ 50%] PASSED tests/a.py::test_x".
_OUTCOME = re.compile(r"^(?:(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b|\[gw\d+\] \[ *\d+%\] "
                      r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+::\S+))", re.MULTILINE)
_OUTCOME_KEY = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped",
                "XFAIL": "skipped"}


def outcomes_from_log(text: str) -> dict[str, Any]:
    """The counts and failures from ``pytest -v`` output, for a run cut off before it wrote its junit report."""
    found = [(test or xdist_test, outcome or xdist_outcome) for test, outcome, xdist_outcome, xdist_test
             in _OUTCOME.findall(text)]
    return _tally([(test, _OUTCOME_KEY[outcome], outcome.lower()) for test, outcome in found])


def cuda_tests(ctx: StudyContext) -> StageResult:
    if not (ctx.root / "tests" / "gpu").is_dir():
        return StageResult(problems=[f"the cuda test tier (tests/gpu) is not under {ctx.root}: run the study from a "
                                     "checkout of the repository, or pass --root CHECKOUT"])
    report, log = ctx.out / "cuda_tests.xml", ctx.out / "cuda_tests.log"
    # 4 pytest-xdist workers where xdist is installed; the engine matrix stays in one (xdist_group)
    workers = ["-p", "xdist", "-n", "4", "--dist", "loadgroup"] if importlib.util.find_spec("xdist") else []
    ran = ctx.run_python(["-m", "pytest", "tests/gpu", "-m", "cuda", "-v", "-rfE", "-p", "no:cacheprovider",
                          f"--junitxml={report.resolve()}", *workers], log)
    text = log.read_text(errors="replace") if log.exists() else ""
    summary_line = next((line for line in reversed(text.splitlines()) if " in " in line
                         and any(w in line for w in ("passed", "failed", "error", "skipped"))), "").strip("= ")
    if report.exists():
        data = read_junit(report)
    elif _OUTCOME.search(text):  # cut off before the junit report: what the -v lines say so far
        data = outcomes_from_log(text)
    else:
        return StageResult(files=["cuda_tests.log"], problems=[ran.error or "pytest wrote no report"])
    data.update(summary_line=summary_line, exit_code=ran.code, timed_out=ran.timed_out)
    problems = [f"{f['test']}: {f['message']}" for f in data["failures"]]
    if problems:
        problems[0] = f"{len(problems)} of {data['tests']} failed, first: {problems[0]}"
    if ran.timed_out:
        problems.insert(0, f"the tier ran out of time ({summary_line or 'no summary'})")
    elif data["tests"] and data["skipped"] == data["tests"]:
        problems.append("every test of the tier was skipped: pytest saw no CUDA device")
    return StageResult(data=data, files=[p.name for p in (report, log) if p.exists()], problems=problems)


def compute(ctx: StudyContext) -> StageResult:
    stage, scale = ctx.stage_dir("compute"), ctx.scale.compute
    published_ms = [f"batch {batch}: {ms:,.0f} ms = {batch * seq / (ms / 1e3):,.0f} tokens/s per GPU"
                    + (" (extrapolated)" if extrapolated else "")
                    for (batch, seq), (ms, extrapolated) in calibrated_compute_ms().items() if seq == scale["seq_len"]]
    result = StageResult(data={"preset": scale["preset"], "seq_len": scale["seq_len"],
                               "published": "; ".join(published_ms) or "none at this context", "runs": {}})
    for precision in ("bf16-mixed", "32-true"):
        request, out = stage / f"request_{precision}.json", stage / f"compute_{precision}.json"
        write_json_atomically(request, {**scale, "precision": precision, "device": ctx.scale.device,
                                        "out": str(out.resolve())})
        ran = ctx.run_python(["-m", "lightning_ddp.bench.gpu_study.processes", "compute", "--config",
                              str(request.resolve())], stage / f"compute_{precision}.log", out)
        run = ran.data or {"status": "failed", "error": f"{precision}: {ran.error}"}
        if ran.data is not None:  # the process wrote its result
            run.pop("estimate_table", None)
            run["status"] = "ok" if run.get("batch") else "failed"
            result.files.append(f"compute/compute_{precision}.json")
        if run["status"] != "ok":
            run.setdefault("error", f"{precision}: every batch from {run.get('preflight_batch')} down ran out of "
                           "memory" if run.get("preflight_batch") else f"{precision}: the pre-flight allows no batch")
            result.problems.append(run["error"])
        result.data["runs"][precision] = run
    return result


def _tried(run: dict[str, Any], data: dict[str, Any]) -> str:
    """The pre-flight's batch and each batch tried from it."""
    tried = [f"{a['batch']}{' OOM' if a['status'] == 'oom' else ''}" for a in run.get("attempts", [])]
    return f"{run.get('preflight_batch')}: {' → '.join(tried)}"


def _estimate_over_reserved(run: dict[str, Any], data: dict[str, Any]) -> float | None:
    estimate, reserved = run.get("estimate_bytes"), run.get("peak_reserved_bytes")
    return estimate / reserved if estimate and reserved else None


def _fit_row(result: FitResult) -> dict[str, Any]:
    """Every median of one fit's timing summary; ``"not recorded"`` where its timer could not measure the key."""
    summary = result.summary or {}
    medians = {key: stats.get("median") for key, stats in (summary.get("summary") or {}).items()}
    return {"status": result.status, "error": result.error, "seconds": round(result.seconds, 1), **medians,
            **dict.fromkeys(summary.get("not_recorded") or (), "not recorded")}


def step_problems(summary: dict[str, Any] | None, what: str) -> list[str]:
    """The CommTimer's guarantees a step broke: a number not finite, comm longer than the step, a clock anomaly."""
    if not summary:
        return [f"{what}: no timing summary"]
    problems = []
    for row in summary.get("steps", []):
        step, step_ms = row.get("step"), row.get("step/time_ms", 0.0)
        bad = [k for k, v in row.items() if not (isinstance(v, (int, float)) and math.isfinite(v))]
        if bad:
            problems.append(f"{what}: step {step}: {bad[0]} = {row[bad[0]]!r}")
        for key in ("comm/exposed_ms", "comm/busy_ms"):
            if row.get(key, 0.0) > step_ms + 1e-3:
                problems.append(f"{what}: step {step}: {key} {row[key]:.3f} > step {step_ms:.3f} ms")
        if row.get("comm/clock_anomalies", 0):
            problems.append(f"{what}: step {step}: {row['comm/clock_anomalies']:.0f} clock anomalies")
    return problems


def strategies(ctx: StudyContext) -> StageResult:
    names = ["ddp", *(name for name in catalogue.names() if name != "ddp")]  # the baseline first: a cut stage keeps it
    results = ctx.fits("strategies", [FitSpec(n, fit_args(ctx, **ctx.scale.strategies, strategy=n)) for n in names])
    rows = {r.name: _fit_row(r) for r in results}
    baseline = rows.get("ddp", {}).get("step/time_ms")
    for row in rows.values():
        step = row.get("step/time_ms")
        row["overhead_vs_ddp"] = step / baseline - 1 if step and baseline else None
    problems = _failures(results) + [p for r in results if r.ok for p in step_problems(r.summary, r.name)]
    data = {**ctx.scale.strategies, "backend": ctx.scale.backend, "precision": ctx.scale.precision, "rows": rows}
    files = [ctx.relative(f) for r in results for f in [r.file("timing_summary.json")] if f is not None]
    return StageResult(data=data, files=files, problems=problems)


# Stage one_gpu_pair's equivalence: fp32 fits on the same global batch, 2 ranks against one process, compared in
# updates (lr x steps); docs/gpu.md says how the tolerances were calibrated.
EQUIVALENCE = {"preset": "tiny", "per_rank_batch": 2, "seq_len": 64, "steps": 3, "lr": 1e-3}
OFF_BY = 0.1  # a weight is *off* when it differs from one process's by more than this many updates
EXACT_TOLERANCE = 1e-4  # the largest fraction of weights off an exact algorithm may have
LOSSY_TOLERANCE = 1e-2  # the same for a lossy algorithm (bucketed_bf16_ddp)


def weight_differences(actual: dict[str, Any], expected: dict[str, Any], update: float) -> dict[str, Any]:
    """How far ``actual``'s weights are from ``expected``'s, in updates (``update`` = lr x steps): the fraction off
    by more than ``OFF_BY``, the median, the 99th percentile and the largest, and where the largest is."""
    if actual.keys() != expected.keys():
        missing = sorted(set(expected) ^ set(actual))
        raise ValueError(f"the two runs saved different tensors, e.g. {missing[:3]}: compare runs of the same model")
    per_tensor = {k: (actual[k].double() - expected[k].double()).abs().flatten() / update for k in expected}
    every = torch.cat(list(per_tensor.values()))
    worst = max(per_tensor, key=lambda k: float(per_tensor[k].max()))
    median, p99 = (float(every.kthvalue(max(1, round(q * every.numel()))).values) for q in (0.5, 0.99))
    return {"off_fraction": float((every > OFF_BY).double().mean()), "median_updates": median,
            "p99_updates": p99, "max_updates": float(per_tensor[worst].max()), "worst_tensor": worst}


def _equivalence_spec(ctx: StudyContext, name: str, strategy: str, ranks: int) -> FitSpec:
    """One fp32 fit saving its final weights; ``ranks`` x its batch is the same global batch for every fit."""
    weights = ctx.out / "one_gpu_pair" / "equivalence" / name / "weights.pt"
    extra = ("--model.lr", str(EQUIVALENCE["lr"]), "--timer.enabled", "false",
             "--trainer.callbacks+=lightning_ddp.bench.gpu_study.processes.SaveFinalWeights",
             "--trainer.callbacks.path", str(weights.resolve()))
    return FitSpec(name, fit_args(ctx, preset=EQUIVALENCE["preset"], batch=2 * EQUIVALENCE["per_rank_batch"] // ranks,
                                  seq_len=EQUIVALENCE["seq_len"], steps=EQUIVALENCE["steps"], warmup=0,
                                  precision="32-true", strategy=strategy, ranks=ranks, extra=extra))


def _weights(result: FitResult) -> Any:
    """The final weights ``result``'s fit saved, removed once read (~14 MB a strategy, worth nothing more)."""
    path = result.log_dir / "weights.pt" if result.ok and result.log_dir is not None else None
    if path is None or not path.exists():
        return None
    weights = torch.load(path, weights_only=True)
    path.unlink()
    return weights


def _equivalence(ctx: StudyContext) -> tuple[dict[str, Any], list[str]]:
    """Every strategy on 2 ranks sharing the device vs one process on the same global batch (fp32)."""
    reference = ctx.fits("one_gpu_pair/equivalence", [_equivalence_spec(ctx, "one_process", REFERENCE, 1)])[0]
    pairs = ctx.fits("one_gpu_pair/equivalence", [_equivalence_spec(ctx, n, n, 2) for n in catalogue.names()],
                     ranks=2)
    problems = _failures([reference]) + _failures(pairs, " on 2 ranks")
    expected = _weights(reference)
    rows: dict[str, Any] = {}
    for result in pairs:
        row = rows[result.name] = {"status": result.status, "error": result.error}
        actual = _weights(result)
        if expected is None or actual is None:
            continue
        row.update(weight_differences(actual, expected, EQUIVALENCE["lr"] * EQUIVALENCE["steps"]))
        tolerance = EXACT_TOLERANCE if catalogue.get(result.name).exact else LOSSY_TOLERANCE
        row.update(tolerance=tolerance, equal=row["off_fraction"] <= tolerance)
        if not row["equal"]:
            problems.append(f"{result.name} on 2 ranks differs from one process: {row['off_fraction']:.2%} of the "
                            f"weights off by > {OFF_BY:g} update (tolerance {tolerance:.2%}; worst "
                            f"{row['max_updates']:.3g} updates at {row['worst_tensor']})")
    return {**EQUIVALENCE, "precision": "32-true", "off_by_updates": OFF_BY, "rows": rows}, problems


def one_gpu_pair(ctx: StudyContext) -> StageResult:
    from lightning_ddp.bench.report import read_rows

    equivalence, problems = _equivalence(ctx)
    sweep_dir = ctx.stage_dir("one_gpu_pair/sweep")
    ran = ctx.run_python(["-m", "lightning_ddp.bench", "--config", ctx.scale.sweep_config, "--output.out_dir",
                          str(sweep_dir.resolve()), "--run.timeout_s", str(max(60, int(ctx.stage_deadline())))],
                         ctx.out / "one_gpu_pair" / "sweep.log")
    rows = list(read_rows(sweep_dir / "results.csv").values()) if (sweep_dir / "results.csv").exists() else []
    if ran.code != 0:
        problems.append(f"sweep: {ran.error}")
    files = [ctx.relative(p) for p in sorted(sweep_dir.glob("*")) if p.is_file()]
    return StageResult(data={"equivalence": equivalence, "sweep": {"rows": rows, "exit_code": ran.code}},
                       files=files, problems=problems)


def without_and_with_overlap() -> list[str]:
    """The catalogue's first engine that communicates after backward, and its first that overlaps backward."""
    engines = [catalogue.get(name) for name in catalogue.names(engines_only=True)]
    return [next(e.name for e in engines if not e.overlaps_backward),
            next(e.name for e in engines if e.overlaps_backward)]


def traces(ctx: StudyContext) -> StageResult:
    from lightning_ddp.trace import load_run, render_timeline

    record = str((ctx.root / "configs" / "trace" / "record.yaml").resolve())
    specs = [FitSpec(name, fit_args(ctx, **ctx.scale.traces, strategy=name, ranks=2, extra=("--config", record)))
             for name in without_and_with_overlap()]
    results = ctx.fits("traces", specs, ranks=2)
    problems = _failures(results)
    runs = [load_run([r.log_dir / "traces"], r.name) for r in results if r.ok and (r.log_dir / "traces").exists()]
    data: dict[str, Any] = {**ctx.scale.traces, "ranks": 2, "precision": ctx.scale.precision, "runs": {}}
    if not runs:
        return StageResult(data=data, problems=problems)
    picture = ctx.out / "traces" / "timeline.png"
    timeline = render_timeline(runs, picture, title="naive vs overlap, 2 gloo ranks time-slicing one device")
    for label, overlap in timeline.overlaps.items():
        gpu_rows = [row.bars for row in timeline.rows if row.run == label and row.kind == "gpu"]
        data["runs"][label] = {"overlap": overlap.fraction, "comm_ms": overlap.comm / 1e3,
                               "hidden_ms": overlap.overlapped / 1e3, "gpu_kernel_bars": sum(gpu_rows),
                               "gpu_rows": len(gpu_rows)}
        if ctx.scale.device == "cuda" and not sum(gpu_rows):
            problems.append(f"{label}: the trace has no GPU kernel rows")
    files = [ctx.relative(picture), *(ctx.relative(rank.path) for run in runs for rank in run.ranks)]
    return StageResult(data=data, files=files, problems=problems)


def ready_times(ctx: StudyContext) -> StageResult:
    from lightning_ddp.hardware import find_device
    from lightning_ddp.profile import read_profile
    from lightning_ddp.projection import config as projection
    from lightning_ddp.projection.flops import GPUS
    from lightning_ddp.projection.run import run_projection

    scale = ctx.scale.profile
    spec = FitSpec("profile", fit_args(ctx, **scale, strategy=without_and_with_overlap()[0]))
    (fit,) = ctx.fits("ready_times", [spec])
    path = fit.file("compute_profile.json")
    if not fit.ok or path is None:
        error = fit.error or "no compute_profile.json"
        return StageResult(problems=[f"the {scale['preset']} fit: {fit.status}: {error}"])
    profile = read_profile(path)
    ready = sorted(p.ready_ms for p in profile.params if p.ready_ms is not None)
    data: dict[str, Any] = {
        **scale, "device": profile.device, "precision": ctx.scale.precision,
        "forward_ms": profile.forward_ms, "backward_ms": profile.backward_ms, "optimizer_ms": profile.optimizer_ms,
        "tensors": len(profile.params), "first_ready_ms": ready[0] if ready else None,
        "last_ready_ms": ready[-1] if ready else None, "profile": ctx.relative(path), "projections": {},
    }
    result = StageResult(data=data, files=[ctx.relative(path)])
    if len(ready) != len(profile.params):
        result.problems.append(f"{len(profile.params) - len(ready)} tensors never became ready")
    # Projected to 2 ranks on the profiled GPU (its memory bandwidth prices the copies; H100 if not in the table):
    # one row per strategy, a bucketed one at its best bucket size.
    device = find_device(profile.device) if profile.device != "cpu" else None
    gpu = device.key if device is not None and device.key in GPUS else "h100-sxm"
    for network in ("nvlink4", "pcie_gen4"):
        outcome = run_projection(projection.ProjectionConfig(
            name=f"2 x {gpu} over {network}, from the measured profile",
            compute=projection.ComputeConfig(source="profile", profile_path=str(path), gpu=gpu),
            network=projection.NetworkConfig(preset=network),
            study=projection.StudyConfig(world_sizes=[2], bucket_sizes_mb=[1, 10, 100, 1000]),
            output=projection.OutputConfig(out_dir=str(ctx.stage_dir("ready_times") / f"projection_{network}"),
                                           plots=False),
        ))
        rows = [r for r in outcome.rows if r.get("best_bucket") == "true" or r.get("bucket_size_mb") in (None, "")]
        data["projections"][network] = {"gpu": gpu, "rows": rows}
        result.files += [ctx.relative(Path(f)) for f in outcome.files]
    return result


def timer_overhead(ctx: StudyContext) -> StageResult:
    overhead, stage = ctx.scale.overhead, ctx.stage_dir("timer_overhead")
    fit = fit_args(ctx, **overhead, strategy=catalogue.DEFAULT_ENGINE)
    # The benchmark sets the steps and the timer (its arms) itself; the rest is this study's fit, after `--`.
    owned = {"--trainer.max_steps", "--timer.warmup_steps", "--timer.every_n_steps"}
    fit = [a for i, a in enumerate(fit) if a not in owned and (i == 0 or fit[i - 1] not in owned)]
    log, path = stage / "timer_overhead.log", stage / "timer_overhead.json"
    ran = ctx.run_python(["-m", "lightning_ddp.bench.timer_overhead", "--fit_config", "configs/quickstart.yaml",
                          "--steps", str(overhead["steps"]), "--warmup_steps", str(overhead["warmup"]), "--repeats",
                          str(ctx.scale.overhead_repeats), "--out_dir", str(stage.resolve()),
                          "--fit_args", json.dumps(fit)], log, path)
    if ran.data is None:
        return StageResult(files=[ctx.relative(log)], problems=[ran.error])
    return StageResult(data={**ran.data, "preset": overhead["preset"]},
                       files=[ctx.relative(path), ctx.relative(stage / "timer_overhead.md")])


def _hardware(gpu: dict[str, Any], data: dict[str, Any]) -> str:
    """A GPU's row of the hardware table: its key and dense peaks (those MFU is computed against)."""
    row = gpu.get("hardware_table")
    if not row:
        return "not in the table"
    peaks = row.get("dense_tflops") or {}
    return f"{row.get('key')}: {peaks.get('bf16')} / {peaks.get('fp32')} TFLOP/s dense bf16 / fp32"


STAGES: tuple[Stage, ...] = (
    Stage("environment", "Environment", 20, 5, False, environment, caption=(
        "Device {device} (CPU: {cpu[model]}, {cpu[count]} cores); NVIDIA driver {nvidia_driver}, CUDA driver API "
        "{cuda_driver_api}, torch {torch} (CUDA {torch_cuda}, cuDNN {cudnn}, NCCL {nccl}), Lightning {lightning}, "
        "Python {python}; commit {git_commit:.12} (dirty: {git_dirty})."),
        tables=(Table("gpus", (("GPU", "name", ""), ("memory GiB", "total_memory_bytes", "GiB"),
                               ("SMs", "sm_count", ""), ("CC", "compute_capability", ""),
                               ("hardware table", _hardware, ""), ("MIG (g, GB)", "mig_profile", ""))),)),
    Stage("cuda_tests", "The cuda test tier", 240, 0, True, cuda_tests, caption=(
        "pytest: {summary_line} ({tests} tests: {passed} passed, {failed} failed, {errors} errors, {skipped} "
        "skipped)."),
        tables=(Table("failures", (("failed test", "test", ""), ("message", "message", ""))),)),
    Stage("compute", "Compute: xl on one GPU", 120, 20, False, compute, caption=(
        "{preset} preset, context {seq_len}, at the largest batch that fits. The published 2-GPU xl runs' "
        "compute-only step at this context (naive's step minus its all-reduce; bf16-mixed, GPU not named): "
        "{published}."),
        tables=(Table("runs", (
            ("precision", "name", ""), STATUS, ("dtype", "compute_dtype", ""), ("batch", "batch", ""),
            ("pre-flight batch: tried", _tried, ""), ("step ms", "step_ms_median", ",.1f"),
            ("tokens/s", "tokens_per_s", ",.0f"), ("MFU", "mfu", ".1%"),
            ("peak alloc GiB", "peak_allocated_bytes", "GiB"), ("peak reserved GiB", "peak_reserved_bytes", "GiB"),
            ("estimate GiB", "estimate_bytes", "GiB"), ("estimate / reserved", _estimate_over_reserved, ".2f"))),)),
    Stage("strategies", "Every strategy at world size 1", 120, 55, False, strategies, caption=(
        "{preset} preset, batch {batch} x {seq_len} tokens, {precision}, one rank ({backend}), medians after "
        "{warmup} of {steps} steps: the step over ddp's is what a strategy's hooks cost."),
        tables=(Table("rows", (
            ("strategy", "name", ""), STATUS, ("step ms", "step/time_ms", ",.1f"),
            ("vs ddp", "overhead_vs_ddp", "+.1%"), ("exposed ms", "comm/exposed_ms", ",.2f"),
            ("calls", "comm/calls", ",.0f"), ("MFU", "step/mfu", ".1%"), ("peak MiB", "memory/peak_MiB", ",.0f"),
            ("published 2-GPU xl (batch 4, ctx 512)", published(4, 512), ""))),)),
    Stage("one_gpu_pair", "2 ranks over gloo on one GPU", 240, 100, False, one_gpu_pair, caption=(
        "**Equivalence** ({equivalence[preset]} preset, fp32, {equivalence[steps]} steps at lr {equivalence[lr]}): "
        "2 ranks of batch {equivalence[per_rank_batch]} against one process on the same samples; weight "
        "differences in updates (lr x steps), *off* beyond {equivalence[off_by_updates]} update; how the tolerances "
        f"were calibrated: [docs/gpu.md]({DOCS}#how-the-stages-measure)."),
        tables=(Table("equivalence[rows]", (
            ("strategy", "name", ""), STATUS, ("weights off", "off_fraction", ".3%"),
            ("tolerance", "tolerance", ".2%"), ("median", "median_updates", ".1e"),
            ("99th pct", "p99_updates", ".1e"), ("largest", "max_updates", ".2g"), ("at", "worst_tensor", ""),
            ("equal", "equal", ""))),
                Table("sweep[rows]", (
                    ("strategy", "strategy", ""),
                    ("bucket MB", lambda row, data: row.get("resolved_bucket_size_mb") or row.get("bucket_size_mb"),
                     ".3g"), ("batch", "batch_size", ""), ("context", "context_length", ""), STATUS,
                    ("step ms", "step_ms_median", ",.1f"), ("comm share", "comm_share", ".1%"),
                    ("overlap", "overlap", ".0%"), ("tokens/s", "tokens_per_s", ",.0f"),
                    ("published 2-GPU xl", published(), "")),
                      "**Short sweep** (`one_gpu_pair/sweep/results.md` has the intervals): the comparison between "
                      "strategies transfers, the milliseconds do not."))),
    Stage("traces", "Traces: naive vs overlap", 60, 30, False, traces, caption=(
        "{preset} preset, {precision}, 2 gloo ranks on the one device, 3 traced steps; overlap: the share of "
        "communication during which the rank computed. ![naive vs overlap](traces/timeline.png)"),
        tables=(Table("runs", (
            ("run", "name", ""), ("overlap", "overlap", ".0%"), ("comm ms", "comm_ms", ",.1f"),
            ("hidden ms", "hidden_ms", ",.1f"), ("GPU rows", "gpu_rows", ""),
            ("GPU kernels drawn", "gpu_kernel_bars", ",d"),
            ("published 2-GPU xl (batch 2, ctx 512)", published(2, 512), ""))),)),
    Stage("ready_times", "Gradient-ready times in xl backward, projected to 2 GPUs", 90, 20, False, ready_times,
          caption=(
        "{preset} preset on {device}, batch {batch} x {seq_len}, {precision}: forward {forward_ms:,.1f} ms, backward "
        "{backward_ms:,.1f} ms, optimizer {optimizer_ms:,.1f} ms; {tensors} gradients ready from "
        "{first_ready_ms:,.1f} to {last_ready_ms:,.1f} ms into backward (`{profile}`), and projected to 2 GPUs."),
        tables=(Table(lambda data: [{**row, "network": network, "gpu": projection["gpu"]} for network, projection
                            in data.get("projections", {}).items() for row in projection["rows"]], (
            ("network", "network", ""), ("GPU", "gpu", ""), ("strategy", "strategy", ""),
            ("best bucket MB", "bucket_size_mb", "g"), ("step ms", "step_ms", ",.1f"),
            ("exposed ms", "exposed_comm_ms", ",.1f"), ("comm share", "comm_share", ".1%"),
            ("published 2-GPU xl", published(), ""))),)),
    Stage("timer_overhead", "The CommTimer's overhead", 120, 40, False, timer_overhead, caption=(
        "{preset} preset, {repeats} off/on pairs of {steps} steps ({warmup} left out): median step "
        "{median_step_ms_timer_off:,.2f} ms off, {median_step_ms_timer_on:,.2f} ms on: overhead {overhead:+.2%} "
        "[95 %: {overhead_lo:+.2%}, {overhead_hi:+.2%}], goal < 2 %: **{verdict}**; over whole runs "
        "{window_overhead:+.2%}.")),
)
"""Every stage, in the order the study runs them (``GPU_SCALE``: ~17 minutes, two calls of 9)."""
