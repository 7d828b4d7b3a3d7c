"""PowerSGD (``lightning_ddp.sync.bucketed_powersgd``): its arithmetic, its reduce step, and its engine on 2 ranks.

The 2-rank checks share one spawn (``ranks`` fixture, ~30 s on 2 cores):

- **full rank is exact**: with ``rank`` >= every matrix's smaller side and ``min_compression_rate=0`` every matrix
  is compressed from the first step and yet ``P P^T`` is the identity on its column space, so the engine must match
  single-process training at the *fp32* tolerances of the equivalence matrix, in every case of it (tied, frozen,
  unused and data-dependent parameters, accumulation, bf16 autocast, mixed dtypes, gradients kept as views);
- **rank 1 is lossy, and error feedback loses nothing**: the matrices arrive as rank-1 matrices (so not as the
  average), and over the steps (sum of what arrived) + (mean over ranks of the last error) == sum of the averages;
- **rank 1 keeps the bookkeeping**: missing and frozen gradients neither hang nor get a ``.grad`` no rank had;
- **resume is bitwise**: the engine's ``state_dict()`` restored into a fresh engine continues exactly.

The catalogue's ``bucketed_powersgd_ddp`` also runs through the equivalence matrix
(``tests/dist/test_sync_equivalence.py``) at its defaults; its default ``start_iter=10`` outlasts the matrix's 3-4 steps, so there it averages exactly (and is
held to the bf16 tolerances of a lossy algorithm). Compression itself is covered here.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_ddp.sync import BucketedDDP, Recorder
from lightning_ddp.sync.bucketed_powersgd import (
    BucketedPowerSGDDDP,
    PowerSGDReduce,
    check_powersgd_options,
    matrix_shape,
    orthogonalize,
    plan_bucket,
    should_compress,
)
from lightning_ddp.sync.comm import Communicator
from lightning_ddp.sync.bucketed import AllReduceMean, BucketLayout
from lightning_ddp import catalogue
from tests.support.dist_utils import run_on_ranks
from tests.support.tolerance import assert_within, reordered_sum_bound, unit_roundoff
from tests.support.equivalence import (
    CASES,
    JOB_TIMEOUT_S,
    MODEL_SEED,
    PER_RANK,
    SEVERAL_BUCKETS_CAP,
    MiB,
    TinyLM,
    _lm_loss,
    _token_batch,
    check_grad_none_and_record,
    check_matches_single_process,
    check_ranks_agree_and_start_from_rank0,
    jobs_for,
    run_jobs,
    runs_of,
)

# TinyLM's matrices (all compressed at min_compression_rate=0) and the rest (averaged exactly).
TINY_MATRICES = {"embed.weight", "fc1.weight", "fc2.weight", "head.weight"}
TINY_REST = {"logit_scale", "norm.weight", "norm.bias", "fc1.bias", "fc2.bias"}


# ---- the arithmetic ----------------------------------------------------------------------------------------


def test_matrix_shape_keeps_the_first_dim_and_flattens_the_rest() -> None:
    assert matrix_shape(torch.Size([5, 7])) == (5, 7)
    assert matrix_shape((4, 2, 3)) == (4, 6)  # a conv weight (out, in, k): out x (in * k)
    assert matrix_shape((8,)) is None and matrix_shape(()) is None  # vectors and scalars are never compressed


@pytest.mark.parametrize("rows, cols", [(16, 16), (32, 8), (768, 3072), (1, 100), (50257, 768)])
@pytest.mark.parametrize("rank", [1, 4, 16])
@pytest.mark.parametrize("rate", [0.0, 0.5, 2.0, 8.0])
def test_the_compress_decision_is_torchs(rows, cols, rank, rate) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    k = min(rows, cols, rank)
    assert should_compress(rows, cols, k, rate) == _should_compress(rows, cols, k, rate)[0]


def test_the_compress_decision_at_its_boundary() -> None:
    # 16x16 at rank 4: 256 elements against (16 + 16) * 4 = 128, exactly 2x: "more than 2x" (torch's strict <) fails.
    assert not should_compress(16, 16, 4, 2.0)
    assert should_compress(16, 16, 4, 1.99)
    # At full rank k = min(rows, cols) the factors are bigger than the matrix ((n + m) k > n m): 16x8 at k = 8 is
    # 128 elements against 192, a "rate" of 2/3, so 0.5 compresses it, 1.0 does not (the full-rank tests use 0).
    assert should_compress(16, 8, 8, 0.5) and not should_compress(16, 8, 8, 1.0) and should_compress(16, 8, 8, 0.0)


def _qr_bound(q: torch.Tensor) -> float:
    """Householder QR of an m x k matrix gives columns orthonormal to within the rounding of ~m k operations
    (Higham, Accuracy and Stability, Theorem 19.4), here as the probabilistic bound of a sum of m k terms of size 1."""
    return reordered_sum_bound(q.numel(), 1.0)


def _orthonormal(q: torch.Tensor) -> bool:
    return bool(((q.T @ q - torch.eye(q.shape[1])).abs() <= _qr_bound(q)).all())


def _spans(q: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether span(q) holds every column of p: projecting onto it changes nothing, to the basis's rounding (above)
    and that of the two products (sums of m and k terms) on values up to max|p|."""
    bound = (_qr_bound(q) + reordered_sum_bound(q.shape[0] + q.shape[1], 1.0)) * p.abs().max().item()
    return bool(((q @ (q.T @ p) - p).abs() <= bound).all())


