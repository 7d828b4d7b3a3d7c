"""The stages of the GPU study: one function each, and ``STAGES``, the one table of them.

A stage takes the ``StudyContext`` and returns a ``StageResult``: the data ``report.py`` renders (written as
``<out>/<name>.json``), the files it wrote (relative to ``<out>``) and its problems (any makes it ``failed``). Every
process a stage starts stops at ``ctx.stage_deadline()`` (docs/gpu.md, "How a call is budgeted").
"""

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
from typing import Any, Callable

from lightning_ddp import catalogue
from lightning_ddp.bench.gpu_study.config import GPUStudyConfig, Scale
from lightning_ddp.bench.gpu_study.fits import FitResult, FitSpec, run_fits
from lightning_ddp.bench.launch import REFERENCE, base_environment, error_line, run_processes, strategy_argument
from lightning_ddp.files import write_json_atomically
from lightning_ddp.provenance import COMMIT_VARIABLE

__all__ = ["STAGES", "Stage", "StageResult", "StudyContext", "step_problems"]


@dataclass(frozen=True)
class Ran:
    """How a process a stage started ended; ``error``: its error line, else why it stopped (empty after exit 0)."""

    code: int | None
    timed_out: bool
    line: str

    @property
    def error(self) -> str:
        if self.code == 0:
            return ""
        return self.line or ("timed out" if self.timed_out else f"exited {self.code}")


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
        """Seconds this stage's processes may still run: the budget left, and at most 1.5 x the stage's estimate
        (at least a minute more than it)."""
        allowed = max(1.5 * self.stage_estimate_s, self.stage_estimate_s + 60.0)
        return max(0.0, min(self.remaining(), self.stage_started + allowed - time.monotonic()))

    def stage_dir(self, name: str) -> Path:
        path = self.out / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def relative(self, path: Path) -> str:
        """``path`` relative to the study's folder, as stages.json lists files."""
        return path.resolve().relative_to(self.out.resolve()).as_posix()

    @property
    def device(self) -> str:
        return self.scale.device

    @property
    def backend(self) -> str:
        """The backend of one rank per device: NCCL on a GPU, gloo on CPU."""
        return "nccl" if self.device == "cuda" else "gloo"

    def threads(self, ranks: int) -> int | None:
        """``OMP_NUM_THREADS`` of each of ``ranks`` CPU processes (the cores shared out); unset on a GPU."""
        return max(1, (os.cpu_count() or 1) // ranks) if self.device == "cpu" else None

    def env(self) -> dict[str, str]:
        """Extra environment of every process: the checkout first on PYTHONPATH, ``--commit`` as
        ``LIGHTNING_DDP_COMMIT`` (no .git on a GPU machine), and ``--extra_env``."""
        path = os.pathsep.join(p for p in (str(self.root), os.environ.get("PYTHONPATH", "")) if p)
        commit = {COMMIT_VARIABLE: self.config.commit} if self.config.commit else {}
        return {"PYTHONPATH": path, **commit, **self.config.extra_env}

    def run_python(self, args: list[str], log: Path) -> Ran:
        """``python ARGS`` in the checkout until the stage's deadline, output to ``log``."""
        env = base_environment(self.threads(1), extra=self.env())
        log.parent.mkdir(parents=True, exist_ok=True)
        result = run_processes([sys.executable, *args], [env], [log], max(self.stage_deadline(), 1.0),
                               cwd=str(self.root))
        text = log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""
        return Ran(result.returncodes[0], result.timed_out, error_line(text))

    def run_module(self, module: str, args: list[str], result: Path, log: Path) -> tuple[Ran, dict[str, Any] | None]:
        """``python -m MODULE ARGS`` and the JSON it wrote to ``result`` (None if it failed)."""
        ran = self.run_python(["-m", module, *args], log)
        return ran, json.loads(result.read_text()) if ran.code == 0 and result.exists() else None

    def fits(self, name: str, specs: list[FitSpec], ranks: int = 1) -> list[FitResult]:
        """``run_fits`` into ``<out>/<name>/``, bounded by the stage's deadline."""
        return run_fits(specs, self.stage_dir(name), ranks=ranks, timeout_s=self.stage_deadline(),
                        cwd=str(self.root), env=self.env(), threads=self.threads(ranks))


@dataclass
class StageResult:
    """What a stage produced: ``data`` for report.py, the ``files`` it wrote (relative to ``out``), ``problems``."""

    data: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Stage:
    """One row of ``STAGES``: seconds on one H100 or H200 and in the dry run on 2 cores (start-up included), whether
    it cannot run without a GPU, and what it shows (one sentence of results.md)."""

    name: str
    title: str
    estimate_s: float
    dry_run_estimate_s: float
    needs_cuda: bool
    run: Callable[[StudyContext], StageResult]
    shows: str

    def estimate(self, dry_run: bool) -> float:
        return self.dry_run_estimate_s if dry_run else self.estimate_s


# ---- shared pieces ---------------------------------------------------------------------------------------------


def fit_args(ctx: StudyContext, *, preset: str, batch: int, seq_len: int, steps: int, warmup: int, strategy: str,
             precision: str | None = None, ranks: int = 1, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The CLI arguments (after ``fit``) of one fit on the study's device, every step timed: ``ranks`` ranks share
    it over gloo; ``strategy`` is a catalogue name, or the study's one-process ``reference``."""
    backend = ctx.backend if ranks == 1 else "gloo"
    return (
        "--seed_everything", "0", "--model.preset", preset, "--model.context_length", str(seq_len),
        "--data.source", "synthetic", "--data.seq_len", str(seq_len), "--data.batch_size", str(batch),
        "--trainer.accelerator", ctx.device, "--trainer.devices", "1", "--trainer.num_nodes", str(ranks),
        "--trainer.strategy", strategy_argument(strategy, backend),
        "--trainer.precision", precision or ctx.scale.precision,
        "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
        "--trainer.log_every_n_steps", "1", "--trainer.enable_checkpointing", "false",
        "--timer.warmup_steps", str(warmup), "--timer.every_n_steps", "1", *extra,
    )


def step_problems(summary: dict[str, Any] | None, what: str) -> list[str]:
    """What a step of ``summary`` breaks of the CommTimer's guarantees: a number that is not finite, exposed or busy
    communication longer than the step, a clock anomaly."""
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


FIT_KEYS = ("step/time_ms", "comm/exposed_ms", "comm/wait_ms", "comm/transfer_ms", "comm/busy_ms", "comm/share",
            "comm/overlap", "comm/calls", "comm/bytes", "step/tokens_per_s", "step/mfu", "memory/peak_MiB",
            "memory/peak_reserved_MiB")
"""The medians of a fit's timing summary that the report shows."""


def _fit_row(result: FitResult) -> dict[str, Any]:
    """``FIT_KEYS``'s medians of one fit; ``"not recorded"`` where its timer could not measure a key (the summary's
    ``not_recorded``: fsdp2's and ddp's busy time and overlap)."""
    summary = result.summary or {}
    not_recorded = set(summary.get("not_recorded") or ())
    row: dict[str, Any] = {"status": result.status, "error": result.error, "seconds": round(result.seconds, 1)}
    for key in FIT_KEYS:
        median = (summary.get("summary") or {}).get(key, {}).get("median")
        if key in not_recorded:
            row[key] = "not recorded"
        else:
            row[key] = float(median) if isinstance(median, (int, float)) else None
    return row


def _failures(results: list[FitResult]) -> list[str]:
    return [f"{r.name}: {r.status}: {r.error}" for r in results if not r.ok]


# ---- the stages -----------------------------------------------------------------------------------------------


def environment(ctx: StudyContext) -> StageResult:
    path = ctx.out / "environment.json"
    args, log = [str(path.resolve()), "--device", ctx.device], ctx.out / "logs" / "environment.log"
    ran, data = ctx.run_module("lightning_ddp.bench.gpu_study.environment", args, path, log)
    if data is None:
        return StageResult(problems=[ran.error or "no environment.json"])
    return StageResult(data=data, files=["environment.json"])


def _tally(outcomes: list[tuple[str, str, str]]) -> dict[str, Any]:
    """``{"tests", "passed", "failed", "errors", "skipped", "failures": [{"test", "message"}]}`` of (test, outcome,
    message) triples."""
    counts = dict.fromkeys(("passed", "failed", "errors", "skipped"), 0)
    for _, outcome, _ in outcomes:
        counts[outcome] += 1
    failures = [{"test": test, "message": message} for test, outcome, message in outcomes
                if outcome in ("failed", "errors")]
    return {"tests": len(outcomes), **counts, "failures": failures}


def read_junit(path: Path) -> dict[str, Any]:
    """The counts and failures (``_tally``) of a pytest ``--junitxml`` report."""
    outcomes = []
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for tag, key in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            element = case.find(tag)
            if element is not None:
                lines = (element.get("message") or element.text or "").strip().splitlines()
                outcome, message = key, lines[0][:300] if lines else ""
                break
        outcomes.append((test, outcome, message))
    return _tally(outcomes)


_OUTCOME = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.MULTILINE)
_OUTCOME_KEY = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped",
                "XFAIL": "skipped"}


