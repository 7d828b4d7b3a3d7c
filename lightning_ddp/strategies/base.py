"""``GradSyncStrategy``: Lightning's ``DDPStrategy`` with any engine of ``lightning_ddp.catalogue`` instead of torch
DDP; checkpoints carry every rank's engine state (``ENGINE_STATES_KEY``). Details: ``docs/algorithms.md``.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Generator, Literal, Union

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from lightning_ddp import catalogue, compat
from lightning_ddp.sync import GradSyncEngine, Recorder
from lightning_ddp.sync.bucketed import check_bucket_size
from lightning_ddp.sync.comm import backend_from_spec, gather_rank_states

BucketSizeOption = Union[float, Literal["auto", "default"], None]

ENGINE_STATES_KEY = "grad_sync_engine_states"
"""Where a checkpoint holds the engines' states: ``{"algorithm", "world_size", "states": [one per rank]}``."""


class DataParallelStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with our defaults and checks (the base of our strategies).

    Args:
        process_group_backend: ``gloo``, ``nccl`` or one per device type, e.g. ``cpu:gloo,cuda:nccl``.
        timeout: How long a collective may wait for the other ranks before the job fails.
        start_method: How the launcher starts the other ranks (``popen`` re-runs the command).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: Set by the Trainer.
    """

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

    @property
    def strategy_name(self) -> str:
        """The catalogue name this run's strategy goes by, as in Lightning's ``StrategyRegistry``: its class's one
        entry, else (``GradSyncStrategy``, one entry per engine) its algorithm's."""
        return entry_of(type(self), getattr(self, "algorithm", None)).name

    def reported_settings(self) -> tuple[float | str, dict[str, Any]]:
        """(bucket size in MiB, ``catalogue.ONE_BUCKET`` or ``NOT_APPLICABLE``; the settings that change how it
        communicates), as the CommTimer's HPARAMS table shows them."""
        return catalogue.NOT_APPLICABLE, {}

    @override
    def setup_environment(self) -> None:
        self.check_process_group_backend()
        super().setup_environment()

    def check_process_group_backend(self) -> None:
        """Refuse a backend spec that cannot move this run's tensors, before any process starts."""
        spec, device = self._get_process_group_backend(), self.root_device.type
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


