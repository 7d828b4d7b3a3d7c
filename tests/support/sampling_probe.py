"""A 2-rank CPU fit with ``CommTimer(every_n_steps=3)`` and counters on everything measuring costs, for
``tests/dist/test_sampling.py``. Run as a script (Lightning's launcher re-runs it for rank 1)::

    python tests/support/sampling_probe.py OUT_DIR [ACCELERATOR DEVICES]    # default: cpu 2

Each rank writes ``OUT_DIR/rank{r}.json``: per optimizer step, how many times each counted function ran in it
(from the first callback's ``on_train_batch_start`` to the last callback's ``on_train_batch_end``, so the
timer's own work at both ends is inside), whether the gradient-ready hooks were registered during backward, and
what the timer handed its logger.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddp.callbacks.comm_timer import CommTimer
from lightning_ddp.metrics import straggler
from lightning_ddp.metrics.recording import recorder_for
from lightning_ddp.sync import record

COUNTS: collections.Counter = collections.Counter()


def _counted(owner: object, name: str, key: str) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        COUNTS[key] += 1
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


_counted(torch.cuda, "synchronize", "torch.cuda.synchronize")
_counted(dist, "all_reduce", "dist.all_reduce")  # the engine's buckets (and flags)
_counted(record.StepClock, "synchronize", "StepClock.synchronize")  # torch.cuda.synchronize on CUDA
_counted(record.StepClock, "mark", "StepClock.mark")  # every clock read: hooks, landmarks, collectives
_counted(record.Recorder, "launch", "Recorder.launch")  # a recorded collective
_counted(straggler.StragglerExchange, "exchange", "timer collective")  # its one all-gather per step


class MemoryLogger(Logger):
    """Keeps what is logged: [(step, sorted keys)]."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, list[str]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        self.logged.append((step, sorted(metrics)))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


class Start(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        Probe.before = COUNTS.copy()


class Probe(pl.Callback):
    before: collections.Counter = collections.Counter()

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.steps: dict[int, dict] = {}
        self.watching: dict[int, bool] = {}

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.watching[trainer.global_step] = recorder_for(trainer).watching

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step - 1  # the optimizer step that just ended
        self.steps[step] = dict(COUNTS - Probe.before)

    def on_train_end(self, trainer, pl_module) -> None:
        timer = next(c for c in trainer.callbacks if isinstance(c, CommTimer))
        logger = trainer.logger
        result = {"steps": self.steps, "watching": self.watching, "logged": logger.logged,
                  "summary_steps": timer.summary.steps}
        Path(self.out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,))), batch_size=4)
    accelerator, devices = (sys.argv[2], int(sys.argv[3])) if len(sys.argv) > 3 else ("cpu", 2)
    trainer = pl.Trainer(
        strategy="bucketed_ddp", devices=devices, accelerator=accelerator, max_steps=7, logger=MemoryLogger(),
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Start(), CommTimer(every_n_steps=3, warmup_steps=1), Probe(sys.argv[1])],
    )
    trainer.fit(Tiny(), data)
