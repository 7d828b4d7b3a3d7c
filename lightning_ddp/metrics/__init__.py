"""What the ``CommTimer`` logs: pure step accounting (``accounting``), the ranks' straggler exchange (``straggler``),
the run's shared ``Recorder`` (``recording``) and the traces' communication track (``comm_track``). The
definitions of every key are in ``docs/comm_timer.md``.
"""

from __future__ import annotations

from lightning_ddp.metrics.accounting import METRIC_KEYS, StepTiming, TimingSummary, step_metrics

__all__ = ["METRIC_KEYS", "StepTiming", "TimingSummary", "step_metrics"]
