"""``python -m lightning_ddp advise``: the calibration, the verdicts and the bad folders, on synthetic runs."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from lightning_ddp.projection.advise import (
    NOISY_SPREAD, PROJECTION_ERROR, QUIET_SPREAD, RunError, advise, fit_calls, main, read_run, render_markdown,
)
from lightning_ddp.reporting.tables import read_csv
from lightning_ddp.metrics.recording import SUMMARY_SCHEMA, call_table, collective_calls
from lightning_ddp.profile import ComputeProfile, ParamTiming, write_profile
from tests.support.cli_utils import REPO

BLOCKS = 8
BLOCK_BYTES = 4 * 256 * 256


def _write_run(path: Path, call_ms: float = 8.0, wait_ms: float = 0.0, strategy: str = "naive_ddp",
               cli: bool = True, peak_mib: float = 500.0, step_spread: float = 0.0) -> Path:
    """A 2-rank CommTimer folder: 8 blocks of one 256 x 256 weight, per-tensor all-reduces of ``call_ms`` each; its
    10 measured steps spread ``step_spread`` (``Run.step_spread``) around the median step."""
    params = tuple(ParamTiming(f"model.blocks.{i}.w", 256 * 256, BLOCK_BYTES, 100.0 - 10 * i, (256, 256))
                   for i in range(BLOCKS))
    write_profile(ComputeProfile(50.0, 100.0, 10.0, params, device="cpu", world_size=2), path / "compute_profile.json")
    exposed = 1.0 + BLOCKS * call_ms + wait_ms
    medians = {"step/time_ms": 160.0 + exposed, "comm/exposed_ms": exposed, "comm/wait_ms": wait_ms,
               "comm/busy_ms": exposed - wait_ms, "comm/share": exposed / (160.0 + exposed), "memory/peak_MiB": peak_mib}
    # half the steps at m (1 - a), half at m (1 + a): every deviation is a m, so step_spread = 1.4826 a
    deviation = step_spread / 1.4826 * medians["step/time_ms"]
    steps = [{**medians, "step/time_ms": medians["step/time_ms"] + (-1) ** k * deviation, "straggler/rank": 1.0}
             for k in range(10)]
    calls = {("world", "all_reduce", 4 * BLOCKS): [1.0] * 10,
             ("world", "all_reduce", BLOCK_BYTES): [call_ms] * 10 * BLOCKS}
    summary = {"schema": SUMMARY_SCHEMA, "warmup_steps": 0, "steps": steps, "collectives": call_table(calls),
               "summary": {key: {"median": value} for key, value in medians.items()},
               "run": {"strategy": strategy, "world_size": 2, "backend": "gloo", "device": "cpu", "cli": cli,
                       "bucket_size_mb": None}}
    (path / "timing_summary.json").write_text(json.dumps(summary))
    return path


def calibrated_error(rows: list[dict[str, str]]) -> float:
    """Median |error| of predicting one cell from another of its group scaled to the other's measured step (what
    advise does): ``(1 + e_b) / (1 + e_a) - 1`` over every ordered pair of the validation's ``step_error``."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault((r["precision"], r["batch_size"], r["context_length"]), []).append(float(r["step_error"]))
    return statistics.median(abs((1 + b) / (1 + a) - 1) for errors in groups.values()
                             for i, a in enumerate(errors) for j, b in enumerate(errors) if i != j)


def test_the_interval_is_the_committed_validation_s_calibrated_error() -> None:
    rows = read_csv(REPO / "benchmarks" / "results" / "projection" / "cpu_sweep_validation.csv")
    assert round(calibrated_error(rows), 3) == PROJECTION_ERROR


def test_each_collective_is_busy_from_the_end_of_the_one_before() -> None:
    class Call:
        def __init__(self, launched: float, completed: float) -> None:
            self.op, self.nbytes, self.launched, self.completed = "all_reduce", 8, launched, completed
            self.group = "world"

    assert collective_calls([Call(0.0, 4.0), Call(1.0, 6.0), Call(8.0, 9.0)]) == [
        ("world", "all_reduce", 8, 4.0), ("world", "all_reduce", 8, 2.0), ("world", "all_reduce", 8, 1.0)]
    assert call_table({("world", "all_reduce", 8): [1.0, 3.0, 2.0]}) == [
        {"group": "world", "op": "all_reduce", "bytes": 8, "count": 3, "median_ms": 2.0}]


