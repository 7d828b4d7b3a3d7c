"""The equivalence matrix's machinery: every engine on N ranks against one process on the full batch.

The argument: with the global batch of 8 split 4/4 and ``loss = mean over the local batch``, the average of
the two local gradients, ``(sum_0 / 4 + sum_1 / 4) / 2 = (sum_0 + sum_1) / 8``, is the full-batch gradient.
So after the same AdamW steps from the same initial weights, the weights must equal single-process training
on all 8 samples, up to float rounding (the sums are associated differently).

``run_jobs`` (spawned on 2 ranks with ``tests.support.dist_utils.run_on_ranks``) trains every (engine, case) pair on
both ranks and, on rank 0, the single-process reference of every case. Engines are named as in
``lightning_ddp.catalogue`` (plus two bucket-count variants of ``bucketed_ddp``), so an algorithm registered
anywhere the spawned ranks import (a test module registering a toy one, say) runs through the same matrix.

Each rank seeds its model differently (``MODEL_SEED + rank``) before wrapping, so the ranks only agree, and
only match the reference (built from ``MODEL_SEED``), because the constructor broadcasts rank 0's
parameters and buffers.

Devices and layouts: ``run_jobs(..., device=)`` trains on any device; models are built on the CPU from the seed and
then moved, and batches are drawn on the CPU and moved, so every device starts from the same numbers. What comes
back is on the CPU (the parent needs no GPU). The CPU suite runs 2 gloo ranks; the GPU tier (``tests/gpu``) runs
the same jobs on CUDA tensors at NCCL world size 1 and as 2 gloo ranks sharing one GPU (``tests.support.device_matrix``).
The global batch of 8 divides over 1, 2, 4 or 8 ranks. ZeRO-1 joins the matrix as ``ZERO1_VARIANTS`` (a
container plus a ``ShardedOptimizer``), checked by ``check_zero1_matches_single_process``; ZeRO-2 as ``ZERO2_VARIANTS``
(a ``ZeRO2DDP`` plus a ``ShardedOptimizer`` placed by it) on every case, checked by
``check_zero2_matches_single_process``. Its fp64 runs at 2 and 3 ranks, with clipping, are ``tests/dist/test_zero2.py``.
"""

from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lightning_ddp.sync import BucketedDDP, DeferredGradSync, Recorder, ShardedOptimizer
from lightning_ddp.catalogue import get as get_algorithm
from lightning_ddp.sync.memory_model import MiB
from lightning_ddp.sync.zero2 import ZeRO2DDP
from tests.support.dist_utils import DEFAULT_TIMEOUT_S
from tests.support.tolerance import adam_weight_bounds, assert_within, reordered_gradient_bound, with_tied

WORLD_SIZE = 2  # the CPU suite's layout; run_jobs takes any world size that divides GLOBAL_BATCH
GLOBAL_BATCH = 8  # 4 samples per rank on 2 ranks
PER_RANK = GLOBAL_BATCH // WORLD_SIZE
MODEL_SEED = 1000  # rank r builds its model from MODEL_SEED + r; the reference from MODEL_SEED (rank 0's)
LR, WEIGHT_DECAY = 1e-2, 0.1
FLAGS = "gradient presence flags"

# Tolerances. fp32 (and the fp64 layer of mixed_dtype): the only difference from the reference is the order of the
# sums (local means averaged after the reduction vs one mean over 8, GEMMs blocked for 4 rows instead of 8), bounded
# per element by tests.support.tolerance: a gradient element sums TOKENS = 32 token terms (8 samples x 4 positions)
# through the inner sums of the layers, forward and back (LayerNorm 8, fc1 8, fc2 32, head 8, softmax 16): CHAIN =
# 32 + 2 x 72 terms, so gradients agree within 2 x 6 sqrt(176) u sqrt(32) = 5.4e-5 x the tensor's largest, and
# AdamW's weights within the bound adam_weight_bounds carries that to through the reference's own gradients (a few
# 1e-7 where gradients are healthy; up to 2 LR per step only where one is within its rounding of zero). A wrong
# gradient (a missing rank's contribution, a stale value) moves a weight by ~LR = 1e-2. Adam is invariant to the
# gradient's scale, so "sum instead of average" barely changes the weights: the synchronised gradients are
# compared with the reference's too, where x2 shows wherever |g| > 5.4e-5 x the tensor's largest.
# bf16 autocast: matmul outputs, and the weight gradients computed from them, are rounded to 8 mantissa bits
# (~4e-3 relative), and a batch of 4 is rounded differently from a batch of 8. Measured: gradients within
# 2e-3 of the reference (|g| <= 0.7), weights within 2e-4 after 3 steps; bf16 training itself moves the weights
# 2e-2 away from fp32 training, so these bounds still see a bf16-sized error (test_bf16_case_is_really_bf16).
BF16_TOL = dict(rtol=1e-3, atol=2e-3)
BF16_GRAD_TOL = dict(rtol=2e-2, atol=1e-2)

