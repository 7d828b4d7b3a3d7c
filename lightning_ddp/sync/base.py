"""The small base every gradient-sync engine shares: wrapping, broadcasting, ``no_sync``, recording.

The conventional data-parallel interface, usable without Lightning::

    ddp = BucketedDDP(model, bucket_size_mb=25)     # broadcasts parameters and buffers from rank 0
    for batch in loader:
        ddp.on_train_batch_start()                  # opens the step's SyncRecord
        loss = loss_fn(ddp(batch))
        loss.backward()                             # hook-based engines start communicating here
        ddp.finish_gradient_synchronization()       # .grad now holds the average over ranks
        optimizer.step(); optimizer.zero_grad()

Gradient accumulation: run every micro-batch but the last under ``with ddp.no_sync():``.

Invariants every engine keeps:

- **Same collectives, same order, on every rank.** Collectives are matched by their position in the
  sequence, so an engine never lets the order depend on local data. Hook-based engines launch in a fixed
  order and launch at ``finish_gradient_synchronization`` whatever was not ready; therefore a parameter that
  received no gradient on some rank never hangs the others.
- **Unused parameters match single-process training.** Once per step, after the gradient collectives, the
  ranks sum one small vector "which parameters have a ``.grad`` here" (one extra tiny all-reduce, recorded
  like the others). A parameter with no gradient on *any* rank keeps ``.grad = None``, exactly as in a
  single process, so the optimizer skips it. A parameter with a gradient on *some* ranks is averaged with
  zeros from the others, which is the full-batch gradient: a rank that did not use it contributed 0.
- **Averages, not sums:** every engine sums and then divides by the world size (gloo has no ``AVG``).
- Tied weights appear once in ``module.parameters()`` and are communicated once; ``requires_grad=False``
  parameters are never communicated.

Profiling: while a torch profiler records, ``finish_gradient_synchronization``, each collective launch and each
wait are ``record_function`` ranges (``ddp/grad_sync``, ``ddp/comm_launch``, ``ddp/comm_wait``; see
``lightning_ddp.trace.ranges``). With no profiler active they cost one flag check.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from lightning_ddp.sync.record import Collective, StepClock, SyncRecord
from lightning_ddp.trace.ranges import COMM_LAUNCH, COMM_WAIT, GRAD_SYNC


class DataParallel(nn.Module):
    """Base of the gradient-sync engines: the wrapped model at ``.module`` plus the shared machinery.

    Subclasses implement ``_synchronize()`` (called by ``finish_gradient_synchronization``) and, if they
    communicate during backward, ``_on_grad_ready(index)`` for hook-driven launches.
    """

    uses_grad_hooks: bool = False
    """Whether the engine registers post-accumulate-grad hooks (overlap, bucketed)."""

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"{type(self).__name__} needs a process group: call torch.distributed.init_process_group() first "
                "(or train through the Lightning strategy, which does it for you)."
            )
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.require_backward_grad_sync = True
        # module.parameters() yields a tied tensor once; frozen parameters are never communicated.
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        device = self.params[0].device if self.params else torch.device("cpu")
        self.clock = StepClock(device)
        self.record = SyncRecord()
        self._step_open = False
        broadcast_module_states(module, process_group)
        self._hook_handles = []
        if self.uses_grad_hooks:
            for index, param in enumerate(self.params):
                self._hook_handles.append(param.register_post_accumulate_grad_hook(self._make_hook(index)))

    # -- the conventional interface -------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip communication for the backward passes inside (gradient-accumulation micro-batches)."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def on_train_batch_start(self) -> None:
        """Open a new optimizer step: a fresh ``SyncRecord`` and clock origin.

        Idempotent within a step, so calling it for every micro-batch of an accumulation window is fine.
        """
        if self._step_open:
            return
        self._step_open = True
        self.clock.start()
        self.record = SyncRecord()

    def finish_gradient_synchronization(self) -> None:
        """Leave the average over ranks of every gradient in ``.grad``; call after the last backward."""
        if not self.require_backward_grad_sync:
            raise RuntimeError(
                "finish_gradient_synchronization() was called inside no_sync(); call it once per optimizer step, "
                "after the backward of the last micro-batch, outside no_sync()."
            )
        self._check_no_parameter_was_unfrozen()
        if not self._step_open:  # a caller that never calls on_train_batch_start still gets a record
            self.on_train_batch_start()
        start = self.clock.mark()
        with profiler_range(GRAD_SYNC):
            self._synchronize()
        self.record.exposed.append((start, self.clock.mark()))
        self._step_open = False

    def _check_no_parameter_was_unfrozen(self) -> None:
        # The engine synchronises the parameters that were trainable when it wrapped the model. One unfrozen
        # later would silently train on each rank's local gradient, so its gradient is an error.
        late = [name for name, param in self._frozen if param.grad is not None]
        if late:
            raise RuntimeError(
                f"{', '.join(late[:3])}{' ...' if len(late) > 3 else ''} had requires_grad=False when "
                f"{type(self).__name__} wrapped the model but now have gradients, which it would not synchronise. "
                "Unfreeze parameters before wrapping (before trainer.fit), or wrap the model again."
            )

    # -- for subclasses -------------------------------------------------------------------------------

    def _synchronize(self) -> None:
        raise NotImplementedError

    def _on_grad_ready(self, index: int) -> None:
        raise NotImplementedError

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            if self.require_backward_grad_sync:
                if not self._step_open:
                    self.on_train_batch_start()
                self._on_grad_ready(index)

        return hook

    def _all_reduce(self, tensor: torch.Tensor, label: str) -> tuple[dist.Work, Collective]:
        """Launch an async SUM all-reduce of ``tensor`` in place and record it."""
        nbytes = tensor.numel() * tensor.element_size()
        return launch_recorded(
            self.record, self.clock, "all_reduce", label, nbytes,
            lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True),
        )

    def _wait(self, work: dist.Work, collective: Collective) -> None:
        """Wait for ``work`` and record the wait (and, on CUDA, the completion estimate)."""
        wait_recorded(self.clock, work, collective)

    def _agree_on_gradients(self, has_grad: list[bool]) -> list[int]:
        """Sum over ranks of "this parameter has a gradient here" (one tiny all-reduce, recorded)."""
        flags = torch.tensor(has_grad, dtype=torch.int32, device=self.clock_device)
        work, collective = self._all_reduce(flags, "gradient presence flags")
        self._wait(work, collective)
        return flags.tolist()

    @property
    def clock_device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    def _pack_interval(self, start) -> None:
        self.record.pack.append((start, self.clock.mark()))


def profiler_range(name: str) -> AbstractContextManager:
    """``record_function(name)`` while a torch profiler is recording, else a no-op context.

    Why the check: entering a ``record_function`` dispatches an op that allocates a ``RecordFunction`` even when
    no profiler listens (20-40 us per range on our CPU machines); ``torch.autograd._profiler_enabled()`` costs
    ~0.1 us, so per-collective ranges are free when nobody profiles.
    """
    return record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


def launch_recorded(
    record: SyncRecord, clock: StepClock, op: str, label: str, nbytes: int, start: Callable[[], dist.Work]
) -> tuple[dist.Work, Collective]:
    """Issue an async collective with ``start()`` and append it to ``record`` (every engine records this way)."""
    collective = Collective(op, label, nbytes, clock.mark())
    with profiler_range(COMM_LAUNCH):
        work = start()
    if not clock.cuda:
        # gloo completes the future on its own thread once the data has arrived: that is completion.
        def on_done(_fut: torch.futures.Future, c: Collective = collective) -> None:
            if c.completed is None:
                c.completed = clock.mark()

        try:
            work.get_future().then(on_done)
        except RuntimeError:  # some gloo collectives (reduce_scatter_tensor) have no future: completion = wait end
            pass
    record.collectives.append(collective)
    return work, collective


def wait_recorded(clock: StepClock, work: dist.Work, collective: Collective) -> None:
    """Wait for ``work`` and record the wait (and, on CUDA, the completion estimate)."""
    start = clock.mark()
    with profiler_range(COMM_WAIT):
        work.wait()
    end = clock.mark()
    collective.wait = (start, end)
    if clock.cuda:
        collective.completed = end  # upper bound; exact whenever the wait actually blocked
        collective.duration_ms = nccl_duration_ms(work)
    elif collective.completed is None:  # the callback thread may not have run yet; the wait returned
        collective.completed = end


def broadcast_module_states(module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
    """Copy rank 0's parameters and buffers to every rank, so ranks start identical whatever their seeds."""
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    seen: set[int] = set()
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        dist.broadcast(tensor.data, src=src, group=process_group)


def nccl_duration_ms(work: dist.Work) -> float | None:
    """NCCL's own timing of a finished collective, if ``TORCH_NCCL_ENABLE_TIMING=1`` made it available."""
    try:
        return float(work._get_duration())
    except (RuntimeError, AttributeError):
        return None
