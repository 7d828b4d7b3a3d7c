"""The study's one launcher: fit arguments -> the ``python -m lightning_ddp fit`` command (``fit_command``), the
ranks placed, run with a timeout, none left behind (docs/benchmarks.md)."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from lightning_ddp import catalogue

REFERENCE = "reference"
"""The study's one-process, compute-only cell (not a strategy: it runs with Lightning's ``auto``)."""

LOOPBACK_INTERFACE = "lo0" if sys.platform == "darwin" else "lo"
"""The loopback interface, which the runs' gloo uses (``GLOO_SOCKET_IFNAME``) unless told otherwise."""

# Variables by which launchers (torchrun, SLURM, MPI, LSF) tell a process its rank: a run is its own
# single-machine job, so inheriting the study's own values would make Lightning pick the wrong cluster environment.
_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "NODE_RANK",
                       "MASTER_ADDR", "MASTER_PORT")
_LAUNCHER_PREFIXES = ("TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "LSB_", "JSM_")
"""Prefixes of the other launcher variables a run's environment drops (``_LAUNCHER_VARIABLES``)."""
_OOM_PATTERNS = re.compile(r"out of memory|OutOfMemoryError|\bMemoryError\b|Cannot allocate memory", re.IGNORECASE)
"""A log line that says a process ran out of memory (torch's, Python's or the OS's words)."""
# "SomeError: ...", "torch.OutOfMemoryError: ...", "KeyboardInterrupt", jsonargparse's "error: ...".
_ERROR_LINE = re.compile(r"^([\w.]*(Error|Exception|Exit|Interrupt|Failure)\b|error:|Killed\b|Segmentation fault)")
_NOISE = re.compile(r"^(Traceback|During handling|The above exception|\s|\^|~|-{5,}|={5,}|.*[Ww]arning\b)")
"""Lines ``error_line`` passes over: traceback frames, rules and warnings."""
_GRACE_S = 5.0  # how long the other ranks get to exit by themselves after one failed


def strategy_argument(name: str, backend: str | None = None, bucket_size_mb: float | str | None = None,
                      settings: Mapping[str, Any] | None = None) -> str:
    """The value of ``--trainer.strategy`` for a catalogue name (``auto`` for the study's ``reference``)."""
    if name == REFERENCE:
        return "auto"
    return json.dumps(catalogue.get(name).strategy_argument(backend, bucket_size_mb, settings))


def fit_command(arguments: Sequence[str], log_dir: Path) -> list[str]:
    """``python -m lightning_ddp fit <arguments>``, a TensorBoard logger writing into ``log_dir`` itself."""
    logger = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
              "init_args": {"save_dir": str(log_dir), "name": "", "version": ""}}
    return [sys.executable, "-m", "lightning_ddp", "fit", *arguments, "--trainer.logger", json.dumps(logger)]


@dataclass(frozen=True)
class RankLayout:
    """Where a run's ranks sit: ``num_nodes`` > 1 only when ranks share GPUs (``gpu_of_rank``: one-GPU nodes)."""

    backend: str
    """``gloo`` or ``nccl``, resolved from ``backend: auto``."""
    devices_per_node: int
    """Ranks per node (Lightning's ``devices``)."""
    num_nodes: int
    """Nodes on this one machine; above 1 only for gloo ranks each given one GPU."""
    gpu_of_rank: tuple[str, ...] | None = None
    """``CUDA_VISIBLE_DEVICES`` of each rank when ranks are one-GPU nodes; ``None`` otherwise."""

    @property
    def world_size(self) -> int:
        """Ranks in all: ``devices_per_node * num_nodes``."""
        return self.devices_per_node * self.num_nodes


