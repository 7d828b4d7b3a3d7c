"""Tests for the CommTimer's TensorBoard views (pure) and what it writes with them in one process; the two-rank
runs compared in one table are in tests/dist/test_tensorboard_views.py."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_ddp.callbacks import CommTimer
from lightning_ddp.metrics.accounting import METRIC_KEYS
from lightning_ddp.callbacks.comm_timer import (
    HPARAM_NAMES,
    LAYOUT,
    MEDIAN_METRICS,
    custom_scalars_layout,
    run_hparams,
    run_metrics,
    strategy_settings,
)
from lightning_ddp.strategies import (
    FSDP2Strategy,
    GradSyncStrategy,
    ZeRO1DDPStrategy,
    ZeRO2DDPStrategy,
)
from tests.support.lightning_toy import tiny_lm_data, tiny_lm_module
from tests.support.tensorboard_events import read_views


def _tags(chart: list) -> list[str]:
    kind, regexes = chart
    assert kind == "Multiline"
    return [regex.removesuffix("$") for regex in regexes]


def test_the_layout_names_only_keys_the_timer_can_log() -> None:
    # A typo here would give an empty chart in every run: each key must be one step_metrics produces.
    keys = [key for _, charts in LAYOUT for _, chart_keys in charts for key in chart_keys]
    assert set(keys) <= set(METRIC_KEYS), set(keys) - set(METRIC_KEYS)


def test_a_run_that_logs_every_key_gets_every_chart() -> None:
    layout = custom_scalars_layout(METRIC_KEYS)
    assert list(layout) == ["Where the step goes", "Hidden or not", "Who made it wait", "Wire", "Throughput and memory"]
    charts = {title: _tags(chart) for charts in layout.values() for title, chart in charts.items()}
    assert len(charts) == 10  # 1 + 1 + 2 + 3 + 3 charts in the five categories
    step_chart = charts["step time, exposed and busy communication (ms)"]
    assert step_chart == ["step/time_ms", "comm/exposed_ms", "comm/busy_ms"]
    assert charts["share of the step exposed, share of communication hidden"] == ["comm/share", "comm/overlap"]


def test_a_run_gets_only_the_charts_of_the_keys_it_logged() -> None:
    # step time, exposed time and share, memory; no collective key, no tokens, no straggler exchange
    logged = ["step/time_ms", "comm/exposed_ms", "comm/share", "comm/clock_anomalies", "memory/peak_MiB"]
    layout = {category: {title: _tags(chart) for title, chart in charts.items()}
              for category, charts in custom_scalars_layout(logged).items()}
    assert layout == {
        "Where the step goes": {"step time, exposed and busy communication (ms)": ["step/time_ms", "comm/exposed_ms"]},
        "Hidden or not": {"share of the step exposed, share of communication hidden": ["comm/share"]},
        "Who made it wait": {"exposed = wait for the last rank + transfer (ms)": ["comm/exposed_ms"]},
        "Throughput and memory": {"peak memory (MiB)": ["memory/peak_MiB"]},
    }  # no "Wire": none of its keys was logged


@pytest.mark.parametrize("prefix", ["", "run"])
def test_each_tag_regex_matches_its_own_tag_and_no_longer_one(prefix: str) -> None:
    # TensorBoard matches a chart's regexes at a tag's start (re.match): unanchored, "comm/busy_ms" would also draw a
    # "comm/busy_ms_p90"; and "median/step/time_ms" (the HPARAMS metric) must not join the step-time chart.
    head = f"{prefix}-" if prefix else ""  # Lightning's TensorBoardLogger joins its prefix with "-"
    keys = [key for _, charts in LAYOUT for _, chart_keys in charts for key in chart_keys]
    layout = custom_scalars_layout(METRIC_KEYS, prefix=prefix)
    regexes = [regex for charts in layout.values() for _, chart in charts.values() for regex in chart]
    assert len(regexes) == len(keys)  # every key of every chart, in LAYOUT's order
    for regex, key in zip(regexes, keys):
        tag = head + key
        assert re.match(regex, tag), (regex, tag)
        assert not re.match(regex, tag + "_p90") and not re.match(regex, f"median/{tag}"), regex
        assert not prefix or not re.match(regex, key), regex  # the logger writes the prefixed tag only


def test_run_metrics_are_the_medians_of_the_listed_keys_present() -> None:
    summary = {"step/time_ms": {"median": 80.0, "p10": 70.0, "p90": 95.0}, "comm/share": {"median": 0.25},
               "comm/bytes": {"median": 1e6}}  # bytes are not a table metric; overlap was not recorded
    assert run_metrics(summary) == {"median/step/time_ms": 80.0, "median/comm/share": 0.25}


@pytest.mark.parametrize(("strategy", "resolved", "expected"), [
    (GradSyncStrategy("naive_ddp"), None, ("n/a", "default")),  # no buckets
    (GradSyncStrategy("bucketed_ddp", bucket_size_mb=None), None, ("one bucket", "default")),
    (GradSyncStrategy("bucketed_ddp", bucket_size_mb="auto"), 3.5, (3.5, "default")),  # `auto` as the engine resolved it
    (GradSyncStrategy("bucketed_powersgd_ddp", engine_settings={"rank": 4}), 25.0, (25.0, "rank=4")),
    (ZeRO1DDPStrategy(), None, ("n/a", "schedule=reduce_scatter, grad_sync=bucketed_ddp, collectives=auto")),
    (ZeRO2DDPStrategy(bucket_size_mb=4), 4.0, (4.0, "collectives=auto, buckets_in_flight=2")),
    (DDPStrategy(), None, (25.0, "default")),  # torch DDP's own default cap
    (DDPStrategy(bucket_cap_mb=4, static_graph=True), None, (4.0, "static_graph=True")),
    (FSDP2Strategy(), None, ("n/a", "reshard_after_forward=True, mixed_precision=True")),  # not torch DDP
], ids=["naive", "bucketed_one_bucket", "bucketed_auto", "powersgd", "zero1", "zero2", "ddp", "ddp_kwargs", "fsdp2"])
def test_strategy_settings(strategy, resolved, expected, monkeypatch) -> None:
    # `resolved`: the bucket cap the engine wrapping the model chose (our strategies report it while fitting)
    monkeypatch.setattr(GradSyncStrategy, "resolved_bucket_size_mb", property(lambda self: resolved))
    assert strategy_settings(strategy) == expected


def test_run_hparams_has_every_name_and_refuses_others() -> None:
    values = dict(strategy="ddp", bucket_size_mb=25.0, engine_settings="default", world_size=2, precision="32-true",
                  batch_size=None, preset=("tiny",))
    hparams = run_hparams(**values)
    assert list(hparams) == list(HPARAM_NAMES.values())
    assert (hparams["run/batch_size"], hparams["run/preset"], hparams["run/world_size"]) == ("n/a", "('tiny',)", 2)
    # TensorBoard's table shows the first five names in sorted order until more are ticked: the strategy's three first
    assert sorted(hparams)[:3] == ["grad_sync/bucket_size_mb", "grad_sync/engine_settings", "grad_sync/strategy"]
    with pytest.raises(TypeError, match="unknown: \\['lr'\\], missing: \\['preset'\\]"):
        run_hparams(**{**{k: v for k, v in values.items() if k != "preset"}, "lr": 1e-3})


# ---- what a one-process fit writes (TinyLM, 4 steps: ~2 s) -----------------------------------------------------


def _fit(logger, timer: CommTimer) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=logger, callbacks=[timer],
                         log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)
    module = tiny_lm_module()
    module.save_hyperparameters({"preset": "toy"})  # hyperparameters to log, as LitGPT has: Lightning logs them first
    trainer.fit(module, DataLoader(tiny_lm_data(16), batch_size=4))


def test_a_tensorboard_run_gets_its_layout_and_its_medians_as_hparams_metrics(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="run")  # default_hp_metric=True: Lightning's placeholder would be on
    _fit(logger, CommTimer(every_n_steps=1, warmup_steps=1))
    views = read_views(Path(logger.log_dir))
    # One device: no comm/ keys, no collective to compare launch times of (no straggler/lag_ms); step time, the
    # ranks' compute spread (0 with one rank) and memory.
    assert views.layout == {
        "Where the step goes": {"step time, exposed and busy communication (ms)": ["step/time_ms$"]},
        "Who made it wait": {"straggler's launch lag, ranks' compute spread (ms)": ["step/rank_spread_ms$"]},
        "Throughput and memory": {"peak memory (MiB)": ["memory/peak_MiB$"]},
    }
    assert views.hparams == {"grad_sync/strategy": "single_device", "grad_sync/bucket_size_mb": "n/a",
                             "grad_sync/engine_settings": "default", "run/world_size": 1.0, "run/precision": "32-true",
                             "run/batch_size": "n/a", "run/preset": "toy"}  # TinyLM counts no tokens: no batch shape
    # The record names every metric, so that one table holds runs that logged different keys; this run has values
    # for the two it logged.
    assert views.metrics == list(MEDIAN_METRICS.values())
    assert {tag for tag in views.scalars if tag.startswith("median/")} == {"median/step/time_ms",
                                                                           "median/memory/peak_MiB"}
    # The metric is the summary's median over steps 1-3 (step 0 is warm-up), logged once at the last measured step.
    summary = json.loads(next(tmp_path.rglob("timing_summary.json")).read_text())["summary"]
    ((step, value),) = views.scalars["median/step/time_ms"]
    assert step == 3 and value == pytest.approx(summary["step/time_ms"]["median"], rel=1e-6)
    assert "hp_metric" not in views.scalars  # no -1 placeholder


def test_a_run_of_warm_up_steps_only_gets_its_row_without_values(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="run")
    _fit(logger, CommTimer(every_n_steps=1, warmup_steps=4))  # the 4 steps are all warm-up: no summary, no medians
    views = read_views(Path(logger.log_dir))
    assert views.hparams["grad_sync/strategy"] == "single_device" and views.metrics == list(MEDIAN_METRICS.values())
    assert "step/time_ms" in views.scalars and not [tag for tag in views.scalars if tag.startswith("median/")]
    assert "Where the step goes" in views.layout and "hp_metric" not in views.scalars


def test_with_the_timer_off_tensorboard_gets_what_lightning_writes(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="run")
    _fit(logger, CommTimer(enabled=False))
    views = read_views(Path(logger.log_dir))
    assert views.layout == {} and not any(tag.startswith(("median/", "step/")) for tag in views.scalars)
    assert views.scalars["hp_metric"] == [(0, -1.0)]  # Lightning's own placeholder, left as it is


def test_another_logger_is_unaffected(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, name="run")
    _fit(logger, CommTimer(every_n_steps=1, warmup_steps=1))
    with open(Path(logger.log_dir) / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 4 and "step/time_ms" in rows[0]  # the timer's keys, one row per step
    assert not [column for column in rows[0] if column.startswith("median/") or column == "hp_metric"]
    assert not list(tmp_path.rglob("events.out.tfevents.*"))