# ~20-30 s on 2 idle cores, nearly all of it two interpreters importing Lightning at once: a bound on a hang
# (mismatched collectives), not on speed, as run_on_ranks' default.
JOB_TIMEOUT_S = DEFAULT_TIMEOUT_S

SEVERAL_BUCKETS_CAP = 1088  # bytes; chosen so TinyLM's norm+fc1 bucket fills it exactly (see EXPECTED_BUCKETS)

# Two bucket-count variants of `bucketed`, only run on the "plain" case, for the bucket-count checks.
VARIANTS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "bucketed_one_bucket": lambda m: BucketedDDP(m, bucket_size_mb=None),
    "bucketed_per_param": lambda m: BucketedDDP(m, bucket_size_mb=1 / MiB),  # 1-byte cap
}


# ZeRO-1 as engines of the matrix: name -> (schedule, collectives). The container is the one the zero1_ddp strategy
# builds (DeferredGradSync for reduce_scatter; a bucketed engine for allreduce_broadcast), the optimizer a
# ShardedOptimizer over AdamW with the reference's hyperparameters. Both implementations of the collectives on
# every backend: `per_owner` (reduce / broadcast per owner) and `native` (reduce-scatter / all-gather).
ZERO1_VARIANTS: dict[str, tuple[str, str]] = {
    "zero1_allreduce_broadcast_per_owner": ("allreduce_broadcast", "per_owner"),
    "zero1_allreduce_broadcast_native": ("allreduce_broadcast", "native"),
    "zero1_reduce_scatter_per_owner": ("reduce_scatter", "per_owner"),
    "zero1_reduce_scatter_native": ("reduce_scatter", "native"),
}
ZERO1_CASES = ("plain", "bf16")  # ZeRO-1's own corner cases (tied, frozen, groups, unfreezing) are test_zero1's

# ZeRO-2 as engines of the matrix: name -> (bucket cap in bytes or None for one bucket, collectives). Several buckets
# reduced per owner; and one bucket whose owner segments are nearly equal (TinyLM's greedy split), so that `native`
# sends it as one reduce-scatter. Every case runs: ZeRO-2 has its own engine, so all its corner cases are the matrix's.
ZERO2_VARIANTS: dict[str, tuple[int | None, str]] = {
    "zero2_per_owner": (SEVERAL_BUCKETS_CAP, "per_owner"),
    "zero2_native_one_bucket": (None, "native"),
}


def make_engine(name: str, module: nn.Module) -> nn.Module:
    """A registered algorithm's engine (with buckets: the several-buckets cap), one of ``VARIANTS``, or the
    container of one of ``ZERO1_VARIANTS``."""
    if name in VARIANTS:
        return VARIANTS[name](module)
    if name in ZERO2_VARIANTS:
        cap, collectives = ZERO2_VARIANTS[name]
        return ZeRO2DDP(module, bucket_size_mb=None if cap is None else cap / MiB, collectives=collectives)
    if name in ZERO1_VARIANTS:
        schedule, _ = ZERO1_VARIANTS[name]
        return DeferredGradSync(module) if schedule == "reduce_scatter" else BucketedDDP(module, SEVERAL_BUCKETS_CAP / MiB)
    algorithm = get_algorithm(name)
    size = SEVERAL_BUCKETS_CAP / MiB if algorithm.has_bucket_size else "default"
    return algorithm.make_engine(module, bucket_size_mb=size)


