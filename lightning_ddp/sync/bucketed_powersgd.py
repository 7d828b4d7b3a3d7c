"""Bucketed DDP with PowerSGD (Vogels et al., 2019; torch's ``powerSGD_hook``) as its reduce step, ``PowerSGDReduce``:
every large gradient matrix crosses the wire as two thin low-rank factors, with per-rank error feedback. The recipe,
invariants and measurements: ``docs/algorithms.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from lightning_ddp.sync.base import check_number
from lightning_ddp.sync.bucketed import AllReduceMean, BucketedDDP, BucketLayout, BucketReduce, Reduction
from lightning_ddp.sync.comm import Communicator

# ---- the arithmetic (pure) -------------------------------------------------------------------------------


def matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int] | None:
    """The matrix a gradient of ``shape`` is viewed as, ``(shape[0], prod(shape[1:]))``; ``None`` below 2-d."""
    if len(shape) < 2:
        return None
    return shape[0], math.prod(shape[1:])


def should_compress(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """Whether ``rows * cols > min_compression_rate * (rows + cols) * rank`` (torch's ``_should_compress``)."""
    return (rows + cols) * rank * min_compression_rate < rows * cols


def orthogonalize(matrix: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis (rows x k) of a space holding the columns of ``matrix`` (rows x k, rows >= k).

    Householder QR: ``Q^T Q = I`` to rounding for any input, a zero or rank-deficient one included.
    """
    return torch.linalg.qr(matrix, mode="reduced").Q


@dataclass(frozen=True)
class CompressedMatrix:
    """One gradient of a bucket sent as low-rank factors: ``P`` (rows x rank) and ``Q`` (cols x rank)."""

    name: str
    start: int  # its first element in the flattened bucket
    rows: int
    cols: int
    rank: int  # min(rows, cols, the approximation rank)

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class BucketPlan:
    """Which gradients of a bucket are compressed, and which element ranges are averaged as they are."""

    matrices: tuple[CompressedMatrix, ...]
    uncompressed: tuple[tuple[int, int], ...]  # (start, stop) ranges of the flat bucket averaged as they are
    numel: int  # the bucket's elements (with the sentinel, if it has one)

    @property
    def uncompressed_numel(self) -> int:
        return sum(stop - start for start, stop in self.uncompressed)

    @property
    def p_numel(self) -> int:
        return sum(m.rows * m.rank for m in self.matrices)

    @property
    def q_numel(self) -> int:
        return sum(m.cols * m.rank for m in self.matrices)

    @property
    def sent_numel(self) -> int:
        """Elements all-reduced per compressed step: the uncompressed part, every ``P`` and every ``Q``."""
        return self.uncompressed_numel + self.p_numel + self.q_numel


def plan_bucket(layout: BucketLayout, numel: int, rank: int, min_compression_rate: float) -> BucketPlan:
    """Split a bucket of ``numel`` elements laid out as ``layout`` into compressed matrices and the rest."""
    matrices = []
    for name, shape, offset in zip(layout.names, layout.shapes, layout.offsets):
        matrix = matrix_shape(shape)
        if matrix is None:
            continue
        rows, cols = matrix
        k = min(rows, cols, rank)
        if should_compress(rows, cols, k, min_compression_rate):
            matrices.append(CompressedMatrix(name, offset, rows, cols, k))
    uncompressed, position = [], 0
    for matrix in sorted(matrices, key=lambda m: m.start):
        if matrix.start > position:
            uncompressed.append((position, matrix.start))
        position = matrix.start + matrix.numel
    if position < numel:
        uncompressed.append((position, numel))
    return BucketPlan(tuple(matrices), tuple(uncompressed), numel)


def check_powersgd_options(rank: Any, start_iter: Any, min_compression_rate: Any, seed: Any) -> None:
    """Reject PowerSGD settings that cannot work, naming the fix (the engine and the strategy share this)."""
    check_number("rank (the PowerSGD approximation rank)", rank, 1,
                 "set e.g. rank=4 (1 sends the fewest bytes, higher ranks approximate better)")
    check_number("start_iter (a number of optimizer steps)", start_iter, 0, "set start_iter=0 to compress from the "
                 "first step, or the number of steps to average exactly first, e.g. start_iter=10")
    check_number("min_compression_rate", min_compression_rate, 0, "set 0 to compress every matrix, or e.g. "
                 "min_compression_rate=2.0 to compress only matrices that shrink more than 2x", integer=False)
    check_number("seed", seed, None, "set e.g. seed=0 (every rank must use the same one)")


# ---- the reduce step ----------------------------------------------------------------------------------------


class PowerSGDReduce(BucketReduce):
    """Average a bucket with PowerSGD: its large matrices as rank-``rank`` factors with error feedback, the rest
    exactly. The settings are ``BucketedPowerSGDDDP``'s."""

    def __init__(self, rank: int = 4, start_iter: int = 10, min_compression_rate: float = 2.0, seed: int = 0) -> None:
        check_powersgd_options(rank, start_iter, min_compression_rate, seed)
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = float(min_compression_rate)
        self.seed = seed
        self.iteration = 0
        """Optimizer steps synchronised so far (compression is on from ``start_iter``)."""
        self.errors: dict[str, torch.Tensor] = {}
        """Per compressed gradient, this rank's error ``E`` (rows x cols) from its last compressed step."""
        self.qs: dict[str, torch.Tensor] = {}
        """Per compressed gradient, the averaged ``Q`` (cols x k) of its last compressed step (the warm start)."""
        self._plans: dict[tuple[BucketLayout, int], BucketPlan] = {}
        self._plain = AllReduceMean()

    def plan(self, layout: BucketLayout, numel: int) -> BucketPlan:
        """The bucket's plan (computed once per layout)."""
        key = (layout, numel)
        if key not in self._plans:
            self._plans[key] = plan_bucket(layout, numel, self.rank, self.min_compression_rate)
        return self._plans[key]

    def launch(
        self, comm: Communicator, bucket: torch.Tensor, label: str, layout: BucketLayout | None = None
    ) -> Reduction:
        if layout is None:  # one tensor of the bucket's shape (a caller outside an engine: a bench, a test)
            layout = BucketLayout(0, 1, (label,), (torch.Size(bucket.shape),), (0,))
        flat = bucket.view(-1) if bucket.is_contiguous() else bucket.contiguous().view(-1)
        plan = self.plan(layout, flat.numel())
        if self.iteration < self.start_iter or not plan.matrices:  # 0. warm-up, or nothing worth compressing
            reduction = self._plain.launch(comm, bucket, label, layout)
            reduction.finish = lambda: self._count_step(layout)  # AllReduceMean's reduction has nothing to finish
            return reduction
        world_size = comm.world_size
        dtype = torch.promote_types(flat.dtype, torch.float32)  # M, E, P and Q: fp32 at least
        pending = []
        uncompressed = None
        if plan.uncompressed:  # 2a. the rest of the bucket, averaged exactly
            with comm.span("pack"):
                uncompressed = torch.cat([flat[start:stop] for start, stop in plan.uncompressed]).div_(world_size)
            pending.append(comm.all_reduce(uncompressed, f"{label} [uncompressed]"))
        with comm.span("pack"):  # 2b. M = G + E; P = M orthogonalise(Q)
            ms, ps = [], []
            p_flat = torch.empty(plan.p_numel, dtype=dtype, device=flat.device)
            qs = self._warm_qs(plan, layout.index, dtype, flat.device)
            p_parts = p_flat.split([matrix.rows * matrix.rank for matrix in plan.matrices])
            for matrix, q, p_part in zip(plan.matrices, qs, p_parts):
                gradient = flat[matrix.start : matrix.start + matrix.numel].view(matrix.rows, matrix.cols)
                m = gradient.to(dtype, copy=True)
                error = self.errors.get(matrix.name)
                if error is not None:
                    if error.shape != m.shape:
                        raise ValueError(
                            f"the PowerSGD state holds an error of shape {tuple(error.shape)} for {matrix.name!r}, "
                            f"whose gradient is a {tuple(m.shape)} matrix; load a state saved for this model, or none."
                        )
                    m += error.to(flat.device)
                p = p_part.view(matrix.rows, matrix.rank)
                torch.matmul(m, orthogonalize(q), out=p)
                ms.append(m)
                ps.append(p)
            p_flat.div_(world_size)  # pre-scaled, as every collective here: the SUM is the average
        pending.append(comm.all_reduce(p_flat, f"{label} [PowerSGD P]"))  # 2c

        def finish() -> None:
            with comm.span("pack"):
                if uncompressed is not None:  # 3a
                    parts = uncompressed.split([stop - start for start, stop in plan.uncompressed])
                    for (start, stop), part in zip(plan.uncompressed, parts):
                        flat[start:stop] = part
                q_flat = torch.empty(plan.q_numel, dtype=dtype, device=flat.device)
                q_parts = q_flat.split([matrix.cols * matrix.rank for matrix in plan.matrices])
                new_qs = []
                for matrix, m, p, q_part in zip(plan.matrices, ms, ps, q_parts):  # 3b, 3c. Q = M^T orthogonalise(P)
                    q = q_part.view(matrix.cols, matrix.rank)
                    p.copy_(orthogonalize(p))  # kept in p_flat: 3d uses it
                    torch.matmul(m.T, p, out=q)
                    new_qs.append(q)
                q_flat.div_(world_size)
            comm.wait(comm.all_reduce(q_flat, f"{label} [PowerSGD Q]"))
            with comm.span("pack"):
                for matrix, m, p, q in zip(plan.matrices, ms, ps, new_qs):  # 3d
                    written = flat[matrix.start : matrix.start + matrix.numel].view(matrix.rows, matrix.cols)
                    written.copy_(p @ q.T)
                    self.errors[matrix.name] = m.sub_(written)  # E = M - what was written (its rounding too)
                    self.qs[matrix.name] = q
            self._count_step(layout)

        return Reduction(comm, pending, flat.view_as(bucket), finish=finish)

    def _warm_qs(
        self, plan: BucketPlan, bucket_index: int, dtype: torch.dtype, device: torch.device
    ) -> list[torch.Tensor]:
        """Each compressed matrix's starting ``Q``: last step's, else a normal draw (equal on every rank)."""
        # The first compressed step draws every matrix's Q of the bucket in order (so a draw does not depend on
        # which Qs exist); a resumed step draws nothing. One stream per (seed, bucket), independent of the order in
        # which buckets first compress.
        generator = None
        if any(matrix.name not in self.qs for matrix in plan.matrices):
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + bucket_index) % 2**63)
        qs = []
        for matrix in plan.matrices:
            shape = (matrix.cols, matrix.rank)
            drawn = torch.randn(shape, generator=generator) if generator is not None else None
            q = self.qs.get(matrix.name)
            if q is None:
                q = drawn
            elif tuple(q.shape) != shape:
                raise ValueError(
                    f"the PowerSGD state holds a Q of shape {tuple(q.shape)} for {matrix.name!r}, but this engine "
                    f"needs {shape} (rank={self.rank}); load a state saved with the same rank and model, or none."
                )
            qs.append(q.to(device=device, dtype=dtype))
        return qs

    def _count_step(self, layout: BucketLayout) -> None:
        if layout.index == layout.count - 1:  # the step's last bucket: one more step synchronised
            self.iteration += 1

    # -- checkpointing ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """A copy of the step counter, ``E`` (this rank's own) and ``Q`` per matrix."""
        return {
            "iteration": self.iteration,
            "rank": self.rank,
            "min_compression_rate": self.min_compression_rate,
            "errors": {name: e.detach().clone() for name, e in self.errors.items()},
            "qs": {name: q.detach().clone() for name, q in self.qs.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (``state_dict()`` of the same rank, with the same ``rank`` setting)."""
        missing = {"iteration", "rank", "min_compression_rate", "errors", "qs"} - set(state)
        if missing:
            raise ValueError(f"not a PowerSGD state: {sorted(missing)} missing; pass what state_dict() returned.")
        if state["rank"] != self.rank or state["min_compression_rate"] != self.min_compression_rate:
            raise ValueError(
                f"the PowerSGD state was saved with rank={state['rank']}, min_compression_rate="
                f"{state['min_compression_rate']}, but this engine has rank={self.rank}, min_compression_rate="
                f"{self.min_compression_rate}; construct it with the saved settings to resume, or do not load the "
                "state to start error feedback afresh."
            )
        self.iteration = int(state["iteration"])
        self.errors = {name: e.detach().clone() for name, e in state["errors"].items()}
        self.qs = {name: q.detach().clone() for name, q in state["qs"].items()}


# ---- the engine ---------------------------------------------------------------------------------------------


class BucketedPowerSGDDDP(BucketedDDP):
    """``BucketedDDP`` whose buckets are averaged with PowerSGD (``PowerSGDReduce``): lossy, far fewer bytes.

    Args:
        bucket_size_mb: Bucket cap in MiB of the *uncompressed* gradients.
        rank: The approximation rank (>= 1).
        start_iter: Optimizer steps averaged exactly before compression starts (>= 0).
        min_compression_rate: Compress only matrices that shrink by more than this factor (>= 0; 0: all).
        seed: Seeds the first ``Q`` of each bucket; must be the same on every rank.

    ``state_dict()`` carries each rank's own PowerSGD state: save every rank's.
    """

    reduce: PowerSGDReduce

    state_summary = (
        "the PowerSGD step counter at 0 (so the start_iter exact steps run again), no error feedback, Q drawn anew"
    )

    check_settings = staticmethod(check_powersgd_options)
    """The catalogue's check of the settings, run before any process starts."""

    def __init__(
        self,
        module: nn.Module,
        bucket_size_mb: float | Literal["auto"] | None = 25.0,
        process_group: dist.ProcessGroup | None = None,
        rank: int = 4,
        start_iter: int = 10,
        min_compression_rate: float = 2.0,
        seed: int = 0,
    ) -> None:
        reduce = PowerSGDReduce(rank, start_iter, min_compression_rate, seed)  # checked before any collective
        super().__init__(module, bucket_size_mb, process_group, reduce=reduce)

    def get_extra_state(self) -> dict[str, Any]:
        return self.reduce.state_dict()

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.reduce.load_state_dict(state)
