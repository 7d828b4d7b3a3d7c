"""One ``Recorder`` per training run, shared by every observer (``CommTimer``, ``TraceRecorder``).

``recorder_for(trainer)`` creates the run's recorder on first use and asks the strategy to record its
collectives into it (``GradSyncStrategy.attach_recorder``); strategies of other kinds (Lightning's ``ddp``) get
the recorder only as a clock. Observers open and finish the recorder's steps themselves
(``Recorder.open_step(global_step)`` is idempotent for the same step, ``finish_step`` for a finished one), so the
strategy's training step is never driven by measuring.
"""

from __future__ import annotations

import weakref
from typing import Any

from lightning_ddp.sync.record import Recorder

__all__ = ["recorder_for", "release_recorder"]

_RECORDERS: "weakref.WeakKeyDictionary[Any, Recorder]" = weakref.WeakKeyDictionary()


def recorder_for(trainer: Any) -> Recorder:
    """The recorder of this run (keyed by its strategy), attached to the strategy if it records collectives."""
    strategy = trainer.strategy
    recorder = _RECORDERS.get(strategy)
    if recorder is None:
        recorder = Recorder(strategy.root_device)
        _RECORDERS[strategy] = recorder
        attach = getattr(strategy, "attach_recorder", None)
        if attach is not None:
            attach(recorder)
    return recorder


def release_recorder(trainer: Any) -> None:
    """Stop recording this run's collectives (at the end of fit)."""
    strategy = trainer.strategy
    if _RECORDERS.pop(strategy, None) is not None:
        attach = getattr(strategy, "attach_recorder", None)
        if attach is not None:
            attach(None)
