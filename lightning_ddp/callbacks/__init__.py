"""Callbacks: ``CommTimer`` (per-step communication accounting) over the pure ``accounting`` module."""

from lightning_ddp.callbacks.accounting import METRIC_KEYS, StepTiming, TimingSummary, step_metrics
from lightning_ddp.callbacks.comm_timer import CommTimer

__all__ = ["CommTimer", "METRIC_KEYS", "StepTiming", "TimingSummary", "step_metrics"]
