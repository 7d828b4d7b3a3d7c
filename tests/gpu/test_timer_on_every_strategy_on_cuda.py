"""The CommTimer's recording at the process group on CUDA (``tests/dist/test_timer_on_every_strategy.py`` on CPU):
at NCCL world size 1, our engines, Lightning's ``ddp`` (with the user's own fp16 comm hook too, registered
at on_train_start) and ``fsdp2`` on the user's own model: every collective recorded, and the
weights bitwise equal with and without the timer."""

from __future__ import annotations

import pytest

from tests.support.dist_utils import run_on_ranks
from tests.support.user_models import STEPS, fits_with_and_without_the_timer

pytestmark = [pytest.mark.cuda, pytest.mark.multiprocess]

STRATEGIES = ["bucketed_ddp", "zero2_ddp", "fsdp2", "ddp"]
# At world size 1 no launch times are compared (no wait/transfer split, no straggler) and the module counts no FLOPs.
KEYS = ["step/time_ms", "comm/exposed_ms", "comm/share", "comm/busy_ms", "comm/overlap", "comm/calls", "comm/bytes",
        "comm/busbw_GBps", "memory/peak_MiB", "memory/peak_reserved_MiB", "step/tokens_per_s"]


@pytest.fixture(scope="module")
def fits() -> dict:
    (result,) = run_on_ranks(fits_with_and_without_the_timer, 1, STRATEGIES, "gpu", backend="nccl", timeout=600)
    return result


@pytest.mark.parametrize("name", STRATEGIES)
def test_the_timer_changes_no_weight_on_cuda(fits: dict, name: str) -> None:
    assert fits[name]["bitwise_equal"], name


@pytest.mark.parametrize("name", [*STRATEGIES, "ddp_fp16_hook"])
def test_every_collective_is_recorded_on_cuda(fits: dict, name: str) -> None:
    last = fits[name]["logged"][STEPS - 1]
    assert all(key in last for key in KEYS), (name, sorted(last))
    assert last["comm/calls"] >= 1 and last["comm/bytes"] > 0 and last["comm/clock_anomalies"] == 0, (name, last)
    assert {group for group, _ in fits[name]["calls"]} == {"world"}


def test_lightnings_ddp_comm_hook_runs_on_cuda_and_halves_the_bytes(fits: dict) -> None:
    assert fits["ddp_fp16_hook"]["logged"][STEPS - 1]["comm/bytes"] == fits["ddp"]["logged"][STEPS - 1]["comm/bytes"] / 2
