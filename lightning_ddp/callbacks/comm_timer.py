"""``CommTimer``: per optimizer step, how much of the step went to gradient communication, into the logger.

A thin Lightning shell over the pure accounting in ``accounting.py`` (whose ``step_metrics`` docstring is the
table of every key and its formula). Per optimizer step, once gradient accumulation is over, it:

1. finishes the step's record (``lightning_ddp.sync.record``: on CUDA the step's one ``torch.cuda.synchronize()``,
   after which its CUDA events are read; every mark becomes milliseconds). The record comes from the run's
   ``Recorder``, which the strategy attaches to its engine when asked (``callbacks.recording``): the timer only
   observes, it never drives the training step;
2. all-reduces the step time with ``MAX`` (the slowest rank sets the pace). This small collective runs after the
   step's end mark and before the next step's start, so it is outside what is measured;
3. turns the engine's ``SyncRecord`` into metrics and logs them with ``LightningModule.log_dict``.

Every strategy is measured the same way, Lightning's built-in ``ddp`` (torch ``DistributedDataParallel``)
included: its bucket all-reduces are recorded through a DDP communication hook equivalent to torch's default
(``callbacks.recording``), and ``comm/exposed_ms`` runs from the step's last gradient computed (a tensor hook on
every trainable parameter) to the gradients usable (``on_before_optimizer_step``) for every strategy; see
``accounting.py``. A strategy whose collectives are not ours to record says so with ``records_collectives = False``
(``fsdp2``): its busy time, overlap and bandwidths are "not recorded" (``accounting.NOT_RECORDED``), never 0. A
strategy whose gradients are computed on other tensors than the LightningModule's parameters (FSDP2's unsharded
ones) names them with ``watched_parameters()``.

At the end of ``fit`` rank 0 prints a summary (median, p10, p90 over the steps after ``warmup_steps``) and
writes it as ``timing_summary.json`` and ``timing_summary.csv`` in the logger's directory, with
``compute_profile.json`` beside them: the median forward, backward and optimizer times and when each
parameter's gradient became ready (``lightning_ddp.profile``; what ``python -m lightning_ddp.projection``
predicts other world sizes from). Forward is the step's start to backward's start, backward runs to the last
gradient computed, the optimizer from the gradients usable to the step's end.
"""

from __future__ import annotations

import os
import platform
import resource
import socket
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_ddp import compat, hardware
from lightning_ddp.callbacks.accounting import COLLECTIVE_KEYS, StepTiming, TimingSummary, step_metrics
from lightning_ddp.callbacks.peak_flops import dense_peak_flops, job_peak_flops
from lightning_ddp.callbacks.recording import recorder_for, release_recorder
from lightning_ddp.profile import ComputeProfile, ParamTiming, write_profile
from lightning_ddp.sync.record import Recorder, SyncRecord


