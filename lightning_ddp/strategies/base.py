"""The shared shell of our strategies: Lightning's ``DDPStrategy`` with our container instead of torch DDP.

Subclassing ``DDPStrategy`` keeps what Lightning gets right (launchers, process-group set-up, the
``DistributedSampler`` it injects, ``reduce``/``barrier``/``broadcast`` for ``sync_dist`` logging). We replace
only the gradient synchronisation:

- ``configure_ddp`` wraps the LightningModule in our container (``lightning_ddp.sync``), which broadcasts
  rank 0's weights. Not ``super()``: that builds a torch ``DistributedDataParallel``.
- ``block_backward_sync`` enters the container's ``no_sync()`` for gradient-accumulation micro-batches
  (Lightning only does this for torch DDP models).
- ``post_backward`` calls ``finish_gradient_synchronization()``. It runs inside the optimizer closure, right
  after ``backward`` and before ``on_before_optimizer_step``, gradient clipping and ``optimizer.step``.
- ``on_train_batch_start`` opens the container's per-step ``SyncRecord`` (idempotent within a step).
- ``teardown`` unwraps the container. Checkpoints are unaffected: Lightning saves the LightningModule's own
  ``state_dict``, so keys carry no ``module.`` prefix.
"""

from __future__ import annotations

import signal
import subprocess
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Generator, Literal

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from typing_extensions import override

from lightning_ddp.sync import DataParallel


class GradSyncStrategy(DDPStrategy):
    """Base of our gradient-sync strategies; subclasses implement ``make_container``.

    Args:
        accelerator: Set by the Trainer from ``trainer.accelerator``.
        parallel_devices: Set by the Trainer from ``trainer.devices``.
        cluster_environment: Set by the Trainer (local, torchrun, SLURM, ...).
        checkpoint_io: Set by the Trainer.
        precision_plugin: Set by the Trainer from ``trainer.precision``.
        process_group_backend: ``gloo`` or ``nccl``; default: ``nccl`` on CUDA, ``gloo`` on CPU.
        timeout: How long a collective may wait for the other ranks before the job fails (a stuck rank then ends
            the job). 10 minutes: long enough for rank 0 to write an xl checkpoint while the others wait at a
            barrier, short enough that a hang does not hold machines for Lightning's default 30 minutes.
        start_method: How the launcher starts the other ranks (``popen`` re-runs the command).
    """

    strategy_name: str = ""
    """The name this strategy is registered under in Lightning's ``StrategyRegistry``."""

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=10),
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )

    @override
    def setup_environment(self) -> None:
        if self._get_process_group_backend() == "nccl" and self.root_device.type != "cuda":
            raise ValueError(
                f"process_group_backend='nccl' needs CUDA GPUs, but this run is on {self.root_device.type}; use gloo "
                "(the default off GPUs: drop `process_group_backend`) or run with --trainer.accelerator cuda."
            )
        super().setup_environment()

    def make_container(self, module: nn.Module) -> DataParallel:
        """Wrap the LightningModule in this strategy's gradient-sync engine."""
        raise NotImplementedError

    @property
    def container(self) -> DataParallel | None:
        """The engine wrapping the model while fitting, else ``None``."""
        return self.model if isinstance(self.model, DataParallel) else None

    @override
    def configure_ddp(self) -> None:
        assert isinstance(self.model, pl.LightningModule)
        self.model = self.make_container(self.model)

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        if self.container is None:
            yield None
            return
        with self.container.no_sync():
            yield None

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.container is not None:
            self.container.on_train_batch_start()

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        container = self.container
        if container is not None and container.require_backward_grad_sync:
            container.finish_gradient_synchronization()

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        # When another rank dies, this one only sees a broken connection ("Connection closed by peer"). The
        # launching process (rank 0 on each node) knows its sibling processes: name the ones that ended and how.
        procs = getattr(self._launcher, "procs", [])
        if any(word in str(exception) for word in ("peer", "Connection", "remote")):
            # The broken connection can be seen before the dead process is reaped: give it a moment.
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline and all(proc.poll() is None for proc in procs):
                time.sleep(0.05)
        deaths = describe_dead_ranks(procs, self.node_rank * self.num_processes)
        if deaths:
            message = f"{exception.args[0] if exception.args else ''}\n[lightning_ddp] {deaths}"
            exception.args = (message, *exception.args[1:])

    @override
    def teardown(self) -> None:
        if self.container is not None:
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        # Overridden so that the inherited DDPStrategy.register_strategies does not re-register "ddp".
        if cls.strategy_name:
            strategy_registry.register(cls.strategy_name, cls, description=(cls.__doc__ or "").strip().splitlines()[0])


def describe_dead_ranks(procs: list[subprocess.Popen], first_rank: int) -> str:
    """Which of the launched sibling processes (ranks ``first_rank + 1``, ...) have ended, and how."""
    deaths = []
    for offset, proc in enumerate(procs, start=1):
        code = proc.poll()
        if code is None or code == 0:
            continue
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        deaths.append(f"rank {first_rank + offset} (pid {proc.pid}) {how}")
    if not deaths:
        return ""
    return "; ".join(deaths) + ". Its own error, if it printed one, is in the output above."
