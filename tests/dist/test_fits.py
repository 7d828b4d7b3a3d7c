"""The GPU tier's fit helpers and checks on CPU: the same launch paths and per-step checks as ``tests/gpu``.

``fit_one_device`` on 1 rank and on 2 ranks started together as "nodes" of one device (the layout the tier uses
to put 2 gloo ranks on one GPU), ``check_step_rows`` on what they logged and on rows it must refuse, and which
clock times a gloo collective's completion.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest

from tests.support.device_matrix import completion_clocks
from tests.support.dist_utils import run_on_ranks
from tests.support.fits import check_step_rows, fit_one_device, strategy_json

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def two_rank_summary(tmp_path_factory) -> dict:
    return fit_one_device(tmp_path_factory.mktemp("two"), "--trainer.strategy", strategy_json("naive_ddp", "gloo"),
                          accelerator="cpu", ranks=2)


@pytest.mark.slow  # the one-rank launch path; the checks themselves run on the two-rank fit below
def test_one_rank_fit_passes_the_step_checks(tmp_path: Path) -> None:
    summary = fit_one_device(tmp_path, "--trainer.strategy", strategy_json("zero1_ddp", "gloo"), accelerator="cpu")
    check_step_rows(summary)
    assert summary["run"]["world_size"] == 1 and summary["run"]["strategy"] == "zero1_ddp"
    assert len(summary["steps"]) == 8  # --trainer.max_steps 8: one row per optimizer step, warm-up included


def test_two_ranks_started_as_nodes_of_one_device_pass_the_step_checks(two_rank_summary: dict) -> None:
    check_step_rows(two_rank_summary)
    assert two_rank_summary["run"]["world_size"] == 2 and two_rank_summary["run"]["backend"] == "gloo"
    # naive on the tiny GPT: 39 tensors + the presence flags = 40 all-reduces per step, really sent between 2 ranks
    assert two_rank_summary["summary"]["comm/calls"]["median"] == 40
    assert two_rank_summary["summary"]["comm/busy_ms"]["median"] > 0


@pytest.mark.parametrize("key, value, message", [
    ("comm/exposed_ms", lambda row: row["step/time_ms"] * 2, "comm/exposed_ms"),
    ("comm/busy_ms", lambda row: row["step/time_ms"] + 1, "comm/busy_ms"),
    ("step/tokens_per_s", lambda row: math.nan, "step/tokens_per_s"),
    ("comm/share", lambda row: -0.5, "share"),
    ("comm/wait_ms", lambda row: row["comm/exposed_ms"] + 1, "do not split comm/exposed_ms"),
])
def test_check_step_rows_refuses_a_wrong_row(two_rank_summary: dict, key: str, value, message: str) -> None:
    bad = copy.deepcopy(two_rank_summary)
    bad["steps"][3][key] = value(bad["steps"][3])
    with pytest.raises(AssertionError, match=message):
        check_step_rows(bad)


def test_gloo_completions_are_timed_on_the_host_clock() -> None:
    # gloo completes each collective on its own thread: the callback reads the host clock, never a CUDA event.
    (result,) = run_on_ranks(completion_clocks, 1, "cpu", backend="gloo")
    assert result["backend_for_device"] == "gloo" and result["group_backend"] == "gloo"
    # bucketed on TinyLM with the several-buckets cap: 5 buckets, each completed on the host clock
    assert result["clocks"] == ["host"] * 5 and result["ordered"]
