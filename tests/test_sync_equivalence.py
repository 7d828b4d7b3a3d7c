"""Every gradient-sync engine on 2 gloo ranks trains exactly like one process on the full batch.

The argument: with the global batch of 8 split 4/4 and ``loss = mean over the local batch``, the average of
the two local gradients, ``(sum_0 / 4 + sum_1 / 4) / 2 = (sum_0 + sum_1) / 8``, is the full-batch gradient.
So after the same AdamW steps from the same initial weights, the weights must equal single-process training
on all 8 samples, up to float rounding (the sums are associated differently).

One spawned job runs every (engine, case) pair on both ranks and, on rank 0, the single-process reference of
every case; the tests below only inspect what it returned. One job, not one per engine, because each spawned
rank spends ~8 s importing Lightning (``import lightning_ddp`` registers the strategies); the price is that
an exception or hang in one pair fails the whole job, and the traceback names the engine and case.

Each rank seeds its model differently (``MODEL_SEED + rank``) before wrapping, so the ranks only agree, and
only match the reference (built from ``MODEL_SEED``), because the constructor broadcasts rank 0's
parameters and buffers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_ddp.sync import BucketedDDP, FlatDDP, NaiveDDP, OverlapDDP
from tests.dist_utils import run_on_ranks

pytestmark = pytest.mark.multiprocess

WORLD_SIZE = 2
GLOBAL_BATCH = 8  # 4 samples per rank
PER_RANK = GLOBAL_BATCH // WORLD_SIZE
MODEL_SEED = 1000  # rank r builds its model from MODEL_SEED + r; the reference from MODEL_SEED (rank 0's)
LR, WEIGHT_DECAY = 1e-2, 0.1
MiB = 2**20
FLAGS = "gradient presence flags"

# Tolerances. fp32: the only difference from the reference is the association of the batch sums (local means
# averaged after the reduction vs one mean over 8), ~1e-7 relative per gradient element (measured: gradients
# within 1e-6 absolute of the reference at |g| up to 10). Adam divides the first moment by the root of the
# second, so a relative gradient error becomes the same relative error of a ~LR-sized update: ~1e-9 per step,
# measured <= 2.4e-7 on the weights after 3 steps (the worst where a tiny embedding-row gradient nearly
# cancels). A wrong gradient (a missing rank's contribution, a stale value) moves a weight by ~LR = 1e-2.
# But Adam is invariant to the gradient's scale, so "sum instead of average" barely changes the weights
# (only through eps): the gradients after synchronisation are therefore compared with the reference's too.
FP32_TOL = dict(rtol=1e-5, atol=1e-6)  # weights
FP32_GRAD_TOL = dict(rtol=1e-4, atol=1e-5)  # gradients: x2 is caught wherever |g| > ~1e-5
# bf16 autocast: matmul outputs, and the weight gradients computed from them, are rounded to 8 mantissa bits
# (~4e-3 relative), and a batch of 4 is rounded differently from a batch of 8. Measured: gradients within
# 2e-3 of the reference (|g| <= 0.7), weights within 2e-4 after 3 steps; bf16 training itself moves the weights
# 2e-2 away from fp32 training, so these bounds still see a bf16-sized error (test_bf16_case_is_really_bf16).
BF16_TOL = dict(rtol=1e-3, atol=2e-3)
BF16_GRAD_TOL = dict(rtol=2e-2, atol=1e-2)

# ~20-30 s on 2 cores, nearly all of it two interpreters importing Lightning at once; the margin is for a busy
# machine, and a hang (mismatched collectives) still fails within minutes.
JOB_TIMEOUT_S = 180.0

SEVERAL_BUCKETS_CAP = 1088  # bytes; chosen so TinyLM's norm+fc1 bucket fills it exactly (see EXPECTED_BUCKETS)

ENGINES: dict[str, Callable[[nn.Module], nn.Module]] = {
    "naive": NaiveDDP,
    "flat": FlatDDP,
    "overlap": OverlapDDP,
    "bucketed": lambda m: BucketedDDP(m, bucket_size_mb=SEVERAL_BUCKETS_CAP / MiB),
    # Only run on the "plain" case, for the bucket-count checks.
    "bucketed_one_bucket": lambda m: BucketedDDP(m, bucket_size_mb=None),
    "bucketed_per_param": lambda m: BucketedDDP(m, bucket_size_mb=1 / MiB),  # 1-byte cap
}
MAIN_ENGINES = ["naive", "flat", "overlap", "bucketed"]


# ---- models (module level: the spawned ranks import this module by name) ------------------------

VOCAB, SEQ, DIM = 16, 4, 8


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
    bf16: bool = False  # forward under torch.autocast("cpu", dtype=torch.bfloat16)


CASES = {
    "plain": Case(TinyLM, _token_batch, _lm_loss),
    "tied": Case(lambda: TinyLM(tie=True), _token_batch, _lm_loss),
    "frozen": Case(_frozen_lm, _token_batch, _lm_loss),
    "unused": Case(lambda: TinyLM(unused_layer=True), _token_batch, _lm_loss),
    "data_dependent": Case(GatedMLP, _feature_batch, _mse_loss, steps=len(BRANCH_SAMPLES)),
    "accumulation": Case(TinyLM, _token_batch, _lm_loss, micro_batches=2),
    "bf16": Case(TinyLM, _token_batch, _lm_loss, bf16=True),
    "mixed_dtype": Case(MixedDtypeMLP, _feature_batch, _mse_loss),
}

JOBS = [(engine, case) for engine in MAIN_ENGINES for case in CASES] + [
    ("bucketed_one_bucket", "plain"),
    ("bucketed_per_param", "plain"),
]
JOB_IDS = [f"{engine}-{case}" for engine, case in JOBS]


# ---- what runs on each rank ----------------------------------------------------------------------


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # tied: listed once


def _grad_none(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.grad is None]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _forward_context(case: Case):
    return torch.autocast("cpu", dtype=torch.bfloat16) if case.bf16 else contextlib.nullcontext()


def _train_ddp(rank: int, engine: str, case: Case) -> dict:
    torch.manual_seed(MODEL_SEED + rank)  # different weights on each rank until the broadcast
    model = case.build()
    before_wrap = _state(model)
    ddp = ENGINES[engine](model)
    after_wrap = _state(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    steps = []
    for step in range(case.steps):
        inputs, targets = case.batch(step)
        local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        micro_inputs = inputs[local].chunk(case.micro_batches)
        micro_targets = targets[local].chunk(case.micro_batches)
        collectives_in_no_sync = 0
        for i, (x, y) in enumerate(zip(micro_inputs, micro_targets)):
            ddp.on_train_batch_start()  # as Lightning calls it: every micro-batch (idempotent within a step)
            last = i == case.micro_batches - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                with _forward_context(case):
                    # Each micro-batch is a mean over its samples; / micro_batches makes the sum the local mean.
                    loss = case.loss(ddp(x), y) / case.micro_batches
                loss.backward()
            if not last:
                collectives_in_no_sync += len(ddp.record.collectives)
        grad_none_before_sync = _grad_none(model)
        ddp.finish_gradient_synchronization()
        steps.append(
            dict(
                collectives=list(ddp.record.collectives),
                exposed=len(ddp.record.exposed),
                collectives_in_no_sync=collectives_in_no_sync,
                grad_none_before_sync=grad_none_before_sync,
                grad_none=_grad_none(model),
                grads=_grads(model),
            )
        )
        optimizer.step()
        optimizer.zero_grad()
    return dict(
        before_wrap=before_wrap,
        after_wrap=after_wrap,
        final=_state(model),
        steps=steps,
        trainable=[(n, p.numel() * p.element_size(), p.dtype) for n, p in _trainable(model)],
        buckets=[list(b) for b in ddp.buckets] if isinstance(ddp, BucketedDDP) else None,
        still_tied=(model.head.weight is model.embed.weight) if isinstance(model, TinyLM) else None,
    )


def _train_reference(case: Case) -> dict:
    """Single process, full batch of 8, no micro-batching: what every engine must reproduce."""
    torch.manual_seed(MODEL_SEED)
    model = case.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    grad_none, grads = [], []
    for step in range(case.steps):
        inputs, targets = case.batch(step)
        with _forward_context(case):
            loss = case.loss(model(inputs), targets)
        loss.backward()
        grad_none.append(_grad_none(model))
        grads.append(_grads(model))
        optimizer.step()
        optimizer.zero_grad()
    return dict(final=_state(model), grad_none=grad_none, grads=grads)


def _run_jobs(rank: int, world_size: int, jobs: list[tuple[str, str]]) -> dict:
    assert world_size == WORLD_SIZE
    runs = {}
    for engine, case in jobs:
        try:
            runs[engine, case] = _train_ddp(rank, engine, CASES[case])
        except Exception as error:
            raise RuntimeError(f"engine={engine!r} case={case!r} failed on rank {rank}") from error
    references = {case: _train_reference(CASES[case]) for case in CASES} if rank == 0 else None
    return dict(runs=runs, references=references)


# ---- the tests -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """Both ranks' results of every job in JOBS (one spawn for the whole module)."""
    return run_on_ranks(_run_jobs, WORLD_SIZE, JOBS, timeout=JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def references(ranks) -> dict:
    return ranks[0]["references"]


def _runs(ranks: list[dict], engine: str, case: str) -> list[dict]:
    return [r["runs"][engine, case] for r in ranks]


def _data(collectives) -> list:
    return [c for c in collectives if c.label != FLAGS]


def _assert_states_close(actual: dict, expected: dict, tol: dict, what: str) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        a, e = actual[key], expected[key]
        assert torch.allclose(a, e, **tol), f"{what}: {key} differs by up to {(a - e).abs().max().item():.3g}"


@pytest.mark.parametrize("engine, case", JOBS, ids=JOB_IDS)
def test_matches_single_process_full_batch(ranks, references, engine, case):
    tol = BF16_TOL if CASES[case].bf16 else FP32_TOL
    for rank, run in enumerate(_runs(ranks, engine, case)):
        _assert_states_close(run["final"], references[case]["final"], tol, f"rank {rank} vs single process")


@pytest.mark.parametrize("engine, case", JOBS, ids=JOB_IDS)
def test_synchronized_gradients_are_full_batch_gradients(ranks, references, engine, case):
    tol = BF16_GRAD_TOL if CASES[case].bf16 else FP32_GRAD_TOL
    for rank, run in enumerate(_runs(ranks, engine, case)):
        for step, (ours, reference) in enumerate(zip([s["grads"] for s in run["steps"]], references[case]["grads"])):
            _assert_states_close(ours, reference, tol, f"rank {rank} step {step} .grad vs full-batch gradient")


def test_bf16_case_is_really_bf16(references):
    # Same seeds and data as "plain": only autocast differs, and it must show at the bf16 tolerance.
    plain, bf16 = references["plain"]["final"], references["bf16"]["final"]
    assert any(not torch.allclose(bf16[k], plain[k], **BF16_TOL) for k in plain)


@pytest.mark.parametrize("engine, case", JOBS, ids=JOB_IDS)
def test_ranks_end_bitwise_identical(ranks, engine, case):
    # Both ranks receive the same reduced sums (a + b == b + a exactly) and step identical optimizers.
    first, second = _runs(ranks, engine, case)
    for key, value in first["final"].items():
        assert torch.equal(value, second["final"][key]), key


@pytest.mark.parametrize("engine, case", JOBS, ids=JOB_IDS)
def test_constructor_broadcasts_rank0_parameters_and_buffers(ranks, engine, case):
    runs = _runs(ranks, engine, case)
    rank0_init = runs[0]["before_wrap"]
    # Different seeds really gave different weights (otherwise this test proves nothing) ...
    assert any(not torch.equal(rank0_init[k], runs[1]["before_wrap"][k]) for k in rank0_init)
    # ... and after wrapping every rank holds rank 0's, parameters and buffers (TinyLM's `pos`) alike.
    for run in runs:
        for key, value in rank0_init.items():
            assert torch.equal(run["after_wrap"][key], value), key


@pytest.mark.parametrize("engine, case", JOBS, ids=JOB_IDS)
def test_grad_none_exactly_where_single_process_has_none(ranks, references, engine, case):
    # After synchronisation .grad is None iff no sample of the global batch reached the parameter.
    for run in _runs(ranks, engine, case):
        assert [s["grad_none"] for s in run["steps"]] == references[case]["grad_none"]


def _expected_data_traffic(engine: str, run: dict, step: dict) -> tuple[int, int]:
    """(calls, bytes) of the gradient collectives (flags excluded) in one step.

    naive:  one call per tensor that has a gradient on some rank; bytes = those tensors' bytes.
    flat:   one call per dtype among those tensors; same bytes.
    overlap, bucketed: every bucket is launched every step (zeros stand in for a missing gradient, since the
            launch order is fixed before anyone knows who has what); bytes = all trainable tensors.
    """
    synced = [(n, b, d) for n, b, d in run["trainable"] if n not in step["grad_none"]]
    if engine == "naive":
        return len(synced), sum(b for _, b, _ in synced)
    if engine == "flat":
        return len({d for _, _, d in synced}), sum(b for _, b, _ in synced)
    return len(run["buckets"]), sum(b for _, b, _ in run["trainable"])


@pytest.mark.parametrize("engine, case", JOBS, ids=JOB_IDS)
def test_record_is_complete_and_ordered(ranks, engine, case):
    for run in _runs(ranks, engine, case):
        for step in run["steps"]:
            collectives = step["collectives"]
            flags = [c for c in collectives if c.label == FLAGS]
            # One presence-flag all-reduce per step: one int32 per trainable tensor.
            assert len(flags) == 1 and flags[0].nbytes == 4 * len(run["trainable"])
            calls, nbytes = _expected_data_traffic(engine, run, step)
            assert len(_data(collectives)) == calls
            assert sum(c.nbytes for c in _data(collectives)) == nbytes
            assert step["exposed"] == 1  # one finish_gradient_synchronization per step
            for c in collectives:
                assert c.op == "all_reduce"
                assert c.completed is not None, c.label
                assert c.wait is not None and c.wait[0] <= c.wait[1], c.label
                # CPU marks are perf_counter floats: completion cannot precede launch.
                assert isinstance(c.launched, float) and c.launched <= c.completed, c.label
            if engine == "naive":  # one call per tensor, in parameters() order, labelled by name
                names = [n for n, _, _ in run["trainable"] if n not in step["grad_none"]]
                assert [c.label for c in _data(collectives)] == names


# ---- case-specific checks ------------------------------------------------------------------------

# Tied TinyLM: head.weight *is* embed.weight, so parameters() lists 8 tensors (2788 B) and the flags
# all-reduce carries 8 int32 = 32 B. Every step, every engine moves 2788 + 32 = 2820 B:
#   naive:    8 tensors + 1 flags                                                   = 9 calls
#   flat:     1 float32 buffer + 1 flags                                            = 2 calls
#   overlap:  8 one-tensor buckets + 1 flags                                        = 9 calls
#   bucketed (1088 B cap), reverse walk over [scale, embed, norm.w, norm.b, fc1.w, fc1.b, fc2.w, fc2.b]:
#             [fc2.b 32, fc2.w 1024] = 1056 B (+fc1.b would be 1184) | [fc1.b 128] (+fc1.w 1152) |
#             [fc1.w 1024, norm.b 32, norm.w 32] = 1088 B (exactly the cap) | [embed 512, scale 4]
#             : 4 buckets + 1 flags                                                 = 5 calls
# Were the tied tensor sent twice, each count would grow by one (flat: bytes by 512).
TIED_CALLS = {"naive": 9, "flat": 2, "overlap": 9, "bucketed": 5}
TIED_BYTES = 2820


@pytest.mark.parametrize("engine", MAIN_ENGINES)
def test_tied_weight_communicated_once(ranks, engine):
    for run in _runs(ranks, engine, "tied"):
        assert run["still_tied"]
        assert [n for n, _, _ in run["trainable"]].count("embed.weight") == 1
        for step in run["steps"]:
            collectives = step["collectives"]
            assert len(collectives) == TIED_CALLS[engine]
            assert sum(c.nbytes for c in collectives) == TIED_BYTES
            labels = [c.label for c in collectives]
            assert "head.weight" not in labels
            if engine in ("naive", "overlap"):  # labelled per tensor: the tied one appears exactly once
                assert labels.count("embed.weight") == 1


# Frozen TinyLM (embed and norm frozen): trainable fc1.w 1024 + fc1.b 128 + fc2.w 1024 + fc2.b 32 + head 512 +
# scale 4 = 2724 B in 6 tensors, so 24 B of flags; every engine moves 2724 B of gradients per step.
FROZEN = ("embed.weight", "norm.weight", "norm.bias")


@pytest.mark.parametrize("engine", MAIN_ENGINES)
def test_frozen_parameters_never_communicated_and_unchanged(ranks, engine):
    for run in _runs(ranks, engine, "frozen"):
        assert not any(n in FROZEN for n, _, _ in run["trainable"])
        for step in run["steps"]:
            assert sum(c.nbytes for c in _data(step["collectives"])) == 2724
            assert not any(name in c.label for c in step["collectives"] for name in FROZEN)
            assert all(name in step["grad_none"] for name in FROZEN)
        for name in FROZEN:  # not even weight decay: AdamW skips a parameter whose .grad is None
            assert torch.equal(run["final"][name], run["after_wrap"][name])


# TinyLM with `unused` (never called): 11 trainable tensors, 3300 B used + 288 B unused; 44 B of flags.
#   naive, flat: only the 9 used tensors (3300 B): naive 9 calls, flat 1.
#   overlap: all 11 one-tensor buckets (3588 B), zeros standing in for `unused`.
#   bucketed (1088 B cap), reverse: [head, fc2.b] 544 B | [fc2.w, unused.b] 1056 B | [unused.w, fc1.b] 384 B |
#     [fc1.w, norm.b, norm.w] 1088 B | [embed, scale] 516 B -> 5 buckets (3588 B), so the unused tensors sit in
#     buckets whose other members did get gradients.
UNUSED_CALLS = {"naive": 9, "flat": 1, "overlap": 11, "bucketed": 5}
UNUSED_BYTES = {"naive": 3300, "flat": 3300, "overlap": 3588, "bucketed": 3588}


@pytest.mark.parametrize("engine", MAIN_ENGINES)
def test_parameter_unused_on_every_rank_keeps_grad_none(ranks, engine):
    for run in _runs(ranks, engine, "unused"):
        if engine == "bucketed":
            assert run["buckets"] == [[10, 9], [8, 7], [6, 5], [4, 3, 2], [1, 0]]
        for step in run["steps"]:
            assert {"unused.weight", "unused.bias"} <= set(step["grad_none"])
            assert len(_data(step["collectives"])) == UNUSED_CALLS[engine]
            assert sum(c.nbytes for c in _data(step["collectives"])) == UNUSED_BYTES[engine]
        for name in ("unused.weight", "unused.bias"):
            assert torch.equal(run["final"][name], run["after_wrap"][name])


@pytest.mark.parametrize("engine", MAIN_ENGINES)
def test_branch_used_on_some_ranks_matches_full_batch(ranks, engine):
    branch = {"branch.weight", "branch.bias"}
    runs = _runs(ranks, engine, "data_dependent")
    # Locally (before synchronisation) the branch had a gradient only on the ranks whose samples took it ...
    for step, samples in enumerate(BRANCH_SAMPLES):
        for rank, run in enumerate(runs):
            used_here = any(rank * PER_RANK <= s < (rank + 1) * PER_RANK for s in samples)
            local_none = set(run["steps"][step]["grad_none_before_sync"])
            assert ((branch & local_none) == set()) if used_here else (branch <= local_none), (step, rank)
            # ... and afterwards on every rank exactly when some rank used it (zeros averaged in for the others).
            assert (branch <= set(run["steps"][step]["grad_none"])) == (not samples), (step, rank)
    # The branch was really trained (the weight comparison with the reference is test_matches_...).
    assert not torch.equal(runs[0]["final"]["branch.weight"], runs[0]["after_wrap"]["branch.weight"])


@pytest.mark.parametrize("engine", MAIN_ENGINES)
def test_accumulation_communicates_once_per_optimizer_step(ranks, engine):
    plain = _runs(ranks, engine, "plain")[0]
    for run in _runs(ranks, engine, "accumulation"):
        for step, plain_step in zip(run["steps"], plain["steps"]):
            assert step["collectives_in_no_sync"] == 0  # the no_sync micro-batch communicated nothing
            # The synced micro-batch moves exactly what one plain step moves (TinyLM: naive 9 + flags = 10).
            assert [(c.label, c.nbytes) for c in step["collectives"]] == [
                (c.label, c.nbytes) for c in plain_step["collectives"]
            ]
    assert len(plain["steps"][0]["collectives"]) == {"naive": 10, "flat": 2, "overlap": 10, "bucketed": 6}[engine]


# TinyLM bucket assignment (reverse walk over 9 float32 tensors; bytes in the TinyLM docstring):
#   None:       one bucket [8..0] (3300 B).
#   1088 B cap: [head 512, fc2.b 32] = 544 (+fc2.w would be 1568) | [fc2.w 1024] (+fc1.b 1152) |
#               [fc1.b 128] (+fc1.w 1152) | [fc1.w 1024, norm.b 32, norm.w 32] = 1088, exactly the cap, kept |
#               [embed 512, scale 4] = 516  -> 5 buckets.
#   1 B cap:    every tensor exceeds the cap, so each sits alone -> 9 buckets (what OverlapDDP uses).
EXPECTED_BUCKETS = {
    "bucketed_one_bucket": [[8, 7, 6, 5, 4, 3, 2, 1, 0]],
    "bucketed": [[8, 7], [6], [5], [4, 3, 2], [1, 0]],
    "bucketed_per_param": [[i] for i in range(8, -1, -1)],
    "overlap": [[i] for i in range(8, -1, -1)],
}


@pytest.mark.parametrize("engine", list(EXPECTED_BUCKETS))
def test_bucket_assignment_of_tinylm(ranks, engine):
    for run in _runs(ranks, engine, "plain"):
        assert run["buckets"] == EXPECTED_BUCKETS[engine]
        for step in run["steps"]:
            assert len(_data(step["collectives"])) == len(EXPECTED_BUCKETS[engine])


# MixedDtypeMLP: fc1 (f32: 384 + 64 B), fc2 (f64: 2048 + 128 B), fc3 (f32: 64 + 4 B).
#   flat: one buffer per dtype -> 2 gradient calls.
#   bucketed (1088 B cap), reverse: [fc3.b, fc3.w] | dtype change | [fc2.b] (+fc2.w 2176 B) | [fc2.w] |
#     dtype change | [fc1.b, fc1.w] -> 4 buckets.
@pytest.mark.parametrize("engine, calls", [("flat", 2), ("bucketed", 4)])
def test_mixed_dtypes_split_buffers(ranks, engine, calls):
    for run in _runs(ranks, engine, "mixed_dtype"):
        for step in run["steps"]:
            assert len(_data(step["collectives"])) == calls
