"""``hsdp``: hybrid sharded data parallelism, torch's FSDP2 (``fully_shard``) over a 2-D ``(dp_replicate, dp_shard)``
device mesh. The recipe, and when to choose it: ``docs/algorithms.md``.

1. The world of N ranks is ``replicas`` groups of ``shard_size`` consecutive ranks (default: the devices of one node),
   N = replicas x shard_size; the mesh is built as soon as the process group exists, so the CommTimer records its
   groups (it registers a recording stand-in for every group at its ``setup``).
2. Each shard group holds the model once, ``fsdp2``'s way: the same wrapping rule, parameters, gradients and
   optimizer state split over its ``shard_size`` ranks; the ranks with the same place in every group hold the same
   shard (a replica group).
3. After each block's backward its gradients are reduce-scattered in the shard group (``dp_shard``), then each
   1/shard_size piece all-reduced across the replica group (``dp_replicate``): the sum over all N ranks, divided by N.

Invariants: every replica group's ranks hold bitwise the same shard (the same reduced gradient, the same optimizer
step); mixed precision, accumulation, clipping (the norm over the shard group; the replicas agree) and the
consolidated checkpoints are ``fsdp2``'s. ``shard_size`` = N is ``fsdp2`` (one dimension, no all-reduce); 1 keeps
the whole model on every rank and all-reduces every gradient over the world (replicated, as ``ddp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_ddp import catalogue
from lightning_ddp.strategies.fsdp2 import FSDP2Strategy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

REPLICATE_DIM, SHARD_DIM = "dp_replicate", "dp_shard"
"""The mesh's dimension names (torchtitan's): the CommTimer labels each group's collectives by them."""


@dataclass(frozen=True)
class HybridLayout:
    """How ``hsdp`` splits ``replicas x shard_size`` ranks."""

    replicas: int  # groups holding one copy of the model each
    shard_size: int  # ranks in a group, each holding 1/shard_size of the model

    @classmethod
    def of(cls, world_size: int, shard_size: int, where: str = "") -> HybridLayout:
        """The layout of ``world_size`` ranks in groups of ``shard_size``; ``ValueError`` naming the divisors when
        ``shard_size`` does not divide it (``where``: how the world came about, for the message).

        >>> HybridLayout.of(8, 4)
        HybridLayout(replicas=2, shard_size=4)
        >>> HybridLayout.of(4, 3)
        Traceback (most recent call last):
        ValueError: hsdp: shard_size 3 does not divide the world of 4 ranks; set shard_size to one of 1, 2, 4 ...
        """
        if world_size % shard_size:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            example = max(d for d in divisors if d < world_size) if world_size > 1 else 1
            raise ValueError(
                f"hsdp: shard_size {shard_size} does not divide the world of {world_size} ranks{where}; set shard_size "
                f"to one of {', '.join(map(str, divisors))} (the ranks of one shard group; null: the devices of one "
                f"node), e.g. --config configs/strategy/hsdp.yaml --trainer.strategy.init_args.shard_size {example}, "
                "or change the world (--trainer.devices, --trainer.num_nodes)."
            )
        return cls(replicas=world_size // shard_size, shard_size=shard_size)

    def describe(self) -> str:
        """What runs, in one line, said once at start.

        >>> HybridLayout(replicas=2, shard_size=2).describe()
        'hsdp: 4 ranks as 2 replicas x 2 shards: each group of 2 ranks shards the model ...'
        """
        world = self.replicas * self.shard_size
        if self.replicas == 1:
            return (f"hsdp: shard_size {self.shard_size} = the world of {world} ranks: one shard group, no replica: "
                    "the same as fsdp2")
        if self.shard_size == 1:
            return (f"hsdp: shard_size 1: each of the {world} ranks holds the whole model and all-reduces every "
                    "gradient over the world: replicated, as ddp (through FSDP2)")
        return (f"hsdp: {world} ranks as {self.replicas} replicas x {self.shard_size} shards: each group of "
                f"{self.shard_size} ranks shards the model (reduce-scatter, all-gather on {SHARD_DIM}), each gradient "
                f"shard is all-reduced across the {self.replicas} replicas ({REPLICATE_DIM})")


def hybrid_mesh(device_type: str, layout: HybridLayout) -> DeviceMesh | None:
    """The ``(dp_replicate, dp_shard)`` mesh of ``layout`` over the world (a collective: every rank calls it); ``None``
    for one replica, where ``fully_shard`` shards over the world as ``fsdp2`` does (no all-reduce over groups of one).
    Ranks ``r * shard_size ... (r + 1) * shard_size - 1`` form shard group ``r``: one node's under torchrun."""
    if layout.replicas == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    shape = (layout.replicas, layout.shard_size)
    return init_device_mesh(device_type, shape, mesh_dim_names=(REPLICATE_DIM, SHARD_DIM))


class HSDPStrategy(FSDP2Strategy):
    """Hybrid sharding with torch's FSDP2 over a ``(dp_replicate, dp_shard)`` mesh (``trainer.strategy: hsdp``).

    Args:
        shard_size: Ranks per shard group; ``null``: the devices of one node (``--trainer.devices``). It must divide
            the world size; the world / ``shard_size`` groups replicate the model.
        **kwargs: The arguments of ``FSDP2Strategy`` (``shard_modules``, ``reshard_after_forward``,
            ``mixed_precision``, the backend, ...).
    """

    def __init__(self, shard_size: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if shard_size is not None and (isinstance(shard_size, bool) or not isinstance(shard_size, int)
                                       or shard_size < 1):
            raise ValueError(f"hsdp: shard_size must be a positive number of ranks, or null for the devices of one "
                             f"node; got {shard_size!r}.")
        self.shard_size = shard_size
        self.layout: HybridLayout | None = None  # once Lightning has set the devices and nodes

    @override
    def reported_settings(self) -> tuple[float | str, dict[str, Any]]:
        _, settings = super().reported_settings()
        shard_size = self.layout.shard_size if self.layout is not None else self.shard_size
        return catalogue.NOT_APPLICABLE, {"shard_size": shard_size, **settings}

    def _layout(self, world_size: int) -> HybridLayout:
        where = f" ({self.num_nodes} nodes x {self.num_processes} devices)" if self.num_nodes > 1 else ""
        return HybridLayout.of(world_size, self.shard_size or self.num_processes, where)

    @override
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        # Lightning calls this when the Trainer is built, devices and nodes set: the layout is refused before any
        # process is launched, and again in each process once the world is known.
        if self.num_processes:
            self.layout = self._layout(self.num_nodes * self.num_processes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # the process group
        self.layout = self._layout(self.world_size)
        self.device_mesh = hybrid_mesh(self.root_device.type, self.layout)
        rank_zero_info(self.layout.describe())

    @override
    def teardown(self) -> None:
        self.device_mesh = None
        super().teardown()