def outcomes_from_log(text: str) -> dict[str, Any]:
    """The counts and failures from ``pytest -v`` output, for a run cut off before it wrote its junit report."""
    return _tally([(test, _OUTCOME_KEY[outcome], outcome.lower()) for test, outcome in _OUTCOME.findall(text)])


def _tier_problems(data: dict[str, Any], summary_line: str, timed_out: bool) -> list[str]:
    problems = [f"{f['test']}: {f['message']}" for f in data["failures"]]
    if timed_out:
        problems.insert(0, f"the tier ran out of time ({summary_line or 'no summary'})")
    elif data["tests"] and data["skipped"] == data["tests"]:
        problems.append("every test of the tier was skipped: pytest saw no CUDA device")
    if problems and data["failures"]:
        problems[0] = f"{len(data['failures'])} of {data['tests']} failed, first: {problems[0]}"
    return problems


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
    data = {**data, "summary_line": summary_line, "exit_code": ran.code, "timed_out": ran.timed_out}
    return StageResult(data=data, files=[p.name for p in (report, log) if p.exists()],
                       problems=_tier_problems(data, summary_line, ran.timed_out))


def _compute_run(ctx: StudyContext, precision: str) -> tuple[dict[str, Any], str | None]:
    """One precision of stage compute in its own process: (the run, its problem or None)."""
    stage = ctx.stage_dir("compute")
    request, out = stage / f"request_{precision}.json", stage / f"compute_{precision}.json"
    write_json_atomically(request, {**ctx.scale.compute, "precision": precision, "device": ctx.device})
    ran, run = ctx.run_module("lightning_ddp.bench.gpu_study.compute", [str(request.resolve()), str(out.resolve())],
                              out, stage / f"compute_{precision}.log")
    if run is None:
        problem = f"{precision}: {ran.error or 'no result'}"
        return {"status": "failed", "error": problem}, problem
    run.pop("estimate_table", None)
    run["status"] = "ok" if run.get("batch") else "failed"
    if run["status"] == "ok":
        return run, None
    if not run.get("preflight_batch"):
        return run, f"{precision}: the pre-flight allows no batch"
    return run, f"{precision}: every batch from {run['preflight_batch']} down ran out of memory"


