"""Run one cell of the sweep in its own processes and say how it went: ``ok``, ``oom``, ``failed`` or ``timeout``.

``SubprocessCellRunner`` starts the cell through the launcher (``bench.launch``) and classifies its end
(``classify``); the sweep takes any callable ``(cell, run_dir) -> CellOutcome``, which is how the tests fake it.
docs/benchmarks.md gives the recipe.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lightning_ddp.bench.config import SweepConfig
from lightning_ddp.bench.grid import Cell, cell_command, cell_environments
from lightning_ddp.bench.launch import (
    RankLayout,
    error_line,
    find_free_port,
    is_oom,
    run_processes,
    write_command,
)

__all__ = [
    "CellOutcome",
    "CellRunner",
    "SubprocessCellRunner",
    "classify",
]

STATUSES = ("ok", "oom", "failed", "timeout")

_ADDRESS_IN_USE = re.compile(r"address already in use|EADDRINUSE", re.IGNORECASE)


@dataclass
class CellOutcome:
    """What running a cell produced."""

    status: str
    """``ok``, ``oom``, ``failed`` or ``timeout``."""
    reason: str = ""
    """Empty when ok; else the error line that explains it."""
    summary: dict[str, Any] | None = None
    """The cell's ``timing_summary.json`` (CommTimer), when it wrote one."""
    wall_s: float = 0.0
    """Wall time of the cell, start-up and teardown included."""
    profile: dict[str, Any] | None = None
    """The cell's ``compute_profile.json`` (forward/backward/optimizer and gradient-ready times), if it wrote one."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")


CellRunner = Callable[[Cell, Path], CellOutcome]
"""Runs one cell whose outputs go to the given directory."""


def classify(
    returncodes: list[int | None],
    logs: list[str],
    timed_out: bool,
    killed_by_us: set[int],
    first_failed: int | None,
    summary_found: bool,
    timeout_s: float = 0.0,
) -> tuple[str, str]:
    """``(status, reason)`` of a finished cell: timeout; else oom if a failed rank's log says so or a rank died by a
    SIGKILL we did not send; else failed; else ok if the CommTimer wrote its summary.

    Args:
        returncodes: Exit code of each process (negative: killed by that signal).
        logs: Output of each process.
        timed_out: The cell passed its time limit and was killed.
        killed_by_us: Indices of processes the runner killed (their SIGKILL is not an OOM).
        first_failed: Index of the first process that exited non-zero, if any.
        summary_found: Whether the CommTimer wrote ``timing_summary.json``.
        timeout_s: The limit, for the reason text.
    """
    order = ([first_failed] if first_failed is not None else []) + [i for i in range(len(logs)) if i != first_failed]
    if timed_out:
        last = next((error_line(logs[i]) for i in order if error_line(logs[i])), "")
        return "timeout", f"no result after {timeout_s:.0f} s" + (f"; last output: {last}" if last else "")
    failed = [i for i in order if returncodes[i] not in (0, None)]
    if not failed:
        if summary_found:
            return "ok", ""
        last = next((error_line(logs[i]) for i in order if error_line(logs[i])), "")
        return "failed", "exited 0 but wrote no timing_summary.json" + (f" (last output: {last})" if last else "")
    for i in failed:
        match = next((line for line in reversed(logs[i].splitlines()) if is_oom(line)), None)
        if match:
            return "oom", f"rank {i}: {match.strip()[:300]}"
    for i in failed:
        if returncodes[i] == -signal.SIGKILL and i not in killed_by_us:
            return "oom", f"rank {i} was killed by SIGKILL (-9), most likely the kernel's out-of-memory killer"
    first = failed[0]
    line = error_line(logs[first])
    code = returncodes[first]
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    return "failed", f"rank {first} ({how}): {line}" if line else f"rank {first} ({how}) printed no error line"


class SubprocessCellRunner:
    """Runs a cell as ``python -m lightning_ddp fit`` processes (docs/benchmarks.md).

    Args:
        config: The sweep (workload, run settings).
        layout: Where the ranks go (``launch.rank_layout``).
        cwd: Working directory of the cells (relative paths in the config resolve against it).
    """

    def __init__(self, config: SweepConfig, layout: RankLayout, cwd: str | None = None) -> None:
        self.config = config
        self.layout = layout
        self.cwd = cwd

    def __call__(self, cell: Cell, run_dir: Path) -> CellOutcome:
        outcome = self._run_once(cell, run_dir)
        if outcome.status == "failed" and _ADDRESS_IN_USE.search(outcome.reason):
            outcome = self._run_once(cell, run_dir)  # the free port was taken between probe and bind: once more
        return outcome

    def _run_once(self, cell: Cell, run_dir: Path) -> CellOutcome:
        if run_dir.exists():
            shutil.rmtree(run_dir)  # a rerun (e.g. retry_failed) starts clean: no stale summary is read
        run_dir.mkdir(parents=True)
        command = cell_command(cell, self.config, self.layout, run_dir.resolve())
        port = find_free_port()
        envs = cell_environments(cell, self.config, self.layout, port)
        write_command(run_dir / "command.txt", command, envs)
        logs = [run_dir / f"rank{r}.log" for r in range(len(envs))]
        result = run_processes(command, envs, logs, self.config.run.timeout_s, cwd=self.cwd)
        summary_path = next(iter(sorted(run_dir.rglob("timing_summary.json"))), None)
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in logs]
        status, reason = classify(
            result.returncodes, texts, result.timed_out, result.killed_by_us, result.first_failed,
            summary_path is not None, self.config.run.timeout_s,
        )
        summary = json.loads(summary_path.read_text()) if status == "ok" and summary_path is not None else None
        profile_path = next(iter(sorted(run_dir.rglob("compute_profile.json"))), None)
        profile = None
        if status == "ok" and profile_path is not None:
            try:
                profile = json.loads(profile_path.read_text())
            except (OSError, json.JSONDecodeError):  # an extra, not the measurement: a bad file is left out
                profile = None
        return CellOutcome(status, reason, summary, result.wall_s, profile)