def make_optimizer(name: str, params, engine: nn.Module | None = None) -> torch.optim.Optimizer:
    """AdamW with the reference's hyperparameters; sharded for the ``ZERO1_VARIANTS`` and (placed by ``engine``, the
    variant's ``ZeRO2DDP``) the ``ZERO2_VARIANTS``."""
    if name in ZERO2_VARIANTS:
        assert isinstance(engine, ZeRO2DDP)
        return ShardedOptimizer(params, torch.optim.AdamW, schedule="reduce_in_backward",
                                collectives=ZERO2_VARIANTS[name][1], placement=engine.owner_of, lr=LR,
                                weight_decay=WEIGHT_DECAY)
    if name in ZERO1_VARIANTS:
        schedule, collectives = ZERO1_VARIANTS[name]
        return ShardedOptimizer(params, torch.optim.AdamW, schedule=schedule, collectives=collectives, lr=LR,
                                weight_decay=WEIGHT_DECAY)
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def tolerances(name: str, case: Case) -> tuple[dict, dict] | None:
    """(weights, gradients) tolerances for the bf16 case and for lossy (not ``exact``) algorithms; None: the
    derived fp32 bounds (``assert_matches_reference``)."""
    lossy = name not in {**VARIANTS, **ZERO1_VARIANTS, **ZERO2_VARIANTS} and not get_algorithm(name).exact
    return (BF16_TOL, BF16_GRAD_TOL) if case.bf16 or lossy else None


def grad_bounds(reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor, how far a gradient summed in another order can be from ``reference`` (see Tolerances above); fp32
    rounding throughout, mixed_dtype's fp64 layer included (its inputs and gradients come through fp32 layers)."""
    return {name: reordered_gradient_bound(g, CHAIN, TOKENS, torch.float32) for name, g in reference.items()}


def weight_bounds(reference: dict) -> dict[str, torch.Tensor]:
    """Per weight, how far AdamW's weights after the case's steps can be from the reference's (see Tolerances)."""
    history = reference["grads"]
    bounds = adam_weight_bounds(history, [grad_bounds(step) for step in history], [LR] * len(history),
                                weights=reference["final"])
    return with_tied(bounds, reference["final"])


# ---- models (module level: the spawned ranks import this module by name) ------------------------

VOCAB, SEQ, DIM = 16, 4, 8
TOKENS = GLOBAL_BATCH * SEQ  # the LM cases' terms per gradient element (the MLP cases have 8: fewer, covered)
CHAIN = TOKENS + 2 * (DIM + DIM + 4 * DIM + DIM + VOCAB)  # + LayerNorm, fc1, fc2, head, softmax; forward and back


class TinyLM(nn.Module):
    """Transformer-ish: token embedding + positional buffer, a pre-norm MLP block with residual, LM head.

    Trainable tensors in ``parameters()`` order (float32, bytes = 4 * numel); a module lists its own
    parameters before its children's, so the 0-d ``logit_scale`` (a learnable temperature) comes first::

        0 logit_scale   ()      4 B     5 fc1.bias     32     128 B
        1 embed.weight  16x8  512 B     6 fc2.weight   8x32  1024 B
        2 norm.weight   8      32 B     7 fc2.bias     8       32 B
        3 norm.bias     8      32 B     8 head.weight  16x8   512 B   (absent when tied to embed.weight)
        4 fc1.weight    32x8 1024 B                                   total 3300 B (2788 B tied)

    ``unused_layer`` inserts ``unused`` (8x8 weight 256 B, bias 32 B) between fc1 and fc2; it is never called.
    """

    def __init__(self, tie: bool = False, unused_layer: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.register_buffer("pos", torch.randn(SEQ, DIM))  # random, so a missing buffer broadcast shows
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        if unused_layer:
            self.unused = nn.Linear(DIM, DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight  # one Parameter used by two modules
        self.logit_scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos  # (B, T, D)
        h = h + self.fc2(F.gelu(self.fc1(self.norm(h))))  # (B, T, D)
        return self.head(h) * self.logit_scale  # (B, T, V)


class GatedMLP(nn.Module):
    """A sample goes through ``branch`` only if its first feature is positive (a data-dependent branch).

    When no sample of a batch is positive the branch is not in the autograd graph at all, so its parameters
    get no gradient (``.grad`` stays None), not a zero gradient. Per sample, so the full batch computes each
    sample exactly as the rank that holds it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 16)
        self.branch = nn.Linear(16, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))  # (B, 16)
        use = x[:, 0] > 0  # (B,)
        if use.any():
            delta = torch.zeros_like(h)
            delta[use] = self.branch(h[use])
            h = h + delta
        return self.out(h)  # (B, 1)


class MixedDtypeMLP(nn.Module):
    """float32 - float64 - float32 layers: flat packs one buffer per dtype; buckets split at dtype changes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 16, dtype=torch.float64)
        self.fc3 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.fc2(h.double())).float()
        return self.fc3(h)


def _frozen_lm() -> TinyLM:
    model = TinyLM()
    model.embed.requires_grad_(False)
    model.norm.requires_grad_(False)
    return model


# ---- data and cases ------------------------------------------------------------------------------


def _token_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)  # the same global batch on every rank and in the reference
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    return tokens, torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)


