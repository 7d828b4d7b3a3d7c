"""Timelines from profiler traces: did communication overlap computation, and by how much?

Record traces with the ``TraceRecorder`` (``--trace.enabled true``), then draw one or several runs::

    python -m lightning_ddp.trace logs/naive/version_0 logs/overlap/version_0 -o timeline.png

``chrome`` reads the traces back and computes HTA's overlap, ``render`` draws the picture.
"""

from lightning_ddp.trace.chrome import (Overlap, RankTrace, RunTraces, comm_compute_overlap, find_traces,
                                        load_rank_trace, load_run)
from lightning_ddp.trace.render import Timeline, render_timeline

__all__ = ["Overlap", "RankTrace", "RunTraces", "Timeline", "comm_compute_overlap", "find_traces", "load_rank_trace",
           "load_run", "render_timeline"]
