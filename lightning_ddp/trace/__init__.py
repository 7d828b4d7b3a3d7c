"""Timelines from the ``TraceRecorder``'s profiler traces: did communication overlap computation, and by how much?
``chrome`` reads the traces back and computes HTA's overlap, ``render`` draws the picture, ``python -m
lightning_ddp.trace`` does both (``docs/tensorboard.md``, "Profiler traces and timelines").
"""

from lightning_ddp.trace.chrome import (Overlap, RankTrace, RunTraces, comm_compute_overlap, find_traces,
                                        load_rank_trace, load_run)
from lightning_ddp.trace.render import Timeline, render_timeline

__all__ = ["Overlap", "RankTrace", "RunTraces", "Timeline", "comm_compute_overlap", "find_traces", "load_rank_trace",
           "load_run", "render_timeline"]
