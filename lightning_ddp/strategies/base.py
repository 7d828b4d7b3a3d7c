"""``GradSyncStrategy``: Lightning's ``DDPStrategy`` with one of our engines instead of torch DDP.

One class serves every algorithm of ``lightning_ddp.sync.registry``: ``GradSyncStrategy(algorithm="bucketed",
bucket_size_mb=25)`` is ``bucketed_ddp``. The named classes (``NaiveDDPStrategy`` ...) only fix the algorithm,
for the class paths users' YAML names; a new algorithm needs none.

Subclassing ``DDPStrategy`` keeps what Lightning gets right (launchers, process-group set-up, the
``DistributedSampler`` it injects, ``reduce``/``barrier``/``broadcast`` for ``sync_dist`` logging). We replace
only the gradient synchronisation:

- ``configure_ddp`` wraps the LightningModule in our container (``lightning_ddp.sync``), which broadcasts
  rank 0's weights. Not ``super()``: that builds a torch ``DistributedDataParallel``.
- ``block_backward_sync`` enters the container's ``no_sync()`` for gradient-accumulation micro-batches
  (Lightning only does this for torch DDP models).
- ``post_backward`` calls ``finish_gradient_synchronization()``. It runs inside the optimizer closure, right
  after ``backward`` and before ``on_before_optimizer_step``, gradient clipping and ``optimizer.step``.
- ``on_train_batch_start`` tells the container a micro-batch begins (the strategy owns the training step).
- ``attach_recorder`` is how an observer (the ``CommTimer``, the ``TraceRecorder``) asks for the step's
  collectives to be recorded: the strategy hands the recorder to its container (and, for ZeRO-1, to the
  sharded optimizers). Nothing is recorded until someone asks.
- ``teardown`` unwraps the container. Checkpoints are unaffected: Lightning saves the LightningModule's own
  ``state_dict``, so keys carry no ``module.`` prefix.
"""

from __future__ import annotations

import signal
import subprocess
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Generator, Literal, Union

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_ddp import compat
from lightning_ddp.sync import DataParallel, Recorder
from lightning_ddp.sync.bucketed import check_bucket_size
from lightning_ddp.sync.comm import backend_from_spec
from lightning_ddp.sync.registry import ALGORITHMS, get_algorithm

BucketSizeOption = Union[float, Literal["auto", "default"], None]