def rank_layout(accelerator: str, devices: int, backend: str = "auto", launcher: str = "lightning",
                gpu_count: int = 0, visible_gpus: str | None = None) -> RankLayout:
    """The backend and the rank placement (``backend: auto`` resolved here): gloo on CPU, nccl with a GPU per rank,
    else gloo with each rank a one-GPU "node" (needs ``launcher: ranks``); see docs/benchmarks.md."""
    if accelerator == "cpu":
        return RankLayout(backend="gloo", devices_per_node=devices, num_nodes=1)
    if gpu_count < 1:
        raise ValueError("`run.accelerator: cuda` but no GPU is visible; use `run.accelerator: cpu` on this machine")
    if gpu_count >= devices:
        return RankLayout(backend="nccl" if backend in ("auto", "nccl") else "gloo", devices_per_node=devices,
                          num_nodes=1)
    if backend == "nccl":
        raise ValueError(
            f"`run.backend: nccl` with {devices} ranks on {gpu_count} GPU(s): NCCL refuses two ranks on one GPU; "
            "use `run.backend: auto` (gloo with CUDA tensors) or `run.devices` <= the number of GPUs"
        )
    if launcher != "ranks":
        raise ValueError(
            f"{devices} ranks on {gpu_count} GPU(s) need `run.launcher: ranks` (Lightning's launcher puts one rank "
            "on each GPU and refuses to reuse one)"
        )
    ids = [g.strip() for g in visible_gpus.split(",")] if visible_gpus else [str(i) for i in range(gpu_count)]
    ids = ids[:gpu_count]
    return RankLayout(backend="gloo", devices_per_node=1, num_nodes=devices,
                      gpu_of_rank=tuple(ids[r % len(ids)] for r in range(devices)))


def cpu_threads_per_rank(ranks: int) -> int:
    """Each of ``ranks`` CPU processes' share of this machine's cores, at least 1 (what Lightning's DDP sets)."""
    return max(1, (os.cpu_count() or 1) // ranks)


def base_environment(threads: int | None = None, extra: Mapping[str, str] | None = None,
                     parent: Mapping[str, str] | None = None) -> dict[str, str]:
    """``parent`` (default: this process's environment) without the launchers' rank variables, plus unbuffered
    output, ``OMP_NUM_THREADS`` = ``threads``, ``GLOO_SOCKET_IFNAME`` = the loopback (unless set) and ``extra``."""
    parent = dict(os.environ if parent is None else parent)
    env = {k: v for k, v in parent.items() if k not in _LAUNCHER_VARIABLES and not k.startswith(_LAUNCHER_PREFIXES)}
    env["PYTHONUNBUFFERED"] = "1"  # logs stream to the rank files as they happen (the reason of a crash survives)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)  # Lightning keeps an OMP_NUM_THREADS that is already set
    env.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_INTERFACE)
    env.update(extra or {})
    return env


def rank_environments(layout: RankLayout, port: int, *, every_rank: bool, threads: int | None = None,
                      extra: Mapping[str, str] | None = None,
                      parent: Mapping[str, str] | None = None) -> list[dict[str, str]]:
    """One environment per process to start: one (Lightning starts the others), or with ``every_rank`` each rank's."""
    envs = [base_environment(threads, extra, parent) for _ in range(layout.world_size if every_rank else 1)]
    for rank, env in enumerate(envs):
        node_rank, local_rank = divmod(rank, layout.devices_per_node)
        if every_rank:
            env.update({
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "WORLD_SIZE": str(layout.world_size),
                "NODE_RANK": str(node_rank),
                "LOCAL_RANK": str(local_rank),
                "RANK": str(rank),  # read by Lightning's rank_zero_only before the strategy sets the rank
            })
        if layout.gpu_of_rank:
            env["CUDA_VISIBLE_DEVICES"] = layout.gpu_of_rank[rank]
    return envs