def test_latency_and_bandwidth_are_fitted_per_collective_and_one_size_is_said() -> None:
    calls = [{"op": "all_reduce", "bytes": b, "count": 2, "median_ms": 1.0 + b / 1e6} for b in (1e3, 1e6)]
    calls.append({"op": "reduce_scatter", "bytes": 2e6, "count": 1, "median_ms": 3.0})
    fits, notes = fit_calls(calls)
    assert fits["all_reduce"] == pytest.approx((1e-3, 1e9))
    assert fits["reduce_scatter"] == pytest.approx((1e-3, 1e9))  # all-reduce's o, the rest on bandwidth
    assert len(notes) == 1 and notes[0].startswith("reduce_scatter: one message size")


def test_a_communication_bound_naive_run_is_told_to_change_and_how(tmp_path: Path) -> None:
    document = advise(read_run(_write_run(tmp_path)))
    current = [r for r in document["recommendations"] if r["current"]]
    assert len(current) == 1 and current[0]["predicted_step_ms"] == pytest.approx(document["run"]["step_ms"])
    verdict = document["verdict"]
    assert verdict["action"] == "change" and verdict["top"]["strategy"] != "naive_ddp" and verdict["top"]["exact"]
    top = verdict["top"]
    lo, hi = top["predicted_step_interval"]
    assert lo < top["predicted_step_ms"] < hi < document["run"]["step_ms"]
    assert top["fit_args"][0] == "--trainer.strategy" and "class_path" in json.loads(top["fit_args"][1])
    assert any(not r["exact"] for r in document["recommendations"])  # compression is offered, flagged lossy
    assert any(r["settings"].get("bucket_size_mb") == "auto" for r in document["recommendations"])
    # read first: what the verdict recommends, then the exact rows, then the lossy ones, each fastest first
    first, *rest = document["recommendations"]
    assert first is not None and first == top
    exact, lossy = [r for r in rest if r["exact"]], [r for r in rest if not r["exact"]]
    assert rest == exact + lossy and lossy
    for group in (exact, lossy):
        assert [r["predicted_step_ms"] for r in group] == sorted(r["predicted_step_ms"] for r in group)


def test_keep_a_straggler_memory_and_a_script(tmp_path: Path) -> None:
    keep = advise(read_run(_write_run(tmp_path / "keep", call_ms=0.01)))
    assert keep["verdict"]["action"] == "keep" and keep["verdict"]["top"] is None
    slow = advise(read_run(_write_run(tmp_path / "slow", call_ms=0.5, wait_ms=50.0)))
    assert slow["verdict"]["action"] == "straggler" and slow["verdict"]["straggler"]["rank"] == 1
    assert "rank 1" in slow["verdict"]["text"] and "no strategy fixes a straggler" in slow["verdict"]["text"]
    # most of the exposed time, but 3 of ~172 ms of step (under 5 %): jitter behind a hidden sync, no straggler
    jitter = advise(read_run(_write_run(tmp_path / "jitter", call_ms=0.01, wait_ms=3.0)))
    assert jitter["verdict"]["action"] == "keep"
    full = advise(read_run(_write_run(tmp_path / "full", peak_mib=900.0)), device_memory_gib=1.0)
    saves = full["verdict"]["memory"]["sharding_saves_GiB"]  # 8 MiB of state: FSDP2 shards all of it
    assert saves["fsdp2"] == pytest.approx(3 * BLOCKS * BLOCK_BYTES / 2 / 2**30, rel=0.3)
    script = advise(read_run(_write_run(tmp_path / "script", cli=False)))
    assert script["verdict"]["top"]["fit_args"] == [] and script["verdict"]["top"]["python"].startswith("Trainer(")
    resolved = _write_run(tmp_path / "auto", strategy="bucketed_ddp")
    summary = json.loads((resolved / "timing_summary.json").read_text())
    summary["run"]["bucket_size_mb"] = 3.3  # what `auto` resolved to: a size the table does not try, still the row
    (resolved / "timing_summary.json").write_text(json.dumps(summary))
    (current,) = [r for r in advise(read_run(resolved))["recommendations"] if r["current"]]
    assert current["settings"] == {"bucket_size_mb": 3.3}
    scales = advise(read_run(_write_run(tmp_path / "scales")), world_sizes=[4, 8], network="nvlink4")["scales"]
    assert set(scales) == {"4", "8"} and scales["8"][0]["predicted_step_ms"] > 0


