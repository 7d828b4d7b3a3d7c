"""The names of the ``torch.profiler.record_function`` ranges we add to a trace, and of our own tracks.

One place for the strings that the engines (``lightning_ddp.sync``) and the trace recorder
(``lightning_ddp.callbacks.trace_recorder``) write and the trace analysis (``lightning_ddp.trace``) reads. They
live in the core because the engines open the collective ranges themselves, and the core imports nothing above
it. Ranges are constant names (no parameter names in them) so that aggregating tools (TensorBoard's profiler
view, HTA, Perfetto's SQL) group them; the per-collective detail lives in the communication track's ``args``.

=====================  ===================================================================================
``ddp/step#N``         one optimizer step N (``trainer.global_step`` at its start), opened at the first
                       ``on_train_batch_start`` and closed at the last ``on_train_batch_end``; the clock
                       anchor: we read ``time.perf_counter()`` right before and after opening it
``ddp/forward``        the wrapped model's forward (``training_step`` under a DDP wrapper)
``ddp/backward``       ``on_before_backward`` .. ``on_after_backward``: autograd, plus whatever the engine's
                       gradient hooks do (launching collectives, see ``ddp/comm_launch``)
``ddp/grad_sync``      ``finish_gradient_synchronization()``: the critical-path part of gradient sync
``ddp/comm_launch``    issuing one async collective (``dist.all_reduce(..., async_op=True)``)
``ddp/comm_wait``      ``Work.wait()`` on one collective
``ddp/optimizer``      ``on_before_optimizer_step`` .. the optimizer's step post-hook: clipping + ``step()``
=====================  ===================================================================================

The communication track: per collective of the engine's ``SyncRecord`` an ``X`` event named after the
collective's op, from its launch to its completion, category ``COMM_CATEGORY``, on threads named
``COMM_THREAD_NAME`` in the rank's process.
"""

STEP = "ddp/step"
"""Prefix of the per-step range; the full name is ``f"{STEP}#{step}"`` (torch's own ``ProfilerStep#N`` style)."""
FORWARD = "ddp/forward"
BACKWARD = "ddp/backward"
OPTIMIZER = "ddp/optimizer"
GRAD_SYNC = "ddp/grad_sync"
COMM_LAUNCH = "ddp/comm_launch"
COMM_WAIT = "ddp/comm_wait"

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
    return f"{STEP}#{step}"
