"""Timelines from profiler traces: did communication overlap computation, and by how much?

The names of our ranges and of the communication track are in ``lightning_ddp.sync.ranges`` (the engines open
some of them). Record traces with the ``TraceRecorder`` callback (``--trace.enabled true``), then draw one or
several runs::

    python -m lightning_ddp.trace logs/naive/version_0 logs/overlap/version_0 -o timeline.png

=====================  ==========================================================================
``overlap``            HTA's communication/computation overlap (interval arithmetic: ``lightning_ddp.intervals``)
``chrome``             Chrome-trace JSON read back (the recorder writes the communication track:
                       ``lightning_ddp.metrics.comm_track``)
``render``             the picture: per rank a compute row, on CUDA a GPU-kernel row, a communication row
=====================  ==========================================================================

Where the collectives come from (``--comm-source``): our engines record each collective's launch and
completion (the SyncRecord track the recorder adds); with Lightning's built-in ``ddp`` there is none, and the
renderer falls back to what the profiler saw on its own: gloo's ``gloo:*`` ranges on its worker threads (or
NCCL kernels, HTA's ``^nccl.*Kernel``). Those also include non-gradient collectives (the CommTimer's step-time
``MAX``, Lightning's own), and torch DDP waits for its buckets inside autograd's backward, so for ``ddp`` the
overlap is an upper bound. What counts as compute: on CPU the training thread's forward, backward and optimizer
ranges; on CUDA, where those host ranges only say when kernels were queued, the non-communication GPU kernels,
as Holistic Trace Analysis does.
"""

from lightning_ddp.trace.chrome import RankTrace, RunTraces, find_traces, load_rank_trace, load_run
from lightning_ddp.trace.overlap import Overlap, comm_compute_overlap
from lightning_ddp.trace.render import Timeline, render_timeline

__all__ = [
    "Overlap",
    "RankTrace",
    "RunTraces",
    "Timeline",
    "comm_compute_overlap",
    "find_traces",
    "load_rank_trace",
    "load_run",
    "render_timeline",
]
