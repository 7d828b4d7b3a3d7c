"""Run a sweep (docs/benchmarks.md): every cell repeat in its own processes, interleaved, resumable, each after the
load guard; then results.csv, results.md and the plots. The cell runner and the load guard are injected (tests)."""

from __future__ import annotations

import math
import os
import platform
import re
import shutil
import signal
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

from lightning_ddp.bench.config import REFERENCE, Cell, SweepConfig, expand_grid, has_bucket_axis
from lightning_ddp.bench.launch import (
    ProcessResult, RankLayout, cpu_threads_per_rank, error_line, first_error_line, fit_command, is_oom,
    rank_environments, rank_layout, run_processes, strategy_argument, write_command,
)
from lightning_ddp.bench.report import (
    REPEAT_COLUMNS, RESULT_COLUMNS, Analysis, RepeatKey, Row, build_report, cell_data, cell_row, parse_row,
    read_rows, read_steps, write_csv, write_plots,
)
from lightning_ddp.bench.stats import Bootstrapper
from lightning_ddp.bench.study import (
    NO_CHECKPOINTS, NO_VALIDATION, LoadCheck, find_timing_summary, interleaved, load_average, print_flushed,
    provenance, read_json, wait_until_idle, write_outputs,
)
from lightning_ddp.local_group import find_free_port
from lightning_ddp.memory import FP32, gpt_parameter_shapes
from lightning_ddp.reporting.provenance import package_version
from lightning_ddp.reporting.tables import csv_value
from lightning_ddp.reporting.variants import format_settings

RESULTS_CSV = "results.csv"
"""One row per cell (``report.RESULT_COLUMNS``), recomputed from repeats.csv and steps.csv alone."""
REPEATS_CSV = "repeats.csv"
"""One row per repeat run (``report.REPEAT_COLUMNS``); a repeat listed here is done and not run again."""
STEPS_CSV = "steps.csv"
"""One row per measured step of an ok repeat: the CommTimer's metrics of that step."""
PROFILES_JSON = "profiles.json"
"""Cell id -> the compute_profile.json of its first ok repeat (what the projection validates on)."""
RESULTS_MD = "results.md"
"""The report: the strategy tables, goals and verdicts, written from results.csv's analysis."""
ENVIRONMENT_JSON = "environment.json"
"""Hardware, versions and the config of the sweep, with one entry per session that added repeats."""
PREDICTION_JSON = "bucket_prediction.json"
"""The all-reduce microbenchmark's fit and the bucket size it predicts (``bucket_size_mb: auto``)."""
ALLREDUCE_REPEATS = 10  # timed calls per message size in the sweep's microbenchmark (the median is kept)


# ---- a cell's processes ---------------------------------------------------------------------------------


def cell_command(cell: Cell, config: SweepConfig, layout: RankLayout, run_dir: Path) -> list[str]:
    """The ``fit`` command every process of the cell runs, logging into ``run_dir``."""
    run, workload = config.run, config.workload
    reference = cell.strategy == REFERENCE
    args = ["--config", workload.base_config, *workload.cli_args]
    if workload.preset is not None:
        args += ["--model.preset", workload.preset]
    strategy = strategy_argument(cell.strategy, layout.backend, cell.bucket_size_mb, dict(cell.engine_settings))
    args += [
        "--model.context_length", str(cell.context_length),
        "--data.seq_len", str(cell.context_length),
        "--data.batch_size", str(cell.batch_size),
        "--trainer.accelerator", run.accelerator,
        "--trainer.devices", "1" if reference else str(layout.devices_per_node),
        "--trainer.num_nodes", "1" if reference else str(layout.num_nodes),
        "--trainer.strategy", strategy,
        "--trainer.precision", cell.precision,
        "--trainer.max_steps", str(run.warmup_steps + run.steps),
        *NO_VALIDATION,
        "--trainer.log_every_n_steps", "1",
        *NO_CHECKPOINTS,
        "--trainer.enable_progress_bar", "false",
        "--timer.enabled", "true",
        "--timer.every_n_steps", "1",  # every step measured: the statistics are over steps
        "--timer.warmup_steps", str(run.warmup_steps),
    ]
    return fit_command(args, run_dir)


