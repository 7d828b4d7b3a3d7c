"""Lightning callbacks: ``CommTimer`` (per-step communication metrics), ``TraceRecorder`` (profiler traces with a
communication track), ``FinalStepCheckpoint`` and ``SlowRank`` (an injected straggler). What they log is computed,
pure, in ``lightning_ddp.metrics``.
"""

from lightning_ddp.callbacks.comm_timer import CommTimer
from lightning_ddp.callbacks.final_checkpoint import FinalStepCheckpoint
from lightning_ddp.callbacks.slow_rank import SlowRank
from lightning_ddp.callbacks.trace_recorder import TraceRecorder

__all__ = ["CommTimer", "FinalStepCheckpoint", "SlowRank", "TraceRecorder"]
