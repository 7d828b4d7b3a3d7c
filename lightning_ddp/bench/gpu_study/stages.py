"""The GPU study's ``STAGES``: each one's ``run`` (``StudyContext`` -> ``StageResult``, its processes stopped at
``ctx.stage_deadline()``), what it costs (``GPUEstimate``) and its results.md caption and tables; docs/gpu.md says
what each measures."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Union

import torch

from lightning_ddp import catalogue
from lightning_ddp.bench.gpu_study.processes import FitResult, FitSpec, run_fits
from lightning_ddp.bench.gpu_study.scales import FitSize, Scale
from lightning_ddp.bench.launch import (
    REFERENCE, base_environment, cpu_threads_per_rank, error_line, run_processes, strategy_argument,
)
from lightning_ddp.bench.study import NO_CHECKPOINTS, NO_VALIDATION, read_json
from lightning_ddp.files import write_json_atomically
from lightning_ddp.projection.published import PUBLISHED_RUNS, calibrated_compute_ms
from lightning_ddp.reporting.provenance import COMMIT_VARIABLE

if TYPE_CHECKING:  # the config imports this module to check its stage names
    from lightning_ddp.bench.gpu_study.config import GPUStudyConfig


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
    """The study's options (``--budget_min``, ``--stages``, ``--commit``, ...)."""
    scale: Scale
    """The sizes of every stage's fits: the GPU study's, or the CPU dry run's."""
    out: Path
    """The study's folder: stages.json, results.md, and each stage's files under ``<out>/<stage>``."""
    root: Path  # the repository checkout (configs/, tests/)
    cuda: bool  # whether a child process saw a CUDA device (the study's own process holds no CUDA context)
    deadline: float  # time.monotonic() at which the budget ends
    log: Callable[[str], None] = print
    """Where progress lines go, one call per line."""
    stage_estimate_s: float = 0.0  # the running stage's estimate and start, set by the study
    stage_started: float = 0.0

    def remaining(self) -> float:
        """Seconds left of the call's budget (negative once it has run out)."""
        return self.deadline - time.monotonic()

    def stage_deadline(self) -> float:
        """Seconds this stage's processes may still run: the budget left, at most max(1.5 x, 60 s +) its estimate."""
        allowed = max(1.5 * self.stage_estimate_s, self.stage_estimate_s + 60.0)
        return max(0.0, min(self.remaining(), self.stage_started + allowed - time.monotonic()))

    def stage_dir(self, name: str) -> Path:
        """``<out>/<name>``, created if it does not exist."""
        path = self.out / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def relative(self, path: Path) -> str:
        """``path`` relative to the study's folder, as stages.json lists files."""
        return path.resolve().relative_to(self.out.resolve()).as_posix()

    def threads(self, ranks: int) -> int | None:
        """``OMP_NUM_THREADS`` of each of ``ranks`` CPU processes (the cores shared out); unset on a GPU."""
        return cpu_threads_per_rank(ranks) if self.scale.device == "cpu" else None

    def env(self) -> dict[str, str]:
        """Every process's extra environment: the checkout first on PYTHONPATH, ``--commit`` (a copy has no .git)."""
        env = {"PYTHONPATH": os.pathsep.join(p for p in (str(self.root), os.environ.get("PYTHONPATH", "")) if p)}
        if self.config.commit:
            env[COMMIT_VARIABLE] = self.config.commit
        return env

    def run_python(self, args: list[str], log: Path, result: Path | None = None) -> Ran:
        """``python ARGS`` in the checkout until the stage's deadline, output to ``log``; it writes ``result``."""
        log.parent.mkdir(parents=True, exist_ok=True)
        ended = run_processes([sys.executable, *args], [base_environment(self.threads(1), extra=self.env())], [log],
                              max(self.stage_deadline(), 1.0), cwd=str(self.root))
        code = ended.returncodes[0]
        if code == 0 and result is None:
            return Ran(code=0, timed_out=False, error="")
        if code == 0:
            data = read_json(result, missing_ok=True)
            return Ran(code=0, timed_out=False, error="" if data is not None else f"no {result.name}", data=data)
        line = error_line(log.read_text(encoding="utf-8", errors="replace")) if log.exists() else ""
        if not line:
            line = "timed out" if ended.timed_out else f"exited {code}"
        return Ran(code=code, timed_out=ended.timed_out, error=line)

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


Row = dict[str, Any]
"""One row of a results.md table: a column's key (``Column.value``) -> its value."""


@dataclass(frozen=True)
class Column:
    """A column of a results.md table: its header, the row's value (the row's key, or a function of the row), and
    how to show it (a Python format spec, or ``GiB`` for bytes)."""

    header: str
    value: Union[str, Callable[[Row], Any]]
    format: str = ""


@dataclass(frozen=True)
class Table:
    """A table of results.md: its rows (a function of the stage's data) and its columns."""

    rows: Callable[[dict[str, Any]], list[Row]]
    columns: tuple[Column, ...]


