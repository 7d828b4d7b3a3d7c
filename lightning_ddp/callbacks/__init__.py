"""Callbacks: ``CommTimer`` (per-step communication accounting, over the pure ``accounting`` module) and
``TraceRecorder`` (profiler traces with our ranges and a communication track).

The names load on first use: ``import lightning_ddp.callbacks.accounting`` needs neither Lightning nor torch.

=====================  ==========================================================================
``accounting``         pure: metrics of one step from its record, and the summary over steps
``comm_timer``         ``CommTimer``, the thin Lightning shell that logs them every n-th step
``tensorboard_views``  pure: the timer's custom-scalars layout and HPARAMS record for TensorBoard
``trace_recorder``     ``TraceRecorder``: torch profiler traces of a few steps on every rank
``final_checkpoint``   ``FinalStepCheckpoint``: the run's last step saved whenever checkpointing is on
``comm_track``         the communication track it adds to each trace (``lightning_ddp.trace`` reads it back)
``recording``          the run's one shared ``Recorder``; what each strategy lets us measure
``straggler``          pure: each rank's launch-time vector, and waiting versus transfer from all of them
``clock_offset``       pure: a rank's clock offset to rank 0 from NTP-style round trips
``rank_exchange``      the timer's one all-gather per step, and the clock-offset ping-pongs
``slow_rank``          ``SlowRank``: an injected straggler (sleeps on one rank before backward)
=====================  ==========================================================================
"""

from __future__ import annotations

from lightning_ddp._lazy import lazy_exports

_HOMES = {
    "CommTimer": "lightning_ddp.callbacks.comm_timer",
    "TraceRecorder": "lightning_ddp.callbacks.trace_recorder",
    "SlowRank": "lightning_ddp.callbacks.slow_rank",
    "FinalStepCheckpoint": "lightning_ddp.callbacks.final_checkpoint",
    "METRIC_KEYS": "lightning_ddp.callbacks.accounting",
    "StepTiming": "lightning_ddp.callbacks.accounting",
    "TimingSummary": "lightning_ddp.callbacks.accounting",
    "step_metrics": "lightning_ddp.callbacks.accounting",
}
__all__ = sorted(_HOMES)
__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
