"""Several CLI fits in one set of processes: ``python -m lightning_ddp fit`` without paying start-up per fit.

``run_fits`` starts ``ranks`` processes of this module on a plan (``plan.json``); each runs the fits one after
another through ``lightning_ddp.cli.main``, logging to ``<out_dir>/<name>/``, and rank 0 writes each fit's
``fit_result.json``. Two ranks share one device over gloo. Fits a crash or a failure left without a result run
again in a fresh set of processes (docs/gpu.md, "Fits in one set of processes").
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_ddp.files import write_json_atomically

__all__ = ["FitResult", "FitSpec", "logger_argument", "run_fits"]

RESULT_FILE = "fit_result.json"
STARTED_FILE = "fit_started"


@dataclass(frozen=True)
class FitSpec:
    """One fit: a name (its directory under the batch's ``out_dir``) and the CLI arguments after ``fit``."""

    name: str
    args: tuple[str, ...]


@dataclass
class FitResult:
    """How one fit went, and what it wrote."""

    name: str
    status: str
    """``ok``, ``oom``, ``failed``, ``timeout`` or ``not run`` (no time was left to start it)."""
    error: str = ""
    """The error line (empty when ok)."""
    seconds: float = 0.0
    """Wall time of the fit itself (start-up of the processes not included)."""
    log_dir: Path | None = None
    summary: dict[str, Any] | None = None
    """The CommTimer's ``timing_summary.json``, when it wrote one."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def file(self, name: str) -> Path | None:
        """A file the fit wrote under its log directory (the first match of ``name``), or ``None``."""
        if self.log_dir is None or not self.log_dir.exists():
            return None
        return next(iter(sorted(self.log_dir.rglob(name))), None)


def logger_argument(log_dir: Path) -> str:
    """``--trainer.logger`` so that a fit logs into ``log_dir`` itself (name and version empty)."""
    return json.dumps({"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                       "init_args": {"save_dir": str(log_dir), "name": "", "version": ""}})


def run_fits(specs: list[FitSpec], out_dir: Path, *, ranks: int = 1, timeout_s: float, cwd: str | None = None,
             env: dict[str, str] | None = None, threads: int | None = None) -> list[FitResult]:
    """Run ``specs`` on ``ranks`` processes (module recipe); one ``FitResult`` per spec, in order.

    Args:
        specs: The fits; names must be unique (each is a directory).
        out_dir: Where each fit logs (``out_dir/<name>/``) and the processes' logs go (``out_dir/_processes/``).
        ranks: Processes per fit; 2 puts both on the one device (each a "node" of one device).
        timeout_s: Wall-clock limit for all the fits together, start-ups included.
        cwd: Working directory of the processes (relative paths in the fits' arguments resolve there).
        env: Extra environment variables.
        threads: ``OMP_NUM_THREADS`` per process (CPU runs); ``None`` leaves it unset.
    """
    from lightning_ddp.bench.grid import LOOPBACK_INTERFACE, without_launcher_variables
    from lightning_ddp.bench.runner import error_line, is_oom, run_processes
    from lightning_ddp.local_group import find_free_port

    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"fit names must be unique (each is a directory), got {names}")
    out_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    results: dict[str, FitResult] = {}
    pending = list(specs)
    launches = out_dir / "_processes"
    launch = len(list(launches.glob("launch*"))) if launches.exists() else 0  # a later batch into the same directory
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 1:
            break
        work = out_dir / "_processes" / f"launch{launch}"
        work.mkdir(parents=True, exist_ok=True)
        for spec in pending:  # markers of an earlier launch would make a fit look started
            (out_dir / spec.name / STARTED_FILE).unlink(missing_ok=True)
        plan = work / "plan.json"
        plan.write_text(json.dumps({"out_dir": str(out_dir.resolve()), "stop_on_failure": ranks > 1,
                                    "fits": [{"name": s.name, "args": list(s.args)} for s in pending]}, indent=2))
        # Every rank is on this host: gloo on the loopback unless set (the host name's interface may not route back).
        base = {"GLOO_SOCKET_IFNAME": LOOPBACK_INTERFACE, **without_launcher_variables(), "PYTHONUNBUFFERED": "1",
                **(env or {})}
        if threads is not None:
            base["OMP_NUM_THREADS"] = str(threads)
        port = str(find_free_port())
        envs = [{**base, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(ranks),
                 "NODE_RANK": str(r), "LOCAL_RANK": "0", "RANK": str(r)} for r in range(ranks)]
        logs = [work / f"rank{r}.log" for r in range(ranks)]
        command = [sys.executable, "-m", "lightning_ddp.bench.gpu_study.fits", str(plan.resolve())]
        outcome = run_processes(command, envs, logs, remaining, cwd=cwd)
        finished = 0
        for spec in pending:
            result = _read_result(out_dir / spec.name, spec.name)
            if result is not None:
                results[spec.name] = result
                finished += 1
        missing = [s for s in pending if s.name not in results]
        if not missing:
            break
        first = missing[0]
        launch += 1
        if finished and not (out_dir / first.name / STARTED_FILE).exists() and not outcome.timed_out:
            pending = missing  # the ranks stopped after a fit that failed (and said so): start the rest afresh
            continue
        # Else the first fit without a result is the one the processes died in (or ran out of time in), or, when
        # none started, the start-up that failed: either way it gets the error.
        texts = [p.read_text(encoding="utf-8", errors="replace") if p.exists() else "" for p in logs]
        failed = [t for t, code in zip(texts, outcome.returncodes) if code not in (0, None)] or texts
        line = next((error_line(t) for t in failed if error_line(t)), "")
        if outcome.timed_out:
            status = "timeout"
            line = f"no result within the time left ({remaining:.0f} s)" + (f"; last output: {line}" if line else "")
        else:
            status = "oom" if any(is_oom(t) for t in failed) else "failed"
            line = line or f"the processes exited {outcome.returncodes} without a result for this fit"
        results[first.name] = FitResult(first.name, status, line, 0.0, out_dir / first.name)
        pending = missing[1:]
    return [results.get(s.name) or FitResult(s.name, "not run", "no time was left to start it", 0.0, out_dir / s.name)
            for s in specs]


def _read_result(log_dir: Path, name: str) -> FitResult | None:
    path = log_dir / RESULT_FILE
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    summary_path = next(iter(sorted(log_dir.rglob("timing_summary.json"))), None)
    summary = json.loads(summary_path.read_text()) if summary_path is not None and data["status"] == "ok" else None
    return FitResult(name, data["status"], data.get("error", ""), data.get("seconds", 0.0), log_dir, summary)


# ---- the child: run the plan's fits on this rank ------------------------------------------------------------


def _free_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main(plan_path: str) -> int:
    """Run the fits of the plan file ``plan_path`` (JSON, written by ``run_fits``) in this process, one after another.

    Args:
        plan_path: The plan: the output folder and each fit's command line.
    """
    from lightning_ddp.bench.runner import error_line, is_oom
    from lightning_ddp.cli import main as cli_main

    plan = json.loads(Path(plan_path).read_text())
    out_dir = Path(plan["out_dir"])
    rank = int(os.environ.get("RANK", "0"))
    for fit in plan["fits"]:
        log_dir = out_dir / fit["name"]
        log_dir.mkdir(parents=True, exist_ok=True)
        print(f"[gpu_study] fit {fit['name']} on rank {rank}", flush=True)
        if rank == 0:
            (log_dir / STARTED_FILE).touch()
        start = time.perf_counter()
        status, error = "ok", ""
        try:
            cli = cli_main(["fit", *fit["args"], "--trainer.logger", logger_argument(log_dir),
                            "--trainer.enable_progress_bar", "false"])
            del cli
        except BaseException as exc:  # noqa: BLE001 - SystemExit from argument parsing included; reported, not raised
            if isinstance(exc, KeyboardInterrupt):
                raise
            text = traceback.format_exc()
            print(text, file=sys.stderr, flush=True)
            status = "oom" if is_oom(text) else "failed"
            error = error_line(text) or f"{type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - start
        _free_memory()
        if rank == 0:
            write_json_atomically(log_dir / RESULT_FILE, {"status": status, "error": error, "seconds": seconds})
        if status != "ok" and plan["stop_on_failure"]:
            return 1
    return 0


if __name__ == "__main__":
    from jsonargparse import auto_cli

    sys.exit(auto_cli(main, prog="python -m lightning_ddp.bench.gpu_study.fits"))
