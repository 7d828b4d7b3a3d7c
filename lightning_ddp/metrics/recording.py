"""One ``Recorder`` per training run, shared by every observer (``CommTimer``, ``TraceRecorder``).

``recorder_for(trainer)`` creates it and has the gradient collectives recorded into it (Lightning's ``ddp``
through a comm hook); ``comm_recording(strategy)`` decides what can be measured (``docs/comm_timer.md``).
"""

from __future__ import annotations

import statistics
import weakref
from typing import Any, Literal, Optional, Sequence

from torch.nn.parallel import DistributedDataParallel

from lightning_ddp.metrics.accounting import busy_intervals
from lightning_ddp.sync.comm import Communicator
from lightning_ddp.sync.record import Recorder

__all__ = ["COMM_RECORDING_LEVELS", "SUMMARY_SCHEMA", "CommRecording", "call_table", "collective_calls",
           "comm_recording", "measurement_note", "record_torch_ddp", "recorder_for", "release_recorder"]

SUMMARY_SCHEMA = "lightning_ddp.timing_summary/2"
"""``timing_summary.json``'s version: 2 added ``collectives`` (``call_table``); a summary without one is version 1."""

CommRecording = Optional[Literal["full", "landmarks"]]
COMM_RECORDING_LEVELS: tuple[CommRecording, ...] = ("full", "landmarks", None)
"""What the ``CommTimer`` can see of a strategy's communication: every collective, the landmarks, nothing."""

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
    """How much of ``strategy``'s gradient communication the recorder sees, one of ``COMM_RECORDING_LEVELS``
    (``ValueError`` for a strategy that declares another)."""
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
    """The name a strategy is selected by: its ``strategy_name``, else the most specific ``StrategyRegistry`` entry
    of exactly its class whose settings it has (``ddp``, not ``ddp_spawn``), else its class name."""
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
    if level == "full":
        return None
    name = strategy_label(strategy)
    measured = "step time, throughput (when the module counts tokens or FLOPs), memory and the compute profile"
    see = ' (docs/comm_timer.md, "What each strategy lets us measure")'
    if level == "landmarks":
        return (f"CommTimer on {name}: measures {measured} and comm/exposed_ms, comm/share; its collectives are not "
                f"recorded, so comm/busy_ms, comm/overlap and the bandwidths are not logged{see}")
    if world_size == 1 and not hasattr(strategy, "comm_recording"):
        return f"CommTimer on {name} (one device): measures {measured}; no gradient communication, no comm/* metrics"
    return f"CommTimer cannot record {name}'s communication: it measures {measured}, but no comm/* metrics{see}"


def collective_calls(collectives: Sequence[Any]) -> list[tuple[str, int, float]]:
    """``(op, bytes, busy ms)`` per collective of a finished step (ms marks): the length of its ``busy_intervals``."""
    return [(c.op, int(c.nbytes), end - start) for c, (start, end) in zip(collectives, busy_intervals(collectives))]


def call_table(calls: dict[tuple[str, int], list[float]]) -> list[dict[str, Any]]:
    """``timing_summary.json``'s ``collectives``: per (op, bytes) of the measured steps after warm-up, the count and
    the median busy ms (what ``python -m lightning_ddp advise`` fits latency and bandwidth to)."""
    return [{"op": op, "bytes": nbytes, "count": len(times), "median_ms": statistics.median(times)}
            for (op, nbytes), times in sorted(calls.items())]