PROCESS_START_S = 12.0
"""A process on the GPU machine until its first step: Python, torch, Lightning and the CLI (7 s for the imports on 2
shared CPU cores), the CUDA context and NCCL's set-up."""
FIT_START_S = 4.0
"""A fit in a running process until its first step: Trainer, strategy, model (3.4-8.8 s in the CPU dry run)."""


@dataclass(frozen=True)
class Estimate:
    """A stage's seconds: on one H100 or H200 counted (no GPU has run the study yet) from the processes it starts one
    after another, the fits it starts in running processes and its work; in the CPU dry run on 2 idle cores, measured
    (docs/gpu.md, "What each stage costs")."""

    process_starts: int
    """Processes the stage starts one after another, ``PROCESS_START_S`` each on the GPU."""
    fit_starts: int
    """Fits it starts in a process already running, ``FIT_START_S`` each on the GPU."""
    work_s: float
    """Seconds of the stage's own steps and computation on one H100 or H200."""
    dry_run_s: float
    """Seconds the whole stage took in the CPU dry run on 2 idle cores."""

    @property
    def gpu_s(self) -> float:
        """Seconds on one H100 or H200: the process and fit starts, then the work."""
        return self.process_starts * PROCESS_START_S + self.fit_starts * FIT_START_S + self.work_s

    def seconds(self, dry_run: bool) -> float:
        """The stage's expected seconds: ``dry_run_s`` in the dry run, ``gpu_s`` on a GPU."""
        return self.dry_run_s if dry_run else self.gpu_s

    def basis(self, dry_run: bool) -> str:
        """Where ``seconds(dry_run)`` comes from, for stages.json."""
        if dry_run:
            return "measured in the dry run on 2 idle CPU cores"
        return (f"{self.process_starts} process starts x {PROCESS_START_S:g} s + {self.fit_starts} fits x "
                f"{FIT_START_S:g} s + {self.work_s:g} s of work")


@dataclass(frozen=True)
class Stage:
    """One stage: what it measures, how it runs, what it costs, how results.md shows its data."""

    name: str
    """Its key: ``--stages`` selects by it, stages.json lists it, its data goes to ``<out>/<name>.json``."""
    title: str
    """What it measures, true of the GPU study and of the dry run alike (the caption says what ran)."""
    run: Callable[[StudyContext], StageResult]
    """Runs the stage; its processes stop at ``ctx.stage_deadline()``; an exception is recorded as a problem."""
    estimate: Estimate
    """What it costs; a stage whose estimate exceeds the budget left is skipped (``skipped: budget``)."""
    needs_cuda: bool = False
    """Skipped (``skipped: no CUDA``) when no child process sees a CUDA device."""
    caption: str = ""
    """``str.format`` over the stage's data; a missing field shows as ``–``."""
    tables: tuple[Table, ...] = ()
    """results.md's tables under the caption, each over the stage's data."""


# ---- shared pieces ---------------------------------------------------------------------------------------------


def workload_args(ctx: StudyContext, size: FitSize, *, strategy: str, precision: str | None = None,
                  ranks: int = 1) -> tuple[str, ...]:
    """The arguments after ``fit`` saying what one fit on the study's device trains, without validation or
    checkpoints, but not its steps or timer; ``ranks`` share the device over gloo."""
    return (
        "--seed_everything", "0", "--model.preset", size.preset, "--model.context_length", str(size.seq_len),
        "--data.source", "synthetic", "--data.seq_len", str(size.seq_len), "--data.batch_size", str(size.batch),
        "--trainer.accelerator", ctx.scale.device, "--trainer.devices", "1", "--trainer.num_nodes", str(ranks),
        "--trainer.strategy", strategy_argument(strategy, ctx.scale.backend if ranks == 1 else "gloo"),
        "--trainer.precision", precision or ctx.scale.precision, *NO_VALIDATION, "--trainer.log_every_n_steps", "1",
        *NO_CHECKPOINTS,
    )