class CommTimer(Callback):
    """Log step time, exposed and busy communication time, comm share and overlap per optimizer step.

    Args:
        warmup_steps: Optimizer steps left out of the end-of-fit summary (start-up, allocator warm-up).
        enabled: Set false to switch the callback off (it is always added by the CLI).
        summary_name: Stem of the summary files written at the end of fit (``.json`` and ``.csv``).
        peak_tflops: Dense peak TFLOP/s of one device at the run's compute dtype, for ``step/mfu``; default: the
            table in ``lightning_ddp.hardware`` (H100, GH200, H200, B200, A100, L4, a MIG slice's share of its GPU,
            CPU estimate).
    """

    def __init__(
        self,
        warmup_steps: int = 5,
        enabled: bool = True,
        summary_name: str = "timing_summary",
        peak_tflops: float | None = None,
    ) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}; e.g. --timer.warmup_steps 5")
        if peak_tflops is not None and not peak_tflops > 0:
            h100 = hardware.get_device("h100-sxm").dense_tflops["bf16"]
            raise ValueError(f"peak_tflops must be > 0 (TFLOP/s of one device), got {peak_tflops}; e.g. --timer.peak_tflops "
                             f"{h100:g} for an H100 SXM in bf16")
        self.peak_tflops = peak_tflops
        self.warmup_steps = warmup_steps
        self.enabled = enabled
        self.summary_name = summary_name
        self.summary = TimingSummary()
        self._recorder: Recorder | None = None
        self._watched: list[tuple[str, torch.Tensor]] = []
        self._compute: list[dict[str, Any]] = []  # per measured step: forward/backward/optimizer ms, ready ms
        self._batch_shape: tuple[int, ...] = ()  # (batch, seq_len) of a micro-batch
        self._in_step = False
        self._tokens = 0
        self._flops_per_token: float | None = None
        self._peak_flops: float | None = None
        self._bucket_size_mb: float | None = None
        self._collectives_recorded = True

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.enabled and stage == "fit" and trainer.logger is None:
            raise ValueError(
                "CommTimer logs to the Trainer's logger, but `Trainer(logger=False)` leaves it nowhere to write. "
                "Enable a logger or switch the timer off with `--timer.enabled false`."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.enabled:
            return
        self._recorder = recorder_for(trainer)
        self._collectives_recorded = records_collectives(trainer.strategy)
        if not self._collectives_recorded and len(self.summary) == 0:
            self.summary = TimingSummary(not_recorded=COLLECTIVE_KEYS)
        # When each gradient is computed: the landmark that starts exposed communication, for every strategy.
        watched = getattr(trainer.strategy, "watched_parameters", None)
        named = watched() if watched is not None else pl_module.named_parameters()
        seen: set[int] = set()
        self._watched = [(n, p) for n, p in named if p.requires_grad and id(p) not in seen and not seen.add(id(p))]
        self._recorder.watch_gradients([p for _, p in self._watched])
        # Read now: at on_fit_end the strategy has already unwrapped its engine. For `auto`, the predicted size.
        self._bucket_size_mb = getattr(trainer.strategy, "resolved_bucket_size_mb", None)
        self._peak_flops = _job_peak_flops(trainer, self.peak_tflops)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if not self.enabled or self._recorder is None:
            return
        if not self._in_step:  # first micro-batch of an optimizer step
            self._in_step = True
            self._recorder.open_step(trainer.global_step)
            if self._recorder.clock.cuda:
                torch.cuda.reset_peak_memory_stats()
            self._tokens = 0
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        if isinstance(x, torch.Tensor):
            self._tokens += x.numel()
            self._batch_shape = tuple(x.shape)
            if self._flops_per_token is None and hasattr(pl_module, "flops_per_token"):
                self._flops_per_token = float(pl_module.flops_per_token(x.shape[-1]))

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self.enabled and self._recorder is not None:
            self._recorder.mark_backward_started()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.enabled and self._recorder is not None:
            self._recorder.mark_gradients_usable()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.enabled or not self._in_step or compat.should_accumulate(trainer):
            return
        self._in_step = False
        assert self._recorder is not None
        record = self._recorder.finish_step()
        step_ms = _max_over_ranks(record.step_ms, trainer.strategy.root_device)
        timing = StepTiming.from_record(record, step_ms, self._tokens)
        metrics = step_metrics(
            timing,
            trainer.world_size,
            flops_per_token=self._flops_per_token,
            peak_flops=self._peak_flops,
            peak_memory_mib=_peak_memory_mib(self._recorder.clock.cuda),
            peak_reserved_mib=torch.cuda.max_memory_reserved() / 2**20 if self._recorder.clock.cuda else None,
            collectives_recorded=self._collectives_recorded,
        )
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)
        # Inconsistent marks were clamped and counted, never raised: the first ones of the run are warned about here.
        self.summary.add(trainer.global_step, metrics, anomalies=timing.anomalies)
        self._compute.append(_compute_landmarks(record))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.enabled:
            release_recorder(trainer)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.enabled or not trainer.is_global_zero or len(self.summary) == 0:
            return
        if len(self.summary) <= self.warmup_steps:
            rank_zero_info(
                f"CommTimer: {len(self.summary)} steps ran, all within warmup_steps={self.warmup_steps}; no summary "
                "written (lower --timer.warmup_steps or run more steps)."
            )
            return
        out_dir = Path(trainer.logger.log_dir if trainer.logger and trainer.logger.log_dir else trainer.default_root_dir)
        name = getattr(trainer.strategy, "strategy_name", "") or type(trainer.strategy).__name__
        title = f"CommTimer [{name}, {trainer.world_size} ranks]"
        print(self.summary.format_table(self.warmup_steps, title=title), flush=True)
        extra = {"run": {**_run_description(trainer, pl_module), "bucket_size_mb": self._bucket_size_mb}}
        self.summary.write_json(out_dir / f"{self.summary_name}.json", self.warmup_steps, extra=extra)
        self.summary.write_csv(out_dir / f"{self.summary_name}.csv")
        profile = _median_profile(self._compute[self.warmup_steps:], self._watched, trainer, pl_module, self._batch_shape)
        if profile is not None:
            write_profile(profile, out_dir / "compute_profile.json")


def records_collectives(strategy: Any) -> bool:
    """Whether ``strategy``'s gradient collectives land in the recorder: ours and Lightning's ``ddp`` do; a strategy
    that issues its own (``fsdp2``) sets ``records_collectives = False``."""
    return bool(getattr(strategy, "records_collectives", True))


