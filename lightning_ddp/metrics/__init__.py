"""Step metrics and their definitions: what the ``CommTimer`` logs, computed by pure functions.

=================  ==========================================================================================
``accounting``     pure (no torch): one step's metrics from its record, and the summary over steps
``straggler``      pure: each rank's launch-time vector, and waiting versus transfer from all of them
``clock_offset``   pure: a rank's clock offset to rank 0 from NTP-style round trips
``rank_exchange``  the timer's one all-gather per step, and the clock-offset ping-pongs
``recording``      the run's one shared ``Recorder``; what each strategy lets us measure
``comm_track``     the communication track added to profiler traces (``lightning_ddp.trace`` reads it back)
=================  ==========================================================================================

The definitions of every key are in ``docs/comm_timer.md``.
"""

from __future__ import annotations

from lightning_ddp.metrics.accounting import METRIC_KEYS, StepTiming, TimingSummary, step_metrics

__all__ = ["METRIC_KEYS", "StepTiming", "TimingSummary", "step_metrics"]