def fit_args(ctx: StudyContext, size: FitSize, *, strategy: str, precision: str | None = None, ranks: int = 1,
             extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """``workload_args`` for ``size.steps`` steps, every step timed after ``size.warmup``, then ``extra``."""
    return (*workload_args(ctx, size, strategy=strategy, precision=precision, ranks=ranks),
            "--trainer.max_steps", str(size.steps), "--timer.warmup_steps", str(size.warmup),
            "--timer.every_n_steps", "1", *extra)


def _failures(results: list[FitResult], where: str = "") -> list[str]:
    """One line per fit that did not end ``ok``: ``<name><where>: <status>: <error>``."""
    return [f"{r.name}{where}: {r.status}: {r.error}" for r in results if not r.ok]


def published(batch: int = 0, seq_len: int = 0) -> Callable[[Row], str]:
    """A cell: ``step ms, comm share`` of the published 2-GPU xl run of the row's strategy at (batch, context), else
    at the row's ``batch_size`` and ``context_length``, at its best bucket size; ``–`` where there is none."""

    def cell(row: Row) -> str:
        at = (row.get("strategy") or row.get("name"), batch or int(row.get("batch_size") or 0),
              seq_len or int(row.get("context_length") or 0))
        runs = [r for r in PUBLISHED_RUNS if (r.strategy, r.batch_size, r.seq_len) == at]
        if not runs:
            return "–"
        best = min(runs, key=attrgetter("total_s"))  # the fastest run of the strategy there
        bucket = f" ({best.bucket_size_mb:g} MB)" if best.bucket_size_mb is not None else ""
        return f"{best.total_s * 1e3:,.0f} ms, {best.ratio:.0%} comm{bucket}"

    return cell


def _status(row: Row) -> str:
    """``ok``, or the status and its error."""
    return "ok" if row.get("status") == "ok" else f"{row.get('status')}: {row.get('error')}"


STATUS = Column(header="status", value=_status)
"""The ``status`` column: ``ok``, or the status with its error."""


# ---- the stages -----------------------------------------------------------------------------------------------


def environment(ctx: StudyContext) -> StageResult:
    """Stage environment: a child process (the study holds no CUDA context) writes environment.json: the
    device, the GPUs, driver, CUDA, torch, NCCL, Lightning and Python versions, the commit."""
    path = ctx.out / "environment.json"
    ran = ctx.run_python(["-m", "lightning_ddp.bench.gpu_study.processes", "environment", str(path.resolve()),
                          "--device", ctx.scale.device], ctx.out / "logs" / "environment.log", path)
    return StageResult(data=ran.data or {}, problems=[] if ran.data else [ran.error])  # the study writes <name>.json


# A -v line: "tests/a.py::test_x PASSED [ 50%]", or under pytest-xdist "[gw0] [ 50%] PASSED tests/a.py::test_x"; a
# line of the -rfE summary: "FAILED tests/a.py::test_x - AssertionError: ...".
_OUTCOME = re.compile(r"^(?:(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b|\[gw\d+\] \[ *\d+%\] "
                      r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+::\S+))", re.MULTILINE)
_OUTCOME_KEY = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped",
                "XFAIL": "skipped"}
_SUMMARY = re.compile(r"^(?:FAILED|ERROR) (\S+::\S+) - (.*)$", re.MULTILINE)


def read_pytest_log(text: str) -> dict[str, Any]:
    """The outcomes of a ``pytest -v -rfE`` log as far as it got (a tier cut off included): each outcome's count, and
    the failures (``{"test", "message"}``) with the summary's message."""
    outcomes: dict[str, str] = {}
    for test, outcome, xdist_outcome, xdist_test in _OUTCOME.findall(text):  # the plain form's groups, or xdist's
        outcomes[test or xdist_test] = _OUTCOME_KEY[outcome or xdist_outcome]  # a test's last line: its teardown's
    messages = dict(_SUMMARY.findall(text))
    counts = {key: list(outcomes.values()).count(key) for key in ("passed", "failed", "errors", "skipped")}
    failures = [{"test": test, "message": messages.get(test, outcome)[:300]} for test, outcome in outcomes.items()
                if outcome in ("failed", "errors")]
    return {"tests": len(outcomes), **counts, "failures": failures}


def _pytest_summary_line(log_text: str) -> str:
    """pytest's last line, ``N passed, M failed in S s``, without its ``=`` rule; empty if it never got there."""
    for line in reversed(log_text.splitlines()):
        if " in " in line and any(word in line for word in ("passed", "failed", "error", "skipped")):
            return line.strip("= ")
    return ""


def cuda_tests(ctx: StudyContext) -> StageResult:
    """Stage cuda_tests: ``pytest tests/gpu -m cuda`` in a child process (pytest-xdist workers where installed),
    read back from cuda_tests.log; a problem per failed test, for a tier cut off, and if every test was skipped."""
    if not (ctx.root / "tests" / "gpu").is_dir():
        return StageResult(problems=[f"the cuda test tier (tests/gpu) is not under {ctx.root}: run the study from a "
                                     "checkout of the repository, or pass --root CHECKOUT"])
    log = ctx.out / "cuda_tests.log"
    # 12 pytest-xdist workers where it is installed (the lent GPU machines have 16 cores; each test starts processes
    # of one or two ranks); the engine matrix stays in one worker (xdist_group)
    workers = []
    if importlib.util.find_spec("xdist"):
        workers = ["-p", "xdist", "-n", str(min(12, os.cpu_count() or 1)), "--dist", "loadgroup"]
    ran = ctx.run_python(["-m", "pytest", "tests/gpu", "-m", "cuda", "-v", "-rfE", "-p", "no:cacheprovider",
                          *workers], log)
    text = log.read_text(errors="replace") if log.exists() else ""
    summary_line = _pytest_summary_line(text)
    data = read_pytest_log(text)
    if not data["tests"]:
        return StageResult(files=["cuda_tests.log"] if log.exists() else [],
                           problems=[ran.error or "pytest ran no test"])
    data.update(summary_line=summary_line, exit_code=ran.code, timed_out=ran.timed_out)
    problems = [f"{f['test']}: {f['message']}" for f in data["failures"]]
    if problems:
        problems[0] = f"{len(problems)} of {data['tests']} failed, first: {problems[0]}"
    if ran.timed_out:
        problems.insert(0, f"the tier ran out of time ({summary_line or 'no summary'})")
    elif data["tests"] and data["skipped"] == data["tests"]:
        problems.append("every test of the tier was skipped: pytest saw no CUDA device")
    return StageResult(data=data, files=["cuda_tests.log"], problems=problems)