def threads_per_rank(config: SweepConfig) -> int | None:
    """``run.threads_per_rank``, or on CPU ``cores // devices`` (what Lightning's DDP sets), or ``None`` on CUDA."""
    if config.run.threads_per_rank is not None:
        return config.run.threads_per_rank
    if config.run.accelerator != "cpu":
        return None
    return cpu_threads_per_rank(config.run.devices)


def cell_environments(cell: Cell | None, config: SweepConfig, layout: RankLayout, port: int,
                      parent: dict[str, str] | None = None) -> list[dict[str, str]]:
    """Every rank's environment, or one for the reference and ``launcher: lightning`` (``cell`` None: all-reduce)."""
    every_rank = cell is None or (cell.strategy != REFERENCE and config.run.launcher == "ranks")
    return rank_environments(layout, port, every_rank=every_rank, threads=threads_per_rank(config),
                             extra=config.run.env, parent=parent)


# ---- one cell repeat ----------------------------------------------------------------------------------------


_ADDRESS_IN_USE = re.compile(r"address already in use|EADDRINUSE", re.IGNORECASE)
"""A rank's error when the free port was taken between probe and bind: the cell is run once more."""


@dataclass
class CellOutcome:
    """A cell run's status, the error line behind it, its timing_summary.json and compute_profile.json, wall time."""

    status: Literal["ok", "oom", "failed", "timeout"]
    reason: str = ""
    """The error line behind a status other than ``ok``; empty when ok."""
    summary: dict[str, Any] | None = None
    """The CommTimer's timing_summary.json; ``None`` unless ok."""
    wall_s: float = 0.0
    """Seconds from starting the cell's processes to the last one's exit (``ProcessResult.wall_s``)."""
    profile: dict[str, Any] | None = None
    """Its compute_profile.json; ``None`` unless ok, or where none was written or it did not parse."""


def classify(result: ProcessResult, logs: list[str], summary_found: bool, timeout_s: float = 0.0) -> tuple[str, str]:
    """``(status, reason)`` of a finished cell from its processes (``launch.run_processes``) and their output:
    timeout; else oom if a failed rank's log says so or a rank died by a SIGKILL we did not send; else failed; else
    ok if the CommTimer wrote its summary."""
    returncodes, first_failed = result.returncodes, result.first_failed
    order = [i for i in range(len(logs)) if i != first_failed]  # the ranks, the first that failed first
    if first_failed is not None:
        order.insert(0, first_failed)
    last = first_error_line(logs[i] for i in order)
    if result.timed_out:
        return "timeout", f"no result after {timeout_s:.0f} s" + (f"; last output: {last}" if last else "")
    failed = [i for i in order if returncodes[i] not in (0, None)]
    if not failed and summary_found:
        return "ok", ""
    if not failed:
        return "failed", "exited 0 but wrote no timing_summary.json" + (f" (last output: {last})" if last else "")
    for i in failed:
        match = next((line for line in reversed(logs[i].splitlines()) if is_oom(line)), None)
        if match:
            return "oom", f"rank {i}: {match.strip()[:300]}"
    for i in failed:
        if returncodes[i] == -signal.SIGKILL and i not in result.killed_by_us:
            return "oom", f"rank {i} was killed by SIGKILL (-9), most likely the kernel's out-of-memory killer"
    first = failed[0]
    line = error_line(logs[first])
    code = returncodes[first]
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    if not line:
        return "failed", f"rank {first} ({how}) printed no error line"
    return "failed", f"rank {first} ({how}): {line}"


