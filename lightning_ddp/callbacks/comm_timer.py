"""``CommTimer``: per measured optimizer step, how much of the step went to gradient communication, into the logger;
a thin Lightning shell over ``lightning_ddp.metrics``. At the end of fit: a summary, ``timing_summary.json``/``.csv``,
``compute_profile.json`` and the TensorBoard views. ``docs/comm_timer.md``.
"""

from __future__ import annotations

import os
import platform
import re
import resource
import socket
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_ddp import catalogue, compat, hardware
from lightning_ddp.metrics.accounting import StepTiming, TimingSummary, step_metrics
from lightning_ddp.metrics.recording import (SUMMARY_SCHEMA, call_table, collective_calls, comm_recording,
                                             format_call_table, measurement_note, recorder_for, release_recorder,
                                             strategy_label)
from lightning_ddp.metrics.straggler import DEFAULT_MAX_COLLECTIVES, StragglerExchange, clock_note, distributed
from lightning_ddp.profile import ComputeProfile, ParamTiming, write_profile
from lightning_ddp.sync.base import check_number
from lightning_ddp.sync.record import Recorder, SyncRecord


class StepObserver(Callback):
    """A callback that observes whole optimizer steps through the run's shared ``Recorder`` (``recorder_for``), from
    ``setup`` (before the strategy wraps the model around the process groups) to ``teardown``. A subclass says which
    steps it ``observes(step)``; at the first micro-batch of one the recorder is opened and ``_opened(trainer)``
    called; after each step's last, ``_closed(trainer, record)`` gets the finished record (``None`` for a step not
    observed)."""

    enabled: bool = False
    _recorder: Recorder | None = None
    _in_step = False
    _observing = False  # the current optimizer step is observed
    _step = 0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """At an optimizer step's first micro-batch: if the step is observed, open the recorder's step and
        call ``_opened``."""
        if self._recorder is None or self._in_step:  # only the first micro-batch of an optimizer step
            return
        self._in_step = True
        self._step = trainer.global_step
        self._observing = self.observes(self._step)
        if self._observing:
            self._recorder.open_step(self._step)  # idempotent: another observer may have opened it already
            self._opened(trainer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """After the step's last micro-batch: ``_closed`` with the finished record (``None``: not observed)."""
        if not self._in_step or compat.should_accumulate(trainer):
            return
        self._in_step = False
        observed, self._observing = self._observing, False
        self._closed(trainer, self._recorder.finish_step() if observed else None)  # idempotent too

    def _start_recording(self, trainer: pl.Trainer) -> None:
        """Record the run's collectives from now on (a subclass's ``setup`` calls it once it will observe)."""
        self._recorder = recorder_for(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Stop recording: the process groups go back to torch's own."""
        if self._recorder is not None:
            release_recorder(trainer)  # the process groups go back to torch's own
            self._recorder = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")  # Lightning calls no teardown hook after an exception


class CommTimer(StepObserver):
    """Log step time, exposed and busy communication time, comm share and overlap per optimizer step.

    ``Trainer(strategy="ddp", callbacks=[CommTimer()])``. FLOPs come from the module's ``flops_per_batch`` (a
    number or a method of the batch) or ``flops_per_token(seq_len)``.

    Args:
        warmup_steps: Measured optimizer steps left out of the end-of-fit summary (start-up, allocator warm-up).
        enabled: Set false to switch the callback off (it is always added by the CLI).
        summary_name: Stem of the summary files written at the end of fit (``.json`` and ``.csv``).
        peak_tflops: Dense peak TFLOP/s of one device at the run's compute dtype, for ``step/mfu``; default: the
            table in ``lightning_ddp.hardware``.
        every_n_steps: Measure optimizer step ``s`` iff ``s % every_n_steps == 0``; the steps between cost nothing.
            Default: the trainer's ``log_every_n_steps``. 1 measures every step (the benchmarks do).
        tokens_fn: Tokens of one micro-batch on this rank, for ``step/tokens_per_s``; default: the module's
            ``tokens_per_batch(batch)`` if it has one.
        straggler_collectives: Launch times compared across ranks per step (the step's last ones) for
            ``comm/wait_ms`` and ``straggler/*``; 8 bytes each per rank and step.
        clock_sync: ``auto``: estimate every rank's clock offset to rank 0 when the ranks run on several hosts;
            ``always``: on one host too; ``off``: never.
        clock_sync_every_n_steps: Re-estimate the clock offsets after this many steps.
        clock_sync_rounds: Ping-pongs per rank and estimate; the one with the shortest round trip is kept.
    """

    def __init__(
        self,
        warmup_steps: int = 5,
        enabled: bool = True,
        summary_name: str = "timing_summary",
        peak_tflops: float | None = None,
        every_n_steps: int | None = None,
        tokens_fn: Callable[[Any], int] | None = None,
        straggler_collectives: int = DEFAULT_MAX_COLLECTIVES,
        clock_sync: str = "auto",
        clock_sync_every_n_steps: int = 1000,
        clock_sync_rounds: int = 8,
    ) -> None:
        if every_n_steps is not None:
            check_number("every_n_steps", every_n_steps, 1, "e.g. --timer.every_n_steps 1 to measure every step (null: "
                         "the trainer's log_every_n_steps)")
        check_number("warmup_steps", warmup_steps, 0, "e.g. --timer.warmup_steps 5")
        if peak_tflops is not None and not peak_tflops > 0:
            h100 = hardware.DEVICES["h100-sxm"].dense_tflops["bf16"]
            raise ValueError(f"peak_tflops must be > 0 (TFLOP/s of one device), got {peak_tflops}; "
                             f"e.g. --timer.peak_tflops {h100:g} for an H100 SXM in bf16")
        self.peak_tflops = peak_tflops
        self.warmup_steps = warmup_steps
        self.enabled = enabled
        self.summary_name = summary_name
        self.every_n_steps = every_n_steps
        self.tokens_fn = tokens_fn
        self.summary = TimingSummary()
        self._watched: list[tuple[str, torch.Tensor]] = []
        self._compute: list[dict[str, Any]] = []  # per measured step: forward/backward/optimizer ms, ready ms
        self._calls: dict[tuple[str, str, int], list[float]] = {}  # (group, op, bytes) -> busy ms, after warm-up
        self._batch_shape: tuple[int | None, int | None] = (None, None)  # (batch, seq_len): a 2-D counted micro-batch
        self._every = 1  # every_n_steps resolved at the start of training
        self._comm: str | None = "full"  # what this strategy's communication can be seen of (comm_recording)
        self._watch = False  # whether gradient-ready hooks are wanted (the compute profile)
        self._tokens: int | None = None
        self._flops: float | None = None
        self._peak_flops: float | None = None
        self._settings: tuple[float | str, str] = (catalogue.NOT_APPLICABLE, "default")  # strategy_settings
        self._first_step = 0  # the run's first optimizer step (after a resume: where it resumed)
        self.exchange = StragglerExchange(
            straggler_collectives, clock_sync, clock_sync_every_n_steps, clock_sync_rounds
        )

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """For fit, when enabled: refuses ``Trainer(logger=False)``, drops TensorBoard's placeholder ``hp_metric``
        and starts recording every collective of the run, before the strategy wraps the model."""
        if not self.enabled or stage != "fit":
            return
        if trainer.logger is None:
            raise ValueError(
                "CommTimer logs to the Trainer's logger, but `Trainer(logger=False)` leaves it nowhere to write. "
                "Enable a logger or switch the timer off with `--timer.enabled false`."
            )
        # The run's medians become its HPARAMS metrics at the end of fit (`_write_tensorboard_views`). Lightning
        # would log the hyperparameters first with a placeholder `hp_metric` of -1, and TensorBoard keeps a run's
        # first hparams record: that placeholder would hide ours, so it is turned off.
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                compat.drop_placeholder_hp_metric(logger)
        # Now, between the process groups' creation and the model's wrapping (DDP, FSDP2 and our engines capture
        # their group in the strategy's setup, after this hook): every collective of the run passes our recording.
        self._start_recording(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """When enabled: fixes the sampling (``every_n_steps``), warns of what the strategy's timing cannot see,
        chooses the parameters whose ready times are watched, reads the strategy's settings and the job's peak
        FLOP/s."""
        if not self.enabled:
            return
        self._every = self.every_n_steps if self.every_n_steps is not None else default_every_n_steps(
            trainer.log_every_n_steps, _planned_steps(trainer), self.warmup_steps)
        self._first_step = trainer.global_step
        self._comm = comm_recording()
        for note in (measurement_note(trainer.strategy, self._comm), _dropped_comm_hook_note(trainer.strategy)):
            if note is not None:
                rank_zero_warn(note)
        # When each gradient is computed: the landmark that starts exposed communication, for every strategy. Under
        # FSDP2 (ours, or a user's fully_shard) backward computes them on the unsharded parameters it swaps in.
        unsharded = compat.fsdp2_unsharded_parameters(pl_module)  # {} without FSDP2; else a collective
        self._watched = _trainable_once((name, unsharded.get(p, p)) for name, p in pl_module.named_parameters())
        self._watch = self._comm is not None or trainer.world_size == 1
        self._hook_gradients(self.observes(trainer.global_step))
        # Read now: at on_fit_end the strategy has already unwrapped its engine. For `auto`, the predicted size.
        self._settings = strategy_settings(trainer.strategy)
        self._peak_flops, hosts = _job_peak_flops(trainer, self.peak_tflops)
        self.exchange.start(trainer.strategy.root_device, hosts)

    def observes(self, step: int) -> bool:
        """Whether optimizer step ``step`` is measured: the same answer on every rank, with no communication."""
        return step % self._every == 0

    def _opened(self, trainer: pl.Trainer) -> None:
        """A measured step begins: CUDA's peak-memory counter reset, its tokens and FLOPs counted from zero."""
        if self._recorder.clock.cuda:
            torch.cuda.reset_peak_memory_stats()
        self._tokens = self._flops = None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """An observed micro-batch's tokens and FLOPs are added, where the module (or ``tokens_fn``) counts them."""
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if not self._observing:
            return
        counter = self.tokens_fn or getattr(pl_module, "tokens_per_batch", None)
        tokens = int(counter(batch)) if counter is not None else None
        if tokens is not None:
            self._tokens = (self._tokens or 0) + tokens
            x = batch[0] if isinstance(batch, (list, tuple)) else batch
            if isinstance(x, torch.Tensor) and x.dim() == 2:
                self._batch_shape = tuple(x.shape)
        flops = getattr(pl_module, "flops_per_batch", None)
        if callable(flops):
            flops = flops(batch)
        per_token = getattr(pl_module, "flops_per_token", None)
        if flops is None and tokens is not None and per_token is not None and self._batch_shape[1] is not None:
            flops = tokens * float(per_token(self._batch_shape[1]))
        if flops is not None:
            self._flops = (self._flops or 0.0) + float(flops)

    def _hook_gradients(self, wanted: bool) -> None:
        """Put the gradient-ready hooks on before a measured step, take them off before one that is not."""
        wanted = wanted and self._watch
        if wanted and not self._recorder.watching:
            self._recorder.watch_gradients([p for _, p in self._watched])
        elif not wanted and self._recorder.watching:
            self._recorder.unwatch_gradients()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        """A measured step's backward begins: marked on its record."""
        if self._observing:
            self._recorder.mark_backward_started()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """A measured step's gradients are ready for the optimizer: marked on its record."""
        if self._observing:
            self._recorder.mark_gradients_usable()

    def _closed(self, trainer: pl.Trainer, record: SyncRecord | None) -> None:
        """Hooks on (or off) for the next step; a measured step's time reduced over the ranks, logged and kept."""
        # trainer.global_step is now the next step's number: outside any measured window
        self._hook_gradients(self.observes(trainer.global_step))
        if record is None:
            return
        straggler = self.exchange.exchange(record, trainer.global_step)  # the step's one collective, on every rank
        timing = StepTiming.from_record(record, straggler.step_ms, self._tokens)
        metrics = step_metrics(
            timing,
            trainer.world_size,
            flops_per_step=self._flops,
            peak_flops=self._peak_flops,
            peak_memory_mib=_peak_memory_mib(self._recorder.clock.cuda),
            peak_reserved_mib=torch.cuda.max_memory_reserved() / 2**20 if self._recorder.clock.cuda else None,
            straggler=straggler,
            comm=self._comm,
        )
        # To the loggers at the measured step's number, whatever the trainer's log_every_n_steps (which Lightning's
        # own logging follows: a sampled step between its logging steps would be lost), as ThroughputMonitor does.
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=self._step)
        # Inconsistent marks were clamped and counted, never raised: the first ones of the run are warned about here.
        self.summary.add(self._step, metrics, anomalies=timing.anomalies)
        self._compute.append(_compute_landmarks(record))
        if len(self.summary) > self.warmup_steps:
            for group, op, nbytes, busy_ms in collective_calls(timing.collectives):
                self._calls.setdefault((group, op, nbytes), []).append(busy_ms)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Rank 0: the TensorBoard views; with more measured steps than ``warmup_steps``, the summary table printed,
        ``<summary_name>.json`` and ``.csv`` (and compute_profile.json where one is built) in the logger's folder;
        else a note on why there is no summary."""
        if not self.enabled or not trainer.is_global_zero:
            return
        summary = self.summary.summarize(self.warmup_steps) if len(self.summary) > self.warmup_steps else {}
        if len(self.summary):
            self._write_tensorboard_views(trainer, pl_module, run_metrics(summary))
        if not summary:
            rank_zero_info(self._no_summary_message(trainer.global_step - self._first_step))
            return
        out_dir = Path(trainer.logger.log_dir or trainer.default_root_dir)  # setup() refused a run without a logger
        title = f"CommTimer [{strategy_label(trainer.strategy)}, {trainer.world_size} ranks]"
        print(self.summary.format_table(self.warmup_steps, title=title), flush=True)
        calls = call_table(self._calls)
        if calls:
            print(format_call_table(calls), flush=True)
        if "comm/overlap" in summary:
            print(OVERLAP_NOTE, flush=True)
        lag = summary.get("straggler/lag_ms", {}).get("median")
        clock = self.exchange.describe()
        note = clock_note(clock["max_uncertainty_ms"], lag)
        if note is not None:
            print(f"note: {note}", flush=True)
            clock["note"] = note
        bucket, _ = self._settings
        extra = {"schema": SUMMARY_SCHEMA,
                 "run": {**run_description(trainer, pl_module),
                         "bucket_size_mb": bucket if isinstance(bucket, float) else None,
                         "every_n_steps": self._every, "comm_recording": self._comm},
                 "clock": clock,
                 "collectives": calls}
        self.summary.write_json(out_dir / f"{self.summary_name}.json", self.warmup_steps, extra=extra)
        self.summary.write_csv(out_dir / f"{self.summary_name}.csv")
        steps = self._compute[self.warmup_steps:]
        profile = _median_profile(steps, self._watched, trainer, pl_module, self._batch_shape)
        if profile is not None:
            write_profile(profile, out_dir / "compute_profile.json")

    def _no_summary_message(self, steps_run: int) -> str:
        """Why a fit wrote no summary: what ran, what was measured, and the arguments that change it (the flags
        under the CLI, the constructor's names in a script)."""
        measured = len(self.summary)
        if _launched_by_cli():
            every, warmup = "--timer.every_n_steps", "--timer.warmup_steps"
        else:
            every, warmup = "CommTimer(every_n_steps=...)", "CommTimer(warmup_steps=...)"
        sampled = "every step" if self._every == 1 else f"one step in {self._every}"
        return (f"CommTimer: {steps_run} optimizer steps ran and {measured} of them were measured ({sampled}), all "
                f"within the warm-up of warmup_steps={self.warmup_steps} measured steps; no summary written. Run "
                f"more steps, measure more often ({every}) or leave fewer out ({warmup}).")

    def _write_tensorboard_views(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 medians: dict[str, float]) -> None:
        """Into every TensorBoard logger (rank 0, end of fit): the custom-scalars layout of the keys this run logged,
        and the run's hparams record with ``medians`` as metrics (none when every measured step was warm-up)."""
        loggers = [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]
        if not loggers:
            return
        logged = set().union(*self.summary.metrics)
        bucket, engine = self._settings
        batch_size = getattr(trainer.datamodule, "hparams", {}).get("batch_size", self._batch_shape[0])  # or None
        hparams = run_hparams(
            strategy=strategy_label(trainer.strategy), bucket_size_mb=bucket, engine_settings=engine,
            world_size=trainer.world_size, precision=str(trainer.precision),
            batch_size=batch_size, preset=pl_module.hparams.get("preset"),
        )
        from torch.utils.tensorboard.summary import hparams as hparams_summary  # loads tensorboard: only when needed

        # What Lightning's log_hyperparams(params, metrics) writes, but naming every metric of MEDIAN_METRICS in the
        # record whether or not this run logged it: TensorBoard takes the table's columns from one run's record.
        records = hparams_summary(hparams, dict.fromkeys(MEDIAN_METRICS.values(), 0.0))  # values unused: names
        for logger in loggers:
            logger.experiment.add_custom_scalars(custom_scalars_layout(logged, prefix=compat.logger_prefix(logger)))
            writer = compat.event_file_writer(logger)  # as Lightning's own log_hyperparams does
            for record in records:
                writer.add_summary(record, self._step)
            if medians:
                logger.log_metrics(medians, step=self._step)


MIN_SUMMARY_STEPS = 10
"""Measured steps after warm-up that the default sampling keeps in a run of known length (``default_every_n_steps``)."""

OVERLAP_NOTE = (
    "overlap: the share of the time a collective was in flight that lay outside the exposed communication (hidden "
    "behind compute: docs/comm_timer.md). The trace tool reports HTA's, the share of communication kernel time "
    "concurrent with compute kernels, from a profiler trace: another number, explained on the same page."
)


def default_every_n_steps(log_every_n_steps: int, planned_steps: int | None, warmup_steps: int) -> int:
    """Measure every ``log_every_n_steps``-th step (Lightning's logging cadence), but often enough that a run of
    ``planned_steps`` optimizer steps (``None``: unknown) keeps ``MIN_SUMMARY_STEPS`` measured steps after the
    ``warmup_steps`` measured ones it leaves out.

    >>> default_every_n_steps(50, 30, 5), default_every_n_steps(50, 100_000, 5), default_every_n_steps(2, 40, 5)
    (2, 50, 2)
    """
    every = max(1, log_every_n_steps)
    if planned_steps is not None:
        every = min(every, max(1, planned_steps // (warmup_steps + MIN_SUMMARY_STEPS)))
    return every


def _planned_steps(trainer: pl.Trainer) -> int | None:
    """The optimizer steps this fit will run, where Lightning knows them (``max_steps``, else the epochs' batches)."""
    if trainer.max_steps > 0:
        return trainer.max_steps - trainer.global_step
    try:
        planned = trainer.estimated_stepping_batches
    except Exception:  # an iterable dataset without a length: unknown, keep Lightning's cadence
        return None
    return int(planned) if planned != float("inf") else None


def _trainable_once(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The trainable ``(name, tensor)`` pairs, a tied tensor once (by its first name)."""
    kept: dict[int, tuple[str, torch.Tensor]] = {}
    for name, tensor in named:
        if tensor.requires_grad and id(tensor) not in kept:
            kept[id(tensor)] = (name, tensor)
    return list(kept.values())


def _dropped_comm_hook_note(strategy: Any) -> str | None:
    """The line said once when Lightning's ``DDPStrategy(ddp_comm_hook=...)`` will not run its hook: Lightning
    registers it on CUDA only, so a CPU run all-reduces plain buckets (and the timer measures those)."""
    from lightning.pytorch.strategies import DDPStrategy

    hook = compat.ddp_comm_hook(strategy) if isinstance(strategy, DDPStrategy) else None
    if hook is None or strategy.root_device.type == "cuda":
        return None
    name = getattr(hook, "__name__", type(hook).__name__)
    return (f"DDPStrategy(ddp_comm_hook={name}) is not applied on {strategy.root_device.type}: Lightning registers "
            "DDP communication hooks on CUDA devices only, so this run all-reduces its gradient buckets uncompressed "
            "in their own dtype, and that is what the CommTimer measures. To run a hook on CPU, register it yourself "
            "(`trainer.strategy.model.register_comm_hook(state, hook)` in your module's on_train_start).")


def _launched_by_cli() -> bool:
    """Whether this process runs ``python -m lightning_ddp`` (flags: ``--timer.*``), not a script of the user's."""
    return getattr(sys.modules["__main__"].__spec__, "name", "") == "lightning_ddp.__main__"


def _peak_memory_mib(cuda: bool) -> float:
    """CUDA: peak allocated bytes this step (reset at its start). CPU: the process's peak RSS so far (Linux KiB)."""
    if cuda:
        return torch.cuda.max_memory_allocated() / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # macOS reports bytes, Linux KiB


def _job_peak_flops(trainer: pl.Trainer, peak_tflops: float | None) -> tuple[float | None, int]:
    """The job's dense peak FLOP/s, each distinct device once, and how many hosts the ranks run on (a collective:
    one ``all_gather_object``)."""
    device = trainer.strategy.root_device
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(compat.compute_dtype(trainer), "fp32")
    if device.type == "cuda":
        if dtype == "fp32" and torch.get_float32_matmul_precision() != "highest":
            dtype = "tf32"
        properties = torch.cuda.get_device_properties(device)
        identity: tuple = (socket.gethostname(), str(getattr(properties, "uuid", device.index)))
        # The SM count makes a MIG slice's peak its share of the GPU, not the whole GPU's (~7x too high for 1g).
        sm_count = getattr(properties, "multi_processor_count", None)
        peak = hardware.dense_peak_flops(properties.name, dtype, sm_count=sm_count)
    else:
        identity = (socket.gethostname(), os.getpid())  # a CPU rank computes on its own threads
        peak = hardware.dense_peak_flops("cpu", dtype, threads=torch.get_num_threads())
    if peak_tflops is not None:
        peak = peak_tflops * 1e12
    per_rank: list = [(identity, peak)]
    if distributed():
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, (identity, peak))
    return hardware.job_peak_flops(per_rank), len({identity[0] for identity, _ in per_rank})


def _compute_landmarks(record: SyncRecord) -> dict[str, Any]:
    """One step's compute timeline in ms, from the recorder's marks (``None`` where a mark is missing)."""
    def since(start: float | None, end: float | None) -> float | None:
        return end - start if start is not None and end is not None else None

    backward = record.backward_started
    return {"forward_ms": since(record.started, backward), "backward_ms": since(backward, record.last_ready),
            "optimizer_ms": since(record.usable, record.ended), "ready_ms": [since(backward, r) for r in record.ready]}


def _median_profile(steps: list[dict[str, Any]], watched: list[tuple[str, torch.Tensor]], trainer: pl.Trainer,
                    pl_module: pl.LightningModule, batch_shape: tuple[int | None, ...]) -> ComputeProfile | None:
    """The median over ``steps`` of each landmark, as a compute profile (``None`` if a landmark never showed)."""

    def median(values: list[float | None]) -> float | None:
        # A negative median (a gradient ready before backward started) can only be two clocks disagreeing: clamped
        # to 0, since ParamTiming refuses a negative time and the profile would not be written.
        present = [v for v in values if v is not None]
        return max(0.0, statistics.median(present)) if present else None

    times = {key: median([s[key] for s in steps]) for key in ("forward_ms", "backward_ms", "optimizer_ms")}
    if not steps or None in times.values():
        return None
    ready = [median([s["ready_ms"][i] for s in steps if i < len(s["ready_ms"])]) for i in range(len(watched))]
    params = tuple(ParamTiming(name, p.numel(), p.nbytes, ready_ms, tuple(p.shape))
                   for (name, p), ready_ms in zip(watched, ready))
    device = trainer.strategy.root_device
    return ComputeProfile(
        **times, params=params,
        source=f"CommTimer: median of {len(steps)} steps of {strategy_label(trainer.strategy)}",
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        preset=pl_module.hparams.get("preset"), batch_size=batch_shape[0], seq_len=batch_shape[1],
        precision=str(trainer.precision), world_size=trainer.world_size,
    )


def run_description(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """What belongs next to the numbers: strategy, devices, precision, versions, hyperparameters."""
    device = trainer.strategy.root_device
    strategy = trainer.strategy
    return {
        "strategy": strategy_label(strategy),
        "strategy_class": type(strategy).__name__,
        "cli": _launched_by_cli(),  # else a script
        "world_size": trainer.world_size,
        "backend": dist.get_backend() if dist.is_available() and dist.is_initialized() else None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "precision": str(trainer.precision),
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "hparams": {key: _plain(value) for key, value in pl_module.hparams.items()},
        "torch": torch.__version__,
        "lightning": pl.__version__,
        "python": platform.python_version(),
    }


# ---- the two TensorBoard views: a custom-scalars layout to read a run, the HPARAMS table to compare runs ---------
# (strategy and settings as hparams, medians as metrics). What to read in each: docs/tensorboard.md.

LAYOUT: tuple[tuple[str, tuple[tuple[str, tuple[str, ...]], ...]], ...] = (
    ("Where the step goes", (
        ("step time, exposed and busy communication (ms)", ("step/time_ms", "comm/exposed_ms", "comm/busy_ms")),
    )),
    ("Hidden or not", (
        ("share of the step exposed, share of communication hidden", ("comm/share", "comm/overlap")),
    )),
    ("Who made it wait", (
        ("exposed = wait for the last rank + transfer (ms)", ("comm/exposed_ms", "comm/wait_ms", "comm/transfer_ms")),
        ("straggler's launch lag, ranks' compute spread (ms)", ("straggler/lag_ms", "step/rank_spread_ms")),
    )),
    ("Wire", (
        ("bus and algorithm bandwidth (GB/s)", ("comm/busbw_GBps", "comm/algbw_GBps")),
        ("bytes per step", ("comm/bytes",)),
        ("collectives per step", ("comm/calls",)),
    )),
    ("Throughput and memory", (
        ("tokens per second, all ranks", ("step/tokens_per_s",)),
        ("model FLOPs utilisation", ("step/mfu",)),
        ("peak memory (MiB)", ("memory/peak_MiB", "memory/peak_reserved_MiB")),
    )),
)
"""Category -> charts, each chart a title and the CommTimer keys drawn on it, keys of one unit per chart."""

MEDIAN_METRICS: dict[str, str] = {
    key: f"median/{key}"
    for key in ("step/time_ms", "comm/exposed_ms", "comm/share", "comm/overlap", "memory/peak_MiB", "comm/wait_ms",
                "step/tokens_per_s")
}
"""CommTimer key -> the HPARAMS metric tag of its end-of-fit median, in the order TensorBoard shows them."""

HPARAM_NAMES: dict[str, str] = {
    **{key: f"grad_sync/{key}" for key in ("strategy", "bucket_size_mb", "engine_settings")},
    **{key: f"run/{key}" for key in ("world_size", "precision", "batch_size", "preset")},
}
"""``run_hparams``' arguments -> the hparams' names in TensorBoard; every run writes all of them."""



def custom_scalars_layout(logged: Iterable[str], prefix: str = "") -> dict[str, dict[str, list[Any]]]:
    """``LAYOUT`` reduced to the keys the run ``logged``, in ``SummaryWriter.add_custom_scalars``' format; each tag
    escaped, anchored at its end and preceded by ``prefix``.

    >>> layout = custom_scalars_layout(["step/time_ms", "comm/exposed_ms"])
    >>> layout["Where the step goes"]["step time, exposed and busy communication (ms)"]
    ['Multiline', ['step/time_ms$', 'comm/exposed_ms$']]
    """
    logged = set(logged)
    head = f"{prefix}-" if prefix else ""
    layout: dict[str, dict[str, list[Any]]] = {}
    for category, charts in LAYOUT:
        kept = {title: ["Multiline", [re.escape(head + key) + "$" for key in keys if key in logged]]
                for title, keys in charts if any(key in logged for key in keys)}
        if kept:
            layout[category] = kept
    return layout


def run_metrics(summary: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """The run's HPARAMS metrics: ``MEDIAN_METRICS`` of the keys in ``summary`` (``TimingSummary.summarize``)."""
    return {tag: float(summary[key]["median"]) for key, tag in MEDIAN_METRICS.items() if key in summary}


def strategy_settings(strategy: Any) -> tuple[float | str, str]:
    """(bucket size in MiB, settings as ``name=value, ...``) of a Lightning strategy for the HPARAMS table, as ours
    report them (``reported_settings``) and as Lightning's ``DDPStrategy`` hands them to torch DDP; ``default``
    without settings, ``NOT_APPLICABLE`` for a bucket size the strategy does not have."""
    from lightning.pytorch.strategies import DDPStrategy

    own = getattr(strategy, "reported_settings", None)
    if own is not None:
        bucket, settings = own()
    elif isinstance(strategy, DDPStrategy):
        kwargs = compat.ddp_kwargs(strategy)
        bucket = float(kwargs.get("bucket_cap_mb") or catalogue.DEFAULT_BUCKET_SIZE_MB)  # torch DDP's own default
        settings = {name: value for name, value in kwargs.items() if name != "bucket_cap_mb"}
    else:
        bucket, settings = catalogue.NOT_APPLICABLE, {}
    return bucket, ", ".join(f"{name}={value}" for name, value in settings.items()) or "default"


def run_hparams(**values: Any) -> dict[str, Any]:
    """Every one of ``HPARAM_NAMES`` from ``values``: numbers and strings kept, ``None`` as ``NOT_APPLICABLE``.

    >>> run_hparams(strategy="naive_ddp", bucket_size_mb="n/a", engine_settings="default", world_size=2,
    ...             precision="32-true", batch_size=8, preset=None)["run/preset"]
    'n/a'
    """
    unknown, missing = set(values) - set(HPARAM_NAMES), set(HPARAM_NAMES) - set(values)
    if unknown or missing:
        raise TypeError(f"run_hparams takes exactly {', '.join(HPARAM_NAMES)}; unknown: {sorted(unknown)}, missing: "
                        f"{sorted(missing)}")
    return {name: catalogue.NOT_APPLICABLE if values[key] is None else _plain(values[key])
            for key, name in HPARAM_NAMES.items()}


def _plain(value: Any) -> Any:
    """``value`` itself if JSON and TensorBoard hold it as it is (a number, string, bool or ``None``), else its str."""
    return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)
