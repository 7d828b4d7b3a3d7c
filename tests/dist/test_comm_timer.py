"""CommTimer through the CLI on 2 CPU processes: every key in TensorBoard, summary files, controlled delays."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lightning_ddp.metrics.accounting import METRIC_KEYS
from tests.support.cli_utils import REPO, read_scalars, run_cli

pytestmark = pytest.mark.multiprocess

# A small, fast cell: tiny model, short sequences; 8 steps of which the first 3 are warm-up.
FAST = ("--model.context_length", "32", "--data.seq_len", "32", "--data.batch_size", "2",
        "--trainer.max_steps", "8", "--timer.warmup_steps", "3")
# On CPU: no reserved memory (CUDA's caching allocator); MFU and peak memory are checked apart.
COMM_KEYS = [k for k in METRIC_KEYS if k not in ("step/mfu", "memory/peak_MiB", "memory/peak_reserved_MiB")]


def fit(tmp_path: Path, *args: str) -> tuple[dict, dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    run_cli("fit", "--config", str(REPO / "configs" / "quickstart.yaml"), *FAST,
            "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"), *args, cwd=tmp_path)
    (summary_file,) = (tmp_path / "logs").rglob("timing_summary.json")
    assert summary_file.with_suffix(".csv").exists()
    return read_scalars(tmp_path / "logs"), json.loads(summary_file.read_text())


# Calls per step of the naive engine on the tiny model: 39 parameter tensors (2 + 4 layers x 9 + final norm), and the
# gradient-presence flags every step. (Every strategy's keys and calls on 2 ranks: test_timer_on_every_strategy.)
BUILT_IN_CALLS = {"naive_ddp": 40}


@pytest.mark.parametrize("strategy", ["naive_ddp", "zero2_ddp"])  # a blocking engine and a sharded one, through the CLI
def test_every_strategy_logs_every_key(tmp_path: Path, strategy: str) -> None:
    scalars, summary = fit(tmp_path, "--trainer.strategy", strategy)
    profile = json.loads(next((tmp_path / "logs").rglob("compute_profile.json")).read_text())
    # 39 tensors of the tiny model, every one's gradient ready after backward started, within backward
    assert len(profile["params"]) == 39 and all(0 <= p["ready_ms"] <= profile["backward_ms"] for p in profile["params"])
    assert profile["forward_ms"] > 0 and profile["optimizer_ms"] > 0 and profile["batch_size"] == 2
    # with each parameter's shape (the projection's PowerSGD model needs to know which gradients are matrices)
    assert all(math.prod(p["shape"]) == p["numel"] for p in profile["params"])
    assert [len(p["shape"]) for p in profile["params"]][:3] == [2, 1, 2]  # tok_emb, attn_norm, q_proj
    for key in [*COMM_KEYS, "memory/peak_MiB", "step/mfu"]:
        assert [step for step, _ in scalars[key]] == list(range(8)), key  # one value per optimizer step
        assert key in summary["summary"], key
    # MFU against the CPU estimate (78 GFLOP/s per thread, 1 thread per rank here): a fraction, not a percentage
    assert 0 < summary["summary"]["step/mfu"]["median"] < 1
    calls = [value for _, value in scalars["comm/calls"]]
    assert len(set(calls)) == 1 and calls[0] >= 1  # the same collectives every step
    if strategy in BUILT_IN_CALLS:
        assert calls[0] == BUILT_IN_CALLS[strategy]
    assert summary["summary"]["comm/exposed_ms"]["median"] > 0
    assert summary["run"]["strategy"] == strategy


def test_builtin_ddp_is_measured_with_the_same_definitions(tmp_path: Path) -> None:
    scalars, summary = fit(tmp_path, "--trainer.strategy", "ddp")
    # Every key, every step, as for our engines: its bucket all-reduces are recorded at the process group.
    for key in [*COMM_KEYS, "memory/peak_MiB"]:
        assert [step for step, _ in scalars[key]] == list(range(8)), key
    calls = [value for _, value in sorted(scalars["comm/calls"])]
    # torch DDP's buckets for the tiny model's 14 MB: up to 25 MiB each, and in step 1 rebuilt in the order the
    # gradients became ready, with a 1 MiB first bucket: a few calls, the same from step 2 on, and no presence-flags
    # call (DDP does not look for unused parameters unless asked). Step 1 also carries the rebuild's own two
    # broadcasts of the new bucket layout, in DDP's forward: every collective of the step is counted.
    assert len(set(calls[2:])) == 1 and 1 <= calls[-1] <= 4
    assert calls[1] == calls[-1] + 2
    assert summary["summary"]["comm/busy_ms"]["median"] > 0 and summary["summary"]["comm/exposed_ms"]["median"] > 0
    assert not any(key.startswith("ddp/") for key in scalars)  # torch DDP's own, differently defined stats are gone


@pytest.mark.slow  # a timing threshold: noisy on a shared machine, so in the slow tier (`pytest -m slow`)
def test_slower_all_reduce_shows_up_as_exposed_time_for_naive(tmp_path: Path) -> None:
    slow = "tests.support.timing_helpers.SlowNaiveDDPStrategy"
    _, base = fit(tmp_path / "base", "--trainer.strategy", slow, "--trainer.strategy.init_args.delay_ms", "0")
    _, delayed = fit(tmp_path / "slow", "--trainer.strategy", slow, "--trainer.strategy.init_args.delay_ms", "5")
    # 40 all-reduce calls per step (39 tensors + the flags), each 5 ms slower: exposed grows by ~200 ms. A sleep
    # never ends early but overshoots on a busy machine (262 ms measured on 2 shared cores), and medians of
    # 5 noisy steps differ, hence the band: well below the 400 ms that counting each delay twice would give.
    growth = delayed["summary"]["comm/exposed_ms"]["median"] - base["summary"]["comm/exposed_ms"]["median"]
    assert 140 < growth < 340, growth
    assert delayed["summary"]["comm/overlap"]["median"] < 0.1  # naive never overlaps


@pytest.mark.slow  # a timing threshold, as above
def test_overlap_hides_communication_behind_a_slow_backward(tmp_path: Path) -> None:
    slow = "tests.support.timing_helpers.SlowBackwardOverlapDDPStrategy"
    _, summary = fit(tmp_path, "--trainer.strategy", slow, "--trainer.strategy.init_args.delay_ms", "5")
    # Each gradient's all-reduce (tens of KB over gloo, well under 5 ms) finishes while backward "computes" for
    # 5 ms more, so most communication is hidden: exposed is only the last few waits plus the flags call.
    assert summary["summary"]["comm/overlap"]["median"] > 0.5, summary["summary"]["comm/overlap"]
