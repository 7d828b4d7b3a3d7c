"""One ``Recorder`` per training run, shared by every observer (``CommTimer``, ``TraceRecorder``).

``recorder_for(trainer)`` creates the run's recorder on first use and has the run's gradient collectives
recorded into it:

- our strategies (``GradSyncStrategy``): ``strategy.attach_recorder`` hands it to the engine (and ZeRO-1's
  optimizers);
- Lightning's ``ddp`` (torch ``DistributedDataParallel``): a DDP communication hook that does exactly what torch's
  default all-reduce hook does (divide the bucket by the world size, all-reduce it, same buckets, same result)
  through our ``Communicator``, so each bucket's launch and completion land in the same record, under the same
  definitions, as our engines' collectives. Registered only when someone measures; a model that already has a
  comm hook keeps it (and its collectives go unrecorded, with a warning).

Observers open and finish the recorder's steps themselves (``Recorder.open_step(global_step)`` is idempotent for
the same step, ``finish_step`` for a finished one), so the strategy's training step is never driven by measuring.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from lightning_ddp.sync.comm import Communicator
from lightning_ddp.sync.record import Recorder

__all__ = ["record_torch_ddp", "recorder_for", "release_recorder"]

_RECORDERS: "weakref.WeakKeyDictionary[Any, Recorder]" = weakref.WeakKeyDictionary()


def recorder_for(trainer: Any) -> Recorder:
    """The recorder of this run (keyed by its strategy), with the run's gradient collectives recorded into it."""
    strategy = trainer.strategy
    recorder = _RECORDERS.get(strategy)
    if recorder is None:
        recorder = Recorder(strategy.root_device)
        _RECORDERS[strategy] = recorder
        attach = getattr(strategy, "attach_recorder", None)
        if attach is not None:
            attach(recorder)
        elif isinstance(strategy.model, DistributedDataParallel):
            record_torch_ddp(strategy.model, recorder)
    return recorder


def release_recorder(trainer: Any) -> None:
    """Stop recording this run's collectives into its recorder (at the end of fit)."""
    strategy = trainer.strategy
    recorder = _RECORDERS.pop(strategy, None)
    if recorder is None:
        return
    recorder.unwatch_gradients()
    attach = getattr(strategy, "attach_recorder", None)
    if attach is not None:
        attach(None)


def record_torch_ddp(model: DistributedDataParallel, recorder: Recorder) -> bool:
    """Register a comm hook on ``model`` that records its bucket all-reduces into ``recorder``; ``False`` if the
    model already has one (DDP takes a single hook)."""
    comm = Communicator(model.process_group)
    comm.recorder = recorder

    # No annotations: DDP checks a hook's annotations against dist.GradBucket / Future, and this module's are strings.
    def allreduce_recorded(state, bucket):  # noqa: ANN001, ANN202
        # torch's allreduce_hook (torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py): pre-divide, then
        # an async SUM all-reduce of the bucket's flat buffer; the future resolves to the averaged buffer.
        tensor = bucket.buffer()
        with comm.span("pack"):
            tensor.div_(comm.world_size)
        pending = comm.all_reduce(tensor, f"ddp bucket {bucket.index()}")
        return pending.work.get_future().then(lambda future: future.value()[0])

    try:
        model.register_comm_hook(None, allreduce_recorded)
    except RuntimeError as error:  # "register_comm_hook ... can only be called once"
        import warnings

        warnings.warn(
            f"CommTimer cannot record torch DDP's collectives: the model already has a communication hook ({error}). "
            "Its step time and exposed communication are still measured; busy time and bandwidth are not.",
            stacklevel=2,
        )
        return False
    return True
