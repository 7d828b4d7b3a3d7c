"""Several CLI fits in one set of processes: the launcher's ``fit`` command lines without start-up per fit.

``run_fits`` starts ``ranks`` processes of this module on a plan; each runs the fits one after another through
``lightning_ddp.cli.main``, logging to ``<out_dir>/<name>/``, where rank 0 writes ``fit_result.json``. Fits a crash
or a failure left without a result run in a fresh set of processes (docs/gpu.md, "How the stages measure").
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_ddp.bench.launch import RankLayout, error_line, fit_command, is_oom, rank_environments, run_processes
from lightning_ddp.bench.study import read_timing_summary
from lightning_ddp.files import write_json_atomically
from lightning_ddp.local_group import find_free_port

__all__ = ["FitResult", "FitSpec", "run_fits"]

RESULT_FILE = "fit_result.json"


@dataclass(frozen=True)
class FitSpec:
    """One fit: a name (its directory under the batch's ``out_dir``) and the CLI arguments after ``fit``."""

    name: str
    args: tuple[str, ...]


@dataclass
class FitResult:
    """How one fit went, and what it wrote."""

    name: str
    status: str  # ok, oom, failed, timeout or "not run" (no time was left to start it)
    error: str = ""  # the error line
    seconds: float = 0.0  # of the fit itself, the processes' start-up not included
    log_dir: Path | None = None
    summary: dict[str, Any] | None = None  # the CommTimer's timing_summary.json, when it wrote one

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def file(self, name: str) -> Path | None:
        """A file the fit wrote under its log directory (the first match of ``name``), or ``None``."""
        if self.log_dir is None or not self.log_dir.exists():
            return None
        return next(iter(sorted(self.log_dir.rglob(name))), None)


def run_fits(specs: list[FitSpec], out_dir: Path, *, ranks: int = 1, timeout_s: float, cwd: str | None = None,
             env: dict[str, str] | None = None, threads: int | None = None) -> list[FitResult]:
    """Run ``specs`` (unique names) on ``ranks`` processes sharing one device, all within ``timeout_s``; one
    ``FitResult`` per spec, in order. The processes' logs go to ``out_dir/_processes/``; ``threads``:
    ``OMP_NUM_THREADS`` per process (None: unset)."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"fit names must be unique (each is a directory), got {names}")
    out_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    results: dict[str, FitResult] = {}
    pending = list(specs)
    launch = len(list((out_dir / "_processes").glob("launch*")))  # a later batch into the same directory
    while pending and deadline - time.monotonic() > 1:
        remaining = deadline - time.monotonic()
        outcome, logs = _launch(pending, out_dir, out_dir / "_processes" / f"launch{launch}", ranks, remaining,
                                cwd, env, threads)
        launch += 1
        finished = {spec.name: result for spec in pending
                    if (result := _read_result(out_dir / spec.name, spec.name)) is not None}
        results.update(finished)
        missing = [s for s in pending if s.name not in results]
        if not missing:
            break
        if ranks > 1 and finished and list(finished.values())[-1].status != "ok" and not outcome.timed_out:
            pending = missing  # the ranks stopped after a fit that failed (and said so): start the rest afresh
            continue
        # Else the first fit without a result is the one the processes died in (or ran out of time in), or, when
        # none started, the start-up that failed: either way it gets the error.
        results[missing[0].name] = _lost(missing[0].name, out_dir, outcome, logs, remaining)
        pending = missing[1:]
    return [results.get(s.name) or FitResult(s.name, "not run", "no time was left to start it", 0.0, out_dir / s.name)
            for s in specs]


def _launch(pending: list[FitSpec], out_dir: Path, work: Path, ranks: int, remaining: float, cwd: str | None,
            env: dict[str, str] | None, threads: int | None):
    """Start ``ranks`` processes on a plan of the ``pending`` fits and wait for them: (outcome, rank logs)."""
    work.mkdir(parents=True, exist_ok=True)
    for spec in pending:  # a result of an earlier call (--resume) would make a fit look finished
        (out_dir / spec.name / RESULT_FILE).unlink(missing_ok=True)
    plan = work / "plan.json"
    plan.write_text(json.dumps({"out_dir": str(out_dir.resolve()), "stop_on_failure": ranks > 1,
                                "fits": [{"name": s.name, "args": list(s.args)} for s in pending]}, indent=2))
    # Each rank a "node" of one device: 2 ranks then share it over gloo (NCCL refuses two ranks on one GPU).
    envs = rank_environments(RankLayout("gloo", 1, ranks), find_free_port(), every_rank=True, threads=threads,
                             extra=env)
    logs = [work / f"rank{r}.log" for r in range(ranks)]
    command = [sys.executable, "-m", "lightning_ddp.bench.gpu_study.fits", str(plan.resolve())]
    return run_processes(command, envs, logs, remaining, cwd=cwd), logs


def _lost(name: str, out_dir: Path, outcome, logs: list[Path], remaining: float) -> FitResult:
    """The result of a fit the processes left without one: out of time, out of memory, or failed."""
    texts = [p.read_text(encoding="utf-8", errors="replace") if p.exists() else "" for p in logs]
    failed = [t for t, code in zip(texts, outcome.returncodes) if code not in (0, None)] or texts
    line = next((error_line(t) for t in failed if error_line(t)), "")
    if outcome.timed_out:
        status = "timeout"
        line = f"no result within the time left ({remaining:.0f} s)" + (f"; last output: {line}" if line else "")
    else:
        status = "oom" if any(is_oom(t) for t in failed) else "failed"
        line = line or f"the processes exited {outcome.returncodes} without a result for this fit"
    return FitResult(name, status, line, 0.0, out_dir / name)


def _read_result(log_dir: Path, name: str) -> FitResult | None:
    path = log_dir / RESULT_FILE
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    summary = read_timing_summary(log_dir) if data["status"] == "ok" else None
    return FitResult(name, data["status"], data.get("error", ""), data.get("seconds", 0.0), log_dir, summary)


# ---- the child: run the plan's fits on this rank ------------------------------------------------------------


def _run_one(args: list[str], log_dir: Path) -> tuple[str, str]:
    """One fit in this process: the launcher's command line after ``python -m lightning_ddp``; (status, error)."""
    from lightning_ddp.cli import main as cli_main

    try:
        cli_main(fit_command([*args, "--trainer.enable_progress_bar", "false"], log_dir)[3:])  # the CLI not kept
    except BaseException as exc:  # noqa: BLE001 - SystemExit from argument parsing included; reported, not raised
        if isinstance(exc, KeyboardInterrupt):
            raise
        text = traceback.format_exc()
        print(text, file=sys.stderr, flush=True)
        return ("oom" if is_oom(text) else "failed"), error_line(text) or f"{type(exc).__name__}: {exc}"
    return "ok", ""


def main(plan_path: str) -> int:
    """Run the fits of the plan file ``plan_path`` (written by ``run_fits``) in this process, one after another."""
    import torch

    plan = json.loads(Path(plan_path).read_text())
    out_dir = Path(plan["out_dir"])
    rank = int(os.environ.get("RANK", "0"))
    for fit in plan["fits"]:
        log_dir = out_dir / fit["name"]
        log_dir.mkdir(parents=True, exist_ok=True)
        print(f"[gpu_study] fit {fit['name']} on rank {rank}", flush=True)
        start = time.perf_counter()
        status, error = _run_one(fit["args"], log_dir)
        seconds = time.perf_counter() - start
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        if rank == 0:
            write_json_atomically(log_dir / RESULT_FILE, {"status": status, "error": error, "seconds": seconds})
        if status != "ok" and plan["stop_on_failure"]:
            return 1
    return 0


if __name__ == "__main__":
    from jsonargparse import auto_cli

    sys.exit(auto_cli(main, prog="python -m lightning_ddp.bench.gpu_study.fits"))