def compute(ctx: StudyContext) -> StageResult:
    compute_scale = ctx.scale.compute
    result = StageResult(data={"preset": compute_scale["preset"], "seq_len": compute_scale["seq_len"], "runs": {}})
    for precision in ("bf16-mixed", "32-true"):
        run, problem = _compute_run(ctx, precision)
        result.data["runs"][precision] = run
        if problem:
            result.problems.append(problem)
        if "error" not in run:  # the process wrote its result
            result.files.append(f"compute/compute_{precision}.json")
    return result


def strategies(ctx: StudyContext) -> StageResult:
    names = ["ddp", *(name for name in catalogue.names() if name != "ddp")]  # the baseline first: a cut stage keeps it
    specs = [FitSpec(name, fit_args(ctx, **ctx.scale.strategies, strategy=name)) for name in names]
    results = ctx.fits("strategies", specs)
    rows = {r.name: _fit_row(r) for r in results}
    baseline = rows.get("ddp", {}).get("step/time_ms")
    for row in rows.values():
        step = row.get("step/time_ms")
        row["overhead_vs_ddp"] = step / baseline - 1 if step and baseline else None
    problems = _failures(results)
    for r in results:
        if r.ok:
            problems += step_problems(r.summary, r.name)
    data = {**ctx.scale.strategies, "backend": ctx.backend, "precision": ctx.scale.precision, "rows": rows}
    files = [ctx.relative(f) for r in results for f in [r.file("timing_summary.json")] if f is not None]
    return StageResult(data=data, files=files, problems=problems)


