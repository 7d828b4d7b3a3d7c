"""Every gradient-sync engine on 2 gloo ranks trains exactly like one process on the full batch.

The machinery (models, cases, the spawned job and the checks every algorithm must pass) is in
``tests/support/equivalence.py``; this file runs it for every engine of ``lightning_ddp.catalogue`` and adds the
checks specific to the built-in engines (calls and bytes per step, bucket assignment).

One spawned job runs every (engine, case) pair on both ranks and, on rank 0, the single-process reference of
every case; the tests below only inspect what it returned. One job, not one per engine, because each spawned
rank pays interpreter start-up and imports; the price is that an exception or hang in one pair fails the
whole job, and the traceback names the engine and case.
"""

from __future__ import annotations

import pytest
import torch

from lightning_ddp import catalogue
from tests.support.dist_utils import run_on_ranks
from tests.support.equivalence import (
    BRANCH_SAMPLES,
    CASES,
    FLAGS,
    JOB_TIMEOUT_S,
    PER_RANK,
    WORLD_SIZE,
    BF16_TOL,
    check_grad_none_and_record,
    check_matches_single_process,
    check_ranks_agree_and_start_from_rank0,
    data_collectives,
    jobs_for,
    run_jobs,
    runs_of,
)

pytestmark = pytest.mark.multiprocess

ALGORITHM_NAMES = catalogue.names(engines_only=True)  # every engine of the catalogue, the built-in four included
BUILT_IN = ["naive_ddp", "flat_ddp", "overlap_ddp", "bucketed_ddp"]
JOBS = jobs_for(ALGORITHM_NAMES) + [("bucketed_one_bucket", "plain"), ("bucketed_per_param", "plain")]
JOB_IDS = [f"{engine}-{case}" for engine, case in JOBS]