def test_orthogonalize_gives_an_orthonormal_basis_of_the_columns() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.randn(50, 4, generator=g)
    q = orthogonalize(p)
    assert q.shape == (50, 4) and _orthonormal(q) and _spans(q, p)


def test_orthogonalize_stays_orthonormal_for_dependent_and_zero_columns() -> None:
    # The case that broke Gram-Schmidt (measured in the module docstring): a rank-1 gradient, every row the same
    # (the head of a model whose loss is a plain sum), times a random Q at k = 8. Its 8 columns span one direction;
    # Gram-Schmidt normalises the rounding leftovers of columns 2..8 into further copies of that direction, and
    # P P^T M came back 1.85x too large. A basis must be orthonormal AND hold the one direction.
    g = torch.Generator().manual_seed(0)
    m = torch.randn(1, 8, generator=g).expand(16, 8)  # (16, 8), rank 1
    p = m @ torch.randn(8, 8, generator=g)  # (16, 8), rank 1
    q = orthogonalize(p)
    assert _orthonormal(q) and _spans(q, p)
    assert _spans(q, m)  # the approximation of m is m, not 1.85 m
    zero = orthogonalize(torch.zeros(6, 3))  # a gradient that vanished: no NaN, still a basis
    assert torch.isfinite(zero).all() and _orthonormal(zero)


def test_plan_splits_a_bucket_into_matrices_and_the_rest() -> None:
    # A bucket of 4 gradients plus the sentinel (the last bucket's extra element), at rank 2, rate 2:
    #   a (16, 8)  at 0:   128 elements vs (16 + 8) * 2 = 48; 128 > 2 * 48 = 96   -> compressed (k = 2)
    #   b (8,)     at 128: a vector                                                -> as is, [128, 136)
    #   c (32, 8)  at 136: 256 vs (32 + 8) * 2 = 80; 256 > 160                     -> compressed (k = 2)
    #   d (4, 4)   at 392: 16 vs (4 + 4) * 2 = 16; 16 > 32 fails                   -> as is, [392, 408)
    #   sentinel   at 408: in no tensor                                            -> as is, so [392, 409)
    layout = BucketLayout(4, 5, ("a", "b", "c", "d"), tuple(map(torch.Size, [(16, 8), (8,), (32, 8), (4, 4)])),
                          (0, 128, 136, 392))
    plan = plan_bucket(layout, 409, rank=2, min_compression_rate=2.0)
    assert [(m.name, m.start, m.rows, m.cols, m.rank) for m in plan.matrices] == [("a", 0, 16, 8, 2), ("c", 136, 32, 8, 2)]
    assert plan.uncompressed == ((128, 136), (392, 409))
    # Sent per compressed step: 8 + 17 as they are, P = 16*2 + 32*2 = 96, Q = 8*2 + 8*2 = 32 -> 153 of 409 elements.
    assert (plan.uncompressed_numel, plan.p_numel, plan.q_numel, plan.sent_numel) == (25, 96, 32, 153)