# Stage one_gpu_pair's equivalence: fp32 fits on the same global batch, 2 ranks against one process, compared in
# updates (lr x steps); the tolerances' calibration is TOLERANCE_ORIGIN (docs/gpu.md).
EQUIVALENCE = {"preset": "tiny", "per_rank_batch": 2, "seq_len": 64, "steps": 3, "lr": 1e-3}
OFF_BY = 0.1  # a weight is *off* when it differs from one process's by more than this many updates
EXACT_TOLERANCE = 1e-4  # the largest fraction of weights off an exact algorithm may have
LOSSY_TOLERANCE = 1e-2  # the same for a lossy algorithm (bucketed_bf16_ddp)
TOLERANCE_ORIGIN = ("calibrated on CPU (gloo, fp32, tiny preset, 3 steps at lr 1e-3): exact algorithms left no "
                    "weight off (99th percentile 2.5e-6 updates, largest 4e-3), bucketed_bf16_ddp 0.08 % (99th "
                    "percentile 8e-3), a rank's gradient missing from the average 52 %. cuBLAS sums in another order "
                    "than the CPU: read the 99th percentile and the largest difference beside the verdict.")
SWEEP_CONFIG = "configs/bench/gpu_study.yaml"  # stage one_gpu_pair's short sweep, relative to the checkout


def weight_differences(actual: dict[str, Any], expected: dict[str, Any], update: float) -> dict[str, Any]:
    """How far ``actual``'s weights are from ``expected``'s, in updates (``update`` = lr x steps): the fraction off
    by more than ``OFF_BY``, the median, the 99th percentile and the largest, and where the largest is."""
    import torch

    if actual.keys() != expected.keys():
        missing = sorted(set(expected) ^ set(actual))
        raise ValueError(f"the two runs saved different tensors, e.g. {missing[:3]}: compare runs of the same model")
    per_tensor = {k: (actual[k].double() - expected[k].double()).abs().flatten() / update for k in expected}
    every = torch.cat(list(per_tensor.values()))
    worst = max(per_tensor, key=lambda k: float(per_tensor[k].max()))

    def quantile(q: float) -> float:
        return float(every.kthvalue(max(1, round(q * every.numel()))).values)

    return {"off_fraction": float((every > OFF_BY).double().mean()), "median_updates": quantile(0.5),
            "p99_updates": quantile(0.99), "max_updates": float(per_tensor[worst].max()), "worst_tensor": worst}


def _equivalence_spec(ctx: StudyContext, name: str, strategy: str, ranks: int) -> FitSpec:
    """One fp32 fit saving its final weights; ``ranks`` x its batch is the same global batch for every fit."""
    weights = ctx.out / "one_gpu_pair" / "equivalence" / name / "weights.pt"
    extra = ("--model.lr", str(EQUIVALENCE["lr"]), "--timer.enabled", "false",
             "--trainer.callbacks+=lightning_ddp.bench.gpu_study.callbacks.SaveFinalWeights",
             "--trainer.callbacks.path", str(weights.resolve()))
    return FitSpec(name, fit_args(ctx, preset=EQUIVALENCE["preset"], batch=2 * EQUIVALENCE["per_rank_batch"] // ranks,
                                  seq_len=EQUIVALENCE["seq_len"], steps=EQUIVALENCE["steps"], warmup=0,
                                  precision="32-true", strategy=strategy, ranks=ranks, extra=extra))


