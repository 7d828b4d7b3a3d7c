"""The ``TraceRecorder``'s traces read back (``traces``): HTA's overlap ``|comm ∩ compute| / |comm|`` of each rank
(``overlap``) and the runs drawn as timelines (``timeline``); ``python -m lightning_ddp.trace`` does both
(docs/tensorboard.md, "Two overlaps")."""

from lightning_ddp.trace.overlap import OVERLAP_DEFINITION, Overlap, clip, comm_compute_overlap
from lightning_ddp.trace.timeline import LEGEND, MAX_COMM_LANES, Row, Timeline, render_timeline
from lightning_ddp.trace.traces import (
    COMM_SOURCES, GPU_KERNEL_CATEGORY, PROFILER_COMM_RE, CommEvent, RankTrace, RunTraces, find_traces, load_rank_trace,
    load_run, trace_files,
)

__all__ = [
    "COMM_SOURCES", "GPU_KERNEL_CATEGORY", "LEGEND", "MAX_COMM_LANES", "OVERLAP_DEFINITION", "PROFILER_COMM_RE",
    "CommEvent", "Overlap", "RankTrace", "Row", "RunTraces", "Timeline", "clip", "comm_compute_overlap", "find_traces",
    "load_rank_trace", "load_run", "render_timeline", "trace_files",
]