# Which samples take GatedMLP's branch in each step (samples 0-3 live on rank 0, 4-7 on rank 1).
BRANCH_SAMPLES = [
    [0, 1],  # step 0: rank 0 only -> rank 1 has no gradient for the branch, averaged in as zeros
    [5, 6],  # step 1: rank 1 only
    [2, 7],  # step 2: both ranks
    [],  # step 3: no rank -> .grad stays None everywhere and AdamW skips the branch (no weight decay either)
]


def _feature_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=g)
    positive = torch.zeros(GLOBAL_BATCH, dtype=torch.bool)
    positive[BRANCH_SAMPLES[step]] = True
    x[:, 0] = torch.where(positive, x[:, 0].abs() + 0.1, -x[:, 0].abs() - 0.1)
    return x, torch.randn(GLOBAL_BATCH, 1, generator=g)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # Mean over the local tokens; every rank holds the same number of tokens, so mean of means = global mean.
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _mse_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), targets)


@dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    steps: int = 3
    micro_batches: int = 1  # > 1: all but the last micro-batch run under no_sync()
    bf16: bool = False  # forward under torch.autocast(<device type>, dtype=torch.bfloat16)
    set_to_none: bool = True  # optimizer.zero_grad(set_to_none=...): False keeps .grad (an engine's view) alive


CASES = {
    "plain": Case(TinyLM, _token_batch, _lm_loss),
    "tied": Case(lambda: TinyLM(tie=True), _token_batch, _lm_loss),
    "frozen": Case(_frozen_lm, _token_batch, _lm_loss),
    "unused": Case(lambda: TinyLM(unused_layer=True), _token_batch, _lm_loss),
    "data_dependent": Case(GatedMLP, _feature_batch, _mse_loss, steps=len(BRANCH_SAMPLES)),
    "accumulation": Case(TinyLM, _token_batch, _lm_loss, micro_batches=2),
    "bf16": Case(TinyLM, _token_batch, _lm_loss, bf16=True),
    "mixed_dtype": Case(MixedDtypeMLP, _feature_batch, _mse_loss),
    # gradients zeroed in place: backward accumulates straight into the engine's bucket views (nothing to copy)
    "grads_kept": Case(TinyLM, _token_batch, _lm_loss, set_to_none=False),
}


def jobs_for(engines: list[str]) -> list[tuple[str, str]]:
    """Every case for each of ``engines`` (the ZeRO-1 variants: ``ZERO1_CASES``; the ZeRO-2 ones: every case)."""
    return [(engine, case) for engine in engines for case in (ZERO1_CASES if engine in ZERO1_VARIANTS else CASES)]


# ---- what runs on each rank ----------------------------------------------------------------------


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}  # CPU: the parent may have no GPU


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # tied: listed once


def _grad_none(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.grad is None]


def _grads(model: nn.Module, only: set[str] | None = None) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()
            if p.grad is not None and (only is None or n in only)}


def _forward_context(case: Case, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16) if case.bf16 else contextlib.nullcontext()


def _build(case: Case, seed: int, device: torch.device) -> nn.Module:
    """``case``'s model from ``seed``, built on the CPU (the same numbers whatever the device) and moved."""
    torch.manual_seed(seed)
    return case.build().to(device)


