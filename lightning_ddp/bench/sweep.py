"""Run a sweep: every cell in its own processes, one results.csv row per cell, resumable, then the report.

Recipe (``run_sweep``):

1. Expand the grid (``grid.expand_grid``); decide the backend and rank placement (``grid.rank_layout``);
   write ``environment.json`` (versions, hardware, git commit, the full config).
2. Read ``results.csv`` if it exists: a cell whose id has a row is done and is skipped (with
   ``output.retry_failed``, only ``ok`` rows count as done). The id hashes the cell's whole configuration, so
   a changed setting reruns the cells it affects.
3. If an algorithm with buckets is in the grid and ``run.predict_bucket_size`` is on, run the all-reduce microbenchmark
   once on the same ranks (``bench.allreduce``) unless ``bucket_prediction.json`` exists: it fits the
   per-call overhead ``o`` and bandwidth ``w``. Once a cell has finished, its model shape gives the gradient
   bytes ``s`` and the largest parameter, and the predicted best bucket ``b* = sqrt(s * w * o)`` is added.
4. Run the remaining cells in grid order. After each one, rewrite ``results.csv`` whole and atomically
   (tmp + ``os.replace``) and ``results.md``, so a killed sweep keeps every finished row.
5. Write ``results.md`` and the PNG plots.

The cell runner is injected (any ``(cell, run_dir) -> CellOutcome``), which is how tests fake cells.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from lightning_ddp.bench.config import SweepConfig, has_bucket_axis
from lightning_ddp.bench.grid import Cell, RankLayout, every_rank_environment, expand_grid, rank_layout, threads_per_rank
from lightning_ddp.bench.report import build_report
from lightning_ddp.bench.results import make_row, parse_row, read_results, write_results, write_text_atomically
from lightning_ddp.bench.runner import CellOutcome, CellRunner, SubprocessCellRunner, find_free_port, run_processes
from lightning_ddp.provenance import git_state

__all__ = ["SweepResult", "describe_environment", "gradient_bytes", "run_sweep"]

RESULTS_CSV = "results.csv"
RESULTS_MD = "results.md"
ENVIRONMENT_JSON = "environment.json"
PREDICTION_JSON = "bucket_prediction.json"
ALLREDUCE_REPEATS = 10  # timed calls per message size in the sweep's microbenchmark (the median is kept)


@dataclass
class SweepResult:
    """What ``run_sweep`` produced."""

    out_dir: Path
    cells: list[Cell]
    rows: list[dict[str, Any]]
    """Parsed results.csv rows of this grid's cells that have run, in grid order."""
    ran: list[str] = field(default_factory=list)
    """Ids of the cells run by this call (the others were skipped as done)."""
    plots: list[Path] = field(default_factory=list)

    @property
    def ok(self) -> int:
        return sum(1 for r in self.rows if r["status"] == "ok")