@dataclass
class SubprocessCellRunner:
    """Runs a cell as ``python -m lightning_ddp fit`` processes in ``cwd`` (relative config paths resolve there)."""

    config: SweepConfig
    layout: RankLayout
    cwd: str | None = None

    def __call__(self, cell: Cell, run_dir: Path) -> CellOutcome:
        """Runs ``cell`` into ``run_dir`` (emptied first); once more if a rank lost its port."""
        outcome = self._run_once(cell, run_dir)
        if outcome.status == "failed" and _ADDRESS_IN_USE.search(outcome.reason):
            outcome = self._run_once(cell, run_dir)  # the free port was taken between probe and bind: once more
        return outcome

    def _run_once(self, cell: Cell, run_dir: Path) -> CellOutcome:
        """The cell's processes once, in a fresh ``run_dir``: their logs, command and outcome."""
        if run_dir.exists():
            shutil.rmtree(run_dir)  # a rerun (e.g. retry_failed) starts clean: no stale summary is read
        run_dir.mkdir(parents=True)
        command = cell_command(cell, self.config, self.layout, run_dir.resolve())
        envs = cell_environments(cell, self.config, self.layout, find_free_port())
        write_command(run_dir / "command.txt", command, envs)
        logs = [run_dir / f"rank{r}.log" for r in range(len(envs))]
        result = run_processes(command, envs, logs, self.config.run.timeout_s, cwd=self.cwd)
        summary = find_timing_summary(run_dir)
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in logs]
        status, reason = classify(result, texts, summary is not None, self.config.run.timeout_s)
        if status != "ok":
            return CellOutcome(status=status, reason=reason, wall_s=result.wall_s)
        profile_path = next(iter(sorted(run_dir.rglob("compute_profile.json"))), None)
        profile = read_json(profile_path, missing_ok=True) if profile_path else None  # an extra: a bad file is left out
        return CellOutcome(status=status, reason=reason, summary=summary, wall_s=result.wall_s, profile=profile)


def repeat_row(cell: Cell, repeat: int, outcome: CellOutcome, load: LoadCheck | None = None, **columns: Any) -> Row:
    """The repeats.csv row of ``cell``'s repeat: its coordinates, ``outcome``, ``load``, ``columns`` (None: empty, as
    ``csv_value`` writes it)."""
    load = load or LoadCheck()
    row: Row = {column: "" for column in REPEAT_COLUMNS}
    row.update(columns)
    row.update(
        {name: getattr(cell, name) for name in ("strategy", "batch_size", "context_length", "precision", "world_size")},
        cell_id=cell.id,
        repeat=repeat,
        bucket_size_mb=cell.bucket_size_mb,
        engine_settings=format_settings(dict(cell.engine_settings)),
        status=outcome.status,
        reason=outcome.reason,
        wall_s=round(outcome.wall_s, 1),
        busy_before=None if load.busy_before is None else round(load.busy_before, 3),
        waited_s=None if load.busy_before is None else round(load.waited_s, 1),
        busy=load.busy,
    )
    if cell.strategy == REFERENCE:
        row["backend"] = ""
    if outcome.status == "ok" and outcome.summary:
        row["measured_steps"] = len(measured_step_rows(cell.id, repeat, outcome.summary))
        resolved = (outcome.summary.get("run") or {}).get("bucket_size_mb")
        if has_bucket_axis(cell.strategy) and isinstance(resolved, (int, float)):  # "auto" if the size was not recorded
            row["resolved_bucket_size_mb"] = resolved
    return row