def _batch(case: Case, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = case.batch(step)  # drawn on the CPU: the same global batch on every rank and device
    return inputs.to(device), targets.to(device)


def _train_ddp(rank: int, world_size: int, engine: str, case: Case, device: torch.device) -> dict:
    model = _build(case, MODEL_SEED + rank, device)  # different weights on each rank until the broadcast
    before_wrap = _state(model)
    ddp = make_engine(engine, model)
    after_wrap = _state(model)
    recorder = Recorder(device)  # what each step communicated (CUDA events on a GPU)
    ddp.recorder = recorder
    optimizer = make_optimizer(engine, ddp.parameters(), ddp)
    zero1 = ZERO1_VARIANTS.get(engine)
    zero2 = engine in ZERO2_VARIANTS
    if zero1 is not None or zero2:
        optimizer.recorder = recorder  # ZeRO's parameter collectives run inside optimizer.step()
    per_rank = GLOBAL_BATCH // world_size
    steps = []
    for step in range(case.steps):
        inputs, targets = _batch(case, step, device)
        local = slice(rank * per_rank, (rank + 1) * per_rank)
        micro_inputs = inputs[local].chunk(case.micro_batches)
        micro_targets = targets[local].chunk(case.micro_batches)
        collectives_in_no_sync = 0
        recorder.open_step(step)
        for i, (x, y) in enumerate(zip(micro_inputs, micro_targets)):
            ddp.on_train_batch_start()  # as the strategy calls it: every micro-batch
            last = i == case.micro_batches - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                with _forward_context(case, device):
                    # Each micro-batch is a mean over its samples; / micro_batches makes the sum the local mean.
                    loss = case.loss(ddp(x), y) / case.micro_batches
                loss.backward()
            if not last:
                collectives_in_no_sync += len(recorder.record.collectives)
        grad_none_before_sync = _grad_none(model)
        ddp.finish_gradient_synchronization()
        grad_none, grads = _grad_none(model), _grads(model)
        if zero2:
            optimizer.step()  # ZeRO-2's parameter phase is part of the step's record
            record = recorder.finish_step()
        elif zero1 is None:
            record = recorder.finish_step()
            optimizer.step()
        else:
            optimizer.step()  # ZeRO-1 communicates in here too: part of the step's record
            if zero1[0] == "reduce_scatter":
                # The gradients stayed local until step() reduce-scattered them: now each owner holds the average of
                # its own parameters' gradients (the others keep their local ones), so compare those.
                owned = {n for n, p in model.named_parameters() if p.requires_grad and optimizer.owner(p) == rank}
                grads = _grads(model, owned)
            record = recorder.finish_step()
        steps.append(
            dict(
                collectives=list(record.collectives),
                exposed=len(record.exposed),
                collectives_in_no_sync=collectives_in_no_sync,
                grad_none_before_sync=grad_none_before_sync,
                grad_none=grad_none,
                grads=grads,
            )
        )
        optimizer.zero_grad(set_to_none=case.set_to_none)
    return dict(
        before_wrap=before_wrap,
        after_wrap=after_wrap,
        final=_state(model),
        steps=steps,
        trainable=[(n, p.numel() * p.element_size(), p.dtype) for n, p in _trainable(model)],
        buckets=[list(b) for b in ddp.bucket_indices] if isinstance(ddp, BucketedDDP) else None,
        still_tied=(model.head.weight is model.embed.weight) if isinstance(model, TinyLM) else None,
        owned=[n for n, p in _trainable(model) if optimizer.owner(p) == rank] if zero2 else None,
    )


def _train_reference(case: Case, device: torch.device) -> dict:
    """Single process, full batch of 8, no micro-batching: what every engine must reproduce."""
    model = _build(case, MODEL_SEED, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    grad_none, grads = [], []
    for step in range(case.steps):
        inputs, targets = _batch(case, step, device)
        with _forward_context(case, device):
            loss = case.loss(model(inputs), targets)
        loss.backward()
        grad_none.append(_grad_none(model))
        grads.append(_grads(model))
        optimizer.step()
        optimizer.zero_grad(set_to_none=case.set_to_none)
    return dict(final=_state(model), grad_none=grad_none, grads=grads)


def run_jobs(rank: int, world_size: int, jobs: list[tuple[str, str]], device: str = "cpu", keep_going: bool = False) -> dict:
    """Spawned on each rank: ``{"runs": {(engine, case): ...}, "references": {case: ...} on rank 0}``.

    ``device``: where every rank (and the reference) trains, e.g. ``cuda`` (each rank's current GPU).
    ``keep_going``: a job that raises becomes ``{"error": traceback}`` and the next job runs, so one broken engine
    fails its own tests only (at world size 1; with more ranks a peer may be left waiting in a collective, and the
    run then fails at its time limit).
    """
    if GLOBAL_BATCH % world_size:
        raise ValueError(f"the global batch of {GLOBAL_BATCH} does not split over {world_size} ranks; use 1, 2, 4 or 8")
    where = torch.device(device)
    if where.type == "cuda" and where.index is None:
        where = torch.device("cuda", torch.cuda.current_device())
    runs = {}
    for engine, case in jobs:
        try:
            runs[engine, case] = _train_ddp(rank, world_size, engine, CASES[case], where)
        except Exception as error:
            if keep_going:
                runs[engine, case] = {"error": f"rank {rank} ({where}):\n{traceback.format_exc()}"}
                continue
            raise RuntimeError(f"engine={engine!r} case={case!r} failed on rank {rank} ({where})") from error
    cases = dict.fromkeys(case for _, case in jobs)
    references = {case: _train_reference(CASES[case], where) for case in cases} if rank == 0 else None
    return dict(runs=runs, references=references, device=str(where), world_size=world_size)


# ---- checks every algorithm must pass (used by test_sync_equivalence and by the toy-algorithm test) -----


def runs_of(ranks: list[dict], engine: str, case: str) -> list[dict]:
    return [r["runs"][engine, case] for r in ranks]


def data_collectives(collectives) -> list:
    return [c for c in collectives if c.label != FLAGS]


def assert_states_close(actual: dict, expected: dict, tol: dict, what: str) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        a, e = actual[key], expected[key]
        assert torch.allclose(a, e, **tol), f"{what}: {key} differs by up to {(a - e).abs().max().item():.3g}"


def assert_weights_match(actual: dict, reference: dict, tol: tuple[dict, dict] | None, what: str) -> None:
    """Final weights against the reference's: the bf16 or lossy ``tol``, else the derived fp32 bounds."""
    if tol is None:
        assert_within(actual, reference["final"], weight_bounds(reference), what)
    else:
        assert_states_close(actual, reference["final"], tol[0], what)


def assert_grads_match(actual: dict, expected: dict, tol: tuple[dict, dict] | None, what: str) -> None:
    """One step's gradients against the reference's (``expected``): as ``assert_weights_match``."""
    if tol is None:
        assert_within(actual, expected, grad_bounds(expected), what)
    else:
        assert_states_close(actual, expected, tol[1], what)


def check_matches_single_process(ranks: list[dict], engine: str, case: str) -> None:
    """Weights after the steps, and the synchronised gradients of every step, equal the full-batch reference."""
    references = ranks[0]["references"][case]
    tol = tolerances(engine, CASES[case])
    for rank, run in enumerate(runs_of(ranks, engine, case)):
        assert_weights_match(run["final"], references, tol, f"rank {rank} vs single process")
        for step, (ours, reference) in enumerate(zip([s["grads"] for s in run["steps"]], references["grads"])):
            assert_grads_match(ours, reference, tol, f"rank {rank} step {step} .grad vs full-batch gradient")


def check_ranks_agree_and_start_from_rank0(ranks: list[dict], engine: str, case: str) -> None:
    """Both ranks end bitwise identical, and wrapping gave every rank rank 0's parameters and buffers."""
    first, second = runs_of(ranks, engine, case)
    for key, value in first["final"].items():
        # Both ranks receive the same reduced sums (a + b == b + a exactly) and step identical optimizers.
        assert torch.equal(value, second["final"][key]), key
    rank0_init = first["before_wrap"]
    # Different seeds really gave different weights (otherwise this check proves nothing) ...
    assert any(not torch.equal(rank0_init[k], second["before_wrap"][k]) for k in rank0_init)
    # ... and after wrapping every rank holds rank 0's, parameters and buffers (TinyLM's `pos`) alike.
    for run in (first, second):
        for key, value in rank0_init.items():
            assert torch.equal(run["after_wrap"][key], value), key


def check_grad_none_and_record(ranks: list[dict], engine: str, case: str) -> None:
    """``.grad`` is None exactly where one process has none; every step's record is complete and ordered."""
    references = ranks[0]["references"][case]
    for run in runs_of(ranks, engine, case):
        assert [s["grad_none"] for s in run["steps"]] == references["grad_none"]
        for step in run["steps"]:
            assert step["exposed"] == 1  # one finish_gradient_synchronization per step
            assert step["collectives_in_no_sync"] == 0  # a no_sync micro-batch communicates nothing
            for c in step["collectives"]:
                assert c.wait is not None and c.wait[0] <= c.wait[1], c.label
                # Finished records are in ms on one axis: completion cannot precede launch.
                assert isinstance(c.launched, float) and c.launched <= c.completed, c.label


# What ZeRO-1 sends, per (schedule, collectives): the gradient phase, then the parameter phase. The all-reduces
# are the container's buckets (allreduce_broadcast) or the gradient-presence flags (reduce_scatter, every step).
ZERO1_OPS: dict[tuple[str, str], set[str]] = {
    ("allreduce_broadcast", "per_owner"): {"all_reduce", "broadcast"},
    ("allreduce_broadcast", "native"): {"all_reduce", "all_gather"},
    ("reduce_scatter", "per_owner"): {"all_reduce", "reduce", "broadcast"},
    ("reduce_scatter", "native"): {"all_reduce", "reduce_scatter", "all_gather"},
}


def check_zero1_matches_single_process(ranks: list[dict], engine: str, case: str) -> None:
    """A ZeRO-1 variant: the weights equal one process's (the ranks' bitwise equal), the averaged gradients each
    rank holds equal the full-batch ones, and it sent through the collectives its ``collectives`` choice names."""
    schedule, collectives = ZERO1_VARIANTS[engine]
    references = ranks[0]["references"][case]
    tol = tolerances(engine, CASES[case])
    runs = runs_of(ranks, engine, case)
    compared: set[str] = set()
    for rank, run in enumerate(runs):
        assert_weights_match(run["final"], references, tol, f"rank {rank} vs single process")
        # Every rank ends with the owners' updates bit for bit: parameters travel, they are not recomputed.
        assert all(torch.equal(value, runs[0]["final"][key]) for key, value in run["final"].items()), rank
        for step, (ours, reference) in enumerate(zip([s["grads"] for s in run["steps"]], references["grads"])):
            assert ours and set(ours) <= set(reference), (rank, step, sorted(ours))
            assert_grads_match(ours, {k: reference[k] for k in ours}, tol, f"rank {rank} step {step} .grad")
            compared |= set(ours)
        for step in run["steps"]:
            assert {c.op for c in step["collectives"]} == ZERO1_OPS[schedule, collectives], step["collectives"]
            for c in step["collectives"]:
                assert isinstance(c.launched, float) and c.launched <= c.completed, c.label
    # Over the ranks every parameter's averaged gradient was seen (reduce_scatter: each by its owner).
    assert compared == set(references["grads"][0]), sorted(set(references["grads"][0]) - compared)


def check_zero2_matches_single_process(ranks: list[dict], engine: str, case: str) -> None:
    """A ZeRO-2 variant: the weights equal one process's (the ranks' bitwise equal); after backward each rank holds
    exactly the averaged gradients it owns (every other ``.grad`` is None) and they equal the full-batch ones;
    a gradient no rank had stays None; no collective under ``no_sync``; the collectives its ``collectives`` names."""
    _, collectives = ZERO2_VARIANTS[engine]
    references = ranks[0]["references"][case]
    tol = tolerances(engine, CASES[case])
    runs = runs_of(ranks, engine, case)
    for rank, run in enumerate(runs):
        assert_weights_match(run["final"], references, tol, f"rank {rank} vs single process")
        assert all(torch.equal(value, runs[0]["final"][key]) for key, value in run["final"].items()), rank
        for number, step in enumerate(run["steps"]):
            ours = step["grads"]
            # Only owned gradients survive backward: the memory claim, and the owners' averages are the full batch's.
            assert set(ours) <= set(run["owned"]), (rank, number, sorted(set(ours) - set(run["owned"])))
            reference = references["grads"][number]
            assert set(ours) == set(reference) & set(run["owned"]), (rank, number, sorted(ours))
            assert_grads_match(ours, {k: reference[k] for k in ours}, tol, f"rank {rank} step {number} .grad")
            # At least two exposed spans: finish_gradient_synchronization and the parameter phase of step(), plus one
            # per bucket completed early during backward (more than buckets_in_flight launched there).
            assert step["exposed"] >= 2 and step["collectives_in_no_sync"] == 0
            ops = {c.op for c in step["collectives"]}
            if collectives == "per_owner":
                assert ops == {"reduce", "broadcast"}, (rank, number, ops)
            else:  # a bucket with unequal owner segments goes per owner (MAX_PADDING); the parameters by all-gather
                assert "all_gather" in ops and ops <= {"reduce_scatter", "reduce", "all_gather"}, (rank, number, ops)
            for c in step["collectives"]:
                assert isinstance(c.launched, float) and c.launched <= c.completed, c.label
    # Over the ranks every parameter is owned exactly once.
    owned = [name for run in runs for name in run["owned"]]
    assert sorted(owned) == sorted({n for n, _, _ in runs[0]["trainable"]}), owned
