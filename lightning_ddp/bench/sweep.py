"""Run a sweep: every cell repeat in its own processes, interleaved round-robin, resumable, then the statistics,
results.csv, results.md and the plots (``output.report_only``: only those, from the raw files).

The cell runner and the load guard are injected (how the tests fake them); the driver imports no torch.
docs/benchmarks.md gives the recipe.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from lightning_ddp.bench.analysis import analyze
from lightning_ddp.bench.config import SweepConfig, has_bucket_axis
from lightning_ddp.bench.grid import Cell, expand_grid, sweep_layout, threads_per_rank
from lightning_ddp.bench.launch import RankLayout, find_free_port, rank_environments, run_processes
from lightning_ddp.bench.load import LoadCheck, wait_until_idle
from lightning_ddp.bench.plots import write_plots
from lightning_ddp.bench.report import build_report
from lightning_ddp.bench.results import (
    REPEAT_COLUMNS,
    cell_data,
    cell_row,
    measured_step_rows,
    parse_row,
    read_repeats,
    read_steps,
    repeat_row,
    write_repeats,
    write_results,
    write_steps,
)
from lightning_ddp.bench.runner import CellOutcome, CellRunner, SubprocessCellRunner
from lightning_ddp.bench.stats import Bootstrapper
from lightning_ddp.files import write_atomically, write_json_atomically
from lightning_ddp.bench.study import load_average, provenance, read_json, write_outputs
from lightning_ddp.provenance import package_version

__all__ = ["SweepResult", "describe_environment", "gradient_bytes", "repeat_order", "run_sweep"]

RESULTS_CSV = "results.csv"
REPEATS_CSV = "repeats.csv"
STEPS_CSV = "steps.csv"
PROFILES_JSON = "profiles.json"
RESULTS_MD = "results.md"
ENVIRONMENT_JSON = "environment.json"
PREDICTION_JSON = "bucket_prediction.json"
ALLREDUCE_REPEATS = 10  # timed calls per message size in the sweep's microbenchmark (the median is kept)

RepeatKey = tuple[str, int]


@dataclass
class SweepResult:
    """What ``run_sweep`` produced."""

    out_dir: Path
    cells: list[Cell]
    rows: list[dict[str, Any]]
    """Parsed results.csv rows of this grid's cells that have run, in grid order."""
    ran: list[RepeatKey] = field(default_factory=list)
    """``(cell_id, repeat)`` of the repeats run by this call, in order (the others were skipped as done)."""
    plots: list[Path] = field(default_factory=list)

    @property
    def ok(self) -> int:
        return sum(1 for r in self.rows if r["status"] == "ok")


def repeat_order(cells: list[Cell], repeats: int) -> list[tuple[Cell, int]]:
    """Every (cell, repeat) in the order the sweep runs them: repeat 0 of every cell in grid order, then repeat 1, ...

    >>> from types import SimpleNamespace as C
    >>> [(c.id, k) for c, k in repeat_order([C(id="a"), C(id="b")], 2)]
    [('a', 0), ('b', 0), ('a', 1), ('b', 1)]
    """
    return [(cell, k) for k in range(repeats) for cell in cells]


