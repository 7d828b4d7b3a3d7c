"""The ``TraceRecorder``'s traces read back (``traces``): HTA's overlap ``|comm ∩ compute| / |comm|`` of each rank
(``overlap``) and the runs drawn as timelines (``timeline``); ``python -m lightning_ddp.trace`` does both
(docs/tensorboard.md, "Two overlaps"). The package exports what a caller reads runs and draws them with; the rest
(the legend, the trace's categories) stays in its module."""

from lightning_ddp.trace.overlap import OVERLAP_DEFINITION, Overlap, comm_compute_overlap
from lightning_ddp.trace.timeline import Timeline, render_timeline
from lightning_ddp.trace.traces import COMM_SOURCES, RankTrace, RunTraces, find_traces, load_rank_trace, load_run

__all__ = ["COMM_SOURCES", "OVERLAP_DEFINITION", "Overlap", "RankTrace", "RunTraces", "Timeline",
           "comm_compute_overlap", "find_traces", "load_rank_trace", "load_run", "render_timeline"]
