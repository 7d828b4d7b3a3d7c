"""The sweep's statistics (lightning_ddp.bench.stats) on hand-made numbers: pooled medians, the two-level bootstrap,
ratios, verdicts, determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_ddp.bench.stats import (
    Bootstrapper,
    Estimate,
    estimate,
    geometric_mean_draws,
    hierarchical_bootstrap,
    percentile_interval,
    pooled_median,
    pooled_percentile,
    ratio_estimate,
    rng_for,
    verdict,
)

B = 2000


def test_pooled_median_is_the_median_of_every_step_of_every_repeat() -> None:
    # 1, 2, 3 and 10 pooled: the middle two are 2 and 3
    assert pooled_median([[1.0, 2.0, 3.0], [10.0]]) == 2.5
    # not the median of the repeats' medians (2 and 10 -> 6): a repeat counts by its steps
    assert pooled_median([[1.0, 2.0, 3.0], [10.0]]) != np.median([2.0, 10.0])
    # 2-D repeats: per metric (column); a missing value (NaN) is left out: column 1 pools 0.5, 0.7 -> 0.6
    assert pooled_median([np.array([[1.0, 0.5], [3.0, np.nan]]), np.array([[2.0, 0.7]])]).tolist() == [2.0, 0.6]
    # percentiles of the pooled steps, numpy's linear rule: 10th of 10, 20, 30, 40, 50 is at rank 0.4 -> 14
    assert pooled_percentile([[10.0, 20.0], [30.0, 40.0, 50.0]], 10) == pytest.approx(14.0)


def test_identical_repeats_of_constant_steps_give_a_zero_width_interval() -> None:
    # Every step of every repeat is 7 ms: no draw can be anything else.
    result = estimate([[7.0] * 5, [7.0] * 5, [7.0] * 5], B, seed=0)
    assert result == Estimate(7.0, 7.0, 7.0)
    # one step per repeat, all repeats the same: also nothing to vary
    assert estimate([[3.0], [3.0]], B, seed=1) == Estimate(3.0, 3.0, 3.0)


def test_the_bootstrap_resamples_repeats_first_so_disagreeing_repeats_widen_the_interval() -> None:
    # Two repeats, constant within each: 100 ms and 200 ms. A draw picks two repeats with replacement:
    # (r0, r0) with probability 1/4 -> median 100; (r1, r1) 1/4 -> 200; mixed 1/2 -> 5 + 5 steps -> (100 + 200) / 2.
    # So 25 % of the draws are 100 and 25 % are 200: the 2.5th and 97.5th percentiles are exactly 100 and 200.
    repeats = [[100.0] * 5, [200.0] * 5]
    draws = hierarchical_bootstrap(repeats, B, rng_for(0, "x"))
    assert set(np.unique(draws)) == {100.0, 150.0, 200.0}
    assert percentile_interval(draws) == (100.0, 200.0)
    assert estimate(repeats, B, seed=0).point == 150.0  # the pooled median: 5 steps of 100, 5 of 200


def test_a_drift_between_repeats_counts_more_than_the_same_steps_in_one_repeat() -> None:
    # Three repeats centred on 90, 100, 110 ms (steps +-2 around each). Pooled median 100 either way, but only the
    # two-level bootstrap sees that a fresh repeat may land anywhere from 90 to 110: a draw of three copies of the
    # 90 ms repeat (probability 1/27 = 3.7 % > 2.5 %) has a median near 90, and of the 110 ms one near 110.
    u = [-2.0, -1.0, 0.0, 1.0, 2.0] * 2
    repeats = [[centre + x for x in u] for centre in (90.0, 100.0, 110.0)]
    result = estimate(repeats, B, seed=0)
    assert result.point == 100.0
    assert result.lo == pytest.approx(90.0, abs=1.0) and result.hi == pytest.approx(110.0, abs=1.0)
    one = estimate([sum(repeats, [])], B, seed=0)  # the same 30 steps as if one repeat: steps resampled only
    assert one.point == 100.0 and one.hi - one.lo < 20.0


def test_a_short_repeat_contributes_only_its_own_number_of_steps() -> None:
    # r0: two steps of 1; r1: six steps of 3. Mixed picks pool 2 ones + 6 threes -> median 3 (if r0 were padded to
    # six steps the median would be 2). Only (r0, r0), probability 1/4, gives 1.
    draws = hierarchical_bootstrap([[1.0, 1.0], [3.0] * 6], B, rng_for(0, "short"))
    assert set(np.unique(draws)) == {1.0, 3.0}
    assert 0.2 < np.mean(draws == 1.0) < 0.3


def test_metrics_of_the_same_steps_are_resampled_together() -> None:
    # Column 1 is always 10 x column 0: every draw keeps that pairing.
    repeats = [np.array([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]]), np.array([[4.0, 40.0], [5.0, 50.0]])]
    draws = hierarchical_bootstrap(repeats, 500, rng_for(3, "pairs"))
    assert draws.shape == (500, 2)
    np.testing.assert_allclose(draws[:, 1], 10 * draws[:, 0])


def test_the_same_seed_and_name_give_the_same_draws() -> None:
    repeats = [[100.0, 104.0, 98.0, 101.0], [110.0, 108.0, 111.0, 109.0], [95.0, 97.0, 99.0, 96.0]]
    assert estimate(repeats, B, seed=0, key="cell") == estimate(repeats, B, seed=0, key="cell")
    assert estimate(repeats, B, seed=0, key="cell") != estimate(repeats, B, seed=1, key="cell")
    assert estimate(repeats, B, seed=0, key="cell") != estimate(repeats, B, seed=0, key="other")
    # The draws depend on the name, not on what was drawn before: a Bootstrapper gives the same as a fresh call.
    cached = Bootstrapper(B, seed=0)
    cached.draws("unrelated", [[1.0, 2.0]])
    np.testing.assert_array_equal(cached.draws("cell", repeats), hierarchical_bootstrap(repeats, B, rng_for(0, "cell")))
    assert cached.draws("cell", repeats) is cached.draws("cell", repeats)  # computed once
    # the same name with other values (the cell gained a repeat) is drawn again, not served stale
    assert cached.draws("cell", repeats[:2]) is not cached.draws("cell", repeats)


def test_ratio_intervals_and_verdicts() -> None:
    ddp = [[100.0] * 4, [100.0] * 4]
    # 90 / 100 = 0.9 in every draw: met (<= 1)
    fast = ratio_estimate([[90.0] * 4, [90.0] * 4], ddp, B, seed=0)
    assert fast == Estimate(0.9, 0.9, 0.9) and verdict(fast, 1.0) == "met"
    # 110 / 100 = 1.1 in every draw: missed
    slow = ratio_estimate([[110.0] * 4, [110.0] * 4], ddp, B, seed=0)
    assert slow.lo == pytest.approx(1.1) and verdict(slow, 1.0) == "missed"
    # repeats of 95 and 105: draws 0.95, 1.00 or 1.05 (as in the 100/200 example): the interval straddles 1
    straddle = ratio_estimate([[95.0] * 4, [105.0] * 4], ddp, B, seed=0)
    assert (straddle.point, straddle.lo, straddle.hi) == pytest.approx((1.0, 0.95, 1.05))
    assert verdict(straddle, 1.0) == "inconclusive"


def test_verdict_rule_at_the_edges() -> None:
    assert verdict((0.5, 1.0), 1.0) == "met"  # upper end on the target: met
    assert verdict((1.0, 1.2), 1.0) == "inconclusive"  # lower end on the target: not above it
    assert verdict((1.0000001, 1.2), 1.0) == "missed"
    assert verdict((0.1 / 0.3, 0.1 / 0.3), 1 / 3) == "met"  # 0.333...4 from floating point is on the target
    assert verdict((math.nan, math.nan), 1.0) == "inconclusive"
    assert verdict(Estimate(0.9, 0.8, 0.95), 0.95) == "met"


def test_geometric_mean_of_ratio_draws() -> None:
    # per draw: sqrt(2 * 0.5) = 1, sqrt(4 * 1) = 2
    draws = geometric_mean_draws([np.array([2.0, 4.0]), np.array([0.5, 1.0])])
    np.testing.assert_allclose(draws, [1.0, 2.0])


def test_missing_values_and_empty_input() -> None:
    # a step that did not report the metric (NaN) is left out of its draw's median
    assert estimate([[np.nan, 5.0, 5.0], [5.0]], 200, seed=0) == Estimate(5.0, 5.0, 5.0)
    with pytest.raises(ValueError, match="no measurements"):
        hierarchical_bootstrap([[], []], 10, rng_for(0))


# ---- the compression benchmark's summary ------------------------------------------------------------------------


def test_compression_summary_pairs_each_variant_with_fp32_by_seed_with_an_interval() -> None:
    from lightning_ddp.bench.compression import summarize

    def run(losses, step_ms=100.0, nbytes=4.0):
        return {"loss": losses, "step_ms_median": step_ms, "exposed_ms_median": 5.0, "bytes_per_step": nbytes}

    shifted = "bucketed_powersgd_ddp rank=4"  # every loss exactly 0.1 above fp32's: a zero-width interval at +0.1
    runs = {
        0: {"bucketed_ddp": run([5.0, 2.0, 1.0]), "bucketed_bf16_ddp": run([5.0, 2.5, 1.5], 90.0, 2.0),
            shifted: run([5.1, 2.1, 1.1], 120.0, 0.25)},
        1: {"bucketed_ddp": run([5.0, 2.0, 1.4]), "bucketed_bf16_ddp": run([5.0, 2.0, 1.2], 94.0, 2.0),
            shifted: run([5.1, 2.1, 1.5], 130.0, 0.25)},
    }
    errors = {"bucketed_bf16_ddp": [(0.002, 1e-3), (0.004, 2e-3), (0.003, 5e-4)],
              shifted: [(0.0, 0.0), (0.0, 0.0), (0.3, 0.01), (0.1, 0.02)]}  # 2 exact warm-up steps
    s = summarize(runs, errors, ["bucketed_bf16_ddp", shifted], last=2, samples=200)
    assert s["seeds"] == [0, 1] and s["fp32"]["loss_first"] == 5.0
    assert s["fp32"]["loss_last_mean"] == {"0": 1.5, "1": 1.7} and s["fp32"]["seed_spread"] == pytest.approx(0.2)
    bf16 = s["variants"]["bucketed_bf16_ddp"]
    assert bf16["loss_last_mean"] == {"0": 2.0, "1": 1.6}
    assert bf16["minus_fp32"] == {"0": pytest.approx(0.5), "1": pytest.approx(-0.1)}
    # pooled: the last 2 steps' differences are 0.5, 0.5 (seed 0) and 0, -0.2 (seed 1): mean 0.2. Its interval
    # resamples the seed values first: a draw of seed 0 twice gives 0.5, of seed 1 twice at most 0; so it straddles
    # 0.2 within [-0.2, 0.5], and includes 0: two seed values cannot tell this gap from seed-to-seed luck.
    assert bf16["minus_fp32_mean"] == pytest.approx(0.2)
    assert -0.2 <= bf16["minus_fp32_lo"] <= 0.0 < 0.2 < bf16["minus_fp32_hi"] <= 0.5
    assert bf16["loss_max_abs_difference"] == pytest.approx(0.5)
    assert bf16["bytes_ratio"] == 0.5 and bf16["step_ms_median"] == 92.0
    assert bf16["exact_steps"] == 0 and bf16["relative_gradient_error_median"] == 0.003
    assert bf16["absolute_gradient_error_max"] == 2e-3
    powersgd = s["variants"][shifted]
    assert (powersgd["minus_fp32_mean"], powersgd["minus_fp32_lo"], powersgd["minus_fp32_hi"]) == (
        pytest.approx(0.1), pytest.approx(0.1), pytest.approx(0.1))
    # the error statistics leave out the exact warm-up: median of 0.3 and 0.1
    assert powersgd["exact_steps"] == 2 and powersgd["relative_gradient_error_median"] == pytest.approx(0.2)
    assert powersgd["bytes_ratio"] == 0.0625 and powersgd["step_ms_median"] == 125.0


def test_compression_variants_are_registered_lossy_algorithms_with_their_engine_settings() -> None:
    from lightning_ddp.bench.compression import CompressionConfig, parse_variant, variants_of

    assert [v.name for v in variants_of(CompressionConfig())][:2] == ["bucketed_bf16_ddp", "bucketed_powersgd_ddp"]
    variant = parse_variant("bucketed_powersgd_ddp:rank=4,start_iter=10")
    assert (variant.algorithm, variant.settings) == ("bucketed_powersgd_ddp", {"rank": 4, "start_iter": 10})
    assert variant.name == "bucketed_powersgd_ddp rank=4 start_iter=10"
    assert variant.effective_settings() == {"rank": 4, "start_iter": 10, "min_compression_rate": 2.0, "seed": 0}
    with pytest.raises(ValueError, match="'bucketed_ddp' is not a lossy engine"):
        parse_variant("bucketed_ddp")
    with pytest.raises(ValueError, match="'rnak' is not a setting of 'bucketed_powersgd_ddp'.* takes: rank=4, start_iter"):
        parse_variant("bucketed_powersgd_ddp:rnak=4")


def test_timer_overhead_is_a_ratio_of_pooled_medians_with_an_interval_and_a_verdict() -> None:
    from lightning_ddp.bench.timer_overhead import _markdown, arms, sampled_arm, summarize

    every, sampled = "every step", sampled_arm(50)
    assert list(arms(50)) == ["off", every, sampled] and arms(50)[sampled][-1] == "50"
    windows = {"off": [100.0, 100.0], every: [101.0, 101.0], sampled: [100.1, 100.1]}
    same = summarize({"off": [[100.0] * 5, [100.0] * 5], every: [[101.0] * 5, [101.0] * 5],
                      sampled: [[100.0] * 5, [100.0] * 5]}, windows, goal_arm=sampled, samples=200)
    # the goal's arm (the default sampling) at the top: its unsampled steps cost nothing (median ratio 1), its
    # measured ones show in the whole-run mean
    assert same["overhead"] == pytest.approx(0.0) and same["verdict"] == "met"
    assert same["window_overhead"] == pytest.approx(0.001)
    # every step: +1 %, exactly the goal, so met only because its whole interval is not above it
    assert same["arms"][every]["overhead"] == pytest.approx(0.01) and same["arms"][every]["verdict"] == "met"
    table = _markdown({"strategies": {"ddp": same}, "goal_arm": sampled,
                       "command": "python -m lightning_ddp.bench.timer_overhead"})
    assert "| ddp | every step | 101.00 | +1.00 % [+1.00, +1.00] | met |" in table and "| ddp | every 50 steps |" in table
    assert "- `ddp`: +0.00 % [95 %: +0.00, +0.00]" in table
    # one repeat of the every-step arm much slower (a drift of the machine): the point moves, the interval says so
    drift = summarize({"off": [[100.0] * 5, [100.0] * 5], every: [[101.0] * 5, [125.0] * 5]}, windows, goal_arm=every,
                      samples=200)
    assert drift["overhead_lo"] == pytest.approx(0.01) and drift["overhead_hi"] == pytest.approx(0.25)
    assert drift["verdict"] == "inconclusive"
    assert summarize({"off": [[100.0] * 3] * 2, every: [[110.0] * 3] * 2}, windows, goal_arm=every,
                     samples=200)["verdict"] == "missed"


def test_the_timer_overhead_config_refuses_an_unknown_strategy() -> None:
    from lightning_ddp.bench.timer_overhead import TimerOverheadConfig

    with pytest.raises(ValueError, match="'dpp' is not a strategy of the catalogue; choose one of: naive_ddp"):
        TimerOverheadConfig(strategies=["ddp", "dpp"])
    with pytest.raises(ValueError, match="strategies is empty"):
        TimerOverheadConfig(strategies=[])


@pytest.mark.parametrize(("module", "stem"), [("timer_overhead", "timer_overhead"), ("engine_step", "engine_step")])
def test_report_only_rebuilds_the_committed_report_from_its_json(module: str, stem: str, tmp_path) -> None:
    # no measurement: the committed JSON in, the committed markdown out, byte for byte (the report is its function)
    import importlib
    from pathlib import Path

    committed = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "cpu"
    (tmp_path / f"{stem}.json").write_text((committed / f"{stem}.json").read_text())
    importlib.import_module(f"lightning_ddp.bench.{module}").main(["--out_dir", str(tmp_path), "--report_only", "true"])
    assert (tmp_path / f"{stem}.md").read_text() == (committed / f"{stem}.md").read_text()
    assert (tmp_path / f"{stem}.json").read_text() == (committed / f"{stem}.json").read_text()
