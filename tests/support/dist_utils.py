"""Run a function on N gloo processes and hand each rank's return value back to the test.

::

    def _check(rank: int, world_size: int, scale: float) -> float:   # module level: spawn pickles by name
        t = torch.tensor([rank * scale])
        dist.all_reduce(t)
        return t.item()

    def test_sum():
        assert run_on_ranks(_check, 2, 1.0) == [1.0, 1.0]

Recipe (``run_on_ranks``):

1. Find a free localhost port (bind a socket to port 0 and read what the OS gave).
2. Start ``world_size`` processes with the ``spawn`` start method (a fresh interpreter each: no forked
   copies of the parent's threads, locks or process group; never Lightning's launchers).
3. Each child pins itself to one intra-op thread (ranks share the machine's cores), joins a group of the
   given backend (gloo by default; with NCCL in it the child first selects GPU ``rank % device_count``)
   through a TCP store on that port, calls ``fn(rank, world_size, *args)``, tears the group down, and writes
   ``("ok", value)`` to ``<tmp>/rank<r>.pkl`` with plain pickle (tensors by value: nothing refers to the child's
   shared memory once it has exited); a rank that raised writes ``("error", traceback)`` at once and exits 1.
   Either way it exits without finalizing the interpreter (``lightning_ddp.teardown``: a gloo thread still alive
   then would abort the process, SIGABRT, after its work was done).
4. The parent waits on the children's exit sentinels. The first rank that raises (or dies without a result)
   fails the call at once with that rank's traceback; the others are killed, since they would otherwise wait
   in a collective for a peer that is gone. Past ``timeout`` seconds every child still running is killed and
   the call fails, so a mismatched collective sequence fails the test instead of hanging it.

Why files and not an ``mp.Queue``: a queue's feeder thread must be drained before the child can exit, and a
killed child can leave a queue's lock held; a file per rank has neither problem.

Cost: each run pays interpreter start-up plus the imports of ``fn``'s module (``import lightning_ddp`` imports
Lightning, ~8 s on 2 cores), so group many checks into one run.
"""

from __future__ import annotations

import importlib
import importlib.util
import pickle
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait as wait_for_sentinels
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_ddp.files import write_atomically
from lightning_ddp.local_group import find_free_port, init_local_process_group
from lightning_ddp.teardown import exit_without_finalizing, tear_down_process_group

DEFAULT_TIMEOUT_S = 600.0
"""A bound on a hang (mismatched collectives), not on speed: ~10x the slowest job's time on 2 busy cores (a 3-rank
fp64 FSDP2 run took 65 s at a load average of 8, twice that at 19)."""
_PORT_RETRIES = 3  # another process can take the free port between our probe and rank 0's bind


class RankFailure(AssertionError):
    """A rank raised, died, or the run passed its time limit; the message holds the child's traceback.

    An ``AssertionError`` so that pytest reports it as a test failure with the message in full.
    """


def run_on_ranks(
    fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, backend: str = "gloo"
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return the values by rank.

    Args:
        fn: A module-level function of an importable module (spawn re-imports it by name in each child).
        world_size: Number of processes, each one rank of the default process group.
        *args: Extra picklable arguments passed to every rank.
        timeout: Seconds for the whole run (start-up included); children still running are killed after it.
        backend: The process group's backend, as ``init_process_group`` takes it: ``gloo`` (CPU tensors, or CUDA
            tensors through the host), ``nccl``, or a per-device spec such as ``cpu:gloo,cuda:nccl``. NCCL refuses
            two ranks on one GPU, so with one GPU it runs at world size 1. Return values must not hold CUDA
            tensors (the parent may have no GPU context): move them to the CPU first.

    Raises:
        RankFailure: A rank raised (message: its traceback), exited without a result, or the run timed out.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    qualname = getattr(fn, "__qualname__", "")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(
            f"run_on_ranks needs a module-level function (spawn imports it by name in each child), got {qualname!r}; "
            "move it to module level."
        )
    target = _FunctionRef(fn.__module__, qualname, getattr(sys.modules.get(fn.__module__), "__file__", None))
    for attempt in range(_PORT_RETRIES):
        try:
            return _run_once(target, world_size, args, timeout, backend)
        except _PortTaken:
            if attempt == _PORT_RETRIES - 1:
                raise RankFailure(f"could not bind a free port for the gloo store in {_PORT_RETRIES} tries") from None
    raise AssertionError("unreachable")


# -- parent side --------------------------------------------------------------------------------------


class _PortTaken(Exception):
    """Rank 0 could not bind the store port (taken between probe and bind): retry on a new port."""


class _FunctionRef:
    """``fn`` by module name, qualified name and file, resolved in the child.

    Resolving it ourselves (rather than letting spawn unpickle ``fn``) turns an import failure into a traceback
    the parent reports, and falls back to loading the module from its file when its name is not importable in
    the child (e.g. pytest's ``--import-mode=importlib`` names test modules without putting them on sys.path).
    """

    def __init__(self, module: str, qualname: str, file: str | None) -> None:
        self.module, self.qualname, self.file = module, qualname, file

    def resolve(self) -> Callable[..., Any]:
        try:
            obj: Any = importlib.import_module(self.module)
        except ImportError:
            if self.file is None:
                raise
            spec = importlib.util.spec_from_file_location(self.module, self.file)
            assert spec is not None and spec.loader is not None
            obj = importlib.util.module_from_spec(spec)
            sys.modules[self.module] = obj
            spec.loader.exec_module(obj)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj

    def __repr__(self) -> str:
        return f"{self.module}.{self.qualname}"