def _compare(result: FitResult, expected: dict[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """The row of one 2-rank fit against the one-process weights ``expected``, and its problem if any."""
    import torch

    row: dict[str, Any] = {"status": result.status, "error": result.error}
    path = result.log_dir / "weights.pt" if result.log_dir is not None else None
    if not result.ok:
        return row, [f"{result.name} on 2 ranks: {result.status}: {result.error}"]
    if expected is None or path is None or not path.exists():
        return row, []
    row.update(weight_differences(torch.load(path, weights_only=True), expected,
                                  EQUIVALENCE["lr"] * EQUIVALENCE["steps"]))
    path.unlink()  # compared: the weights are ~14 MB a strategy and worth nothing more
    tolerance = EXACT_TOLERANCE if catalogue.get(result.name).exact else LOSSY_TOLERANCE
    row.update(tolerance=tolerance, equal=row["off_fraction"] <= tolerance)
    if row["equal"]:
        return row, []
    return row, [f"{result.name} on 2 ranks differs from one process: {row['off_fraction']:.2%} of the weights off "
                 f"by > {OFF_BY:g} update (tolerance {tolerance:.2%}; worst {row['max_updates']:.3g} updates at "
                 f"{row['worst_tensor']})"]


def _equivalence(ctx: StudyContext) -> tuple[dict[str, Any], list[str]]:
    """Every strategy on 2 ranks sharing the device vs one process on the same global batch (fp32)."""
    import torch

    reference = ctx.fits("one_gpu_pair/equivalence", [_equivalence_spec(ctx, "one_process", REFERENCE, 1)])[0]
    pairs = ctx.fits("one_gpu_pair/equivalence", [_equivalence_spec(ctx, n, n, 2) for n in catalogue.names()],
                     ranks=2)
    problems = _failures([reference])
    expected = None
    reference_weights = ctx.out / "one_gpu_pair" / "equivalence" / "one_process" / "weights.pt"
    if reference.ok:
        expected = torch.load(reference_weights, weights_only=True)
        reference_weights.unlink()
    rows: dict[str, Any] = {}
    for result in pairs:
        rows[result.name], found = _compare(result, expected)
        problems += found
    data = {**EQUIVALENCE, "precision": "32-true", "off_by_updates": OFF_BY, "tolerance_origin": TOLERANCE_ORIGIN,
            "rows": rows}
    return data, problems


def _sweep_arguments(ctx: StudyContext, out_dir: Path) -> list[str]:
    args = ["-m", "lightning_ddp.bench", "--config", SWEEP_CONFIG, "--output.out_dir", str(out_dir.resolve()),
            "--run.timeout_s", str(max(60, int(ctx.stage_deadline())))]
    if ctx.scale.sweep_strategies is not None:
        args += ["--grid.strategies", json.dumps(list(ctx.scale.sweep_strategies))]
    if ctx.device == "cpu":  # the dry run: the same sweep, shrunk to the tiny preset on CPU
        args += ["--run.accelerator", "cpu", "--workload.base_config", "configs/quickstart.yaml",
                 "--workload.preset", "tiny", "--workload.cli_args", json.dumps(["--data.source", "synthetic"]),
                 "--grid.batch_sizes", "[2]", "--grid.context_lengths", "[32]", "--grid.bucket_sizes_mb", "[1]",
                 "--grid.precisions", "[32-true]", "--run.warmup_steps", "1", "--run.steps", "2",
                 "--run.predict_bucket_size", "false", "--run.env", "{}"]
    return args


def one_gpu_pair(ctx: StudyContext) -> StageResult:
    from lightning_ddp.bench.report import read_results

    equivalence, problems = _equivalence(ctx)
    sweep_dir = ctx.stage_dir("one_gpu_pair/sweep")
    ran = ctx.run_python(_sweep_arguments(ctx, sweep_dir), ctx.out / "one_gpu_pair" / "sweep.log")
    results_csv = sweep_dir / "results.csv"
    rows = list(read_results(results_csv).values()) if results_csv.exists() else []
    if ran.code != 0:
        problems.append(f"sweep: {ran.error}")
    files = [ctx.relative(p) for p in sorted(sweep_dir.glob("*")) if p.is_file()]
    return StageResult(data={"equivalence": equivalence, "sweep": {"rows": rows, "exit_code": ran.code}},
                       files=files, problems=problems)


def without_and_with_overlap() -> list[str]:
    """The catalogue's first engine that communicates after backward, and its first that overlaps backward."""
    engines = [catalogue.get(name) for name in catalogue.names(engines_only=True)]
    without = next(e.name for e in engines if not e.overlaps_backward)
    return [without, next(e.name for e in engines if e.overlaps_backward)]


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
        if ctx.device == "cuda" and not sum(gpu_rows):
            problems.append(f"{label}: the trace has no GPU kernel rows")
    files = [ctx.relative(picture), *(ctx.relative(rank.path) for run in runs for rank in run.ranks)]
    return StageResult(data=data, files=files, problems=problems)


def ready_times(ctx: StudyContext) -> StageResult:
    from lightning_ddp.profile import read_profile

    profile_scale = ctx.scale.profile
    spec = FitSpec("profile", fit_args(ctx, **profile_scale, strategy=without_and_with_overlap()[0]))
    (result,) = ctx.fits("ready_times", [spec])
    profile_path = result.file("compute_profile.json")
    if not result.ok or profile_path is None:
        error = result.error or "no compute_profile.json"
        return StageResult(problems=[f"the {profile_scale['preset']} fit: {result.status}: {error}"])
    profile = read_profile(profile_path)
    ready = sorted(p.ready_ms for p in profile.params if p.ready_ms is not None)
    data: dict[str, Any] = {
        **profile_scale, "device": profile.device, "precision": ctx.scale.precision,
        "forward_ms": profile.forward_ms, "backward_ms": profile.backward_ms, "optimizer_ms": profile.optimizer_ms,
        "tensors": len(profile.params), "first_ready_ms": ready[0] if ready else None,
        "last_ready_ms": ready[-1] if ready else None, "profile": ctx.relative(profile_path), "projections": {},
    }
    files = [ctx.relative(profile_path)]
    problems = []
    if len(ready) != len(profile.params):
        problems.append(f"{len(profile.params) - len(ready)} tensors never became ready")
    gpu = _projection_gpu(profile.device)
    for network in ("nvlink4", "pcie_gen4"):
        rows, written = _project(ctx, profile_path, gpu, network)
        data["projections"][network] = {"gpu": gpu, "rows": rows}
        files += written
    return StageResult(data=data, files=files, problems=problems)


def _projection_gpu(device_name: str) -> str:
    """The projection's GPU for the profiled device (its memory bandwidth prices the copies); H100 otherwise."""
    from lightning_ddp.hardware import find_device
    from lightning_ddp.projection.flops import GPUS

    spec = find_device(device_name) if device_name != "cpu" else None
    return spec.key if spec is not None and spec.key in GPUS else "h100-sxm"


def _project(ctx: StudyContext, profile_path: Path, gpu: str, network: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The projection from the measured profile to 2 ranks on ``network``, one row per strategy (a bucketed one at
    its best bucket size), and the files it wrote."""
    from lightning_ddp.projection import config as projection
    from lightning_ddp.projection.run import run_projection

    config = projection.ProjectionConfig(
        name=f"2 x {gpu} over {network}, from the measured profile",
        compute=projection.ComputeConfig(source="profile", profile_path=str(profile_path), gpu=gpu),
        network=projection.NetworkConfig(preset=network),
        study=projection.StudyConfig(world_sizes=[2], bucket_sizes_mb=[1, 10, 100, 1000]),
        output=projection.OutputConfig(out_dir=str(ctx.out / "ready_times" / f"projection_{network}"), plots=False),
    )
    outcome = run_projection(config)
    rows = [row for row in outcome.rows if row.get("best_bucket") == "true" or row.get("bucket_size_mb") in (None, "")]
    return rows, [ctx.relative(Path(f)) for f in outcome.files]


def timer_overhead(ctx: StudyContext) -> StageResult:
    overhead = ctx.scale.overhead
    stage = ctx.stage_dir("timer_overhead")
    fit = fit_args(ctx, **overhead, strategy=catalogue.DEFAULT_ENGINE)
    # The benchmark sets the steps and the timer (its arms) itself; the rest is this study's fit, after `--`.
    owned = {"--trainer.max_steps", "--timer.warmup_steps", "--timer.every_n_steps"}
    fit = [a for i, a in enumerate(fit) if a not in owned and (i == 0 or fit[i - 1] not in owned)]
    log, path = stage / "timer_overhead.log", stage / "timer_overhead.json"
    ran, data = ctx.run_module("lightning_ddp.bench.timer_overhead", [
        "--fit_config", "configs/quickstart.yaml", "--steps", str(overhead["steps"]), "--warmup_steps",
        str(overhead["warmup"]), "--repeats", str(ctx.scale.overhead_repeats), "--out_dir", str(stage.resolve()),
        "--fit_args", json.dumps(fit)], path, log)
    if data is None:
        return StageResult(files=[ctx.relative(log)], problems=[ran.error or "no timer_overhead.json"])
    data = {**data, "preset": overhead["preset"]}
    return StageResult(data=data, files=[ctx.relative(path), ctx.relative(stage / "timer_overhead.md")])


STAGES: tuple[Stage, ...] = (
    Stage("environment", "Environment", 20, 5, False, environment,
          "GPU name, memory, SM count, driver, torch / CUDA / NCCL versions, the hardware table's row, git commit."),
    Stage("cuda_tests", "The cuda test tier", 240, 0, True, cuda_tests,
          "Every engine and ZeRO-1 variant on CUDA tensors equal to one process (NCCL at world size 1, 2 gloo ranks "
          "on the GPU), the CommTimer's CUDA path for every strategy, the per-device backend spec, auto buckets."),
    Stage("compute", "Compute: xl on one GPU", 120, 20, False, compute,
          "Step time, tokens/s, MFU and peak memory of the xl preset at the largest batch that fits, bf16-mixed and "
          "32-true, beside the memory pre-flight's estimate."),
    Stage("strategies", "Every strategy at world size 1", 120, 55, False, strategies,
          "Every strategy runs on CUDA (NCCL at world size 1: no data crosses a wire), and what its hooks cost over "
          "ddp's step."),
    Stage("one_gpu_pair", "2 ranks over gloo on one GPU", 240, 100, False, one_gpu_pair,
          "Every strategy on 2 ranks equal to one process on the whole batch, and a short sweep of the strategies "
          "(time-sliced: not 2-GPU step times)."),
    Stage("traces", "Traces: naive vs overlap", 60, 30, False, traces,
          "Profiler timelines with GPU kernel rows: when gradients are communicated against when the GPU computes."),
    Stage("ready_times", "Gradient-ready times in xl backward, projected to 2 GPUs", 90, 20, False, ready_times,
          "When each of xl's 435 gradients is ready in backward, and the projection re-run from it for 2 GPUs over "
          "NVLink and over PCIe, beside the published 2-GPU xl runs."),
    Stage("timer_overhead", "The CommTimer's overhead", 120, 40, False, timer_overhead,
          "Step time with the timer on and off, alternated, with a 95 % interval: what measuring costs on a GPU."),
)
"""Every stage, in the order the study runs them (``GPU_SCALE``: ~17 minutes, two calls of 9)."""
