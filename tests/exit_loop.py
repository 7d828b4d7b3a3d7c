"""Short 2-rank fits again and again, beside busy cores, counting every run that did not end cleanly.

    python -m tests.exit_loop --runs 200 --busy_cores 1 --out exit_loop.json

A run is one (path, strategy) cell in turn, every strategy of the catalogue on every path, until ``--runs``:

- ``cli``: ``python -m lightning_ddp fit`` as README runs it (Lightning's launcher starts rank 1 as its child, so
  rank 1's exit code is not ours to see: its abort is caught by the message it prints);
- ``cli_ranks``: the same fit with each rank started by us, as torchrun or SLURM start them: every exit code seen;
- ``helper``: ``tests.support.dist_utils.run_on_ranks`` (the multi-process tests' launcher) fitting a small MLP
  through the strategy with the ``CommTimer``.

Clean: every exit code 0, the fit finished, and no "terminate called" or "Fatal Python error" in the output (each
process runs with ``PYTHONFAULTHANDLER=1``, which prints a Python stack on SIGABRT). The result file holds the counts
per cell, every run that was not clean (with its output's tail), the commit it started at, the machine and the
versions; the exit status is 1 if any run was not clean. On 2 cores one run takes 8 to 45 s beside a busy core
(docs/troubleshooting.md, "A finished run exits -6").
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jsonargparse import auto_cli

from lightning_ddp import catalogue
from lightning_ddp.bench.launch import RankLayout, rank_environments, run_processes
from lightning_ddp.local_group import find_free_port
from lightning_ddp.reporting.provenance import git_state
from tests.support.cli_utils import REPO, repo_first_on_path
from tests.support.dist_utils import RankFailure, run_on_ranks
from tests.support.fits import strategy_json
from tests.support.lightning_toy import fit_briefly

PATHS = ("cli", "cli_ranks", "helper")
ABORT_MARKERS = ("terminate called", "Fatal Python error")
FIT = ("fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--data.source", "synthetic",
       "--model.context_length", "32", "--data.seq_len", "32", "--data.batch_size", "2", "--trainer.max_steps", "3",
       "--timer.warmup_steps", "1", "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false")
"""3 steps of the quickstart's tiny GPT on 32-token sequences, the timer recording the last 2 (its collectives carry
Python completion callbacks)."""


def _environment() -> dict[str, str]:
    return {**repo_first_on_path(), "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}


def _cli_run(strategy: str, run_dir: Path, every_rank: bool, timeout_s: float) -> dict:
    command = [sys.executable, "-m", "lightning_ddp", *FIT, "--trainer.strategy", strategy_json(strategy, "gloo"),
               "--trainer.logger.init_args.save_dir", str(run_dir / "logs")]
    layout = RankLayout("gloo", devices_per_node=2, num_nodes=1)
    envs = rank_environments(layout, find_free_port(), every_rank=every_rank, threads=1, parent=_environment())
    logs = [run_dir / f"process{i}.log" for i in range(len(envs))]
    result = run_processes(command, envs, logs, timeout_s, cwd=str(run_dir))
    output = "\n".join(log.read_text(encoding="utf-8", errors="replace") for log in logs)
    finished = "`Trainer.fit` stopped: `max_steps=3` reached" in output  # rank 0 says it
    return {"exit_codes": result.returncodes, "timed_out": result.timed_out, "finished": finished, "output": output}


def _helper_run(strategy: str, run_dir: Path, timeout_s: float) -> dict:
    os.environ.update(_environment())  # the spawned ranks inherit it
    try:
        steps = run_on_ranks(fit_briefly, 2, strategy, str(run_dir), timeout=timeout_s)
        return {"exit_codes": [0, 0], "timed_out": False, "finished": steps == [3, 3], "output": ""}
    except RankFailure as failure:
        return {"exit_codes": None, "timed_out": "timed out" in str(failure), "finished": False, "output": str(failure)}


def run_once(path: str, strategy: str, timeout_s: float) -> dict:
    """One run of ``strategy`` on ``path``: exit codes, whether the fit finished, and whether it ended cleanly."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="exit_loop_") as tmp:
        if path == "helper":
            run = _helper_run(strategy, Path(tmp), timeout_s)
        else:
            run = _cli_run(strategy, Path(tmp), every_rank=path == "cli_ranks", timeout_s=timeout_s)
    aborted = any(marker in run["output"] for marker in ABORT_MARKERS)
    clean = run["finished"] and run["exit_codes"] is not None and set(run["exit_codes"]) == {0} and not aborted
    return {"path": path, "strategy": strategy, "seconds": round(time.monotonic() - start, 1), "clean": clean,
            "aborted": aborted, **run}


def main(runs: int = 200, busy_cores: int = 1, out: str = "exit_loop.json", strategies: list[str] | None = None,
         paths: list[str] = list(PATHS), timeout_s: float = 600.0) -> int:
    """Run ``runs`` short 2-rank fits, each (path, strategy) in turn, with ``busy_cores`` spinning processes beside.

    Args:
        runs: How many runs in all (200: every strategy on every path, 6 or 7 times each).
        busy_cores: Processes that spin a core each for the whole loop (the load under which the aborts were seen).
        out: The JSON result file.
        strategies: Catalogue names (default: all of them).
        paths: Of ``cli``, ``cli_ranks``, ``helper``.
        timeout_s: Per run.
    """
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        raise ValueError(f"--paths {unknown}: not a path; choose from {list(PATHS)}")
    cells = [(path, name) for name in strategies or catalogue.names() for path in paths]
    started_at = git_state(ignore=[out])
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy_cores)]
    counts: dict[str, dict[str, int]] = {}
    not_clean, start = [], time.monotonic()
    try:
        for i in range(runs):
            path, strategy = cells[i % len(cells)]
            run = run_once(path, strategy, timeout_s)
            cell = counts.setdefault(f"{path} {strategy}", {"runs": 0, "clean": 0, "aborted": 0})
            cell["runs"] += 1
            cell["clean"] += run["clean"]
            cell["aborted"] += run["aborted"]
            print(f"{i + 1}/{runs} {path} {strategy}: {'clean' if run['clean'] else 'NOT CLEAN'} "
                  f"(exit codes {run['exit_codes']}, {run['seconds']} s)", flush=True)
            if not run["clean"]:
                not_clean.append({**run, "output": run["output"][-6000:]})
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    import torch
    import lightning

    result = {
        "command": " ".join(["python -m tests.exit_loop", *sys.argv[1:]]),
        "runs": runs, "clean": runs - len(not_clean), "aborted": sum(cell["aborted"] for cell in counts.values()),
        "busy_cores": busy_cores, "minutes": round((time.monotonic() - start) / 60, 1), "per_cell": counts,
        "not_clean": not_clean, "git": started_at,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "lightning": lightning.__version__},
    }
    Path(out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"{result['clean']}/{runs} clean, {result['aborted']} aborted, {result['minutes']} min: {out}", flush=True)
    return 0 if not not_clean else 1


if __name__ == "__main__":
    sys.exit(auto_cli(main, as_positional=False))