def run_sweep(
    config: SweepConfig,
    runner: CellRunner | None = None,
    layout: RankLayout | None = None,
    predictor: Callable[[SweepConfig, RankLayout, Path], dict[str, Any] | None] | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    load_guard: Callable[[], LoadCheck] | None = None,
) -> SweepResult:
    """Run (or resume) the sweep of ``config`` (docs/benchmarks.md).

    Args:
        config: The sweep.
        runner: Runs one cell repeat; default ``SubprocessCellRunner`` (real ``python -m lightning_ddp fit`` processes).
        layout: Rank placement; default from ``grid.sweep_layout`` and the GPUs visible here.
        predictor: Runs the all-reduce microbenchmark, returns the fit; default: a job on the sweep's ranks.
        progress: Show a progress bar over the cell repeats.
        log: Where the one-line-per-repeat results go (default: print above the progress bar).
        load_guard: Called before each repeat, waits for an idle machine and says what it saw; default:
            ``load.wait_until_idle`` with ``run.busy_threshold``, ``run.max_wait_s`` and ``run.load_sample_s``.
    """
    out_dir = Path(config.output.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cells = expand_grid(config)
    repeats_path = out_dir / REPEATS_CSV
    repeats = read_repeats(repeats_path)
    # Steps of a repeat without an ok row come from a repeat killed between the two writes: it runs again.
    steps = {key: rows for key, rows in read_steps(out_dir / STEPS_CSV).items()
             if key in repeats and repeats[key]["status"] == "ok"}
    bootstrap = Bootstrapper(config.output.bootstrap_samples, config.output.seed)
    say = log or _tqdm_write

    if config.output.report_only:
        if not repeats:
            raise ValueError(
                f"`output.report_only` but {repeats_path} has no rows (results.csv and results.md are rebuilt from "
                "repeats.csv and steps.csv); run the sweep first (without report_only)"
            )
        rows, plots = _write_outputs(config, out_dir, cells, repeats, steps, bootstrap, final=True)
        return SweepResult(out_dir, cells, rows, plots=plots)

    layout = _start_session(config, out_dir, layout, repeats, say)
    order = repeat_order(cells, config.run.repeats)
    todo = [(cell, k) for cell, k in order if not _done(config, repeats.get((cell.id, k)))]
    say(f"sweep {config.name!r}: {len(cells)} cells x {config.run.repeats} repeats = {len(order)} cell repeats, "
        f"{len(order) - len(todo)} already done, {len(todo)} to run; {layout.world_size} ranks over {layout.backend}; "
        f"results in {out_dir}")
    wants_prediction = config.run.predict_bucket_size and any(has_bucket_axis(s) for s in config.grid.strategies)
    if wants_prediction and todo:
        _predict_bucket_size(config, layout, out_dir, predictor, say)

    runner = runner or SubprocessCellRunner(config, layout)
    guard = load_guard or (lambda: wait_until_idle(config.run.busy_threshold, config.run.max_wait_s,
                                                   config.run.load_sample_s))
    state = _SweepState(config, out_dir, cells, layout, repeats, steps, bootstrap, wants_prediction)
    ran: list[RepeatKey] = []
    bar = _progress_bar(len(order), len(order) - len(todo), progress)
    try:
        for cell, k in todo:
            if bar is not None:
                bar.set_postfix_str(f"{cell.label}, repeat {k + 1}/{config.run.repeats}")
            load = guard()
            outcome = state.run_repeat(runner, cell, k, load)
            ran.append((cell.id, k))
            say(_result_line(len(order) - len(todo) + len(ran), len(order), cell, k, config.run.repeats, outcome,
                             load))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    rows, plots = _write_outputs(config, out_dir, cells, repeats, steps, bootstrap, final=True)
    ok = sum(1 for r in rows if r["status"] == "ok")
    say(f"done: {ok} of {len(cells)} cells ok; {out_dir / RESULTS_MD}")
    return SweepResult(out_dir, cells, rows, ran, plots)


def _done(config: SweepConfig, row: dict[str, Any] | None) -> bool:
    """Whether a repeat with this repeats.csv row is finished (failed ones too, unless ``output.retry_failed``)."""
    return row is not None and (row["status"] == "ok" or (bool(row["status"]) and not config.output.retry_failed))


def _start_session(config: SweepConfig, out_dir: Path, layout: RankLayout | None,
                   repeats: dict[RepeatKey, dict[str, Any]], say: Callable[[str], None]) -> RankLayout:
    """Check the base config, decide the layout and write environment.json (this session added to the earlier)."""
    if not Path(config.workload.base_config).is_file():
        raise ValueError(
            f"`workload.base_config` {config.workload.base_config!r} not found (relative paths resolve against the "
            f"current directory, {os.getcwd()}); run from the repository root or give an absolute path"
        )
    if layout is None:
        layout = _default_layout(config)
    environment = describe_environment(config, layout)
    previous = read_json(out_dir / ENVIRONMENT_JSON, missing_ok=True) if repeats else None
    environment["sessions"] = _sessions(previous, environment, sum(1 for r in repeats.values() if r["status"] == "ok"))
    write_outputs(out_dir, {ENVIRONMENT_JSON: environment})
    if not repeats and (out_dir / RESULTS_CSV).exists():
        say(f"{out_dir / RESULTS_CSV} has no repeats.csv beside it (an older sweep): it will be rewritten from this "
            "sweep's repeats")
    return layout


def _predict_bucket_size(config: SweepConfig, layout: RankLayout, out_dir: Path,
                         predictor: Callable[[SweepConfig, RankLayout, Path], dict[str, Any] | None] | None,
                         say: Callable[[str], None]) -> None:
    """Run the all-reduce microbenchmark once (unless bucket_prediction.json exists) and write its fit."""
    prediction_path = out_dir / PREDICTION_JSON
    if prediction_path.exists():
        return
    say("measuring all-reduce time vs message size for the bucket-size model ...")
    fit = (predictor or _run_allreduce_job)(config, layout, out_dir)
    if not fit:
        say("the all-reduce microbenchmark failed (see runs/allreduce/); the report will have no prediction")
        return
    write_outputs(out_dir, {PREDICTION_JSON: fit})
    bw = f"{fit['bandwidth_Bps'] / 1e9:.3f} GB/s" if fit.get("bandwidth_Bps") else "unbounded"
    say(f"all-reduce fit: o = {fit['overhead_s'] * 1e3:.3f} ms per call, w = {bw}")


@dataclass
class _SweepState:
    """What a running sweep keeps between repeats, and how one repeat's results are written."""

    config: SweepConfig
    out_dir: Path
    cells: list[Cell]
    layout: RankLayout
    repeats: dict[RepeatKey, dict[str, Any]]
    steps: dict[RepeatKey, list[dict[str, Any]]]
    bootstrap: Bootstrapper
    wants_prediction: bool

    def run_repeat(self, runner: CellRunner, cell: Cell, k: int, load: LoadCheck) -> CellOutcome:
        """Run repeat ``k`` of ``cell``; then steps.csv, repeats.csv (last: it marks the repeat done),
        profiles.json, results.csv and results.md, each whole and atomically."""
        config, out_dir = self.config, self.out_dir
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        outcome = runner(cell, out_dir / "runs" / cell.id / f"r{k}")
        key = (cell.id, k)
        self.steps.pop(key, None)
        if outcome.status == "ok" and outcome.summary:
            self.steps[key] = measured_step_rows(cell.id, k, outcome.summary)
        row = repeat_row(cell, k, outcome, config.workload.preset, config.run.accelerator, self.layout, load,
                         load_average(), started_at)
        self.repeats[key] = parse_row({c: _text(v) for c, v in row.items()}, REPEAT_COLUMNS)
        # steps first, the repeat's row last: a kill in between leaves steps that the next run ignores
        write_steps(out_dir / STEPS_CSV, (step for key_ in self.repeats if key_ in self.steps
                                          for step in self.steps[key_]))
        write_repeats(out_dir / REPEATS_CSV, self.repeats.values())
        profiles_path = out_dir / PROFILES_JSON
        profiles: dict[str, Any] = read_json(profiles_path, missing_ok=True) or {}
        if outcome.status == "ok" and outcome.profile and cell.id not in profiles:
            profiles[cell.id] = outcome.profile
            write_json_atomically(profiles_path, profiles, default=str)
        if outcome.status == "ok" and self.wants_prediction:
            _complete_prediction(out_dir / PREDICTION_JSON, outcome)
        _write_outputs(config, out_dir, self.cells, self.repeats, self.steps, self.bootstrap, final=False)
        return outcome


# ---- helpers ------------------------------------------------------------------------------------------


def _default_layout(config: SweepConfig) -> RankLayout:
    gpu_count = 0
    if config.run.accelerator == "cuda":
        import torch

        gpu_count = torch.cuda.device_count()
    return sweep_layout(config, gpu_count, os.environ.get("CUDA_VISIBLE_DEVICES"))


def _text(value: Any) -> str:
    """A value as the CSV will hold it (so a row in memory equals the row read back)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _write_outputs(
    config: SweepConfig,
    out_dir: Path,
    cells: list[Cell],
    repeats: dict[RepeatKey, dict[str, Any]],
    steps: dict[RepeatKey, list[dict[str, Any]]],
    bootstrap: Bootstrapper,
    final: bool,
) -> tuple[list[dict[str, Any]], list[Path]]:
    """results.csv and results.md from the raw data (always) and, when ``final``, the plots.

    results.csv holds every cell of repeats.csv (this grid's first, in grid order, then other configurations'
    cells: the files never lose data); the report and the plots only this grid's cells.
    """
    data = cell_data(repeats.values(), (step for rows in steps.values() for step in rows))
    rows = {cid: parse_row({c: _text(v) for c, v in cell_row(d, bootstrap).items()}) for cid, d in data.items()}
    ids = [c.id for c in cells]
    grid_rows = [rows[cid] for cid in ids if cid in rows]
    write_results(out_dir / RESULTS_CSV, grid_rows + [row for cid, row in rows.items() if cid not in set(ids)])

    analysis = analyze(grid_rows, {cid: data[cid] for cid in ids if cid in data}, bootstrap)
    grid_ids = set(ids)
    grid_repeats = [r for r in repeats.values() if r["cell_id"] in grid_ids]
    expected = {(c.id, k) for c, k in repeat_order(cells, config.run.repeats)}
    pending = len(expected - {(r["cell_id"], r["repeat"]) for r in grid_repeats})
    prediction = read_json(out_dir / PREDICTION_JSON, missing_ok=True)
    environment = read_json(out_dir / ENVIRONMENT_JSON, missing_ok=True)
    report = build_report(grid_rows, config.name, prediction, environment, pending, analysis, grid_repeats)
    write_atomically(out_dir / RESULTS_MD, report)
    if not (final and config.output.plots and grid_rows):
        return grid_rows, []
    predicted_mb = prediction["bucket_bytes"] / 2**20 if prediction and prediction.get("bucket_bytes") else None
    return grid_rows, write_plots(out_dir, grid_rows, predicted_mb, analysis)


def _sessions(previous: dict[str, Any] | None, current: dict[str, Any], repeats_done: int) -> list[dict[str, Any]]:
    """Every session that ran repeats of this sweep, oldest first: when it started, the code it ran (commit, dirty)
    and how many repeats were already done. A resumed sweep keeps the earlier sessions, so results measured
    across two commits say so."""
    keys = ("created", "git_commit", "git_dirty", "git_changed", "hostname")
    earlier = list((previous or {}).get("sessions") or ([{k: previous.get(k) for k in keys}] if previous else []))
    return [*earlier, {**{k: current.get(k) for k in keys}, "repeats_done_before": repeats_done}]


def _result_line(index: int, total: int, cell: Cell, repeat: int, repeats: int, outcome: CellOutcome,
                 load: LoadCheck) -> str:
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
    if isinstance(share, (int, float)) and cell.strategy != "reference":
        text += f", comm share {100 * share:.1f} %"
    return f"{head}{text} ({outcome.wall_s:.0f} s){guard}"


def _tqdm_write(line: str) -> None:
    from tqdm import tqdm

    tqdm.write(line)
    sys.stdout.flush()


def _progress_bar(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    # disable=None: a bar on a terminal; in a log file (not a TTY) only the one-line results
    return tqdm(total=total, initial=initial, unit="repeat", desc="sweep", dynamic_ncols=True, disable=None)


# ---- the bucket-size prediction ------------------------------------------------------------------------


def _run_allreduce_job(config: SweepConfig, layout: RankLayout, out_dir: Path) -> dict[str, Any] | None:
    """``python -m lightning_ddp.bench.allreduce`` on every rank at once; its fit, or ``None`` if it failed."""
    job_dir = out_dir / "runs" / "allreduce"
    job_dir.mkdir(parents=True, exist_ok=True)
    result_path = job_dir / "fit.json"
    result_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "lightning_ddp.bench.allreduce", "--out", str(result_path.resolve()),
               "--backend", layout.backend, "--device", config.run.accelerator, "--repeats", str(ALLREDUCE_REPEATS)]
    envs = rank_environments(layout, find_free_port(), every_rank=True, threads=threads_per_rank(config),
                             extra=config.run.env)
    logs = [job_dir / f"rank{r}.log" for r in range(len(envs))]
    outcome = run_processes(command, envs, logs, min(config.run.timeout_s, 600.0))
    if any(code != 0 for code in outcome.returncodes) or not result_path.exists():
        return None
    return json.loads(result_path.read_text())


def gradient_bytes(hparams: dict[str, Any]) -> tuple[int, int]:
    """``(s, largest)``: gradient bytes and the largest parameter's bytes of the ``LitGPT`` these hparams build.

    The model is built on the meta device (shapes only, no memory), so this is instant even for xl.
    """
    import torch

    from lightning_ddp.model import GPT, get_config

    config = get_config(
        str(hparams["preset"]),
        vocab_size=int(hparams["vocab_size"]),
        context_length=int(hparams["context_length"]),
        tie_embeddings=bool(hparams.get("tie_embeddings", False)),
    )
    with torch.device("meta"):
        model = GPT(config)
    sizes = [p.nbytes for p in model.parameters() if p.requires_grad]
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
    write_atomically(path, json.dumps(fit, indent=2) + "\n")


# ---- environment.json ---------------------------------------------------------------------------------


def describe_environment(config: SweepConfig, layout: RankLayout) -> dict[str, Any]:
    """What belongs next to the numbers: versions, hardware, backend and placement, commit (and whether the tree
    was dirty), the full config."""
    gpus: list[str] = []
    cuda_version = None
    if config.run.accelerator == "cuda":
        import torch

        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        cuda_version = torch.version.cuda
    return provenance(
        config.output.out_dir,  # the sweep's own results are not a code change
        hostname=platform.node(), jsonargparse=package_version("jsonargparse"), cuda=cuda_version, gpus=gpus,
        backend=layout.backend, layout=dataclasses.asdict(layout), threads_per_rank=threads_per_rank(config),
        config=dataclasses.asdict(config),
    )