def compute(ctx: StudyContext) -> StageResult:
    """Stage compute: in bf16-mixed and 32-true, one process each finds the largest batch that fits one device
    (from the memory pre-flight's down) and times it (step ms, tokens/s, MFU, peak memory against the estimate)."""
    stage, size = ctx.stage_dir("compute"), ctx.scale.compute
    published_ms = []
    for (batch, seq), (ms, extrapolated) in calibrated_compute_ms().items():
        if seq == size.seq_len:
            tokens_per_s = batch * seq / (ms / 1e3)
            note = " (extrapolated)" if extrapolated else ""
            published_ms.append(f"batch {batch}: {ms:,.0f} ms = {tokens_per_s:,.0f} tokens/s per GPU{note}")
    result = StageResult(data={**asdict(size), "device": ctx.scale.device,
                               "published": "; ".join(published_ms) or "none at this context", "rows": {}})
    for precision in ("bf16-mixed", "32-true"):
        request, out = stage / f"request_{precision}.json", stage / f"compute_{precision}.json"
        write_json_atomically(request, {"preset": size.preset, "seq_len": size.seq_len, "max_batch": size.batch,
                                        "steps": size.steps, "warmup": size.warmup, "precision": precision,
                                        "device": ctx.scale.device, "out": str(out.resolve())})
        ran = ctx.run_python(["-m", "lightning_ddp.bench.gpu_study.processes", "compute", "--config",
                              str(request.resolve())], stage / f"compute_{precision}.log", out)
        run = ran.data or {"status": "failed", "error": f"{precision}: {ran.error}"}
        if ran.data is not None:  # the process wrote its result
            run.pop("estimate_table", None)
            run["status"] = "ok" if run.get("batch") else "failed"
            result.files.append(f"compute/compute_{precision}.json")
        if run["status"] != "ok" and run.get("preflight_batch"):
            run.setdefault("error", f"{precision}: every batch from {run['preflight_batch']} down ran out of memory")
        elif run["status"] != "ok":
            run.setdefault("error", f"{precision}: the pre-flight allows no batch")
        if run["status"] != "ok":
            result.problems.append(run["error"])
        result.data["rows"][precision] = run
    return result


def _tried(run: Row) -> str:
    """The pre-flight's batch and each batch tried from it."""
    tried = [f"{a['batch']}{' OOM' if a['status'] == 'oom' else ''}" for a in run.get("attempts", [])]
    return f"{run.get('preflight_batch')}: {' → '.join(tried)}"


def _estimate_over_reserved(run: Row) -> float | None:
    """The pre-flight's estimate over the measured peak reserved bytes; ``None`` if either is missing."""
    estimate, reserved = run.get("estimate_bytes"), run.get("peak_reserved_bytes")
    return estimate / reserved if estimate and reserved else None


def _fit_row(result: FitResult) -> dict[str, Any]:
    """Every median of one fit's timing summary."""
    summary = result.summary or {}
    medians = {key: stats.get("median") for key, stats in (summary.get("summary") or {}).items()}
    return {"status": result.status, "error": result.error, "seconds": round(result.seconds, 1), **medians}


def strategies(ctx: StudyContext) -> StageResult:
    """Stage strategies: one fit of every catalogue strategy (ddp first) on one rank; each row holds its timing
    medians and ``overhead_vs_ddp``, its step over ddp's minus 1 (``None`` without both steps)."""
    names = ["ddp", *(name for name in catalogue.names() if name != "ddp")]  # the baseline first: a cut stage keeps it
    results = ctx.fits("strategies", [FitSpec(n, fit_args(ctx, ctx.scale.strategies, strategy=n)) for n in names])
    rows = {r.name: _fit_row(r) for r in results}
    baseline = rows.get("ddp", {}).get("step/time_ms")
    for row in rows.values():
        step = row.get("step/time_ms")
        row["overhead_vs_ddp"] = step / baseline - 1 if step and baseline else None
    problems = _failures(results)  # whether each step's numbers hold: the cuda tier's fits on every strategy
    data = {**asdict(ctx.scale.strategies), "backend": ctx.scale.backend, "precision": ctx.scale.precision,
            "rows": rows}
    files = []
    for r in results:
        summary = r.file("timing_summary.json")
        if summary is not None:
            files.append(ctx.relative(summary))
    return StageResult(data=data, files=files, problems=problems)