class GradSyncStrategy(DataParallelStrategy):
    """Data-parallel training with one of our gradient-sync engines (``trainer.strategy: bucketed_ddp``).

    Args:
        algorithm: A catalogue engine: ``naive_ddp``, ``flat_ddp``, ``bucketed_ddp``, ...
        bucket_size_mb: Bucket cap in MiB, ``null`` for one bucket, ``auto`` to predict it, or ``default``.
        engine_settings: The engine's own settings, name -> value, e.g. ``{rank: 4}``; ``null``: the defaults.
        **kwargs: The arguments of ``DataParallelStrategy`` (backend, timeout, start method).
    """

    def __init__(
        self,
        algorithm: str = catalogue.DEFAULT_ENGINE,
        bucket_size_mb: BucketSizeOption = "default",
        engine_settings: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.algorithm = self._catalogue_entry(algorithm)
        self.algorithm.refuse_bucket_size(bucket_size_mb)
        if bucket_size_mb != "default":
            check_bucket_size(bucket_size_mb)
        self.bucket_size_mb = bucket_size_mb
        try:
            self.algorithm.check_settings(engine_settings)
        except (TypeError, ValueError) as error:
            raise type(error)(f"engine_settings: {error}") from None
        self.engine_settings: dict[str, Any] = dict(engine_settings or {})
        self._recorder: Recorder | None = None
        self._loaded_checkpoint: dict[str, Any] | None = None  # until the engine takes its state from it

    def _catalogue_entry(self, algorithm: str) -> catalogue.Entry:
        entry = catalogue.get(algorithm)
        if not entry.is_engine:
            raise ValueError(
                f"GradSyncStrategy runs an engine of ours alone; {algorithm!r} is built by {entry.lightning_class}: "
                f"choose one of {', '.join(catalogue.names(engines_only=True))}, or select it with "
                f"`trainer.strategy: {algorithm}`."
            )
        return entry

    def make_engine(self, module: nn.Module) -> GradSyncEngine:
        """Wrap the LightningModule in this strategy's engine (a collective: it broadcasts rank 0's weights)."""
        return self.algorithm.make_engine(module, bucket_size_mb=self.bucket_size_mb, **self.engine_settings)

    @property
    def engine(self) -> GradSyncEngine | None:
        """The engine wrapping the model while fitting, else ``None``."""
        return self.model if isinstance(self.model, GradSyncEngine) else None

    @property
    def resolved_bucket_size_mb(self) -> float | None:
        """The bucket cap the engine uses while fitting; else ``None``."""
        return getattr(self.engine, "bucket_size_mb", None)

    @override
    def reported_settings(self) -> tuple[float | str, dict[str, Any]]:
        bucket: float | str = catalogue.NOT_APPLICABLE
        if self.resolved_bucket_size_mb is not None:  # `auto` and `default` as the engine resolved them
            bucket = float(self.resolved_bucket_size_mb)
        elif self.algorithm.has_bucket_size and self.bucket_size_mb is None:
            bucket = catalogue.ONE_BUCKET
        return bucket, dict(self.engine_settings)

    @override
    def configure_ddp(self) -> None:
        assert isinstance(self.model, pl.LightningModule)
        self.model = engine = self.make_engine(self.model)
        prediction = getattr(engine, "bucket_prediction", None)
        if prediction is not None:  # bucket_size_mb=auto: say on rank 0 which cap it chose
            rank_zero_info(
                f"bucket_size_mb=auto: {prediction.bucket_size_mb:.3g} MiB ({len(engine.bucket_indices)} buckets) "
                f"from an all-reduce fit of {prediction.overhead_s * 1e6:.0f} us per call and "
                f"{prediction.bandwidth_Bps / 1e9:.2f} GB/s over {prediction.grad_bytes / 2**20:.1f} MiB of gradients"
            )
        if self._loaded_checkpoint is not None:  # the checkpoint was loaded before the engine existed
            self._restore_engine_state()
        if self._recorder is not None:
            self.attach_recorder(self._recorder)

    # -- the engine's own state in checkpoints ---------------------------------------------------------------

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        # Called on every rank (Trainer.save_checkpoint), so the gather can be a collective; rank 0 writes.
        engine = self.engine
        # Only a full checkpoint (Lightning's weights-only one has no optimizer state) of a run being fitted.
        local = engine.engine_state_dict() if engine is not None and "optimizer_states" in checkpoint else {}
        if local:  # its keys are the engine's structure, the same on every rank: all ranks gather or none
            states = gather_rank_states(local, engine.comm, engine.device, dst=0)
            if states is not None:
                checkpoint[ENGINE_STATES_KEY] = {
                    "algorithm": self.algorithm.name, "world_size": engine.world_size, "states": states,
                }
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # Lightning loads the file on every rank; for fitting, before the engine is built (configure_ddp restores).
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._loaded_checkpoint = checkpoint
        if self.engine is not None:
            self._restore_engine_state()
        return checkpoint

    def _restore_engine_state(self) -> None:
        engine, checkpoint = self.engine, self._loaded_checkpoint
        assert engine is not None and checkpoint is not None
        self._loaded_checkpoint = None
        state, dropped = engine_state_to_restore(
            checkpoint.get(ENGINE_STATES_KEY), self.algorithm.name, engine.world_size, engine.comm.rank,
            bool(engine.engine_state_dict()),
        )
        if state is not None:
            try:
                engine.load_engine_state_dict(move_data_to_device(state, engine.device))
            except ValueError as error:
                dropped = f"the checkpoint's engine state does not fit this engine ({error})"
        if dropped:
            summary = f": {engine.state_summary}" if engine.state_summary else ""
            rank_zero_warn(f"Resuming with a fresh {type(engine).__name__} state: {dropped}. It starts as at "
                           f"construction{summary}.")

    def attach_recorder(self, recorder: Recorder | None) -> None:
        """Record this run's gradient collectives into ``recorder`` (``None`` stops); may precede wrapping."""
        self._recorder = recorder
        for target in self._recorded():
            target.recorder = recorder

    def _recorded(self) -> list[Any]:
        """What issues this run's gradient collectives: the engine (ZeRO-1 adds its optimizers)."""
        return [self.engine] if self.engine is not None else []

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        with self.engine.no_sync() if self.engine is not None else nullcontext():
            yield None

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.engine is not None:
            self.engine.on_train_batch_start()

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        engine = self.engine
        if engine is not None and engine.require_backward_grad_sync:
            engine.finish_gradient_synchronization()

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
        self._loaded_checkpoint = None
        if self.engine is not None:
            self.engine.recorder = None
            self.model = self.lightning_module
        super().teardown()


def entry_of(strategy_class: type, algorithm: catalogue.Entry | None = None) -> catalogue.Entry:
    """The one catalogue entry ``strategy_class`` (or its nearest base of ours) builds, e.g. ``zero2_ddp``; where a
    class builds several (``GradSyncStrategy``), ``algorithm`` if it is one of them."""
    for base in strategy_class.__mro__:
        if not base.__module__.startswith(f"{__package__}."):
            continue
        path = f"{__package__}.{base.__name__}"  # as the catalogue spells it: the package exports every class
        entries = [entry for entry in catalogue.STRATEGIES.values() if entry.lightning_class == path]
        if len(entries) == 1:
            return entries[0]
        if algorithm in entries:
            return algorithm
    raise ValueError(f"no single catalogue entry names {strategy_class.__name__} as its lightning_class")


def engine_state_to_restore(
    saved: Mapping[str, Any] | None, algorithm: str, world_size: int, rank: int, engine_has_state: bool
) -> tuple[dict[str, Any] | None, str]:
    """``(this rank's state or None, why it is dropped or "")`` from a checkpoint's ``ENGINE_STATES_KEY`` entry;
    a state is taken only when the same algorithm saved it at the same world size."""
    if saved is None:
        if not engine_has_state:
            return None, ""
        return None, (f"the checkpoint holds no {algorithm!r} engine state (it was saved by another strategy, or "
                      "without one)")
    saved_algorithm, saved_world_size = saved.get("algorithm"), saved.get("world_size")
    if saved_algorithm != algorithm:
        return None, (f"the checkpoint's engine state was saved by the {saved_algorithm!r} algorithm, this run uses "
                      f"{algorithm!r}; dropped")
    if saved_world_size != world_size:
        return None, (f"the checkpoint's engine state was saved by {saved_world_size} ranks, each its own, and this "
                      f"run has {world_size}; dropped")
    return saved["states"][rank], ""


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