def measured_step_rows(cell_id: str, repeat: int, summary: Mapping[str, Any]) -> list[Row]:
    """The steps.csv rows of one ok repeat: its ``timing_summary.json`` step rows after the first ``warmup_steps``."""
    warmup = int(summary.get("warmup_steps", 0))
    rows = []
    for step in list(summary.get("steps", []))[warmup:]:
        metrics = {k: v for k, v in step.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        rows.append({"cell_id": cell_id, "repeat": repeat, "step": int(step.get("step", len(rows))), **metrics})
    return rows


@dataclass
class SweepResult:
    """The grid's cells, the ``Analysis`` of those that ran, the ``(cell_id, repeat)`` this call ran, the plots."""

    cells: list[Cell]
    analysis: Analysis
    ran: list[RepeatKey] = field(default_factory=list)
    plots: list[Path] = field(default_factory=list)

    @property
    def ok(self) -> int:
        """How many of the analysis's cells ended ok."""
        return sum(1 for r in self.analysis.rows if r["status"] == "ok")


def record(out_dir: Path, repeats: dict[RepeatKey, Row], steps: dict[RepeatKey, list[Row]], outcome: CellOutcome,
           row: Row, wants_prediction: bool) -> None:
    """A repeat's ``row`` ran: steps.csv, repeats.csv (last: marks it done), profiles.json, the prediction."""
    cell_id, repeat = row["cell_id"], row["repeat"]
    key = (cell_id, repeat)
    steps.pop(key, None)
    if outcome.status == "ok" and outcome.summary:
        steps[key] = measured_step_rows(cell_id, repeat, outcome.summary)
    repeats[key] = parse_row({c: csv_value(v) for c, v in row.items()}, REPEAT_COLUMNS)
    # steps first, the repeat's row last: a kill in between leaves steps that the next run ignores
    write_csv(out_dir / STEPS_CSV, (step for k in repeats if k in steps for step in steps[k]))
    write_csv(out_dir / REPEATS_CSV, repeats.values(), REPEAT_COLUMNS)
    profiles: dict[str, Any] = read_json(out_dir / PROFILES_JSON, missing_ok=True) or {}
    if outcome.status == "ok" and outcome.profile and cell_id not in profiles:
        write_outputs(out_dir, {PROFILES_JSON: {**profiles, cell_id: outcome.profile}})
    if outcome.status == "ok" and wants_prediction:
        _complete_prediction(out_dir / PREDICTION_JSON, outcome)


def write_results(config: SweepConfig, cells: list[Cell], repeats: dict[RepeatKey, Row],
                  steps: dict[RepeatKey, list[Row]], bootstrap: Bootstrapper,
                  final: bool = False) -> SweepResult:
    """results.csv (the grid's ``cells``, then any other of repeats.csv), results.md and, when ``final``, the plots."""
    out_dir = Path(config.output.out_dir)
    data = cell_data(repeats.values(), (step for rows in steps.values() for step in rows))
    ids = [c.id for c in cells]
    analysis = Analysis({cid: data[cid] for cid in ids if cid in data}, bootstrap)
    others = [parse_row(cell_row(d, bootstrap)) for cid, d in data.items() if cid not in set(ids)]
    write_csv(out_dir / RESULTS_CSV, analysis.rows + others, RESULT_COLUMNS)
    pending = len(set(interleaved(ids, config.run.repeats)) - set(repeats))
    prediction = read_json(out_dir / PREDICTION_JSON, missing_ok=True)
    environment = read_json(out_dir / ENVIRONMENT_JSON, missing_ok=True)
    write_outputs(out_dir, {RESULTS_MD: build_report(analysis, config.name, prediction, environment, pending)})
    if not (final and config.output.plots and analysis.rows):
        return SweepResult(cells, analysis)
    predicted_mb = prediction["bucket_bytes"] / 2**20 if prediction and prediction.get("bucket_bytes") else None
    return SweepResult(cells, analysis, plots=write_plots(out_dir, analysis, predicted_mb))


def run_sweep(config: SweepConfig, runner: Callable[[Cell, Path], CellOutcome] | None = None,
              layout: RankLayout | None = None, log: Callable[[str], None] | None = None,
              load_guard: Callable[[], LoadCheck] | None = None) -> SweepResult:
    """Run (or resume) the sweep: ``runner`` (default: subprocesses) runs each cell repeat after ``load_guard``."""
    out_dir = Path(config.output.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    repeats = read_rows(out_dir / REPEATS_CSV, REPEAT_COLUMNS)
    # Steps of a repeat without an ok row come from a repeat killed between the two writes: it runs again.
    steps = {key: rows for key, rows in read_steps(out_dir / STEPS_CSV).items()
             if key in repeats and repeats[key]["status"] == "ok"}
    bootstrap = Bootstrapper(config.output.bootstrap_samples, config.output.seed)
    cells = expand_grid(config)
    say = log or print_flushed
    if config.output.report_only:
        if not repeats:
            raise ValueError(
                f"`output.report_only` but {out_dir / REPEATS_CSV} has no rows (results.csv and results.md are rebuilt "
                "from repeats.csv and steps.csv); run the sweep first (without report_only)"
            )
        return write_results(config, cells, repeats, steps, bootstrap, final=True)

    layout = _start_session(config, out_dir, layout, repeats)
    order = interleaved(cells, config.run.repeats)
    # a repeat with a row is done (a failed one too, unless output.retry_failed)
    retry = config.output.retry_failed
    done = {key for key, row in repeats.items() if row["status"] == "ok" or row["status"] and not retry}
    todo = [(cell, k) for cell, k in order if (cell.id, k) not in done]
    say(f"sweep {config.name!r}: {len(cells)} cells x {config.run.repeats} repeats = {len(order)} cell repeats, "
        f"{len(order) - len(todo)} already done, {len(todo)} to run; {layout.world_size} ranks over {layout.backend}; "
        f"results in {out_dir}")
    wants_prediction = config.run.predict_bucket_size and any(has_bucket_axis(s) for s in config.grid.strategies)
    if wants_prediction and todo:
        _predict_bucket_size(config, layout, out_dir, say)
    runner = runner or SubprocessCellRunner(config, layout)
    run = config.run
    guard = load_guard or partial(wait_until_idle, run.busy_threshold, run.max_wait_s, run.load_sample_s)
    ran: list[RepeatKey] = []
    for cell, k in todo:
        load = guard()
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        outcome = runner(cell, out_dir / "runs" / cell.id / f"r{k}")
        row = repeat_row(cell, k, outcome, load, model=config.workload.preset, accelerator=run.accelerator,
                         backend=layout.backend, load_avg_1m=load_average(), started_at=started_at)
        record(out_dir, repeats, steps, outcome, row, wants_prediction)
        write_results(config, cells, repeats, steps, bootstrap)
        ran.append((cell.id, k))
        say(_result_line(len(order) - len(todo) + len(ran), len(order), cell, k, run.repeats, outcome, load))
    result = write_results(config, cells, repeats, steps, bootstrap, final=True)
    result.ran = ran
    say(f"done: {result.ok} of {len(cells)} cells ok; {out_dir / RESULTS_MD}")
    return result


def _start_session(config: SweepConfig, out_dir: Path, layout: RankLayout | None,
                   repeats: dict[RepeatKey, Row]) -> RankLayout:
    """Check the base config, decide the layout, write environment.json (this session added to the earlier ones)."""
    if not Path(config.workload.base_config).is_file():
        raise ValueError(
            f"`workload.base_config` {config.workload.base_config!r} not found (relative paths resolve against the "
            f"current directory, {os.getcwd()}); run from the repository root or give an absolute path"
        )
    run, gpus, cuda_version = config.run, [], None
    if run.accelerator == "cuda":
        import torch

        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        cuda_version = torch.version.cuda
    if layout is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        layout = rank_layout(run.accelerator, run.devices, run.backend, run.launcher, len(gpus), visible)
    environment = provenance(
        config.output.out_dir,  # the sweep's own results are not a code change
        hostname=platform.node(), jsonargparse=package_version("jsonargparse"), cuda=cuda_version, gpus=gpus,
        backend=layout.backend, layout=asdict(layout), threads_per_rank=threads_per_rank(config),
        config=asdict(config),
    )
    previous = read_json(out_dir / ENVIRONMENT_JSON, missing_ok=True) if repeats else None
    # Every session that ran repeats of this sweep, oldest first (a resumed sweep keeps the earlier ones, so results
    # measured across two commits say so): when it started, the code it ran, how many repeats were already done.
    keys = ("created", "git_commit", "git_dirty", "git_changed", "hostname")
    earlier = []
    if previous:  # its sessions, or (written before sessions were recorded) itself as the one session
        earlier = list(previous.get("sessions") or [{k: previous.get(k) for k in keys}])
    done = sum(1 for r in repeats.values() if r["status"] == "ok")
    environment["sessions"] = [*earlier, {**{k: environment.get(k) for k in keys}, "repeats_done_before": done}]
    write_outputs(out_dir, {ENVIRONMENT_JSON: environment})
    return layout


def _predict_bucket_size(config: SweepConfig, layout: RankLayout, out_dir: Path, say: Callable[[str], None]) -> None:
    """Unless bucket_prediction.json exists: ``python -m lightning_ddp.bench.allreduce`` on every rank, its fit."""
    if (out_dir / PREDICTION_JSON).exists():
        return
    say("measuring all-reduce time vs message size for the bucket-size model ...")
    job_dir = out_dir / "runs" / "allreduce"
    job_dir.mkdir(parents=True, exist_ok=True)
    result_path = job_dir / "fit.json"
    result_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "lightning_ddp.bench.allreduce", "--out", str(result_path.resolve()),
               "--backend", layout.backend, "--device", config.run.accelerator, "--repeats", str(ALLREDUCE_REPEATS)]
    envs = cell_environments(None, config, layout, find_free_port())
    logs = [job_dir / f"rank{r}.log" for r in range(len(envs))]
    outcome = run_processes(command, envs, logs, min(config.run.timeout_s, 600.0))
    if any(code != 0 for code in outcome.returncodes) or not result_path.exists():
        say("the all-reduce microbenchmark failed (see runs/allreduce/); the report will have no prediction")
        return
    fit = read_json(result_path)
    write_outputs(out_dir, {PREDICTION_JSON: fit})
    bw = f"{fit['bandwidth_Bps'] / 1e9:.3f} GB/s" if fit.get("bandwidth_Bps") else "unbounded"
    say(f"all-reduce fit: o = {fit['overhead_s'] * 1e3:.3f} ms per call, w = {bw}")


def _result_line(index: int, total: int, cell: Cell, repeat: int, repeats: int, outcome: CellOutcome,
                 load: LoadCheck) -> str:
    """The progress line of one finished cell repeat: its status, step and share, and what the load guard saw."""
    head = f"[{index}/{total}] {cell.label}, repeat {repeat + 1}/{repeats}: {outcome.status}"
    guard = ""
    if load.busy:
        busy = 100 * (load.busy_before or 0)
        guard = f"; started on a busy machine ({busy:.0f} % CPU busy after {load.waited_s:.0f} s)"
    elif load.waited_s >= 1:
        guard = f"; waited {load.waited_s:.0f} s for an idle machine"
    if outcome.status != "ok":
        return f"{head} - {outcome.reason}{guard}"
    summary = (outcome.summary or {}).get("summary", {})
    step = summary.get("step/time_ms", {}).get("median")
    share = summary.get("comm/share", {}).get("median")
    text = f", step {step:,.1f} ms" if isinstance(step, (int, float)) else ""
    if isinstance(share, (int, float)) and cell.strategy != REFERENCE:
        text += f", comm share {100 * share:.1f} %"
    return f"{head}{text} ({outcome.wall_s:.0f} s){guard}"


# ---- the bucket-size prediction ------------------------------------------------------------------------


def gradient_bytes(hparams: dict[str, Any]) -> tuple[int, int]:
    """``(s, largest)``: gradient bytes and the largest parameter's bytes of the ``LitGPT`` of ``hparams`` (fp32)."""
    from lightning_ddp.model import get_config

    config = get_config(
        str(hparams["preset"]),
        vocab_size=int(hparams["vocab_size"]),
        context_length=int(hparams["context_length"]),
        tie_embeddings=bool(hparams.get("tie_embeddings", False)),
    )
    sizes = [FP32 * math.prod(shape) for shape in gpt_parameter_shapes(config).values()]
    return sum(sizes), max(sizes)


def _complete_prediction(path: Path, outcome: CellOutcome) -> None:
    """Add ``s``, the largest parameter and ``b*`` to the fit, from the model of a finished cell (once)."""
    from lightning_ddp.sync.bucket_model import optimal_bucket_bytes

    fit = read_json(path, missing_ok=True)
    hparams = ((outcome.summary or {}).get("run") or {}).get("hparams")
    if not fit or fit.get("bucket_bytes") or not hparams:
        return
    try:
        s, largest = gradient_bytes(hparams)
    except (KeyError, TypeError, ValueError):  # not a LitGPT (a custom module): no prediction
        return
    w = fit.get("bandwidth_Bps") or float("inf")
    bucket = optimal_bucket_bytes(s, fit["overhead_s"], w, largest)
    fit.update(grad_bytes=s, largest_param_bytes=largest, bucket_bytes=bucket)
    write_outputs(path.parent, {path.name: fit})