# ---- the tests -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """Both ranks' results of every job in JOBS (one spawn for the whole module)."""
    return run_on_ranks(run_jobs, WORLD_SIZE, JOBS, timeout=JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def references(ranks) -> dict:
    return ranks[0]["references"]


_runs = runs_of
_data = data_collectives


@pytest.mark.parametrize("engine, case", JOBS, ids=JOB_IDS)
def test_matches_single_process_full_batch_weights_and_gradients(ranks, engine, case):
    check_matches_single_process(ranks, engine, case)


def test_every_registered_algorithm_is_in_the_matrix():
    assert set(BUILT_IN) <= set(ALGORITHM_NAMES)
    assert {engine for engine, _ in JOBS} >= set(ALGORITHM_NAMES)


def test_bf16_case_is_really_bf16(references):
    # Same seeds and data as "plain": only autocast differs, and it must show at the bf16 tolerance.
    plain, bf16 = references["plain"]["final"], references["bf16"]["final"]
    assert any(not torch.allclose(bf16[k], plain[k], **BF16_TOL) for k in plain)


@pytest.mark.parametrize("engine, case", JOBS, ids=JOB_IDS)
def test_ranks_end_bitwise_identical_from_rank0_weights(ranks, engine, case):
    check_ranks_agree_and_start_from_rank0(ranks, engine, case)


@pytest.mark.parametrize("engine, case", JOBS, ids=JOB_IDS)
def test_grad_none_where_single_process_has_none_and_record_is_complete(ranks, engine, case):
    check_grad_none_and_record(ranks, engine, case)


def _expected_data_traffic(engine: str, run: dict, step: dict) -> tuple[int, int]:
    """(calls, bytes) of the gradient collectives (flags excluded) in one step.

    naive:  one call per tensor that has a gradient on some rank; bytes = those tensors' bytes.
    flat:   one call per dtype among those tensors; same bytes.
    overlap, bucketed: every bucket is launched every step (zeros stand in for a missing gradient, since the
            launch order is fixed before anyone knows who has what); bytes = all trainable tensors, plus the
            last bucket's one-element missing-gradient sentinel (4 B: every TinyLM's last bucket is float32).
    """
    synced = [(n, b, d) for n, b, d in run["trainable"] if n not in step["grad_none"]]
    if engine == "naive_ddp":
        return len(synced), sum(b for _, b, _ in synced)
    if engine == "flat_ddp":
        return len({d for _, _, d in synced}), sum(b for _, b, _ in synced)
    return len(run["buckets"]), sum(b for _, b, _ in run["trainable"]) + 4


def _missing_on_some_rank(runs: list[dict], step: int) -> bool:
    """Whether some rank had no gradient for some trainable parameter before synchronising ``step``."""
    return any(set(r["steps"][step]["grad_none_before_sync"]) & {n for n, _, _ in r["trainable"]} for r in runs)


BUILT_IN_JOBS = [(engine, case) for engine, case in JOBS if engine in BUILT_IN]


@pytest.mark.parametrize("engine, case", BUILT_IN_JOBS, ids=[f"{e}-{c}" for e, c in BUILT_IN_JOBS])
def test_built_in_engines_move_the_expected_calls_and_bytes(ranks, engine, case):
    runs = _runs(ranks, engine, case)
    for run in runs:
        for number, step in enumerate(run["steps"]):
            collectives = step["collectives"]
            flags = [c for c in collectives if c.label == FLAGS]
            # The presence flags (one int32 per trainable tensor): naive and flat every step; the bucketed engines
            # only in a step where some rank had a missing gradient (their sentinel said so), then last.
            expected = engine in ("naive_ddp", "flat_ddp") or _missing_on_some_rank(runs, number)
            assert len(flags) == int(expected), (number, [c.label for c in collectives])
            assert all(c.nbytes == 4 * len(run["trainable"]) for c in flags)
            if flags and engine not in ("naive_ddp", "flat_ddp"):
                assert collectives[-1] is flags[0]
            calls, nbytes = _expected_data_traffic(engine, run, step)
            assert len(_data(collectives)) == calls
            assert sum(c.nbytes for c in _data(collectives)) == nbytes
            assert all(c.op == "all_reduce" for c in collectives)
            if engine == "naive_ddp":  # one call per tensor, in parameters() order, labelled by name
                names = [n for n, _, _ in run["trainable"] if n not in step["grad_none"]]
                assert [c.label for c in _data(collectives)] == names


# ---- case-specific checks ------------------------------------------------------------------------

# Tied TinyLM: head.weight *is* embed.weight, so parameters() lists 8 tensors (2788 B) and the flags
# all-reduce carries 8 int32 = 32 B. Every step naive and flat move 2788 + 32 = 2820 B; overlap and bucketed
# 2788 + the 4 B sentinel = 2792 B, and no flags (nothing is missing):
#   naive:    8 tensors + 1 flags                                                   = 9 calls
#   flat:     1 float32 buffer + 1 flags                                            = 2 calls
#   overlap:  8 one-tensor buckets                                                  = 8 calls
#   bucketed (1088 B cap), reverse walk over [scale, embed, norm.w, norm.b, fc1.w, fc1.b, fc2.w, fc2.b]:
#             [fc2.b 32, fc2.w 1024] = 1056 B (+fc1.b would be 1184) | [fc1.b 128] (+fc1.w 1152) |
#             [fc1.w 1024, norm.b 32, norm.w 32] = 1088 B (exactly the cap) | [embed 512, scale 4]
#             : 4 buckets                                                           = 4 calls
# Were the tied tensor sent twice, each count would grow by one (flat: bytes by 512).
TIED_CALLS = {"naive_ddp": 9, "flat_ddp": 2, "overlap_ddp": 8, "bucketed_ddp": 4}
TIED_BYTES = {"naive_ddp": 2820, "flat_ddp": 2820, "overlap_ddp": 2792, "bucketed_ddp": 2792}


@pytest.mark.parametrize("engine", BUILT_IN)
def test_tied_weight_communicated_once(ranks, engine):
    for run in _runs(ranks, engine, "tied"):
        assert run["still_tied"]
        assert [n for n, _, _ in run["trainable"]].count("embed.weight") == 1
        for step in run["steps"]:
            collectives = step["collectives"]
            assert len(collectives) == TIED_CALLS[engine]
            assert sum(c.nbytes for c in collectives) == TIED_BYTES[engine]
            labels = [c.label for c in collectives]
            assert "head.weight" not in labels
            if engine in ("naive_ddp", "overlap_ddp"):  # labelled per tensor: the tied one appears exactly once
                assert labels.count("embed.weight") == 1


# Frozen TinyLM (embed and norm frozen): trainable fc1.w 1024 + fc1.b 128 + fc2.w 1024 + fc2.b 32 + head 512 +
# scale 4 = 2724 B in 6 tensors, so 24 B of flags; every engine moves 2724 B of gradients per step.
FROZEN = ("embed.weight", "norm.weight", "norm.bias")


@pytest.mark.parametrize("engine", BUILT_IN)
def test_frozen_parameters_never_communicated_and_unchanged(ranks, engine):
    for run in _runs(ranks, engine, "frozen"):
        assert not any(n in FROZEN for n, _, _ in run["trainable"])
        for step in run["steps"]:
            # The bucketed engines' last bucket has one more float, the sentinel.
            sentinel = 0 if engine in ("naive_ddp", "flat_ddp") else 4
            assert sum(c.nbytes for c in _data(step["collectives"])) == 2724 + sentinel
            assert not any(name in c.label for c in step["collectives"] for name in FROZEN)
            assert all(name in step["grad_none"] for name in FROZEN)
        for name in FROZEN:  # not even weight decay: AdamW skips a parameter whose .grad is None
            assert torch.equal(run["final"][name], run["after_wrap"][name])


# TinyLM with `unused` (never called): 11 trainable tensors, 3300 B used + 288 B unused; 44 B of flags.
#   naive, flat: only the 9 used tensors (3300 B): naive 9 calls, flat 1.
#   overlap: all 11 one-tensor buckets (3588 B + the 4 B sentinel), zeros standing in for `unused`.
#   bucketed (1088 B cap), reverse: [head, fc2.b] 544 B | [fc2.w, unused.b] 1056 B | [unused.w, fc1.b] 384 B |
#     [fc1.w, norm.b, norm.w] 1088 B | [embed, scale] 516 B -> 5 buckets (3588 B), so the unused tensors sit in
#     buckets whose other members did get gradients.
UNUSED_CALLS = {"naive_ddp": 9, "flat_ddp": 1, "overlap_ddp": 11, "bucketed_ddp": 5}
UNUSED_BYTES = {"naive_ddp": 3300, "flat_ddp": 3300, "overlap_ddp": 3592, "bucketed_ddp": 3592}


@pytest.mark.parametrize("engine", BUILT_IN)
def test_parameter_unused_on_every_rank_keeps_grad_none(ranks, engine):
    for run in _runs(ranks, engine, "unused"):
        if engine == "bucketed_ddp":
            assert run["buckets"] == [[10, 9], [8, 7], [6, 5], [4, 3, 2], [1, 0]]
        for step in run["steps"]:
            assert {"unused.weight", "unused.bias"} <= set(step["grad_none"])
            assert len(_data(step["collectives"])) == UNUSED_CALLS[engine]
            assert sum(c.nbytes for c in _data(step["collectives"])) == UNUSED_BYTES[engine]
        for name in ("unused.weight", "unused.bias"):
            assert torch.equal(run["final"][name], run["after_wrap"][name])


@pytest.mark.parametrize("engine", BUILT_IN)
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


@pytest.mark.parametrize("engine", BUILT_IN)
def test_accumulation_communicates_once_per_optimizer_step(ranks, engine):
    plain = _runs(ranks, engine, "plain")[0]
    for run in _runs(ranks, engine, "accumulation"):
        for step, plain_step in zip(run["steps"], plain["steps"]):
            assert step["collectives_in_no_sync"] == 0  # the no_sync micro-batch communicated nothing
            # The synced micro-batch moves exactly what one plain step moves (TinyLM: naive 9 + flags = 10; the
            # bucketed engines need no flags: nothing is missing).
            assert [(c.label, c.nbytes) for c in step["collectives"]] == [
                (c.label, c.nbytes) for c in plain_step["collectives"]
            ]
    calls = {"naive_ddp": 10, "flat_ddp": 2, "overlap_ddp": 9, "bucketed_ddp": 5}
    assert len(plain["steps"][0]["collectives"]) == calls[engine]


# TinyLM bucket assignment (reverse walk over 9 float32 tensors; bytes in the TinyLM docstring):
#   None:       one bucket [8..0] (3300 B).
#   1088 B cap: [head 512, fc2.b 32] = 544 (+fc2.w would be 1568) | [fc2.w 1024] (+fc1.b 1152) |
#               [fc1.b 128] (+fc1.w 1152) | [fc1.w 1024, norm.b 32, norm.w 32] = 1088, exactly the cap, kept |
#               [embed 512, scale 4] = 516  -> 5 buckets.
#   1 B cap:    every tensor exceeds the cap, so each sits alone -> 9 buckets (what OverlapDDP uses).
EXPECTED_BUCKETS = {
    "bucketed_one_bucket": [[8, 7, 6, 5, 4, 3, 2, 1, 0]],
    "bucketed_ddp": [[8, 7], [6], [5], [4, 3, 2], [1, 0]],
    "bucketed_per_param": [[i] for i in range(8, -1, -1)],
    "overlap_ddp": [[i] for i in range(8, -1, -1)],
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
@pytest.mark.parametrize("engine, calls", [("flat_ddp", 2), ("bucketed_ddp", 4)])
def test_mixed_dtypes_split_buffers(ranks, engine, calls):
    for run in _runs(ranks, engine, "mixed_dtype"):
        for step in run["steps"]:
            assert len(_data(step["collectives"])) == calls