@pytest.mark.parametrize(
    "kwargs, error, fix",
    [
        (dict(rank=0), ValueError, "rank=4"),
        (dict(rank=2.0), TypeError, "rank=4"),
        (dict(rank=True), TypeError, "rank=4"),
        (dict(start_iter=-1), ValueError, "start_iter=0"),
        (dict(start_iter=1.5), TypeError, "start_iter=10"),
        (dict(min_compression_rate=-1.0), ValueError, "set 0"),
        (dict(min_compression_rate=math.nan), ValueError, "set 0"),
        (dict(min_compression_rate="2"), TypeError, "min_compression_rate=2.0"),
        (dict(seed=None), TypeError, "seed=0"),
    ],
)
def test_bad_options_name_the_fix_before_any_collective(kwargs, error, fix) -> None:
    options = dict(rank=4, start_iter=10, min_compression_rate=2.0, seed=0) | kwargs
    with pytest.raises(error, match=fix):
        check_powersgd_options(**options)
    # The engine checks first: no process group is needed to be told (it would otherwise ask for one).
    assert not dist.is_initialized()
    with pytest.raises(error, match=fix):
        BucketedPowerSGDDDP(nn.Linear(2, 2), **kwargs)


# ---- the reduce step and the engine on one rank -------------------------------------------------------------


class _RecordingMean(AllReduceMean):
    def __init__(self) -> None:
        self.layouts: list[BucketLayout] = []

    def launch(self, comm, bucket, label, layout=None):
        self.layouts.append(layout)
        return super().launch(comm, bucket, label, layout)


def test_the_bucketed_engine_tells_the_reduce_step_each_buckets_layout(world_of_one) -> None:
    # TinyLM at the 1088 B cap has the buckets [[8, 7], [6], [5], [4, 3, 2], [1, 0]] (tests/dist/test_sync_equivalence.py).
    # Offsets are cumulative element counts: head 16x8 = 128 before fc2.bias; fc1.weight 32x8 = 256, then norm.bias 8.
    reduce = _RecordingMean()
    engine = BucketedDDP(TinyLM(), bucket_size_mb=SEVERAL_BUCKETS_CAP / MiB, reduce=reduce)
    engine.on_train_batch_start()
    tokens, targets = _token_batch(0)
    _lm_loss(engine(tokens), targets).backward()
    engine.finish_gradient_synchronization()
    assert [(l.index, l.count) for l in reduce.layouts] == [(b, 5) for b in range(5)]
    assert [(l.names, l.offsets) for l in reduce.layouts] == [
        (("head.weight", "fc2.bias"), (0, 128)),
        (("fc2.weight",), (0,)),
        (("fc1.bias",), (0,)),
        (("fc1.weight", "norm.bias", "norm.weight"), (0, 256, 264)),
        (("embed.weight", "logit_scale"), (0, 128)),
    ]
    assert reduce.layouts[0].shapes == (torch.Size([16, 8]), torch.Size([8]))