class GradSyncStrategy(DDPStrategy):
    """Data-parallel training with one of our gradient-sync algorithms (``lightning_ddp.sync.registry``).

    Select an algorithm by name, ``trainer.strategy: bucketed_ddp``, or configure it::

        strategy:
          class_path: lightning_ddp.strategies.GradSyncStrategy
          init_args: {algorithm: bucketed, bucket_size_mb: 4}

    Args:
        algorithm: A registered algorithm: ``naive``, ``flat``, ``overlap``, ``bucketed`` or one you registered.
        bucket_size_mb: For algorithms with buckets: the cap in MiB, ``null`` for one bucket, ``auto`` to predict it
            from an all-reduce microbenchmark, ``default`` for the algorithm's own default (25 MiB). Algorithms
            without buckets take only ``default``.
        accelerator: Set by the Trainer from ``trainer.accelerator``.
        parallel_devices: Set by the Trainer from ``trainer.devices``.
        cluster_environment: Set by the Trainer (local, torchrun, SLURM, ...).
        checkpoint_io: Set by the Trainer.
        precision_plugin: Set by the Trainer from ``trainer.precision``.
        process_group_backend: ``gloo``, ``nccl`` or one per device type, e.g. ``cpu:gloo,cuda:nccl``; default:
            ``nccl`` on CUDA, ``gloo`` on CPU.
        timeout: How long a collective may wait for the other ranks before the job fails (a stuck rank then ends
            the job). 10 minutes: long enough for rank 0 to write an xl checkpoint while the others wait at a
            barrier, short enough that a hang does not hold machines for Lightning's default 30 minutes.
        start_method: How the launcher starts the other ranks (``popen`` re-runs the command).
    """

    def __init__(
        self,
        algorithm: str = "bucketed",
        bucket_size_mb: BucketSizeOption = "default",
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
        # Checked when the config is read, not after the processes have started.
        self.algorithm = get_algorithm(algorithm)
        if bucket_size_mb != "default":
            if not self.algorithm.has_bucket_size:
                raise ValueError(
                    f"the {algorithm!r} algorithm has no bucket size, got bucket_size_mb={bucket_size_mb!r}; drop "
                    "`bucket_size_mb` or choose an algorithm with buckets, e.g. `algorithm: bucketed`."
                )
            check_bucket_size(bucket_size_mb)
        self.bucket_size_mb = bucket_size_mb
        self._recorder: Recorder | None = None

    @property
    def strategy_name(self) -> str:
        """The name this run's strategy goes by (``<algorithm>_ddp``), as in Lightning's ``StrategyRegistry``."""
        return self.algorithm.strategy_name

    @override
    def setup_environment(self) -> None:
        self.check_process_group_backend()
        super().setup_environment()

    def check_process_group_backend(self) -> None:
        """Refuse a backend spec that cannot move this run's tensors (on ``root_device``), before any process starts.

        Per device, not by the spec's name: ``cpu:gloo,cuda:nccl`` on CPU moves the tensors with gloo and is fine,
        while ``nccl`` (or ``cpu:nccl``) on CPU would fail at the first collective.
        """
        spec = self._get_process_group_backend()
        device = self.root_device.type
        backend = backend_from_spec(spec, device)
        if backend is None:
            raise ValueError(
                f"process_group_backend={spec!r} has no backend for {device} tensors, which this run trains on; add "
                f"one (e.g. '{device}:gloo,{spec}') or drop `process_group_backend` for the default."
            )
        if backend == "nccl" and device != "cuda":
            raise ValueError(
                f"process_group_backend={spec!r} needs CUDA GPUs (it moves this run's {device} tensors with nccl); "
                "use gloo (the default off GPUs: drop `process_group_backend`) or run with --trainer.accelerator cuda."
            )

    def make_container(self, module: nn.Module) -> DataParallel:
        """Wrap the LightningModule in this strategy's gradient-sync engine."""
        container = self.algorithm.make_engine(module, bucket_size_mb=self.bucket_size_mb)
        prediction = getattr(container, "bucket_prediction", None)
        if prediction is not None:
            rank_zero_info(
                f"bucket_size_mb=auto: {prediction.bucket_size_mb:.3g} MiB ({len(container.buckets)} buckets) from an "
                f"all-reduce fit of {prediction.overhead_s * 1e6:.0f} us per call and "
                f"{prediction.bandwidth_Bps / 1e9:.2f} GB/s over {prediction.grad_bytes / 2**20:.1f} MiB of gradients"
            )
        return container

    @property
    def container(self) -> DataParallel | None:
        """The engine wrapping the model while fitting, else ``None``."""
        return self.model if isinstance(self.model, DataParallel) else None

    @property
    def resolved_bucket_size_mb(self) -> float | None:
        """The bucket cap the engine uses (``auto`` and ``default`` resolved), while fitting; else ``None``."""
        return getattr(self.container, "bucket_size_mb", None)

    @override
    def configure_ddp(self) -> None:
        assert isinstance(self.model, pl.LightningModule)
        self.model = self.make_container(self.model)
        if self._recorder is not None:
            self.attach_recorder(self._recorder)

    def attach_recorder(self, recorder: Recorder | None) -> None:
        """Record this run's gradient collectives into ``recorder`` (``None`` stops recording).

        Called by observers; may be called before the model is wrapped (it is attached when it is).
        """
        self._recorder = recorder
        for target in self._recorded():
            target.recorder = recorder

    def _recorded(self) -> list[Any]:
        """What issues this run's gradient collectives: the container (ZeRO-1 adds its optimizers)."""
        return [self.container] if self.container is not None else []

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
        procs = compat.launched_processes(self)
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
            self.container.recorder = None
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``<name>_ddp`` for every algorithm of ``lightning_ddp.sync.registry`` (idempotent)."""
        for algorithm in ALGORITHMS.values():
            if algorithm.strategy_name not in strategy_registry:
                strategy_registry.register(
                    algorithm.strategy_name, GradSyncStrategy, description=algorithm.summary, algorithm=algorithm.name
                )


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
