"""Callbacks: ``CommTimer`` (per-step communication accounting) over the pure ``accounting`` module, and
``TraceRecorder`` (profiler traces, defined in ``lightning_ddp.profiling``), re-exported here."""

from lightning_ddp.callbacks.accounting import METRIC_KEYS, StepTiming, TimingSummary, step_metrics
from lightning_ddp.callbacks.comm_timer import CommTimer
from lightning_ddp.profiling import TraceRecorder

__all__ = ["CommTimer", "METRIC_KEYS", "StepTiming", "TimingSummary", "TraceRecorder", "step_metrics"]