def run_sweep(
    config: SweepConfig,
    runner: CellRunner | None = None,
    layout: RankLayout | None = None,
    predictor: Callable[[SweepConfig, RankLayout, Path], dict[str, Any] | None] | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> SweepResult:
    """Run (or resume) the sweep of ``config``; see the module recipe.

    Args:
        config: The sweep.
        runner: Runs one cell; default ``SubprocessCellRunner`` (real ``python -m lightning_ddp fit`` processes).
        layout: Rank placement; default from ``grid.rank_layout`` and the GPUs visible here.
        predictor: Runs the all-reduce microbenchmark, returns the fit; default: a job on the sweep's ranks.
        progress: Show a progress bar over the cells.
        log: Where the one-line-per-cell results go (default: print above the progress bar).
    """
    out_dir = Path(config.output.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cells = expand_grid(config)
    csv_path, md_path = out_dir / RESULTS_CSV, out_dir / RESULTS_MD
    existing = read_results(csv_path)

    if config.output.report_only:
        if not existing:
            raise ValueError(f"`output.report_only` but {csv_path} has no rows; run the sweep first (without report_only)")
        rows = _grid_rows(cells, existing)
        return SweepResult(out_dir, cells, rows, plots=_write_outputs(config, out_dir, cells, existing, final=True))

    if not Path(config.workload.base_config).is_file():
        raise ValueError(
            f"`workload.base_config` {config.workload.base_config!r} not found (relative paths resolve against the "
            f"current directory, {os.getcwd()}); run from the repository root or give an absolute path"
        )
    if layout is None:
        layout = _default_layout(config)
    environment = describe_environment(config, layout)
    write_text_atomically(out_dir / ENVIRONMENT_JSON, json.dumps(environment, indent=2, default=str) + "\n")

    done = {cid for cid, row in existing.items() if row["status"] == "ok" or (row["status"] and not config.output.retry_failed)}
    todo = [c for c in cells if c.id not in done]
    say = log or _tqdm_write
    say(f"sweep {config.name!r}: {len(cells)} cells, {len(cells) - len(todo)} already done, {len(todo)} to run; "
        f"{layout.world_size} ranks over {layout.backend}; results in {out_dir}")

    prediction_path = out_dir / PREDICTION_JSON
    wants_prediction = config.run.predict_bucket_size and any(has_bucket_axis(s) for s in config.grid.strategies)
    if wants_prediction and not prediction_path.exists() and todo:
        say("measuring all-reduce time vs message size for the bucket-size model ...")
        fit = (predictor or _run_allreduce_job)(config, layout, out_dir)
        if fit:
            write_text_atomically(prediction_path, json.dumps(fit, indent=2) + "\n")
            bw = f"{fit['bandwidth_Bps'] / 1e9:.3f} GB/s" if fit.get("bandwidth_Bps") else "unbounded"
            say(f"all-reduce fit: o = {fit['overhead_s'] * 1e3:.3f} ms per call, w = {bw}")
        else:
            say("the all-reduce microbenchmark failed (see runs/allreduce/); the report will have no prediction")

    runner = runner or SubprocessCellRunner(config, layout)
    ran = []
    bar = _progress_bar(len(cells), len(cells) - len(todo), progress)
    try:
        for cell in todo:
            if bar is not None:
                bar.set_postfix_str(cell.label)
            outcome = runner(cell, out_dir / "runs" / cell.id)
            row = make_row(cell, outcome, config.workload.preset, config.run.accelerator, layout, _load_average())
            existing[cell.id] = _reparse(row)
            write_results(csv_path, _ordered(cells, existing))
            ran.append(cell.id)
            if outcome.status == "ok" and wants_prediction:
                _complete_prediction(prediction_path, outcome)
            _write_outputs(config, out_dir, cells, existing, final=False)
            say(_result_line(len(cells) - len(todo) + len(ran), len(cells), cell, existing[cell.id]))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    plots = _write_outputs(config, out_dir, cells, existing, final=True)
    rows = _grid_rows(cells, existing)
    ok = sum(1 for r in rows if r["status"] == "ok")
    say(f"done: {ok} of {len(cells)} cells ok; {md_path}")
    return SweepResult(out_dir, cells, rows, ran, plots)


# ---- helpers ------------------------------------------------------------------------------------------


def _default_layout(config: SweepConfig) -> RankLayout:
    gpu_count = 0
    if config.run.accelerator == "cuda":
        import torch

        gpu_count = torch.cuda.device_count()
    return rank_layout(config, gpu_count, os.environ.get("CUDA_VISIBLE_DEVICES"))


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # not available on this platform
        return None


def _grid_rows(cells: list[Cell], rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [rows[c.id] for c in cells if c.id in rows]


def _ordered(cells: list[Cell], rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """This grid's rows in grid order, then rows of other configurations (kept: the CSV never loses data)."""
    ids = {c.id for c in cells}
    return _grid_rows(cells, rows) + [row for cid, row in rows.items() if cid not in ids]


def _reparse(row: dict[str, Any]) -> dict[str, Any]:
    """The row as it will read back from the CSV (numbers as floats, empty as None)."""
    return parse_row({k: "" if v is None else str(v) for k, v in row.items()})


def _write_outputs(config: SweepConfig, out_dir: Path, cells: list[Cell], rows: dict[str, dict[str, Any]], final: bool) -> list[Path]:
    """results.md (always) and, when ``final``, the plots."""
    grid_rows = _grid_rows(cells, rows)
    prediction = _read_json(out_dir / PREDICTION_JSON)
    environment = _read_json(out_dir / ENVIRONMENT_JSON)
    pending = len(cells) - len(grid_rows)
    report = build_report(grid_rows, config.name, prediction, environment, pending)
    write_text_atomically(out_dir / RESULTS_MD, report)
    if not (final and config.output.plots and grid_rows):
        return []
    from lightning_ddp.bench.plots import write_plots

    predicted_mb = prediction["bucket_bytes"] / 2**20 if prediction and prediction.get("bucket_bytes") else None
    return write_plots(out_dir, grid_rows, predicted_mb)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _result_line(index: int, total: int, cell: Cell, row: dict[str, Any]) -> str:
    head = f"[{index}/{total}] {cell.label}: {row['status']}"
    if row["status"] != "ok":
        return f"{head} - {row['reason']}"
    share = row.get("comm_share")
    comm = f", comm share {100 * share:.1f} %" if share is not None and cell.strategy != "reference" else ""
    return f"{head}, step {row['step_ms_median']:,.1f} ms{comm} ({row['wall_s']:.0f} s)"


def _tqdm_write(line: str) -> None:
    from tqdm import tqdm

    tqdm.write(line)
    sys.stdout.flush()


def _progress_bar(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    # disable=None: a bar on a terminal; in a log file (not a TTY) only the one-line results
    return tqdm(total=total, initial=initial, unit="cell", desc="sweep", dynamic_ncols=True, disable=None)


# ---- the bucket-size prediction ------------------------------------------------------------------------


def _run_allreduce_job(config: SweepConfig, layout: RankLayout, out_dir: Path) -> dict[str, Any] | None:
    """``python -m lightning_ddp.bench.allreduce`` on every rank at once; its fit, or ``None`` if it failed."""
    job_dir = out_dir / "runs" / "allreduce"
    job_dir.mkdir(parents=True, exist_ok=True)
    result_path = job_dir / "fit.json"
    result_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "lightning_ddp.bench.allreduce", "--out", str(result_path.resolve()),
               "--backend", layout.backend, "--device", config.run.accelerator, "--repeats", str(ALLREDUCE_REPEATS)]
    envs = every_rank_environment(config, layout, find_free_port())
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
    sizes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
    return sum(sizes), max(sizes)


def _complete_prediction(path: Path, outcome: CellOutcome) -> None:
    """Add ``s``, the largest parameter and ``b*`` to the fit, from the model of a finished cell (once)."""
    from lightning_ddp.sync.bucket_model import optimal_bucket_bytes

    fit = _read_json(path)
    hparams = ((outcome.summary or {}).get("run") or {}).get("hparams")
    if not fit or fit.get("bucket_bytes") or not hparams:
        return
    try:
        s, largest = gradient_bytes(hparams)
    except (KeyError, TypeError, ValueError):  # not a LitGPT (a custom module): no prediction
        return
    w = fit.get("bandwidth_Bps") or float("inf")
    fit.update(grad_bytes=s, largest_param_bytes=largest, bucket_bytes=optimal_bucket_bytes(s, fit["overhead_s"], w, largest))
    write_text_atomically(path, json.dumps(fit, indent=2) + "\n")


# ---- environment.json ---------------------------------------------------------------------------------


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_environment(config: SweepConfig, layout: RankLayout) -> dict[str, Any]:
    """What belongs next to the numbers: versions, hardware, backend and placement, commit (and whether the tree
    was dirty), the full config."""
    gpus: list[str] = []
    cuda_version = None
    if config.run.accelerator == "cuda":
        import torch

        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        cuda_version = torch.version.cuda
    return {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": sys.argv,
        "cwd": os.getcwd(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": platform.node(),
        "torch": _version("torch"),
        "lightning": _version("lightning"),
        "jsonargparse": _version("jsonargparse"),
        "cuda": cuda_version,
        "cpu": {"model": _cpu_model(), "count": os.cpu_count()},
        "gpus": gpus,
        "backend": layout.backend,
        "layout": dataclasses.asdict(layout),
        "threads_per_rank": threads_per_rank(config),
        **git_state(),
        "config": dataclasses.asdict(config),
    }
