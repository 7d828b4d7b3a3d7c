"""The names of the ``torch.profiler.record_function`` ranges we add to a trace, and of our own tracks: constant, so
aggregating tools group them (per-collective detail lives in the track's ``args``).
"""

STEP = "ddp/step"
"""Prefix of the per-step range; the full name is ``f"{STEP}#{step}"`` (torch's own ``ProfilerStep#N`` style)."""
FORWARD = "ddp/forward"  # the wrapped model's forward
BACKWARD = "ddp/backward"  # on_before_backward .. on_after_backward, the engine's gradient hooks included
OPTIMIZER = "ddp/optimizer"  # on_before_optimizer_step .. the step post-hook: clipping + step()
GRAD_SYNC = "ddp/grad_sync"  # finish_gradient_synchronization(): the critical-path part of the sync
COMM_LAUNCH = "ddp/comm_launch"  # issuing one async collective
COMM_WAIT = "ddp/comm_wait"  # Work.wait() on one collective

COMPUTE_RANGES = (FORWARD, BACKWARD, OPTIMIZER)
"""The ranges whose time counts as computing (minus the time spent in collective calls inside them)."""
COMM_CALL_RANGES = (GRAD_SYNC, COMM_LAUNCH, COMM_WAIT)
"""The ranges where the training thread is busy with communication, not computing."""

COMM_CATEGORY = "ddp_comm"
"""``cat`` of the communication-track events (launch -> completion of each collective, from the SyncRecord)."""
COMM_THREAD_NAME = "communication (SyncRecord: launch -> completion)"
METADATA_KEY = "lightning_ddp"
"""Top-level key of the trace JSON under which the recorder stores rank, strategy, steps and clock anchors."""


def step_range_name(step: int) -> str:
    """The profiler range of optimizer step ``step``, as the trace reader finds it."""
    return f"{STEP}#{step}"