def _backward(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """``loss.backward()``, returning this rank's own gradients. Not read from ``.grad`` afterwards: a one-tensor
    bucket is reduced in place in ``.grad`` as soon as backward produces it."""
    names, params = zip(*model.named_parameters())
    local = dict(zip(names, torch.autograd.grad(loss, params, retain_graph=True)))  # fires no engine hook
    loss.backward()
    return local


def _step(engine, model, step: int) -> dict[str, torch.Tensor]:
    """One step on the whole batch of ``step``; returns the local gradients (before synchronisation)."""
    model.zero_grad()
    engine.on_train_batch_start()
    tokens, targets = _token_batch(step)
    local = _backward(model, _lm_loss(engine(tokens), targets))
    engine.finish_gradient_synchronization()
    return local


def test_warm_up_averages_exactly_and_counts_steps_not_buckets(world_of_one) -> None:
    # One rank: the average is the local gradient. start_iter=2: steps 0 and 1 are exact (bitwise: dividing by 1),
    # step 2 is compressed to rank 1. The counter moves once per step although each step reduces 5 buckets.
    model = TinyLM()
    engine = BucketedPowerSGDDDP(model, SEVERAL_BUCKETS_CAP / MiB, rank=1, start_iter=2, min_compression_rate=0)
    engine.recorder = recorder = Recorder()
    for step in range(3):
        recorder.open_step(step)
        local = _step(engine, model, step)
        labels = [c.label for c in recorder.finish_step().collectives]
        assert engine.reduce.iteration == step + 1
        if step < 2:
            assert len(labels) == 5 and not any("PowerSGD" in label for label in labels)
            assert all(torch.equal(p.grad, local[n]) for n, p in model.named_parameters())
    # Step 2, per bucket: [head, fc2.b] -> uncompressed, P, Q | [fc2.w] -> P, Q | [fc1.b] -> as is |
    # [fc1.w, norm.b, norm.w] -> uncompressed, P, Q | [embed, scale + sentinel] -> uncompressed, P, Q:
    # 3 + 2 + 1 + 3 + 3 = 12 collectives, 4 of them Q rounds.
    assert len(labels) == 12 and sum("[PowerSGD Q]" in label for label in labels) == 4
    for name, param in model.named_parameters():
        if name in TINY_MATRICES:  # compressed to rank 1: no longer the (full-rank) gradient
            assert torch.linalg.matrix_rank(param.grad) == 1 < torch.linalg.matrix_rank(local[name]), name
        else:
            assert torch.equal(param.grad, local[name]), name


def test_a_reduce_step_without_a_layout_treats_the_bucket_as_one_tensor(world_of_one) -> None:
    # What a caller outside an engine does (the compression bench): launch(comm, tensor, label).
    comm = Communicator()
    g = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    exact = PowerSGDReduce(rank=6, start_iter=0, min_compression_rate=0)  # rank >= min(8, 6): the identity
    # P = M Q, orthonormalised, then P (Q^T-weighted) back: QR's rounding on 8 x 6 and two products of 6 terms.
    identity_bound = (reordered_sum_bound(8 * 6, 1.0) + 2 * reordered_sum_bound(6, 1.0)) * g.abs().max().item()
    assert bool(((exact.launch(comm, g.clone(), "probe").wait() - g).abs() <= identity_bound).all())
    lossy = PowerSGDReduce(rank=1, start_iter=0, min_compression_rate=0)
    approx = lossy.launch(comm, g.clone(), "probe").wait()
    assert torch.linalg.matrix_rank(approx) == 1
    assert torch.equal(lossy.errors["probe"], g - approx)  # E = M - what was written (M = G at first): the same op


def test_the_state_is_checked_when_loaded(world_of_one) -> None:
    reduce = PowerSGDReduce(rank=2)
    state = PowerSGDReduce(rank=4).state_dict()
    with pytest.raises(ValueError, match="rank=4.*construct it with the saved settings"):
        reduce.load_state_dict(state)
    with pytest.raises(ValueError, match="not a PowerSGD state"):
        reduce.load_state_dict({"iteration": 3})
    # A state whose Q does not fit (saved for another model) is refused when its bucket first launches.
    model = nn.Linear(8, 16)
    engine = BucketedPowerSGDDDP(model, rank=2, start_iter=0, min_compression_rate=0)
    engine.reduce.load_state_dict(engine.reduce.state_dict() | {"qs": {"weight": torch.zeros(5, 2)}})
    engine.on_train_batch_start()
    with pytest.raises(ValueError, match="Q of shape \\(5, 2\\) for 'weight'.*needs \\(8, 2\\)"):
        model(torch.randn(3, 8)).sum().backward()  # the bucket completes, and launches, in backward


# ---- on 2 ranks --------------------------------------------------------------------------------------------


def _full_rank(module, *, bucket_size_mb=25.0, process_group=None) -> BucketedPowerSGDDDP:
    # rank 64 >= every matrix's smaller side in CASES (at most 16); rate 0: every matrix compressed; from step 0.
    return BucketedPowerSGDDDP(module, bucket_size_mb, process_group, rank=64, start_iter=0, min_compression_rate=0)


def _rank_one(module, *, bucket_size_mb=25.0, process_group=None) -> BucketedPowerSGDDDP:
    return BucketedPowerSGDDDP(module, bucket_size_mb, process_group, rank=1, start_iter=0, min_compression_rate=0)


FULL_RANK = catalogue.Entry("powersgd_full_rank", "PowerSGD at full rank (a test's)", engine=_full_rank,
                            has_bucket_size=True, overlaps_backward=True, exact=True)  # exact: held to fp32 tolerances
RANK_ONE = catalogue.Entry("powersgd_rank_one", "PowerSGD at rank 1 (a test's)", engine=_rank_one,
                           has_bucket_size=True, overlaps_backward=True, exact=False)
RANK_ONE_CASES = ["plain", "frozen", "unused", "data_dependent"]
JOBS = jobs_for([FULL_RANK.name]) + [(RANK_ONE.name, case) for case in RANK_ONE_CASES]
FEEDBACK_STEPS = 4


def _local_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets = _token_batch(step)
    local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return tokens[local], targets[local]


def _train(engine, model, optimizer, rank: int, steps) -> list[tuple[dict, dict]]:
    """Train on this rank's share of each step's batch; (local, synchronised) gradients per step."""
    grads = []
    for step in steps:
        engine.on_train_batch_start()
        tokens, targets = _local_batch(rank, step)
        local = _backward(model, _lm_loss(engine(tokens), targets))
        engine.finish_gradient_synchronization()
        grads.append((local, {n: p.grad.clone() for n, p in model.named_parameters()}))
        optimizer.step()
        optimizer.zero_grad()
    return grads


def _error_feedback_run(rank: int) -> dict:
    torch.manual_seed(MODEL_SEED + rank)
    model = TinyLM()
    engine = _rank_one(model, bucket_size_mb=SEVERAL_BUCKETS_CAP / MiB)
    grads = _train(engine, model, torch.optim.SGD(model.parameters(), lr=0.1), rank, range(FEEDBACK_STEPS))
    return dict(grads=grads, errors=engine.reduce.state_dict()["errors"])


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _resume_run(rank: int) -> dict:
    """3 steps (2 exact, 1 compressed), save, 3 more; then a fresh engine from the saved state, the same 3 steps."""

    def fresh(seed: int):
        torch.manual_seed(seed)
        model = TinyLM()
        engine = BucketedPowerSGDDDP(model, SEVERAL_BUCKETS_CAP / MiB, rank=2, start_iter=2, min_compression_rate=0)
        return model, engine, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, engine, optimizer = fresh(MODEL_SEED + rank)
    _train(engine, model, optimizer, rank, range(3))
    saved, saved_optimizer = copy.deepcopy(engine.state_dict()), copy.deepcopy(optimizer.state_dict())
    _train(engine, model, optimizer, rank, range(3, 6))

    resumed_model, resumed, resumed_optimizer = fresh(MODEL_SEED + 7 + rank)  # other weights until loaded
    resumed.load_state_dict(saved)
    resumed_optimizer.load_state_dict(saved_optimizer)
    _train(resumed, resumed_model, resumed_optimizer, rank, range(3, 6))

    # The control: weights and optimizer restored, PowerSGD's state not (no error, Q drawn afresh, counter at 0).
    control_model, control, control_optimizer = fresh(MODEL_SEED + 7 + rank)
    control_model.load_state_dict({k.removeprefix("module."): v for k, v in saved.items() if k != "_extra_state"})
    control_optimizer.load_state_dict(saved_optimizer)
    _train(control, control_model, control_optimizer, rank, range(3, 6))
    return dict(continued=_weights(model), resumed=_weights(resumed_model), control=_weights(control_model),
                saved=saved["_extra_state"])


def _run_powersgd_checks(rank: int, world_size: int) -> dict:
    catalogue.register(FULL_RANK)  # in this spawned rank: the test's algorithms, then the equivalence matrix
    catalogue.register(RANK_ONE)
    return dict(matrix=run_jobs(rank, world_size, JOBS), feedback=_error_feedback_run(rank), resume=_resume_run(rank))


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_ranks(_run_powersgd_checks, 2, timeout=JOB_TIMEOUT_S)


@pytest.fixture
def registered():
    """The test's algorithms registered in this process too (the equivalence checks read their tolerances)."""
    for algorithm in (FULL_RANK, RANK_ONE):
        catalogue.register(algorithm, replace=True)
    yield
    for algorithm in (FULL_RANK, RANK_ONE):
        catalogue.STRATEGIES.pop(algorithm.name, None)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_full_rank_powersgd_matches_single_process_at_fp32(ranks, registered, case) -> None:
    matrix = [r["matrix"] for r in ranks]
    check_matches_single_process(matrix, FULL_RANK.name, case)
    check_ranks_agree_and_start_from_rank0(matrix, FULL_RANK.name, case)
    check_grad_none_and_record(matrix, FULL_RANK.name, case)
    # ... and every step really compressed (a P and a Q round per bucket holding a matrix): not plain averaging.
    for run in runs_of(matrix, FULL_RANK.name, case):
        for step in run["steps"]:
            labels = [c.label for c in step["collectives"]]
            assert any(label.endswith("[PowerSGD P]") for label in labels), labels
            assert sum(label.endswith("[PowerSGD P]") for label in labels) == sum(
                label.endswith("[PowerSGD Q]") for label in labels)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", RANK_ONE_CASES)
def test_rank_one_keeps_missing_gradients_and_the_ranks_identical(ranks, registered, case) -> None:
    # No hang (the spawn returned), .grad None exactly where one process has none, ranks bitwise equal.
    matrix = [r["matrix"] for r in ranks]
    check_ranks_agree_and_start_from_rank0(matrix, RANK_ONE.name, case)
    check_grad_none_and_record(matrix, RANK_ONE.name, case)


@pytest.mark.multiprocess
def test_rank_one_is_not_the_average_and_error_feedback_loses_nothing(ranks) -> None:
    first, second = (r["feedback"] for r in ranks)
    assert set(first["errors"]) == TINY_MATRICES  # exactly the matrices were compressed
    applied = {n: torch.zeros_like(g) for n, g in first["grads"][0][1].items()}
    averaged = {n: torch.zeros_like(g) for n, g in applied.items()}
    for (local0, synced0), (local1, synced1) in zip(first["grads"], second["grads"]):
        for name in applied:
            assert torch.equal(synced0[name], synced1[name]), name  # the ranks agree bitwise
            average = (local0[name] + local1[name]) / 2
            # Two terms summed in either order, halved (exact): the rounding of one addition.
            two_terms = reordered_sum_bound(2, 1.0) * (local0[name].abs() + local1[name].abs()) / 2
            if name in TINY_MATRICES:
                # Rank 1 arrived, not the average (of rank 8 here): the test fails if compression did nothing.
                assert torch.linalg.matrix_rank(synced0[name]) == 1 < torch.linalg.matrix_rank(average), name
                assert bool(((synced0[name] - average).abs() > two_terms).any()), name
            else:  # the rest is averaged exactly
                assert_within({name: synced0[name]}, {name: average}, {name: two_terms}, "averaged")
            applied[name] += synced0[name]
            averaged[name] += average
    # Error feedback: E starts at 0, so sum(applied) + mean_ranks(E_last) == sum(averages), up to rounding: per step
    # and rank M = G + E and E' = M - PQ^T (2 roundings), the ranks' sum of PQ^T and the running sums here (3 more),
    # each at most u times a value no larger than S = |averaged| + |applied| + |carried|: 4 steps x 2 ranks x 5.
    for name in TINY_MATRICES:
        carried = (first["errors"][name] + second["errors"][name]) / 2
        missing = (averaged[name] - applied[name]).abs().max().item()
        assert missing > 1e-3, name  # something really was left out and carried ...
        scale = (averaged[name].abs() + applied[name].abs() + carried.abs()).max().item()
        bound = 4 * 2 * 5 * unit_roundoff(torch.float32) * scale
        assert_within({name: applied[name] + carried}, {name: averaged[name]}, {name: bound}, "error feedback")


@pytest.mark.multiprocess
def test_resuming_from_the_state_dict_is_bitwise(ranks) -> None:
    for rank in ranks:
        run = rank["resume"]
        assert run["saved"]["iteration"] == 3 and set(run["saved"]["errors"]) == TINY_MATRICES
        for name, value in run["continued"].items():
            assert torch.equal(run["resumed"][name], value), name
        # Without PowerSGD's state the same weights and optimizer go elsewhere: the state is what made it exact.
        assert any(not torch.equal(run["control"][name], value) for name, value in run["continued"].items())
    first, second = ranks[0]["resume"], ranks[1]["resume"]
    assert any(not torch.equal(first["saved"]["errors"][n], second["saved"]["errors"][n]) for n in TINY_MATRICES)


def test_the_registered_algorithm_is_lossy_and_bucketed() -> None:
    algorithm = catalogue.get("bucketed_powersgd_ddp")
    assert (algorithm.has_bucket_size, algorithm.overlaps_backward, algorithm.exact) == (True, True, False)
    assert algorithm.engine_factory() is BucketedPowerSGDDDP and algorithm.is_engine