def test_bad_folders_get_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = _write_run(tmp_path / "old")
    summary = json.loads((old / "timing_summary.json").read_text())
    del summary["schema"]
    (old / "timing_summary.json").write_text(json.dumps(summary))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "timing_summary.json").write_text("{")
    (tmp_path / "empty").mkdir()
    for folder, words in ((tmp_path / "missing", "does not exist"), (tmp_path / "empty", "holds no timing_summary.json"),
                          (old, "re-run the fit with this version"), (tmp_path / "broken", "unreadable")):
        assert main([str(folder)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
    with pytest.raises(RunError):
        read_run(old)


def test_the_command_writes_advice_json_and_md(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _write_run(tmp_path)
    assert main([str(run)]) == 0
    document = json.loads((run / "advice.json").read_text())
    assert {"strategy", "settings", "fit_args", "predicted_step_ms", "predicted_step_interval",
            "predicted_share"} <= set(document["recommendations"][0])
    markdown = (run / "advice.md").read_text()
    assert "**Verdict: change to" in markdown and "--trainer.strategy" in markdown
    assert markdown in capsys.readouterr().out


def test_the_check_s_config_rows_and_report_only(tmp_path: Path) -> None:
    from lightning_ddp.bench import advice as bench
    from lightning_ddp.bench.study import write_outputs
    from lightning_ddp.reporting.tables import csv_text
    from lightning_ddp.command_line import parse_dataclass

    config = parse_dataclass(bench.AdviceBenchConfig, ["--config", str(REPO / "configs/advice/cpu.yaml")],
                             prog="check")
    assert len(config.starts) == 7 and config.tolerance == 0.10
    config.out_dir, config.bootstrap_samples = str(tmp_path), 200
    steps = [[{"step/time_ms": 100.0 + k % 3} for k in range(10)] for _ in range(2)]
    faster = [[{"step/time_ms": 80.0 + k % 3} for k in range(10)] for _ in range(2)]
    advice = {"verdict": "change", "step_ms": 101.0, "applied": "flat", "fit_args": ["--trainer.strategy", "x"],
              "predicted": [84.0, 76.0, 92.0]}
    row = bench.summarize(config, "naive", advice, {"start": steps, "applied": faster})
    assert row["within_tolerance"] and row["not_slower"] and row["gain"] == pytest.approx(101 / 81 - 1, rel=0.02)
    keep = bench.summarize(config, "flat", {**advice, "fit_args": [], "verdict": "keep"}, {"start": steps})
    assert keep["applied_ms"] == keep["start_ms"] and keep["gain"] == 0.0
    markdown = bench.render_markdown(config, [row, keep], "cmd")
    write_outputs(tmp_path, {"results.csv": csv_text([row, keep], list(row), digits=4), "results.md": markdown,
                             "environment.json": {"config": vars(config), "command_line": "cmd",
                                                  "git_commit": "0123456789abcdef", "git_dirty": False}})
    bench.main(["--out_dir", str(tmp_path), "--report_only", "true"])
    # the rebuilt report is the render, then the commit environment.json records (its first 12 digits)
    assert (tmp_path / "results.md").read_text() == markdown.rstrip() + "\n\nMeasured at commit 0123456789ab.\n"


def quiet_spreads(rows: list[dict[str, str]]) -> tuple[float, float]:
    """The median and the largest ``Run.step_spread`` of the straggler benchmark's runs (their steps after warm-up)."""
    runs: dict[tuple[str, str, str], list[float]] = {}
    for r in rows:
        runs.setdefault((r["strategy"], r["delay_ms"], r["repeat"]), []).append(float(r["step/time_ms"]))
    spreads = []
    for times in runs.values():
        middle = statistics.median(times)
        spreads.append(1.4826 * statistics.median(abs(t - middle) for t in times) / middle)
    return statistics.median(spreads), max(spreads)


def test_a_quiet_runs_spread_is_the_committed_quiet_runs():
    rows = read_csv(REPO / "benchmarks" / "results" / "straggler" / "steps.csv")
    assert len({(r["strategy"], r["delay_ms"], r["repeat"]) for r in rows}) == 24
    assert tuple(round(value, 3) for value in quiet_spreads(rows)) == (QUIET_SPREAD, NOISY_SPREAD)


def test_the_interval_is_sized_by_the_runs_own_spread_and_a_noisy_run_is_not_advised(tmp_path: Path) -> None:
    def half_width(document: dict) -> float:
        row = document["recommendations"][0]
        return row["predicted_step_interval"][1] / row["predicted_step_ms"] - 1

    quiet = advise(read_run(_write_run(tmp_path / "quiet", step_spread=0.05)))
    assert quiet["run"]["step_spread"] == pytest.approx(0.05)
    assert half_width(quiet) == pytest.approx(PROJECTION_ERROR)  # as quiet as the validation's runs: its error
    assert quiet["verdict"]["action"] == "change"
    # 0.13 is 1.31 quiet spreads: the interval widens to 11.9 % x 0.13 / 0.099 = 15.6 %
    wide = advise(read_run(_write_run(tmp_path / "wide", step_spread=0.13)))
    assert half_width(wide) == pytest.approx(PROJECTION_ERROR * 0.13 / QUIET_SPREAD)
    noisy = advise(read_run(_write_run(tmp_path / "noisy", step_spread=0.2)))  # above every committed quiet run
    assert noisy["verdict"]["action"] == "noisy" and noisy["verdict"]["top"] is None
    assert noisy["verdict"]["text"].startswith("too noisy to advise from: its 10 measured steps spread +-20%")
    assert noisy["recommendations"][0]["current"]  # nothing recommended: the run itself first
    # 11.9 % x 0.2 / 0.099 = 24 %
    assert ("Intervals: +-24.0%, the projection's +-11.9% widened x2.02, as this run's steps spread +-20% against a "
            "quiet run's +-10%") in render_markdown(noisy)


def test_the_current_row_shows_the_share_the_run_measured(tmp_path: Path) -> None:
    document = advise(read_run(_write_run(tmp_path / "run")))
    (current,) = [r for r in document["recommendations"] if r["current"]]
    # the run's comm/share median, and beside it the model's share as the CommTimer would measure it (waited for
    # communication over the step; compute slowed beside a collective is in the step, not in the share)
    assert current["measured_share"] == document["run"]["share"]
    assert all(r["measured_share"] is None for r in document["recommendations"] if not r["current"])
    assert f"{current['measured_share']:.1%} measured (model {current['predicted_share']:.1%})" in render_markdown(
        document)


def test_a_loggers_folder_is_advised_on_through_its_latest_run(tmp_path: Path) -> None:
    logger = tmp_path / "logs" / "naive_ddp"
    _write_run(logger / "version_0")
    (logger / "version_1").mkdir()  # a validate run: no timing_summary.json
    assert read_run(logger).path == logger / "version_0"


def test_advise_offers_hsdp_past_one_node_where_it_wins(tmp_path: Path) -> None:
    # The 8-block run projected onto H100 nodes of 8 GPUs. At 1024 ranks (128 nodes) fsdp2's ring all-gathers and
    # reduce-scatters each cross 127 network hops (4 us each) for every block, twice gathered; hsdp's stay on the 8
    # GPUs of a node and only a tree all-reduce of 1/8 of each block crosses the network: hsdp is first. On one
    # fabric level (the run's own fit) there is no node to shard within: hsdp is fsdp2, step for step.
    run = read_run(_write_run(tmp_path / "run"))
    scales = advise(run, world_sizes=[16, 1024], network="h100_nvlink_ib")["scales"]
    assert scales["1024"][0]["strategy"] == "hsdp"
    order = [row["strategy"] for row in scales["1024"]]
    assert order.index("hsdp") < order.index("fsdp2")
    flat = {row["strategy"]: row["predicted_step_ms"] for row in advise(run, world_sizes=[16])["scales"]["16"]}
    assert flat["hsdp"] == flat["fsdp2"]
    assert "- 1024 ranks: hsdp " in render_markdown(advise(run, world_sizes=[1024], network="h100_nvlink_ib"))
