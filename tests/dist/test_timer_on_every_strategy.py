"""The CommTimer records at the process group, so it measures every strategy the same way: ours, Lightning's ``ddp``
(with and without a comm hook of the user's), ``fsdp2``, and Lightning's ``ModelParallelStrategy`` with the user's
own ``fully_shard``; on a user's own Transformer LM, not our GPT, on 2 CPU ranks. Measuring changes nothing: the
weights after a fit with the timer are bitwise those of the same fit without it."""

from __future__ import annotations

import pytest

from lightning_ddp import catalogue
from lightning_ddp.metrics.accounting import METRIC_KEYS
from tests.support.dist_utils import run_on_ranks
from tests.support.user_models import MODEL_PARALLEL, STEPS, fits_with_and_without_the_timer

pytestmark = pytest.mark.multiprocess

STRATEGIES = [*catalogue.names(), MODEL_PARALLEL]
# Every key but the two this run cannot have: MFU (the user's module counts no FLOPs) and reserved memory (CUDA's).
EVERY_KEY = [key for key in METRIC_KEYS if key not in ("step/mfu", "memory/peak_reserved_MiB")]


@pytest.fixture(scope="module")
def fits() -> dict:
    first, _ = run_on_ranks(fits_with_and_without_the_timer, 2, STRATEGIES, "cpu", timeout=900)
    return first  # rank 0's: what its logger was handed


@pytest.mark.parametrize("name", STRATEGIES)
def test_the_timer_changes_no_weight(fits: dict, name: str) -> None:
    assert fits[name]["bitwise_equal"], name


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_key_is_a_number_under_every_strategy(fits: dict, name: str) -> None:
    logged = fits[name]["logged"]
    assert sorted(logged) == list(range(STEPS))  # every step measured, each logged at its own number
    for step, metrics in logged.items():
        missing = [key for key in EVERY_KEY if key not in metrics]
        assert not missing, (name, step, missing)
        assert all(isinstance(value, float) for value in metrics.values())
    last = logged[STEPS - 1]
    assert last["comm/calls"] >= 1 and last["comm/bytes"] > 0 and last["comm/busy_ms"] > 0, (name, last)
    assert last["comm/exposed_ms"] > 0 and 0 <= last["comm/overlap"] <= 1, (name, last)


def test_our_engines_issue_what_they_are_built_to_issue(fits: dict) -> None:
    # The user's model has 27 trainable tensors (2 encoder layers of 12, the embedding, the head's weight and bias).
    n = fits["naive_ddp"]["tensors"]
    assert n == 27
    expected = {"naive_ddp": n + 1,  # one all-reduce per tensor, and the gradient-presence flags
                "flat_ddp": 2,  # the flat buffer, and the flags
                "overlap_ddp": n,  # one per tensor; the flags only when a gradient is missing (never here)
                "bucketed_ddp": 1}  # the model's few KB in one 25 MiB bucket
    for name, calls in expected.items():
        assert fits[name]["logged"][STEPS - 1]["comm/calls"] == calls, name


def test_the_sharded_strategies_collectives_are_seen_where_torch_issues_them(fits: dict) -> None:
    # FSDP2's all-gathers (forward, and backward's re-gathers) and reduce-scatters, issued by torch itself
    for name in ("fsdp2", MODEL_PARALLEL):
        ops = {op for _, op in fits[name]["calls"]}
        assert {"all_gather", "reduce_scatter"} <= ops, (name, ops)
    assert {group for group, _ in fits["fsdp2"]["calls"]} == {"world"}
    # Lightning's mesh: its data-parallel dimension spans both ranks, so torch runs it on the world group
    assert {group for group, _ in fits[MODEL_PARALLEL]["calls"]} <= {"world", "data_parallel"}


def test_a_users_own_ddp_comm_hook_runs_and_its_bytes_are_measured(fits: dict) -> None:
    # The hook registered at on_train_start (the timer used to register one of its own first, and the run crashed).
    # fp16_compress_hook all-reduces the bucket in fp16: half the fp32 bucket's bytes.
    fp32 = fits["ddp"]["logged"][STEPS - 1]["comm/bytes"]
    fp16 = fits["ddp_fp16_hook"]["logged"][STEPS - 1]["comm/bytes"]
    assert fp16 == fp32 / 2


def test_a_short_script_run_with_the_defaults_gets_a_summary(fits: dict) -> None:
    # 30 steps under log_every_n_steps=50 measured only step 0 before; now every 30 // (5 + 10) = 2nd step: 15
    # measured, 10 of them after the 5 warm-up ones
    assert fits["short_run"] == {"every": 2, "measured": 15, "summarized": 10}
