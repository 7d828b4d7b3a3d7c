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
The run's recorder does not open steps on demand (``Recorder(open_on_demand=False)``): it is armed only in the steps
an observer opened, so a step nobody measures records nothing, marks nothing and synchronises nothing.

What can be measured depends on the strategy, and ``comm_recording(strategy)`` is the one place that decides:

=================  ==============================================================================================
``"full"``         every gradient collective is recorded (launch, completion, bytes) and the exposed time is taken
                   from the step's landmarks: our strategies (``attach_recorder``) and Lightning's ``ddp`` family
``"landmarks"``    only the landmarks: exposed time (last gradient computed -> gradients usable) and the step;
                   busy time, overlap and bandwidth are not recorded. A strategy declares it with a
                   ``comm_recording = "landmarks"`` attribute
``None``           no communication is seen: step time, throughput, memory and the compute profile only
                   (a single device, which has none; Lightning's ``fsdp``, ``deepspeed`` and any other strategy)
=================  ==============================================================================================

A strategy may declare its level itself with a ``comm_recording`` attribute (one of the above); otherwise it is
inferred as in the table. ``measurement_note`` is the one-line message the ``CommTimer`` gives for every level
but ``"full"``.
"""

from __future__ import annotations

import weakref
from typing import Any, Literal, Optional

from torch.nn.parallel import DistributedDataParallel

from lightning_ddp.sync.comm import Communicator
from lightning_ddp.sync.record import Recorder

__all__ = ["COMM_RECORDING_LEVELS", "CommRecording", "comm_recording", "measurement_note", "record_torch_ddp",
           "recorder_for", "release_recorder"]

CommRecording = Optional[Literal["full", "landmarks"]]
COMM_RECORDING_LEVELS: tuple[CommRecording, ...] = ("full", "landmarks", None)
"""What the ``CommTimer`` can see of a strategy's communication (the module docstring's table)."""

_RECORDERS: "weakref.WeakKeyDictionary[Any, Recorder]" = weakref.WeakKeyDictionary()


def recorder_for(trainer: Any) -> Recorder:
    """The recorder of this run (keyed by its strategy), with the run's gradient collectives recorded into it."""
    strategy = trainer.strategy
    recorder = _RECORDERS.get(strategy)
    if recorder is None:
        recorder = Recorder(strategy.root_device, open_on_demand=False)  # armed only in the steps observers open
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


def comm_recording(strategy: Any) -> CommRecording:
    """How much of ``strategy``'s gradient communication the run's recorder sees (the module docstring's table).

    Raises:
        ValueError: The strategy declares a ``comm_recording`` that is not one of ``COMM_RECORDING_LEVELS``.
    """
    if hasattr(strategy, "comm_recording"):
        declared = strategy.comm_recording
        if declared not in COMM_RECORDING_LEVELS:
            raise ValueError(f"{type(strategy).__name__}.comm_recording is {declared!r}; declare one of "
                             f"{', '.join(map(repr, COMM_RECORDING_LEVELS))}")
        return declared
    if hasattr(strategy, "attach_recorder"):  # ours: the engine records every collective
        return "full"
    from lightning.pytorch.strategies import DDPStrategy

    if isinstance(strategy, DDPStrategy):  # torch DDP: its buckets are recorded through a comm hook
        return "full"
    return None


def strategy_label(strategy: Any) -> str:
    """The name a strategy is selected by: ours carry ``strategy_name``; Lightning's are looked up in its
    ``StrategyRegistry`` (the entry of exactly this class whose settings the instance has: ``DDPStrategy`` with the
    default start method is ``ddp``, not ``ddp_spawn``); anything else is its class name."""
    name = getattr(strategy, "strategy_name", "")
    if name:
        return name
    from lightning.pytorch.strategies import StrategyRegistry

    def has(key: str, value: Any) -> bool:
        return getattr(strategy, f"_{key}", getattr(strategy, key, object())) == value

    # The most specific entry the instance matches; among equals the shortest name (``ddp`` before its aliases).
    matches = [(len(entry["init_params"]), -len(registered), registered)
               for registered, entry in StrategyRegistry.items()
               if entry["strategy"] is type(strategy) and all(has(k, v) for k, v in entry["init_params"].items())]
    return max(matches)[2] if matches else type(strategy).__name__


def measurement_note(strategy: Any, level: CommRecording, world_size: int) -> str | None:
    """The one line the ``CommTimer`` says once when it cannot measure everything (``None`` for ``"full"``)."""
    name = strategy_label(strategy)
    measured = "step time, throughput (when the module counts tokens or FLOPs), memory and the compute profile"
    if level == "full":
        return None
    if level == "landmarks":
        return (f"CommTimer on {name}: measures {measured} and the exposed communication (comm/exposed_ms, "
                "comm/share: last gradient computed -> gradients usable); its collectives are not recorded, so "
                "comm/busy_ms, comm/overlap and the bandwidths are not logged.")
    if world_size == 1 and not hasattr(strategy, "comm_recording"):
        return (f"CommTimer on {name} (one device): measures {measured}; there is no gradient communication, so no "
                "comm/* metrics are logged.")
    return (f"CommTimer cannot record {name}'s communication: it measures {measured}, but no comm/* metrics "
            "(exposed, busy, overlap, bandwidth). Communication is measured for Lightning's ddp and our strategies "
            "(lightning_ddp.catalogue.names()).")