def write_command(path: Path, command: list[str], envs: list[dict[str, str]]) -> None:
    """The command and the variables that differ between ranks or matter to the run, as a shell snippet."""
    keys = ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK",
            "LOCAL_RANK", "RANK")
    lines = ["# one line per process started for this run, all at once (with one line, Lightning starts the",
             "# other ranks itself)"]
    for env in envs:
        prefix = " ".join(f"{k}={shlex.quote(env[k])}" for k in keys if k in env)
        lines.append(f"{prefix} {shlex.join(command)}".strip())
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@dataclass
class ProcessResult:
    """What ``run_processes`` observed (``killed_by_us``: indices of the processes it had to stop)."""

    returncodes: list[int | None]
    """Each process's exit code, negative for a signal; ``None`` if it could not be reaped."""
    timed_out: bool
    """Whether ``timeout_s`` ran out before every process had exited."""
    killed_by_us: set[int] = field(default_factory=set)
    first_failed: int | None = None
    """Index of the first process seen exiting non-zero; ``None`` if none did."""
    wall_s: float = 0.0
    """Seconds from the first start until every process had exited or been killed."""


# Loaded here, in the parent: the child only calls prctl between fork and exec, where loading a library could
# deadlock on a lock held by another thread of the parent.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1
"""``prctl``'s option: the signal the kernel sends a child when its parent dies."""


def _die_with_the_parent() -> None:
    """In a started process: ask the kernel to SIGKILL it when the study dies, even by SIGKILL (no orphans)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to ``proc``'s process group; one that has already gone is no error."""
    try:
        os.killpg(proc.pid, sig)  # the process's own session: it and whatever it started (Lightning's ranks)
    except (ProcessLookupError, PermissionError):
        pass


def run_processes(command: list[str], envs: list[dict[str, str]], log_paths: list[Path], timeout_s: float,
                  cwd: str | None = None) -> ProcessResult:
    """One process per environment (output to its log) until all exit, ``timeout_s`` is up, or ``_GRACE_S`` after
    one failed; then SIGTERM the groups still alive, SIGKILL after 3 s whatever is left: none is left behind."""
    start = time.monotonic()
    procs: list[subprocess.Popen] = []
    files = []
    timed_out, first_failed, failed_at = False, None, None
    try:
        for env, log_path in zip(envs, log_paths):
            log = open(log_path, "w", encoding="utf-8")
            files.append(log)
            procs.append(subprocess.Popen(
                command, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_die_with_the_parent,
            ))
        while True:
            codes = [p.poll() for p in procs]
            if first_failed is None:
                first_failed = next((i for i, c in enumerate(codes) if c not in (0, None)), None)
                failed_at = time.monotonic() if first_failed is not None else None
            done, now = all(c is not None for c in codes), time.monotonic()
            timed_out = not done and now - start > timeout_s
            if done or timed_out or failed_at is not None and now - failed_at > _GRACE_S:
                break
            time.sleep(0.1)
    finally:
        alive = [i for i, proc in enumerate(procs) if proc.poll() is None]  # none after a normal finish
        for i in alive:
            _kill_group(procs[i], signal.SIGTERM)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and any(procs[i].poll() is None for i in alive):
            time.sleep(0.05)
        for i, proc in enumerate(procs):
            _kill_group(proc, signal.SIGKILL)
            if i in alive:
                proc.wait()
        for f in files:
            f.close()
    return ProcessResult(returncodes=[p.returncode for p in procs], timed_out=timed_out, killed_by_us=set(alive),
                         first_failed=first_failed, wall_s=time.monotonic() - start)


def is_oom(text: str) -> bool:
    """Whether ``text`` (a failed process's output) reports running out of memory (CUDA, CPU or the allocator)."""
    return bool(_OOM_PATTERNS.search(text))


def error_line(text: str, limit: int = 300) -> str:
    """The last output line naming an error, else the last that is not traceback, code or a warning (or ``""``)."""
    lines = [line.rstrip() for line in reversed(text.splitlines()) if line.strip()]
    line = next((line for line in lines if _ERROR_LINE.match(line)), None)
    if line is None:
        line = next((line for line in lines if not _NOISE.match(line)), "")
    return line[:limit]


def first_error_line(texts: Iterable[str]) -> str:
    """The ``error_line`` of the first of ``texts`` that has one, else ``""``."""
    for text in texts:
        line = error_line(text)
        if line:
            return line
    return ""
