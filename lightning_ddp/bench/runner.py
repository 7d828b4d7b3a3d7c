"""Run one cell in its own processes and say how it went: ``ok``, ``oom``, ``failed`` or ``timeout``.

A cell is a real ``python -m lightning_ddp fit`` (see ``grid.cell_command``), so a crash, an out-of-memory
error or a hang ends that cell only. ``SubprocessCellRunner`` is the runner the sweep uses; the sweep takes
any callable ``(cell, run_dir) -> CellOutcome``, which is how the tests fake it.

Recipe (``SubprocessCellRunner.__call__``):

1. Empty ``run_dir`` (a rerun starts clean), write ``command.txt`` (the command and each rank's launcher
   variables, to reproduce the cell by hand), pick a free port.
2. Start the cell's processes (``grid.rank_environments``), each in its own session (so it and any process
   it starts can be killed as a group), stdout and stderr to ``rank<r>.log``.
3. Poll. When a process exits non-zero the others are given a few seconds to notice and are then killed
   (a rank whose peer died would otherwise wait in a collective until the backend's timeout); past
   ``run.timeout_s`` everything is killed.
4. Classify (``classify``): timeout; else out of memory if any failed rank's log says so or a rank died by
   SIGKILL that we did not send (the kernel's OOM killer); else failed; else ok if ``timing_summary.json``
   exists. The reason is the last meaningful error line of the first rank that failed (``error_line``).
   An ok cell hands back its ``timing_summary.json`` and, when the CommTimer wrote one, ``compute_profile.json``.

The sweep calls the runner once per cell *repeat*, each with its own ``run_dir`` (``runs/<cell id>/r<k>/``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import ctypes
import signal
import sys
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from lightning_ddp.bench.config import SweepConfig
from lightning_ddp.bench.grid import Cell, RankLayout, cell_command, rank_environments
# Re-exported: the benchmarks and the sweep import them from here.
from lightning_ddp.local_group import find_free_port, init_cpu_process_group

__all__ = [
    "CellOutcome",
    "CellRunner",
    "SubprocessCellRunner",
    "classify",
    "error_line",
    "find_free_port",
    "init_cpu_process_group",
    "is_oom",
    "run_processes",
]

STATUSES = ("ok", "oom", "failed", "timeout")

_OOM_PATTERNS = re.compile(r"out of memory|OutOfMemoryError|\bMemoryError\b|Cannot allocate memory", re.IGNORECASE)
# "SomeError: ...", "torch.OutOfMemoryError: ...", "KeyboardInterrupt", jsonargparse's "error: ...".
_ERROR_LINE = re.compile(r"^([\w.]*(Error|Exception|Exit|Interrupt|Failure)\b|error:|Killed\b|Segmentation fault)")
_NOISE = re.compile(r"^(Traceback|During handling|The above exception|\s|\^|~|-{5,}|={5,}|.*[Ww]arning\b)")
_GRACE_S = 5.0  # how long the other ranks get to exit by themselves after one failed
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
    """The cell's ``compute_profile.json`` (forward/backward/optimizer times, gradient-ready times), when it wrote one."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")


CellRunner = Callable[[Cell, Path], CellOutcome]
"""Runs one cell whose outputs go to the given directory."""


def is_oom(text: str) -> bool:
    """Whether ``text`` (a failed process's output) reports running out of memory (CUDA, CPU or the allocator)."""
    return bool(_OOM_PATTERNS.search(text))


def error_line(text: str, limit: int = 300) -> str:
    """The last meaningful error line of a process's output (``""`` if there is none).

    Scanning from the end: the last line that names an error (``ValueError: ...``, ``error: ...``), else the
    last line that is not traceback scaffolding, code, or a warning.

    >>> error_line("Traceback (most recent call last):\\n  File 'x.py'\\n    f()\\nValueError: bad size\\n")
    'ValueError: bad size'
    """
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if _ERROR_LINE.match(line):
            return line[:limit]
    for line in reversed(lines):
        if not _NOISE.match(line):
            return line[:limit]
    return ""