def _max_over_ranks(value: float, device: torch.device) -> float:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def _peak_memory_mib(cuda: bool) -> float:
    """CUDA: peak allocated bytes this step (reset at its start). CPU: the process's peak RSS so far (Linux KiB)."""
    if cuda:
        return torch.cuda.max_memory_allocated() / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # macOS reports bytes, Linux KiB


def _job_peak_flops(trainer: pl.Trainer, peak_tflops: float | None) -> float | None:
    """The job's dense peak FLOP/s: every distinct device's peak (``peak_flops``), summed once per device.

    A collective (one ``all_gather_object``): ranks that share a GPU (the one-GPU gloo layout) name the same device
    and count it once.
    """
    device = trainer.strategy.root_device
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(compat.compute_dtype(trainer), "fp32")
    if device.type == "cuda":
        if dtype == "fp32" and torch.get_float32_matmul_precision() != "highest":
            dtype = "tf32"
        properties = torch.cuda.get_device_properties(device)
        identity: tuple = (socket.gethostname(), str(getattr(properties, "uuid", device.index)))
        # The SM count makes a MIG slice's peak its share of the GPU, not the whole GPU's (~7x too high for 1g).
        peak = dense_peak_flops(properties.name, dtype, sm_count=getattr(properties, "multi_processor_count", None))
    else:
        identity = (socket.gethostname(), os.getpid())  # a CPU rank computes on its own threads
        peak = dense_peak_flops("cpu", dtype, threads=torch.get_num_threads())
    if peak_tflops is not None:
        peak = peak_tflops * 1e12
    per_rank: list = [(identity, peak)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, (identity, peak))
    return job_peak_flops(per_rank)


def _compute_landmarks(record: SyncRecord) -> dict[str, Any]:
    """One step's compute timeline in ms, from the recorder's marks (``None`` where a mark is missing)."""
    start, backward, last, usable, end = (record.started, record.backward_started, record.last_ready,
                                          record.usable, record.ended)
    return {
        "forward_ms": backward - start if None not in (backward, start) else None,
        "backward_ms": last - backward if None not in (last, backward) else None,
        "optimizer_ms": end - usable if None not in (end, usable) else None,
        "ready_ms": [r - backward if r is not None and backward is not None else None for r in record.ready],
    }


def _median_profile(steps: list[dict[str, Any]], watched: list[tuple[str, torch.Tensor]], trainer: pl.Trainer,
                    pl_module: pl.LightningModule, batch_shape: tuple[int, ...]) -> ComputeProfile | None:
    """The median over ``steps`` of each landmark, as a compute profile (``None`` if a landmark never showed)."""
    import statistics

    def median(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    times = {key: median([s[key] for s in steps]) for key in ("forward_ms", "backward_ms", "optimizer_ms")}
    if not steps or None in times.values():
        return None
    def ready(i: int) -> float | None:
        # A gradient ready before backward started can only be two clocks disagreeing: clamped to 0, as the three
        # times below are, since ParamTiming refuses a negative time and the profile would not be written.
        value = median([s["ready_ms"][i] for s in steps if i < len(s["ready_ms"])])
        return max(0.0, value) if value is not None else None

    params = tuple(
        ParamTiming(name, p.numel(), p.nbytes, ready(i), tuple(p.shape))
        for i, (name, p) in enumerate(watched)
    )
    hparams = pl_module.hparams
    device = trainer.strategy.root_device
    return ComputeProfile(
        forward_ms=max(0.0, times["forward_ms"]), backward_ms=max(0.0, times["backward_ms"]),
        optimizer_ms=max(0.0, times["optimizer_ms"]), params=params,
        source=f"CommTimer: median of {len(steps)} steps of {getattr(trainer.strategy, 'strategy_name', '') or type(trainer.strategy).__name__}",
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        preset=hparams.get("preset"), batch_size=batch_shape[0] if len(batch_shape) == 2 else None,
        seq_len=batch_shape[-1] if len(batch_shape) == 2 else None,
        precision=str(trainer.precision), world_size=trainer.world_size,
    )


def _run_description(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """What belongs next to the numbers: strategy, devices, precision, versions, hyperparameters."""
    device = trainer.strategy.root_device
    strategy = trainer.strategy
    return {
        "strategy": getattr(strategy, "strategy_name", "") or type(strategy).__name__,
        "strategy_class": type(strategy).__name__,
        "world_size": trainer.world_size,
        "backend": dist.get_backend() if dist.is_available() and dist.is_initialized() else None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "precision": str(trainer.precision),
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "hparams": {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v)) for k, v in pl_module.hparams.items()},
        "torch": torch.__version__,
        "lightning": pl.__version__,
        "python": platform.python_version(),
    }