# Stage one_gpu_pair: fp32 fits on the same global batch, 2 ranks (batch 2 each) against one process (batch 4),
# compared in updates (lr x steps); docs/gpu.md says how the tolerances were calibrated.
EQUIVALENCE = FitSize(preset="tiny", batch=2, seq_len=64, steps=3, warmup=0)
EQUIVALENCE_LR = 1e-3
"""Learning rate of the equivalence fits: a weight's difference is counted in updates of lr x steps."""
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

    def quantile(q: float) -> float:
        """The ``q`` quantile of every difference: the k-th smallest, k = q x their number (at least the first)."""
        return float(every.kthvalue(max(1, round(q * every.numel()))).values)

    return {"off_fraction": float((every > OFF_BY).double().mean()), "median_updates": quantile(0.5),
            "p99_updates": quantile(0.99), "max_updates": float(per_tensor[worst].max()), "worst_tensor": worst}


def _equivalence_spec(ctx: StudyContext, name: str, strategy: str, ranks: int) -> FitSpec:
    """One fp32 fit saving its final weights; ``ranks`` x its batch is the same global batch for every fit."""
    weights = ctx.out / "one_gpu_pair" / name / "weights.pt"
    extra = ("--model.lr", str(EQUIVALENCE_LR), "--timer.enabled", "false",
             "--trainer.callbacks+=lightning_ddp.bench.gpu_study.processes.SaveFinalWeights",
             "--trainer.callbacks.path", str(weights.resolve()))
    size = replace(EQUIVALENCE, batch=2 * EQUIVALENCE.batch // ranks)
    return FitSpec(name, fit_args(ctx, size, precision="32-true", strategy=strategy, ranks=ranks, extra=extra))


def _weights(result: FitResult) -> Any:
    """The final weights ``result``'s fit saved, removed once read (~14 MB a strategy, worth nothing more)."""
    path = result.file("weights.pt")
    if not result.ok or path is None:
        return None
    weights = torch.load(path, weights_only=True)
    path.unlink()
    return weights


def one_gpu_pair(ctx: StudyContext) -> StageResult:
    """Every strategy on 2 ranks sharing the device vs one process on the same global batch (fp32)."""
    reference = ctx.fits("one_gpu_pair", [_equivalence_spec(ctx, "one_process", REFERENCE, 1)])[0]
    pairs = ctx.fits("one_gpu_pair", [_equivalence_spec(ctx, n, n, 2) for n in catalogue.names()], ranks=2)
    problems = _failures([reference]) + _failures(pairs, " on 2 ranks")
    expected = _weights(reference)
    rows: dict[str, Any] = {}
    for result in pairs:
        row = rows[result.name] = {"status": result.status, "error": result.error}
        actual = _weights(result)
        if expected is None or actual is None:
            continue
        row.update(weight_differences(actual, expected, EQUIVALENCE_LR * EQUIVALENCE.steps))
        tolerance = EXACT_TOLERANCE if catalogue.get(result.name).exact else LOSSY_TOLERANCE
        row.update(tolerance=tolerance, equal=row["off_fraction"] <= tolerance)
        if not row["equal"]:
            problems.append(f"{result.name} on 2 ranks differs from one process: {row['off_fraction']:.2%} of the "
                            f"weights off by > {OFF_BY:g} update (tolerance {tolerance:.2%}; worst "
                            f"{row['max_updates']:.3g} updates at {row['worst_tensor']})")
    data = {**asdict(EQUIVALENCE), "lr": EQUIVALENCE_LR, "precision": "32-true", "off_by_updates": OFF_BY,
            "rows": rows}
    return StageResult(data=data, problems=problems)


def without_and_with_overlap() -> list[str]:
    """The catalogue's first engine that communicates after backward, and its first that overlaps backward."""
    engines = [catalogue.get(name) for name in catalogue.names(engines_only=True)]
    return [next(e.name for e in engines if not e.overlaps_backward),
            next(e.name for e in engines if e.overlaps_backward)]


def traces(ctx: StudyContext) -> StageResult:
    """Stage traces: the first engine that syncs after backward and the first that overlaps it, each traced on 2
    gloo ranks; draws traces/timeline.png and reports each run's overlap, communication and hidden ms."""
    from lightning_ddp.trace import load_run, render_timeline

    record = str((ctx.root / "configs" / "trace" / "record.yaml").resolve())
    specs = [FitSpec(name, fit_args(ctx, ctx.scale.traces, strategy=name, ranks=2, extra=("--config", record)))
             for name in without_and_with_overlap()]
    results = ctx.fits("traces", specs, ranks=2)
    problems = _failures(results)
    runs = [load_run([r.log_dir / "traces"], r.name) for r in results if r.ok and (r.log_dir / "traces").exists()]
    data: dict[str, Any] = {**asdict(ctx.scale.traces), "ranks": 2, "precision": ctx.scale.precision, "rows": {}}
    if not runs:
        return StageResult(data=data, problems=problems)
    picture = ctx.out / "traces" / "timeline.png"
    timeline = render_timeline(runs, picture, title="naive vs overlap, 2 gloo ranks time-slicing one device")
    for label, overlap in timeline.overlaps.items():
        gpu_rows = [row.bars for row in timeline.rows if row.run == label and row.kind == "gpu"]
        data["rows"][label] = {"overlap": overlap.fraction, "comm_ms": overlap.comm / 1e3,
                               "hidden_ms": overlap.overlapped / 1e3, "gpu_kernel_bars": sum(gpu_rows),
                               "gpu_rows": len(gpu_rows)}
        if ctx.scale.device == "cuda" and not sum(gpu_rows):
            problems.append(f"{label}: the trace has no GPU kernel rows")
    files = [ctx.relative(picture)]
    for run in runs:
        files += [ctx.relative(rank.path) for rank in run.ranks]
    return StageResult(data=data, files=files, problems=problems)


def ready_times(ctx: StudyContext) -> StageResult:
    """Stage ready_times: one fit's compute profile (each gradient's ready time in backward), projected to 2
    ranks of the profiled GPU (H100 if it is not in the table) over nvlink4 and pcie_gen4."""
    from lightning_ddp.hardware import find_device
    from lightning_ddp.profile import read_profile
    from lightning_ddp.projection import config as projection
    from lightning_ddp.projection.flops import GPUS
    from lightning_ddp.projection.run import run_projection

    size = ctx.scale.profile
    spec = FitSpec("profile", fit_args(ctx, size, strategy=without_and_with_overlap()[0]))
    (fit,) = ctx.fits("ready_times", [spec])
    path = fit.file("compute_profile.json")
    if not fit.ok or path is None:
        error = fit.error or "no compute_profile.json"
        return StageResult(problems=[f"the {size.preset} fit: {fit.status}: {error}"])
    profile = read_profile(path)
    ready = sorted(p.ready_ms for p in profile.params if p.ready_ms is not None)
    data: dict[str, Any] = {
        **asdict(size), "device": profile.device, "precision": ctx.scale.precision,
        "forward_ms": profile.forward_ms, "backward_ms": profile.backward_ms, "optimizer_ms": profile.optimizer_ms,
        "tensors": len(profile.params), "first_ready_ms": ready[0] if ready else None,
        "last_ready_ms": ready[-1] if ready else None, "profile": ctx.relative(path), "projections": {},
    }
    result = StageResult(data=data, files=[ctx.relative(path)])
    if len(ready) != len(profile.params):
        result.problems.append(f"{len(profile.params) - len(ready)} tensors never became ready")
    # Projected to 2 ranks on the profiled GPU (its memory bandwidth prices the copies; H100 if not in the table):
    # one row per strategy, a bucketed one at its best bucket size.
    gpu = "h100-sxm"
    device = find_device(profile.device) if profile.device != "cpu" else None
    if device is not None and device.key in GPUS:
        gpu = device.key
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
    """Stage timer_overhead: ``python -m lightning_ddp.bench.timer_overhead`` on the default engine, one round of
    its three arms, with this study's fit arguments."""
    overhead, stage = ctx.scale.overhead, ctx.stage_dir("timer_overhead")
    fit = workload_args(ctx, overhead, strategy=catalogue.DEFAULT_ENGINE)  # the benchmark sets steps and timer
    log, path = stage / "timer_overhead.log", stage / "timer_overhead.json"
    ran = ctx.run_python(["-m", "lightning_ddp.bench.timer_overhead", "--fit_config", "configs/quickstart.yaml",
                          "--strategies", json.dumps([catalogue.DEFAULT_ENGINE]),
                          "--steps", str(overhead.steps), "--warmup_steps", str(overhead.warmup), "--repeats",
                          "1", "--out_dir", str(stage.resolve()),  # one round of the 3 arms: a process each
                          "--fit_args", json.dumps(fit)], log, path)
    if ran.data is None:
        return StageResult(files=[ctx.relative(log)], problems=[ran.error])
    measured = ran.data["strategies"][catalogue.DEFAULT_ENGINE]  # the one strategy this stage ran
    return StageResult(data={**ran.data, **measured, "preset": overhead.preset},
                       files=[ctx.relative(path), ctx.relative(stage / "timer_overhead.md")])


# ---- results.md: each stage's rows, columns and caption -----------------------------------------------------------


def gpu_rows(data: dict[str, Any]) -> list[Row]:
    """environment.json's GPUs, one row each."""
    return data.get("gpus") or []


def failure_rows(data: dict[str, Any]) -> list[Row]:
    """The cuda tier's failed tests, one row each (``test``, ``message``)."""
    return data.get("failures") or []


def rows_by_name(data: dict[str, Any]) -> list[Row]:
    """The rows of ``data["rows"]``, a dict by name, each with its name."""
    return [{"name": name, **row} for name, row in (data.get("rows") or {}).items()]


def projection_rows(data: dict[str, Any]) -> list[Row]:
    """Every network's projected rows, each with its network, GPU, and the profiled batch and context."""
    rows = []
    for network, projection in (data.get("projections") or {}).items():
        where = {"network": network, "gpu": projection["gpu"], "batch_size": data.get("batch"),
                 "context_length": data.get("seq_len")}
        rows += [{**row, **where} for row in projection["rows"]]
    return rows


def _hardware(gpu: Row) -> str:
    """A GPU's row of the hardware table: its key and dense peaks (those MFU is computed against)."""
    row = gpu.get("hardware_table") or {}
    if not row:
        return "not in the table"
    peaks = row.get("dense_tflops") or {}
    return f"{row.get('key')}: {peaks.get('bf16')} / {peaks.get('fp32')} TFLOP/s dense bf16 / fp32"


ENVIRONMENT_GPUS = Table(rows=gpu_rows, columns=(
    Column(header="GPU", value="name"),
    Column(header="memory GiB", value="total_memory_bytes", format="GiB"),
    Column(header="SMs", value="sm_count"),
    Column(header="CC", value="compute_capability"),
    Column(header="hardware table", value=_hardware),
    Column(header="MIG (g, GB)", value="mig_profile"),
))
CUDA_TEST_FAILURES = Table(rows=failure_rows, columns=(
    Column(header="failed test", value="test"),
    Column(header="message", value="message"),
))
COMPUTE_RUNS = Table(rows=rows_by_name, columns=(
    Column(header="precision", value="name"),
    STATUS,
    Column(header="dtype", value="compute_dtype"),
    Column(header="batch", value="batch"),
    Column(header="pre-flight batch: tried", value=_tried),
    Column(header="step ms", value="step_ms_median", format=",.1f"),
    Column(header="tokens/s", value="tokens_per_s", format=",.0f"),
    Column(header="MFU", value="mfu", format=".1%"),
    Column(header="peak alloc GiB", value="peak_allocated_bytes", format="GiB"),
    Column(header="peak reserved GiB", value="peak_reserved_bytes", format="GiB"),
    Column(header="estimate GiB", value="estimate_bytes", format="GiB"),
    Column(header="estimate / reserved", value=_estimate_over_reserved, format=".2f"),
))
STRATEGY_COSTS = Table(rows=rows_by_name, columns=(
    Column(header="strategy", value="name"),
    STATUS,
    Column(header="step ms", value="step/time_ms", format=",.1f"),
    Column(header="vs ddp", value="overhead_vs_ddp", format="+.1%"),
    Column(header="exposed ms", value="comm/exposed_ms", format=",.2f"),
    Column(header="calls", value="comm/calls", format=",.0f"),
    Column(header="MFU", value="step/mfu", format=".1%"),
    Column(header="peak MiB", value="memory/peak_MiB", format=",.0f"),
    Column(header="published 2-GPU xl (batch 4, ctx 512)", value=published(4, 512)),
))
PROJECTED_STEPS = Table(rows=projection_rows, columns=(
    Column(header="network", value="network"),
    Column(header="GPU", value="gpu"),
    Column(header="strategy", value="strategy"),
    Column(header="best bucket MB", value="bucket_size_mb", format="g"),
    Column(header="step ms", value="step_ms", format=",.1f"),
    Column(header="exposed ms", value="exposed_comm_ms", format=",.1f"),
    Column(header="comm share", value="comm_share", format=".1%"),
    Column(header="published 2-GPU xl", value=published()),
))
TRACED_RUNS = Table(rows=rows_by_name, columns=(
    Column(header="run", value="name"),
    Column(header="overlap", value="overlap", format=".0%"),
    Column(header="comm ms", value="comm_ms", format=",.1f"),
    Column(header="hidden ms", value="hidden_ms", format=",.1f"),
    Column(header="GPU rows", value="gpu_rows"),
    Column(header="GPU kernels drawn", value="gpu_kernel_bars", format=",d"),
    Column(header="published 2-GPU xl (batch 2, ctx 512)", value=published(2, 512)),
))
WEIGHT_DIFFERENCES = Table(rows=rows_by_name, columns=(
    Column(header="strategy", value="name"),
    STATUS,
    Column(header="weights off", value="off_fraction", format=".3%"),
    Column(header="tolerance", value="tolerance", format=".2%"),
    Column(header="median", value="median_updates", format=".1e"),
    Column(header="99th pct", value="p99_updates", format=".1e"),
    Column(header="largest", value="max_updates", format=".2g"),
    Column(header="at", value="worst_tensor"),
    Column(header="equal", value="equal"),
))


# ---- the stages, in the order a call runs them: what only a GPU can show first -------------------------------------

STAGES: tuple[Stage, ...] = (
    Stage(
        name="environment",
        title="Environment",
        run=environment,
        estimate=Estimate(process_starts=1, fit_starts=0, work_s=0, dry_run_s=5),
        caption=("Device {device} (CPU: {cpu[model]}, {cpu[count]} cores); NVIDIA driver {nvidia_driver}, CUDA driver "
                 "API {cuda_driver_api}, torch {torch} (CUDA {torch_cuda}, cuDNN {cudnn}, NCCL {nccl}), Lightning "
                 "{lightning}, Python {python}; commit {git_commit:.12} (dirty: {git_dirty})."),
        tables=(ENVIRONMENT_GPUS,),
    ),
    Stage(
        name="cuda_tests",
        title="The cuda test tier: every engine, and the CommTimer's CUDA paths",
        run=cuda_tests,
        estimate=Estimate(process_starts=5, fit_starts=3, work_s=10, dry_run_s=0),
        needs_cuda=True,
        caption=("pytest: {summary_line} ({tests} tests: {passed} passed, {failed} failed, {errors} errors, {skipped} "
                 "skipped)."),
        tables=(CUDA_TEST_FAILURES,),
    ),
    Stage(
        name="compute",
        title="Compute and MFU of one device, without communication",
        run=compute,
        estimate=Estimate(process_starts=2, fit_starts=0, work_s=23, dry_run_s=20),
        caption=("{preset} preset on {device}, context {seq_len}, at the largest batch that fits (at most "
                 "{batch}), medians of {steps} steps after {warmup}. The published 2-GPU xl runs' compute-only "
                 "step at this context (naive's step minus its all-reduce; bf16-mixed, GPU not named): {published}."),
        tables=(COMPUTE_RUNS,),
    ),
    Stage(
        name="strategies",
        title="Every strategy at world size 1: what its hooks and copies cost",
        run=strategies,
        estimate=Estimate(process_starts=1, fit_starts=11, work_s=14, dry_run_s=60),
        caption=("{preset} preset, batch {batch} x {seq_len} tokens, {precision}, one rank ({backend}), medians after "
                 "{warmup} of {steps} steps: the step over ddp's is what a strategy's hooks cost."),
        tables=(STRATEGY_COSTS,),
    ),
    Stage(
        name="ready_times",
        title="Gradient-ready times in backward, projected to 2 GPUs",
        run=ready_times,
        estimate=Estimate(process_starts=1, fit_starts=1, work_s=36, dry_run_s=20),
        caption=("{preset} preset on {device}, batch {batch} x {seq_len}, {precision}: forward {forward_ms:,.1f} ms, "
                 "backward {backward_ms:,.1f} ms, optimizer {optimizer_ms:,.1f} ms; {tensors} gradients ready from "
                 "{first_ready_ms:,.1f} to {last_ready_ms:,.1f} ms into backward (`{profile}`), and projected to 2 "
                 "GPUs."),
        tables=(PROJECTED_STEPS,),
    ),
    Stage(
        name="timer_overhead",
        title="The CommTimer's overhead",
        run=timer_overhead,
        estimate=Estimate(process_starts=3, fit_starts=3, work_s=6, dry_run_s=40),
        caption=("{preset} preset, {repeats} off/on pairs of {steps} steps ({warmup} left out): median step "
                 "{median_step_ms_timer_off:,.2f} ms off, {median_step_ms_timer_on:,.2f} ms with the timer at its "
                 "default sampling ({goal_arm}): overhead {overhead:+.2%} [95 %: {overhead_lo:+.2%}, "
                 "{overhead_hi:+.2%}], goal < 1 %: **{verdict}**; over whole runs {window_overhead:+.2%}."),
    ),
    Stage(
        name="traces",
        title="Traces: naive vs overlap on 2 ranks sharing the device",
        run=traces,
        estimate=Estimate(process_starts=1, fit_starts=2, work_s=17, dry_run_s=30),
        caption=("{preset} preset, {precision}, 2 gloo ranks on the one device, 3 traced steps; overlap: the share of "
                 "communication during which the rank computed. ![naive vs overlap](traces/timeline.png)"),
        tables=(TRACED_RUNS,),
    ),
    Stage(
        name="one_gpu_pair",
        title="2 ranks sharing the device over gloo: every strategy against one process",
        run=one_gpu_pair,
        estimate=Estimate(process_starts=2, fit_starts=12, work_s=5, dry_run_s=82),
        caption=("{preset} preset, fp32, {steps} steps at lr {lr}: 2 ranks of batch {batch} against one process on "
                 "the same samples; weight differences in updates (lr x steps), *off* beyond {off_by_updates} update; "
                 "docs/gpu.md says how the tolerances were calibrated."),
        tables=(WEIGHT_DIFFERENCES,),
    ),
)
"""Every stage, in the order the study runs them (``GPU_SCALE``: one call of ``--budget_min 9``)."""