def classify(
    returncodes: list[int | None],
    logs: list[str],
    timed_out: bool,
    killed_by_us: set[int],
    first_failed: int | None,
    summary_found: bool,
    timeout_s: float = 0.0,
) -> tuple[str, str]:
    """``(status, reason)`` of a finished cell (step 4 of the module recipe).

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


@dataclass
class ProcessResult:
    """What ``run_processes`` observed."""

    returncodes: list[int | None]
    timed_out: bool
    killed_by_us: set[int] = field(default_factory=set)
    first_failed: int | None = None
    wall_s: float = 0.0


# Loaded here, in the parent: the child only calls prctl between fork and exec, where loading a library could
# deadlock on a lock held by another thread of the parent.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


def _die_with_the_sweep() -> None:
    """In a cell process: ask the kernel to SIGKILL it when the sweep dies, even by SIGKILL (no orphans)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the process's own session: it and whatever it started (Lightning's ranks)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(procs: list[subprocess.Popen], indices: list[int], killed: set[int]) -> None:
    """SIGTERM the process groups of ``indices``, then SIGKILL whatever is left after 3 s."""
    alive = [i for i in indices if procs[i].poll() is None]
    for i in alive:
        killed.add(i)
        _kill_group(procs[i], signal.SIGTERM)
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and any(procs[i].poll() is None for i in alive):
        time.sleep(0.05)
    for i in alive:
        _kill_group(procs[i], signal.SIGKILL)  # also reaps stragglers of an exited leader
        procs[i].wait()


def run_processes(
    command: list[str], envs: list[dict[str, str]], log_paths: list[Path], timeout_s: float, cwd: str | None = None
) -> ProcessResult:
    """Start one process per environment, wait for all (steps 2-3 of the module recipe), never leave one behind."""
    start = time.monotonic()
    procs: list[subprocess.Popen] = []
    files = []
    killed: set[int] = set()
    first_failed: int | None = None
    timed_out = False
    try:
        for env, log_path in zip(envs, log_paths):
            log = open(log_path, "w", encoding="utf-8")
            files.append(log)
            procs.append(subprocess.Popen(
                command, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_die_with_the_sweep,
            ))
        failed_at: float | None = None
        while True:
            codes = [p.poll() for p in procs]
            if first_failed is None:
                first_failed = next((i for i, c in enumerate(codes) if c not in (0, None)), None)
                if first_failed is not None:
                    failed_at = time.monotonic()
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if now - start > timeout_s:
                timed_out = True
                _stop(procs, list(range(len(procs))), killed)
                break
            if failed_at is not None and now - failed_at > _GRACE_S:
                _stop(procs, list(range(len(procs))), killed)
                break
            time.sleep(0.1)
    finally:
        _stop(procs, list(range(len(procs))), killed)  # nothing is left alive after a normal finish
        for p in procs:  # end any process a leader left running in its session (Lightning-launched ranks)
            _kill_group(p, signal.SIGKILL)
        for f in files:
            f.close()
    return ProcessResult([p.returncode for p in procs], timed_out, killed, first_failed, time.monotonic() - start)


class SubprocessCellRunner:
    """Runs a cell as ``python -m lightning_ddp fit`` processes (the module recipe).

    Args:
        config: The sweep (workload, run settings).
        layout: Where the ranks go (``grid.rank_layout``).
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
        envs = rank_environments(cell, self.config, self.layout, port)
        _write_command(run_dir / "command.txt", command, envs)
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


def _write_command(path: Path, command: list[str], envs: list[dict[str, str]]) -> None:
    """The command and the variables that differ between ranks or matter to the run, as a shell snippet."""
    keys = ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK",
            "LOCAL_RANK", "RANK")
    lines = ["# one line per process the sweep started for this cell, all at once (with `run.launcher: lightning`,"
             "# Lightning starts the other ranks itself)"]
    for env in envs:
        prefix = " ".join(f"{k}={shlex.quote(env[k])}" for k in keys if k in env)
        lines.append(f"{prefix} {shlex.join(command)}".strip())
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