def _run_once(target: _FunctionRef, world_size: int, args: tuple, timeout: float, backend: str) -> list[Any]:
    ctx = mp.get_context("spawn")
    port = find_free_port()
    with tempfile.TemporaryDirectory(prefix="run_on_ranks_") as result_dir:
        procs = [
            ctx.Process(
                target=_child,
                args=(rank, world_size, port, target, args, result_dir, timeout, backend),
                name=f"rank{rank}",
                # Not daemonic, so a rank may start processes of its own (DataLoader workers); the `finally`
                # below kills any rank still running however this call ends.
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        try:
            return _collect(procs, target, Path(result_dir), time.monotonic() + timeout, timeout)
        finally:
            for proc in procs:  # after success they have exited; after a failure this ends the stragglers
                if proc.is_alive():
                    proc.kill()
            for proc in procs:
                proc.join(timeout=10)


def _collect(procs: list, target: _FunctionRef, result_dir: Path, deadline: float, timeout: float) -> list[Any]:
    world_size = len(procs)
    results: dict[int, Any] = {}
    running = dict(enumerate(procs))
    while running:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RankFailure(
                f"{target} timed out after {timeout:.0f} s on {world_size} ranks; ranks {sorted(running)} were still "
                f"running and were killed (finished: {sorted(results)}). A hang usually means the ranks issued "
                "different collective sequences."
            )
        wait_for_sentinels([p.sentinel for p in running.values()], timeout=min(remaining, 1.0))
        for rank, proc in list(running.items()):
            if proc.is_alive():
                continue
            proc.join()
            del running[rank]
            status, value = _read_result(result_dir / f"rank{rank}.pkl")
            if status == "ok" and proc.exitcode == 0:
                results[rank] = value
            elif status == "ok":
                raise RankFailure(
                    f"rank {rank} of {world_size} returned from {target} and wrote its result, then exited with code "
                    f"{proc.exitcode} (a negative code is the signal: -6 is SIGABRT; docs/troubleshooting.md)."
                )
            elif status == "port_taken":
                raise _PortTaken()
            elif status == "error":
                raise RankFailure(f"rank {rank} of {world_size} raised in {target}:\n\n{value}")
            else:
                raise RankFailure(
                    f"rank {rank} of {world_size} exited with code {proc.exitcode} without a result from {target} "
                    "(killed by a signal, or it failed while starting: see the captured stderr)."
                )
    return [results[rank] for rank in range(world_size)]


def _read_result(path: Path) -> tuple[str, Any]:
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return "missing", None


# -- child side ---------------------------------------------------------------------------------------


def select_device(rank: int, backend: str) -> None:
    """NCCL binds a communicator to the current device: pick it (rank modulo the GPUs) before the group exists."""
    if "nccl" in backend:
        torch.cuda.set_device(rank % torch.cuda.device_count())


def _child(
    rank: int, world_size: int, port: int, target: _FunctionRef, args: tuple, result_dir: str, timeout: float,
    backend: str = "gloo",
) -> None:
    try:
        select_device(rank, backend)
        # Ranks share the machine's cores: one intra-op thread each avoids oversubscription and keeps timing
        # sane. A collective never outwaits the parent's limit.
        init_local_process_group(rank, world_size, port, backend, threads=1, timeout=timedelta(seconds=timeout))
    except Exception as error:  # noqa: BLE001 - reported to the parent, which decides
        in_use = "address already in use" in str(error).lower() or "eaddrinuse" in str(error).lower()
        _write_result(result_dir, rank, ("port_taken" if in_use else "error", traceback.format_exc()))
        return
    try:
        value = target.resolve()(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - includes pytest's Failed (an Exception subclass only in newer pytest)
        # Reported before anything else: tearing the group down could wait on a collective still in flight.
        _write_result(result_dir, rank, ("error", traceback.format_exc()))
        exit_without_finalizing(1)
    tear_down_process_group()
    try:
        _write_result(result_dir, rank, ("ok", value))
    except Exception:  # noqa: BLE001 - e.g. the value does not pickle: report that instead
        unpicklable = f"rank {rank}'s return value could not be pickled:\n{traceback.format_exc()}"
        _write_result(result_dir, rank, ("error", unpicklable))
    exit_without_finalizing()  # a gloo thread of a group torch keeps alive aborts finalization (lightning_ddp.teardown)


def _write_result(result_dir: str, rank: int, result: tuple[str, Any]) -> None:
    # Plain pickle: tensors are written by value. Atomic: the parent never reads half a file.
    write_atomically(Path(result_dir) / f"rank{rank}.pkl", pickle.dumps(result))
