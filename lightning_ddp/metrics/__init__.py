"""What the ``CommTimer`` logs: pure step accounting (``accounting``), the ranks' straggler exchange (``straggler``),
the run's shared ``Recorder`` and the traces' communication track (``recording``). Definitions: ``docs/comm_timer.md``.
"""

from __future__ import annotations

from lightning_ddp.metrics.accounting import METRIC_KEYS, StepTiming, TimingSummary, step_metrics

__all__ = ["METRIC_KEYS", "StepTiming", "TimingSummary", "step_metrics"]
