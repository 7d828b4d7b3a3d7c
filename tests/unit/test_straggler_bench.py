"""The straggler benchmark's statistics and goals on hand-made steps, and its configs (no fit runs here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_ddp.bench.straggler import (
    StragglerBenchConfig, _fit_arguments, main, render_markdown, summarize_cell,
)
from lightning_ddp.command_line import parse_dataclass
from tests.support.cli_utils import REPO

CONFIG = StragglerBenchConfig(bootstrap_samples=200)
COLUMNS = (REPO / "benchmarks" / "results" / "straggler" / "results.csv").read_text().splitlines()[0].split(",")
"""results.csv's columns in order, as committed: a row of summarize_cell has them, nothing else."""


def _steps(wait: float, transfer: float, straggler: int, n: int = 10, jitter: float = 0.2) -> list[dict[str, float]]:
    # n steps alternating +-jitter around the given wait and transfer
    rows = []
    for i in range(n):
        sign = 1 if i % 2 else -1
        rows.append({"comm/wait_ms": wait + sign * jitter, "comm/transfer_ms": transfer + sign * jitter,
                     "straggler/rank": float(straggler), "straggler/lag_ms": wait, "step/rank_spread_ms": wait,
                     "step/time_ms": 100.0 + wait, "comm/exposed_ms": wait + transfer})
    return rows


def test_a_wait_on_the_delay_with_the_right_straggler_meets_every_goal():
    control = summarize_cell(CONFIG, "ddp", 0.0, [_steps(0.5, 6.0, 0), _steps(0.5, 6.0, 1)], None)
    # without a delay: a median wait of 0.5 ms, its whole interval [0.3, 0.7] under 2 ms
    assert control["wait_goal"] == "met" and control["straggler_goal"] == control["transfer_goal"] == ""
    assert control["transfer_ms_lo"] <= 6.0 <= control["transfer_ms_hi"]
    delayed = summarize_cell(CONFIG, "ddp", 20.0, [_steps(20.5, 6.0, 1), _steps(19.5, 6.0, 1)], control)
    # wait median 20 (pooled 19.3 ... 20.7), interval inside [17, 23]; rank 1 every step; transfer 6 in [5.8, 6.2]
    assert delayed["wait_ms"] == pytest.approx(20.0, abs=0.5)
    assert (delayed["wait_goal"], delayed["straggler_goal"], delayed["transfer_goal"]) == ("met", "met", "met")
    assert delayed["straggler_share"] == 1.0 and delayed["measured_steps"] == 20 and delayed["repeats_ok"] == 2
    assert list(delayed) == list(COLUMNS)


def test_a_wrong_wait_a_wrong_straggler_and_a_grown_transfer_miss_their_goals():
    control = summarize_cell(CONFIG, "bucketed_ddp", 0.0, [_steps(0.5, 6.0, 0)], None)
    # wait 30 for a 20 ms delay (interval far above 23), rank 0 named, transfer 9 ms (outside [5.8, 6.2])
    delayed = summarize_cell(CONFIG, "bucketed_ddp", 20.0, [_steps(30.0, 9.0, 0)], control)
    assert (delayed["wait_goal"], delayed["straggler_goal"], delayed["transfer_goal"]) == ("missed", "missed", "missed")
    # an interval straddling the bound cannot decide: 2 ms +- 0.2 against "below 2 ms"
    assert summarize_cell(CONFIG, "ddp", 0.0, [_steps(2.0, 6.0, 0)], None)["wait_goal"] == "inconclusive"


def test_the_straggler_share_is_over_all_pooled_steps():
    # 9 of 10 steps name rank 1: exactly the 90 % goal
    steps = _steps(20.0, 6.0, 1)
    steps[0]["straggler/rank"] = 0.0
    row = summarize_cell(CONFIG, "ddp", 20.0, [steps], None)
    assert row["straggler_share"] == pytest.approx(0.9) and row["straggler_goal"] == "met"
    assert row["transfer_goal"] == ""  # no control given: nothing to compare with
    table = render_markdown(CONFIG, [row], "python -m lightning_ddp.bench.straggler")
    assert "| ddp | 20 | 20.00 [" in table and "| 90% |" in table


def test_a_run_without_delay_has_no_slow_rank_and_a_delayed_one_names_it():
    plain = _fit_arguments(CONFIG, "ddp", 0.0)
    assert not any("SlowRank" in arg for arg in plain)
    delayed = _fit_arguments(CONFIG, "ddp", 5.0)
    i = delayed.index("--trainer.callbacks+=lightning_ddp.callbacks.SlowRank")
    assert delayed[i + 1:i + 5] == ["--trainer.callbacks.rank", "1", "--trainer.callbacks.delay_ms", "5"]


@pytest.mark.parametrize("name", ["bench.yaml", "smoke.yaml"])
def test_the_configs_parse(name: str):
    config = parse_dataclass(StragglerBenchConfig, ["--config", str(REPO / "configs" / "straggler" / name)], "check")
    assert 0 in config.delays_ms and config.slow_rank == 1 and (REPO / config.fit_config).exists()


@pytest.mark.parametrize(("args", "match"), [
    (["--delays_ms", "[5, 20]"], "has no 0"), (["--warmup_steps", "40"], "warmup_steps must be in"),
    (["--delays_ms", "[0, -5]"], "NonNegativeFloat"),
])
def test_bad_settings_name_the_fix(args: list[str], match: str, capsys: pytest.CaptureFixture):
    with pytest.raises(SystemExit):
        main(args)
    assert match in capsys.readouterr().err


def test_report_only_rebuilds_the_committed_report_from_its_rows(tmp_path: Path):
    # the committed rows and environment, no fit: results.md has one table row per (strategy, delay) in the CSV
    for name in ("results.csv", "environment.json"):
        (tmp_path / name).write_text((REPO / "benchmarks" / "results" / "straggler" / name).read_text())
    rows = main(["--out_dir", str(tmp_path), "--report_only", "true"])
    report = (tmp_path / "results.md").read_text()
    assert len(rows) == 8
    assert sum(line.startswith(("| ddp | ", "| bucketed_ddp | ")) for line in report.splitlines()) == len(rows)
    assert "Command: `python -m lightning_ddp.bench.straggler --config configs/straggler/bench.yaml`" in report
