"""``TraceRecorder``: a ``torch.profiler`` trace of a few optimizer steps on every rank, with our ``ddp/*`` ranges
and a communication track, one ``rank{R}.pt.trace.json`` per rank (Perfetto, HTA and TensorBoard open it).
The clock alignment: ``docs/comm_timer.md``, "Traces".
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.profilers import PyTorchProfiler
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.profiler import ProfilerAction, ProfilerActivity, record_function
from typing_extensions import override

from lightning_ddp.callbacks.comm_timer import StepObserver, run_description
from lightning_ddp.metrics.comm_track import TRACE_SUFFIX, RecordedStep, add_communication_track
from lightning_ddp.sync import ranges
from lightning_ddp.sync.base import check_number
from lightning_ddp.sync.record import SyncRecord


@contextlib.contextmanager
def without_kineto_usdt_lines():
    """Drop the ``USDT: ... profiler_start/stop`` lines kineto prints on stderr (fd 2) when it starts and stops, and
    pass every other line on (``KINETO_LOG_LEVEL=6`` would hide them and its errors too)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            os.write(2, b"".join(line for line in caught if not line.startswith(b"USDT:")))


class TraceRecorder(StepObserver):
    """Record a profiler trace of ``active_steps`` optimizer steps after ``wait_steps + warmup_steps`` on every rank.

    Args:
        enabled: Off by default (profiling slows the traced steps); ``--trace.enabled true`` switches it on.
        wait_steps: Optimizer steps left alone first (start-up, allocator and gloo connection warm-up).
        warmup_steps: Steps the profiler runs but discards (its own start-up cost would skew the first one).
        active_steps: Steps recorded into the trace.
        dirpath: Where the ``rank{R}.pt.trace.json`` files go; default ``<trainer.log_dir>/traces``.
        record_shapes: Record operator input shapes (bigger traces).
        with_stack: Record Python stacks of operators (much bigger traces, more overhead).
    """

    def __init__(
        self,
        enabled: bool = False,
        wait_steps: int = 5,
        warmup_steps: int = 1,
        active_steps: int = 3,
        dirpath: str | None = None,
        record_shapes: bool = False,
        with_stack: bool = False,
    ) -> None:
        check_number("wait_steps", wait_steps, 0, "e.g. --trace.wait_steps 5")
        check_number("warmup_steps", warmup_steps, 0, "e.g. --trace.warmup_steps 1")
        check_number("active_steps", active_steps, 1, "e.g. --trace.active_steps 3 (steps recorded)")
        self.enabled = enabled
        self.wait_steps = wait_steps
        self.warmup_steps = warmup_steps
        self.active_steps = active_steps
        self.dirpath = dirpath
        self.record_shapes = record_shapes
        self.with_stack = with_stack
        self.trace_path: Path | None = None
        """The trace this rank wrote, once written."""
        self._dir: Path | None = None
        self._prof: torch.profiler.profile | None = None
        self._open: list[tuple[str, record_function]] = []
        self._steps: list[RecordedStep] = []
        self._anchor = (0.0, 0.0)  # perf_counter() right before and after opening the current step's range
        self._handles: list[Any] = []
        self._tid = 0
        self._description: dict[str, Any] = {}

    @property
    def total_steps(self) -> int:
        """Optimizer steps the run needs for the trace to be written."""
        return self.wait_steps + self.warmup_steps + self.active_steps

    def _needs(self) -> str:
        """The steps a trace needs, in words, for warnings."""
        return (f"{self.total_steps} optimizer steps (wait {self.wait_steps} + warmup {self.warmup_steps} + active "
                f"{self.active_steps})")

    # -- set-up and tear-down -------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """For fit, when enabled: refuses a Trainer that already has a ``PyTorchProfiler``, resolves the trace
        folder (``dirpath``, else ``traces`` under rank 0's log dir) and starts recording the process groups'
        collectives."""
        if not self.enabled or stage != "fit":
            return
        if isinstance(trainer.profiler, PyTorchProfiler):
            raise ValueError(
                "TraceRecorder starts its own torch profiler and only one can run at a time, but the Trainer already "
                "has a PyTorchProfiler. Remove `--trainer.profiler` or switch tracing off with `--trace.enabled false`."
            )
        # trainer.log_dir broadcasts rank 0's directory, so every rank writes next to the same logs
        log_dir = trainer.log_dir or trainer.default_root_dir
        self._dir = Path(self.dirpath) if self.dirpath else Path(log_dir) / "traces"
        self._start_recording(trainer)  # before the strategy wraps the model around the process groups

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """When enabled: warns if ``max_steps`` is below ``total_steps``, brackets forward and the optimizer step
        with hooks, and starts the profiler on its wait/warm-up/active schedule."""
        if not self.enabled:
            return
        if trainer.max_steps != -1 and trainer.max_steps < self.total_steps:
            rank_zero_warn(f"TraceRecorder needs {self._needs()} but max_steps={trainer.max_steps}: the trace will "
                           "cover fewer steps. Lower --trace.wait_steps or raise --trainer.max_steps.")
        model = trainer.strategy.model
        self._tid = threading.get_native_id()
        self._description = {
            **run_description(trainer, pl_module),
            "rank": trainer.global_rank,
            "comm_track": "process groups",  # every collective of the run (sync/recording_group.py)
            "clock": "ts_us = perf_counter_s * 1e6 + offset_us; offset from the ddp/step#N anchor of each step",
        }
        # The strategy calls its wrapped model (our engine, torch DDP) to run training_step: its forward hooks
        # bracket the forward pass. Without a wrapper (single device) there is no forward range.
        if isinstance(model, torch.nn.Module) and model is not pl_module:
            self._handles.append(model.register_forward_pre_hook(lambda *_: self._enter(ranges.FORWARD)))
            self._handles.append(model.register_forward_hook(lambda *_: self._exit(ranges.FORWARD)))
        for optimizer in trainer.optimizers:
            self._handles.append(optimizer.register_step_post_hook(lambda *_: self._exit(ranges.OPTIMIZER)))
        activities = [ProfilerActivity.CPU]
        if trainer.strategy.root_device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=self.wait_steps, warmup=self.warmup_steps, active=self.active_steps, repeat=1
            ),
            on_trace_ready=self._write_trace,
            record_shapes=self.record_shapes,
            with_stack=self.with_stack,
        )
        with without_kineto_usdt_lines():
            self._prof.start()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Also after an exception: hooks removed, ranges closed, the profiler stopped."""
        self._finish()  # also after an exception (StepObserver.on_exception): the profiler never outlives the fit
        super().teardown(trainer, pl_module, stage)

    def _finish(self) -> None:
        """Remove the hooks, close every range and stop the profiler (writing what an unfinished active window
        recorded); warns if no trace was written. Safe to call twice."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._exit()
        if self._prof is not None:
            prof, self._prof = self._prof, None
            with without_kineto_usdt_lines():
                prof.stop()  # if the run ended inside the active window, this still writes what was recorded
            if self.trace_path is None:
                rank_zero_warn(f"TraceRecorder wrote no trace: it needs {self._needs()}. Lower --trace.wait_steps "
                               "or run more steps.")

    # -- per step -------------------------------------------------------------------------------------------

    def observes(self, step: int) -> bool:
        """Whether the profiler records now: only traced steps are recorded (the recorder stays unarmed in others)."""
        return self._prof is not None and self._prof.current_action in (ProfilerAction.RECORD,
                                                                         ProfilerAction.RECORD_AND_SAVE)

    def _opened(self, trainer: pl.Trainer) -> None:
        """Open the step's ``ddp/step#N`` range, its clock anchor taken around the opening."""
        before = time.perf_counter()
        self._enter(ranges.step_range_name(trainer.global_step))
        self._anchor = (before, time.perf_counter())

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._enter(ranges.BACKWARD)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._exit(ranges.BACKWARD)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._enter(ranges.OPTIMIZER)

    def _closed(self, trainer: pl.Trainer, record: SyncRecord | None) -> None:
        """Keep the step's collectives (when it was recorded), close its ranges and advance the profiler."""
        if record is not None:
            self._steps.append(RecordedStep(self._step, self._anchor, record.in_host_seconds().collectives))
        self._exit()
        if self._prof is not None:
            with without_kineto_usdt_lines():
                self._prof.step()  # after the last active step this calls _write_trace

    # -- ranges ---------------------------------------------------------------------------------------------

    def _enter(self, name: str) -> None:
        """Open range ``name``, only in a step the profiler records."""
        if not self.observes(self._step):
            return
        rf = record_function(name)
        rf.__enter__()
        self._open.append((name, rf))

    def _exit(self, name: str | None = None) -> None:
        """Close ``name`` and anything opened inside it that is still open (ranges must nest); ``None``: every range."""
        if name is not None and not any(open_name == name for open_name, _ in self._open):
            return
        while self._open:
            open_name, rf = self._open.pop()
            rf.__exit__(None, None, None)
            if open_name == name:
                return

    # -- output ---------------------------------------------------------------------------------------------

    def _write_trace(self, prof: torch.profiler.profile) -> None:
        """The profiler's callback: write ``rank{R}.pt.trace.json`` with the communication track and the run's
        description added, and set ``trace_path``."""
        assert self._dir is not None, "setup() resolves the trace directory before training starts"
        self._dir.mkdir(parents=True, exist_ok=True)
        rank = self._description.get("rank", 0)
        path = self._dir / f"rank{rank}{TRACE_SUFFIX}"
        prof.export_chrome_trace(str(path))
        with open(path) as f:
            trace = json.load(f)
        add_communication_track(trace, self._steps, pid=os.getpid(), tid=self._tid, metadata=self._description)
        with open(path, "w") as f:
            json.dump(trace, f)
        self.trace_path = path
        rank_zero_info(f"TraceRecorder: wrote rank*{TRACE_SUFFIX} to {self._dir} (open in ui.perfetto.dev, or draw "
                       f"with `python -m lightning_ddp.trace {self._dir} -o timeline.png`)")

