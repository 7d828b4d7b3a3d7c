"""The GPU tier's equivalence logic on CPU: the same jobs and checks as ``tests/gpu``, on gloo CPU layouts.

``tests/gpu`` cannot run here; these runs make sure what it runs is right: world size 1 (the NCCL layout's shape),
the ZeRO-1 and ZeRO-2 variants of the matrix on 1 and 2 ranks, fsdp2's gradients and weights, and the device
plumbing (models and batches moved, results brought back to the CPU). The engines at 2 ranks are
``test_sync_equivalence``'s.
"""

from __future__ import annotations

import pytest
import torch

from lightning_ddp import catalogue
from tests.support.device_matrix import CPU_LAYOUTS, CUDA_LAYOUTS, all_jobs, check_job, run_layout
from tests.support.dist_utils import run_on_ranks
from tests.support.fsdp2_on_device import check_fsdp2_matches_one_process, fsdp2_job
from tests.support.equivalence import CASES, VARIANTS, ZERO1_CASES, ZERO1_VARIANTS, ZERO2_VARIANTS, jobs_for

pytestmark = pytest.mark.multiprocess

ONE_RANK, TWO_RANKS = CPU_LAYOUTS
# At world size 1: every engine on fp32 and bf16 (the two precisions the GPU tier checks), ZeRO-1 and ZeRO-2 on
# plain; at 2: ZeRO-1 on its cases and ZeRO-2 on every case of the matrix.
ENGINES = catalogue.names(engines_only=True)
ONE_RANK_JOBS = ([(e, c) for e in ENGINES for c in ("plain", "bf16")] + jobs_for(list(ZERO1_VARIANTS))
                 + [(e, "plain") for e in ZERO2_VARIANTS])
TWO_RANK_JOBS = jobs_for(list(ZERO1_VARIANTS)) + jobs_for(list(ZERO2_VARIANTS))


@pytest.fixture(scope="module")
def one_rank() -> list[dict]:
    return run_layout(ONE_RANK, ONE_RANK_JOBS)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_layout(TWO_RANKS, TWO_RANK_JOBS)


@pytest.mark.parametrize("engine, case", ONE_RANK_JOBS, ids=[f"{e}-{c}" for e, c in ONE_RANK_JOBS])
def test_one_rank_matches_single_process(one_rank, engine, case) -> None:
    check_job(one_rank, engine, case)


@pytest.mark.parametrize("engine, case", TWO_RANK_JOBS, ids=[f"{e}-{c}" for e, c in TWO_RANK_JOBS])
def test_zero_variants_on_two_ranks_match_single_process(two_ranks, engine, case) -> None:
    check_job(two_ranks, engine, case)


def test_results_come_back_on_the_cpu_from_the_layout_asked_for(one_rank, two_ranks) -> None:
    assert [r["world_size"] for r in one_rank] == [1] and [r["world_size"] for r in two_ranks] == [2, 2]
    run = one_rank[0]["runs"]["bucketed_ddp", "plain"]
    assert all(t.device.type == "cpu" for t in run["final"].values())  # the parent needs no GPU to read them


def test_zero1_reduce_scatter_compares_only_the_gradients_each_rank_owns(two_ranks) -> None:
    # Each owner holds the average of its own parameters' gradients after step(); together the two ranks cover
    # TinyLM's 9 tensors once: the owners split them, so neither rank alone holds all 9.
    owned = [set(r["runs"]["zero1_reduce_scatter_native", "plain"]["steps"][0]["grads"]) for r in two_ranks]
    assert owned[0].isdisjoint(owned[1]) and len(owned[0] | owned[1]) == 9 and all(owned)


def test_a_wrong_gradient_fails_the_check(one_rank) -> None:
    # The check must see a bug: halve one synchronised gradient (a missing rank's contribution) and it fails.
    ranks = [{**one_rank[0], "runs": dict(one_rank[0]["runs"])}]
    run = ranks[0]["runs"]["naive_ddp", "plain"] = {**one_rank[0]["runs"]["naive_ddp", "plain"]}
    run["steps"] = [{**step, "grads": {k: v / 2 for k, v in step["grads"].items()}} for step in run["steps"]]
    with pytest.raises(AssertionError, match="full-batch gradient"):
        check_job(ranks, "naive_ddp", "plain")


def test_zero2_keeps_only_owned_gradients_and_native_sends_one_reduce_scatter(two_ranks) -> None:
    # After backward each rank holds only its own averaged gradients: together the two cover TinyLM's 9 tensors once.
    runs = [r["runs"]["zero2_native_one_bucket", "plain"] for r in two_ranks]
    held = [set(run["steps"][0]["grads"]) for run in runs]
    assert held[0].isdisjoint(held[1]) and len(held[0] | held[1]) == 9 and all(held)
    # One bucket whose owner segments are nearly equal: one reduce-scatter, then one all-gather of the parameters.
    assert [c.op for c in runs[0]["steps"][0]["collectives"]] == ["reduce_scatter", "all_gather"]


def test_the_gpu_tier_runs_every_engine_case_and_zero1_variant() -> None:
    jobs = all_jobs()
    assert {(e, c) for e in ZERO2_VARIANTS for c in CASES} <= set(jobs)
    assert {(e, c) for e in ENGINES for c in CASES} <= set(jobs)
    assert {(e, "plain") for e in VARIANTS} <= set(jobs)
    assert {(e, c) for e in ZERO1_VARIANTS for c in ZERO1_CASES} <= set(jobs)
    assert [(layout.world_size, layout.backend, layout.device) for layout in CUDA_LAYOUTS] == [
        (1, "nccl", "cuda"), (2, "gloo", "cuda")]
    assert torch.device(CUDA_LAYOUTS[0].device).type == "cuda"


@pytest.mark.parametrize("layout", CPU_LAYOUTS, ids=lambda l: l.name)
def test_fsdp2_gradients_after_the_first_step_and_weights_match_one_process(layout) -> None:
    # The GPU tier's fsdp2 check (tests/gpu/test_fsdp2_on_cuda.py) on CPU: the same job and comparison.
    ranks = run_on_ranks(fsdp2_job, layout.world_size, layout.device, backend=layout.backend)
    assert [r["world_size"] for r in ranks] == [layout.world_size] * layout.world_size
    check_fsdp2_matches_one_process(ranks)


def test_the_fsdp2_check_catches_a_sum_instead_of_an_average() -> None:
    # What the check is for: gradients N times too large (gloo summing where FSDP2 asked for an average) fail it,
    # although AdamW's first update, lr x sign(g), would be the same.
    grads = {"w": torch.tensor([0.5, -1.0])}
    reference = {"first_grads": grads, "history": [grads], "weights": {"w": torch.tensor([1.0, 2.0])}}
    summed = {"first_grads": {"w": torch.tensor([1.0, -2.0])}, "weights": {"w": torch.tensor([1.0, 2.0])}}
    with pytest.raises(AssertionError, match=r"step 0 gradients \(norm ratios \{'w': '2.000'\}\): w\[1\] differs by 1,"):
        check_fsdp2_matches_one_process([{**summed, "reference": reference}])
