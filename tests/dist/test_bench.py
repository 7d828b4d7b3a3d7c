"""The benchmark sweep (lightning_ddp.bench): grid, ids, configs, interleaved repeats, resume per repeat, the raw
and aggregate files, failure rows, the load guard, the out-of-sample best bucket size, goals with verdicts, and one
real 2-cell sweep end to end. The statistics themselves are in test_bench_stats.py."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest

from lightning_ddp.bench import launch as launch_module
from lightning_ddp.bench.config import GridConfig, OutputConfig, RunConfig, SweepConfig, WorkloadConfig, expand_grid
from lightning_ddp.bench.launch import ProcessResult, RankLayout, error_line, rank_layout, run_processes
from lightning_ddp.bench.report import (
    REPEAT_COLUMNS,
    RESULT_COLUMNS,
    Analysis,
    build_report,
    cell_data,
    cell_row,
    parse_row,
    read_rows,
    read_steps,
)
from lightning_ddp.bench.stats import Bootstrapper
from lightning_ddp.bench.study import LoadCheck, busy_fraction, read_proc_stat, wait_until_idle
from lightning_ddp.bench.sweep import (
    CellOutcome,
    SubprocessCellRunner,
    cell_command,
    cell_environments,
    classify,
    gradient_bytes,
    measured_step_rows,
    repeat_row,
    run_sweep,
)
from lightning_ddp.command_line import parse_dataclass
from tests.support.cli_utils import REPO, repo_first_on_path

parse_config = partial(parse_dataclass, SweepConfig, prog="python -m lightning_ddp.bench")

BENCH_CONFIGS = sorted((REPO / "configs" / "bench").glob("*.yaml"))
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
CPU_LAYOUT = RankLayout("gloo", 2, 1)
WARMUP = 2  # warm-up steps in every fake timing_summary.json


def sweep_config(tmp_path: Path, repeats: int = 2, **grid) -> SweepConfig:
    """A small grid writing to tmp_path, with the all-reduce job and the load guard off (the runner is faked)."""
    return SweepConfig(
        grid=GridConfig(**{"strategies": ["naive_ddp", "bucketed_ddp"], "batch_sizes": [2], "context_lengths": [32, 64],
                           "bucket_sizes_mb": [1.0, "auto"], **grid}),
        workload=WorkloadConfig(base_config=QUICKSTART),
        run=RunConfig(predict_bucket_size=False, repeats=repeats, load_sample_s=0.0),
        output=OutputConfig(out_dir=str(tmp_path / "sweep"), plots=False, bootstrap_samples=200),
    )


def fake_summary(step_ms: float | list[float], share: float = 0.2, busy_ms: float = 10.0) -> dict:
    """A timing_summary.json: WARMUP warm-up steps of 1000 ms (they must never count), then the measured steps
    (``step_ms``, or 4 steps of it), each with share, busy time and memory 100 + its index."""
    measured = [float(step_ms)] * 4 if isinstance(step_ms, (int, float)) else [float(v) for v in step_ms]
    steps = [{"step": i, "step/time_ms": 1000.0, "comm/share": 0.9, "memory/peak_MiB": 999.0} for i in range(WARMUP)]
    for i, t in enumerate(measured):
        steps.append({"step": WARMUP + i, "step/time_ms": t, "comm/exposed_ms": share * t, "comm/share": share,
                      "comm/busy_ms": busy_ms, "comm/overlap": 0.5, "comm/busbw_GBps": 1.0,
                      "step/tokens_per_s": 1000.0, "memory/peak_MiB": 100.0 + i})
    median = sorted(measured)[len(measured) // 2]
    return {
        "run": {"bucket_size_mb": 4.0, "hparams": {"preset": "tiny", "vocab_size": 10000, "context_length": 64}},
        "warmup_steps": WARMUP,
        "summary": {"step/time_ms": {"median": median, "p10": min(measured), "p90": max(measured), "n": len(measured)},
                    "comm/share": {"median": share, "p10": share, "p90": share, "n": len(measured)}},
        "steps": steps,
    }


class FakeRunner:
    """Records ``(cell id, repeat)`` of every call; answers with ``outcomes[strategy]``, else ``step_ms(cell, k)``
    (default 100 ms) as an ok outcome."""

    def __init__(self, outcomes: dict[str, CellOutcome] | None = None, step_ms=None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.dirs: list[Path] = []
        self.outcomes = outcomes or {}
        self.step_ms = step_ms or (lambda cell, k: 100.0)

    def __call__(self, cell, run_dir: Path) -> CellOutcome:
        repeat = int(run_dir.name.removeprefix("r"))
        self.calls.append((cell.id, repeat))
        self.dirs.append(run_dir)
        if cell.strategy in self.outcomes:
            return self.outcomes[cell.strategy]
        return CellOutcome("ok", "", fake_summary(self.step_ms(cell, repeat)), 1.0)


def run_fake(config: SweepConfig, runner, **kwargs) -> object:
    return run_sweep(config, runner=runner, layout=CPU_LAYOUT, log=lambda line: None, **kwargs)


# ---- configuration ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", BENCH_CONFIGS, ids=lambda p: p.name)
def test_every_bench_config_validates(config: Path) -> None:
    sweep = parse_config(["--config", str(config)])
    assert expand_grid(sweep)


def test_cpu_config_grid_counts() -> None:
    sweep = parse_config(["--config", str(REPO / "configs" / "bench" / "cpu.yaml")])
    cells = expand_grid(sweep)
    groups = len(sweep.grid.batch_sizes) * len(sweep.grid.context_lengths) * len(sweep.grid.precisions)
    # per group: reference + naive_ddp + flat_ddp + overlap_ddp + ddp + fsdp2 + one cell per bucket size (4 sizes + auto) for each of
    # bucketed_ddp and bucketed_bf16_ddp
    assert len(cells) == groups * (6 + 2 * len(sweep.grid.bucket_sizes_mb)) == 4 * 16
    assert "auto" in sweep.grid.bucket_sizes_mb
    # 6 repeats: best bucket size chosen on 0, 2, 4 and measured on 1, 3, 5; uniform random tokens, not the
    # quickstart's learnable Markov chain
    assert sweep.run.repeats == 6 and sweep.workload.cli_args == ["--data.source", "synthetic"]


def test_xl_gpu_config_is_the_study_grid() -> None:
    sweep = parse_config(["--config", str(REPO / "configs" / "bench" / "xl_gpu.yaml")])
    assert sweep.workload.preset == "xl" and sweep.run.accelerator == "cuda" and sweep.run.backend == "auto"
    assert sweep.grid.batch_sizes == [2, 4] and sweep.grid.context_lengths == [128, 256, 512]
    assert set(sweep.grid.precisions) == {"bf16-mixed", "32-true"}
    assert [b for b in sweep.grid.bucket_sizes_mb if b != "auto"] == [1, 10, 100, 1000]
    assert sweep.run.repeats == 3


def test_empty_grid_is_an_error_that_names_the_fix(capsys) -> None:
    with pytest.raises(ValueError, match=r"the sweep has no cells: `strategies` is empty; list at least one of naive_ddp"):
        GridConfig(strategies=[])
    # ...and on the command line: exit 2, the message, no traceback.
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--grid.strategies", "[]"])
    assert exit_info.value.code == 2
    assert "the sweep has no cells: `strategies` is empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: GridConfig(strategies=["nccl_magic"]), "unknown strategy 'nccl_magic'.*choose from naive_ddp"),
        (lambda: GridConfig(batch_sizes=[]), "`batch_sizes` is empty"),
        (lambda: GridConfig(context_lengths=[0]), "integers >= 1"),
        (lambda: GridConfig(bucket_sizes_mb=[]), "`bucketed_ddp` is in `grid.strategies` but `grid.bucket_sizes_mb` is empty"),
        (lambda: GridConfig(bucket_sizes_mb=[-1.0]), "sizes > 0"),
        (lambda: GridConfig(precisions=["fp8"]), "unknown precision 'fp8'"),
        (lambda: RunConfig(devices=1), "reference is added"),
        (lambda: RunConfig(backend="nccl"), "nccl` needs CUDA"),
        (lambda: RunConfig(steps=0), "run.steps"),
        (lambda: WorkloadConfig(cli_args=["--data.batch_size", "8"]), "use `grid.batch_sizes` instead"),
        (lambda: WorkloadConfig(cli_args=["--trainer.strategy.init_args.x=1"]), "grid.strategies"),
        (lambda: RunConfig(repeats=0), r"`run.repeats` must be an integer >= 1.*--run.repeats 6"),
        (lambda: RunConfig(busy_threshold=1.5), r"`run.busy_threshold` is a fraction.*--run.busy_threshold 0.2"),
        (lambda: RunConfig(max_wait_s=-1.0), r"`run.max_wait_s` must be >= 0"),
        (lambda: RunConfig(load_sample_s=-1.0), r"`run.load_sample_s` must be >= 0 seconds.*0 turns the load guard off"),
        (lambda: OutputConfig(bootstrap_samples=10), r"`output.bootstrap_samples` must be an integer >= 100"),
    ],
)
def test_invalid_settings_say_what_to_change(make, match) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_help_documents_every_field(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_config(["--help"])
    out = capsys.readouterr().out
    for flag, words in [("--grid.bucket_sizes_mb", "auto"), ("--run.backend", "NCCL refuses"),
                        ("--run.launcher", "torchrun"), ("--output.retry_failed", "Rerun"),
                        ("--run.repeats", "round-robin"), ("--run.busy_threshold", "/proc/stat"),
                        ("--run.max_wait_s", "busy machine"), ("--run.load_sample_s", "turns the guard off"),
                        ("--output.bootstrap_samples", "hierarchical bootstrap"), ("--output.seed", "same intervals")]:
        assert flag in out and words in out, flag



# ---- grid and cells ---------------------------------------------------------------------------------------


def test_grid_always_has_ddp_and_reference_and_buckets_only_for_bucketed(tmp_path) -> None:
    config = sweep_config(tmp_path)  # naive_ddp + bucketed_ddp (1 MiB, auto), 1 batch size x 2 context lengths
    cells = expand_grid(config)
    # per group: reference, naive_ddp, bucketed_ddp 1, bucketed_ddp auto, ddp = 5; 2 groups
    assert len(cells) == 10
    for context in (32, 64):
        group = [c for c in cells if c.context_length == context]
        assert [(c.strategy, c.bucket_size_mb) for c in group] == [
            ("reference", None), ("naive_ddp", None), ("bucketed_ddp", 1.0), ("bucketed_ddp", "auto"), ("ddp", None)]
    assert all((c.bucket_size_mb is not None) == (c.strategy == "bucketed_ddp") for c in cells)
    assert {c.world_size for c in cells if c.strategy == "reference"} == {1}
    assert {c.world_size for c in cells if c.strategy != "reference"} == {2}
    # without bucketed_ddp the bucket sizes are ignored; ddp/reference listed explicitly are not duplicated
    cells = expand_grid(sweep_config(tmp_path, strategies=["ddp", "reference", "flat_ddp"]))
    assert [c.strategy for c in cells[:3]] == ["reference", "ddp", "flat_ddp"] and len(cells) == 6


def test_cell_ids_are_stable_unique_and_follow_what_is_measured(tmp_path) -> None:
    config = sweep_config(tmp_path)
    ids = [c.id for c in expand_grid(config)]
    assert ids == [c.id for c in expand_grid(sweep_config(tmp_path))]  # same config, same ids
    assert len(set(ids)) == len(ids)
    assert ids[2].startswith("bucketed_ddp-1mb-b2-t32-32-true-") and ids[3].startswith("bucketed_ddp-auto-b2-t32-")
    # Where results go and how long a cell may take do not change what it measures...
    config.output.out_dir, config.run.timeout_s, config.run.launcher = "/elsewhere", 5.0, "lightning"
    # ...nor do the number of repeats and the load guard (raising the repeats runs only the new ones)...
    config.run.repeats, config.run.busy_threshold, config.run.max_wait_s = 9, 0.5, 1.0
    assert [c.id for c in expand_grid(config)] == ids
    # ...the number of measured steps does.
    config.run.steps += 1
    assert not set(c.id for c in expand_grid(config)) & set(ids)


def test_cell_command_sets_the_axes_and_the_strategy(tmp_path) -> None:
    config = sweep_config(tmp_path)
    cells = {(c.strategy, c.bucket_size_mb, c.context_length): c for c in expand_grid(config)}
    command = cell_command(cells[("bucketed_ddp", 1.0, 64)], config, CPU_LAYOUT, tmp_path / "run")
    assert command[1:5] == ["-m", "lightning_ddp", "fit", "--config"]
    args = dict(zip(command[4::2], command[5::2]))  # flag/value pairs after `fit`
    assert args["--data.batch_size"] == "2" and args["--data.seq_len"] == "64" and args["--model.context_length"] == "64"
    assert args["--trainer.max_steps"] == str(config.run.warmup_steps + config.run.steps)
    assert args["--timer.warmup_steps"] == str(config.run.warmup_steps)
    # The quickstart (the base config) validates every 40 steps; a cell never does, nor runs a sanity check.
    assert args["--trainer.limit_val_batches"] == "0" and args["--trainer.num_sanity_val_steps"] == "0"
    assert json.loads(args["--trainer.strategy"]) == {
        "class_path": "lightning_ddp.strategies.GradSyncStrategy",
        "init_args": {"algorithm": "bucketed_ddp", "process_group_backend": "gloo", "bucket_size_mb": 1.0},
    }
    assert json.loads(args["--trainer.logger"])["init_args"]["save_dir"] == str(tmp_path / "run")
    reference_command = cell_command(cells[("reference", None, 64)], config, CPU_LAYOUT, tmp_path)
    reference = dict(zip(reference_command[4::2], reference_command[5::2]))
    assert reference["--trainer.devices"] == "1" and reference["--trainer.strategy"] == "auto"


def test_sharded_strategies_are_sweep_cells_and_zero2_has_a_bucket_axis(tmp_path) -> None:
    config = sweep_config(tmp_path, strategies=["zero1_ddp", "zero2_ddp"])  # bucket sizes 1 MiB and auto
    group = [c for c in expand_grid(config) if c.context_length == 32]
    # zero1_ddp's reduce_scatter schedule has no buckets; zero2_ddp reduces buckets to their owners: one cell per size.
    assert [(c.strategy, c.bucket_size_mb) for c in group] == [
        ("reference", None), ("zero1_ddp", None), ("zero2_ddp", 1.0), ("zero2_ddp", "auto"), ("ddp", None)]
    strategies = {}
    for cell in group[1:3]:
        command = cell_command(cell, config, CPU_LAYOUT, tmp_path / cell.id)
        strategies[cell.strategy] = json.loads(dict(zip(command[4::2], command[5::2]))["--trainer.strategy"])
    assert strategies == {
        "zero1_ddp": {"class_path": "lightning_ddp.strategies.ZeRO1DDPStrategy",
                  "init_args": {"schedule": "reduce_scatter", "process_group_backend": "gloo"}},
        "zero2_ddp": {"class_path": "lightning_ddp.strategies.ZeRO2DDPStrategy",
                  "init_args": {"bucket_size_mb": 1.0, "process_group_backend": "gloo"}},
    }


def test_rank_layout_picks_the_backend() -> None:
    def layout(accelerator="cuda", backend="auto", launcher="ranks", gpus=0, visible=None):
        run = RunConfig(accelerator=accelerator, backend=backend, launcher=launcher)  # a valid run section
        return rank_layout(run.accelerator, run.devices, run.backend, run.launcher, gpus, visible)

    assert layout("cpu") == RankLayout("gloo", 2, 1)
    assert layout(gpus=2) == RankLayout("nccl", 2, 1) and layout(gpus=8).backend == "nccl"
    assert layout(gpus=2, backend="gloo") == RankLayout("gloo", 2, 1)
    # One GPU, two ranks: gloo with CUDA tensors, each rank a 'node' of one device, both on GPU 0 (or the visible one).
    assert layout(gpus=1) == RankLayout("gloo", 1, 2, ("0", "0"))
    assert layout(gpus=1, visible="3").gpu_of_rank == ("3", "3")
    for kwargs, match in [({"gpus": 1, "backend": "nccl"}, "NCCL refuses two ranks"),
                          ({"gpus": 1, "launcher": "lightning"}, "launcher: ranks"),
                          ({"gpus": 0}, "no GPU is visible")]:
        with pytest.raises(ValueError, match=match):
            layout(**kwargs)


def test_rank_environments(tmp_path) -> None:
    config = sweep_config(tmp_path)
    cells = {c.strategy: c for c in expand_grid(config)}
    parent = {"PATH": "/bin", "SLURM_NTASKS": "8", "RANK": "5", "TORCHELASTIC_RUN_ID": "x"}
    envs = cell_environments(cells["naive_ddp"], config, CPU_LAYOUT, 12345, parent)
    assert [(e["RANK"], e["LOCAL_RANK"], e["NODE_RANK"], e["WORLD_SIZE"], e["MASTER_PORT"]) for e in envs] == [
        ("0", "0", "0", "2", "12345"), ("1", "1", "0", "2", "12345")]
    assert all("SLURM_NTASKS" not in e and "TORCHELASTIC_RUN_ID" not in e and e["PATH"] == "/bin" for e in envs)
    # the reference: one process without launcher variables, the same threads as a rank
    (reference,) = cell_environments(cells["reference"], config, CPU_LAYOUT, 12345, parent)
    assert "MASTER_PORT" not in reference and "RANK" not in reference
    assert reference["OMP_NUM_THREADS"] == envs[0]["OMP_NUM_THREADS"]
    # shared GPU: every rank a node of one device, its own CUDA_VISIBLE_DEVICES
    shared = RankLayout("gloo", 1, 2, ("0", "0"))
    envs = cell_environments(cells["naive_ddp"], config, shared, 1, parent)
    assert [(e["NODE_RANK"], e["LOCAL_RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in envs] == [("0", "0", "0"), ("1", "0", "0")]


# ---- the files: repeats.csv, steps.csv, results.csv -------------------------------------------------------


def test_csv_schemas_are_exactly_these_columns() -> None:
    assert REPEAT_COLUMNS == (
        "cell_id", "repeat", "strategy", "bucket_size_mb", "engine_settings", "batch_size", "context_length",
        "precision", "model",
        "world_size", "accelerator", "backend", "status", "reason", "wall_s", "measured_steps",
        "resolved_bucket_size_mb", "busy_before", "waited_s", "busy", "load_avg_1m", "started_at",
    )
    assert RESULT_COLUMNS == (
        "cell_id", "strategy", "bucket_size_mb", "engine_settings", "batch_size", "context_length", "precision", "model",
        "world_size", "accelerator", "backend", "status", "reason", "repeats_ok", "repeats_run",
        "step_ms_median", "step_ms_lo", "step_ms_hi", "step_ms_p10", "step_ms_p90", "exposed_comm_ms", "busy_comm_ms",
        "wait_comm_ms", "transfer_comm_ms", "comm_share", "comm_share_lo", "comm_share_hi", "overlap", "busbw_GBps", "tokens_per_s", "mfu",
        "peak_memory_MiB", "resolved_bucket_size_mb", "measured_steps", "wall_s", "load_avg_1m", "busy_repeats",
        "waited_s",
    )


def test_a_cells_row_pools_the_measured_steps_of_its_repeats(tmp_path) -> None:
    cell = next(c for c in expand_grid(sweep_config(tmp_path)) if c.strategy == "bucketed_ddp")
    repeat_rows, step_rows = [], []
    for k, steps in enumerate([[100.0, 110.0, 120.0, 130.0], [140.0, 150.0, 160.0, 170.0]]):
        outcome = CellOutcome("ok", "", fake_summary(steps, share=0.25), 7.5)
        load = LoadCheck(busy_before=0.5 if k else 0.1, waited_s=30.0 if k else 0.0, busy=bool(k))
        raw = repeat_row(cell, k, outcome, load, model="tiny", accelerator="cpu", backend="gloo",
                         load_avg_1m=round(1.234 + k, 2), started_at="2025-01-01T00:00:00+00:00")
        repeat_rows.append(parse_row({c: "" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
                                      for c, v in raw.items()}, REPEAT_COLUMNS))
        step_rows += measured_step_rows(cell.id, k, outcome.summary)
    assert len(step_rows) == 8 and all(s["step/time_ms"] < 1000 for s in step_rows)  # the 2 warm-up steps are out
    assert repeat_rows[1]["busy"] is True and repeat_rows[1]["measured_steps"] == 4.0
    row = cell_row(cell_data(repeat_rows, step_rows)[cell.id], Bootstrapper(200, seed=0))
    # 8 pooled steps 100..170: the median is between 130 and 140; p10 at rank 0.7 -> 107, p90 at rank 6.3 -> 163
    assert row["step_ms_median"] == 135.0 and row["measured_steps"] == 8
    assert row["step_ms_p10"] == pytest.approx(107.0) and row["step_ms_p90"] == pytest.approx(163.0)
    # the interval holds the median and cannot leave the measured range
    assert 100.0 <= row["step_ms_lo"] < 135.0 < row["step_ms_hi"] <= 170.0
    # share 0.25 in every step: a zero-width interval; exposed = 0.25 x step pools to 0.25 x 135
    assert (row["comm_share"], row["comm_share_lo"], row["comm_share_hi"]) == (0.25, 0.25, 0.25)
    assert row["exposed_comm_ms"] == pytest.approx(33.75) and row["busy_comm_ms"] == 10.0
    assert row["peak_memory_MiB"] == 103.0  # max of 100..103 (a warm-up step's 999 does not count)
    assert row["resolved_bucket_size_mb"] == 4.0 and row["mfu"] == ""  # not logged on CPU: an empty cell
    # the cell's bookkeeping: 2 of 2 repeats ok, 7.5 s each, highest load 2.23, 1 started busy after 30 s waited
    assert (row["repeats_ok"], row["repeats_run"], row["wall_s"], row["load_avg_1m"]) == (2, 2, 15.0, 2.23)
    assert (row["busy_repeats"], row["waited_s"]) == (1, 30.0)
    assert row["status"] == "ok" and row["reason"] == ""


def test_the_sweep_writes_raw_and_aggregate_files(tmp_path) -> None:
    config = sweep_config(tmp_path)
    cells = expand_grid(config)  # 10 cells, 2 repeats each
    run_fake(config, FakeRunner(step_ms=lambda cell, k: [100.0 + k, 101.0 + k, 102.0 + k, 103.0 + k]))
    out = tmp_path / "sweep"
    repeats = read_rows(out / "repeats.csv", REPEAT_COLUMNS)
    assert sorted(repeats) == sorted((c.id, k) for c in cells for k in range(2))
    steps = read_steps(out / "steps.csv")
    assert sum(len(rows) for rows in steps.values()) == 10 * 2 * 4  # every measured step, no warm-up step
    with open(out / "steps.csv", newline="") as f:
        header = next(csv.reader(f))
    assert header[:3] == ["cell_id", "repeat", "step"]
    assert {"step/time_ms", "comm/share", "comm/busy_ms", "comm/exposed_ms", "memory/peak_MiB"} <= set(header)
    assert [s["step"] for s in steps[(cells[0].id, 1)]] == [2, 3, 4, 5]  # step numbers after the 2 warm-up ones
    results = read_rows(out / "results.csv")
    # repeat 0: 100..103, repeat 1: 101..104: pooled 100, 101, 101, 102, 102, 103, 103, 104 -> median 102
    assert list(results) == [c.id for c in cells] and results[cells[0].id]["step_ms_median"] == 102.0
    assert not list(out.glob("*.tmp"))  # every atomic write renamed its temporary file
    assert not (out / "profiles.json").exists()  # no cell wrote a compute profile


def test_profiles_json_keeps_the_first_ok_repeats_compute_profile(tmp_path) -> None:
    config = sweep_config(tmp_path, strategies=["naive_ddp"], context_lengths=[32])  # reference, naive_ddp, ddp

    def runner(cell, run_dir):
        k = int(run_dir.name[1:])
        profile = None if cell.strategy == "ddp" else {"forward_ms": 10.0 + k, "grad_ready_ms": {"w": 1.0}}
        return CellOutcome("ok", "", fake_summary(100.0), 1.0, profile)

    run_fake(config, runner)
    profiles = json.loads((tmp_path / "sweep" / "profiles.json").read_text())
    cells = {c.strategy: c.id for c in expand_grid(config)}
    # repeat 0's profile (forward 10 ms, not repeat 1's 11 ms); ddp wrote none and is left out
    assert profiles == {cells["reference"]: {"forward_ms": 10.0, "grad_ready_ms": {"w": 1.0}},
                        cells["naive_ddp"]: {"forward_ms": 10.0, "grad_ready_ms": {"w": 1.0}}}


# ---- the sweep with a fake cell runner --------------------------------------------------------------------


def test_repeats_run_interleaved_round_robin_each_in_its_own_directory(tmp_path) -> None:
    config = sweep_config(tmp_path, repeats=3)
    cells = expand_grid(config)
    runner = FakeRunner()
    result = run_fake(config, runner)
    # repeat 0 of every cell in grid order, then repeat 1 of every cell, then repeat 2
    assert runner.calls == [(c.id, k) for k in range(3) for c in cells]
    assert result.ran == runner.calls
    assert runner.dirs[:2] == [tmp_path / "sweep" / "runs" / cells[0].id / "r0", tmp_path / "sweep" / "runs" / cells[1].id / "r0"]
    assert runner.dirs[len(cells)] == tmp_path / "sweep" / "runs" / cells[0].id / "r1"


class Interrupted(FakeRunner):
    """A fake runner that is 'killed' (KeyboardInterrupt, like SIGTERM) when asked to run its ``stop``-th repeat."""

    def __init__(self, stop: int) -> None:
        super().__init__()
        self.stop = stop

    def __call__(self, cell, run_dir):
        if len(self.calls) + 1 == self.stop:
            raise KeyboardInterrupt
        return super().__call__(cell, run_dir)


def test_resume_runs_only_the_missing_repeats(tmp_path) -> None:
    config = sweep_config(tmp_path)
    cells = expand_grid(config)
    order = [(c.id, k) for k in range(2) for c in cells]
    out = tmp_path / "sweep"
    with pytest.raises(KeyboardInterrupt):
        run_fake(config, Interrupted(stop=13))  # killed while running repeat 1 of the third cell
    assert list(read_rows(out / "repeats.csv", REPEAT_COLUMNS)) == order[:12]  # the 12 finished repeats are kept
    # A kill between writing steps.csv and repeats.csv leaves steps of a repeat without a row: they are ignored,
    # and that repeat runs again.
    with open(out / "steps.csv", "a", encoding="utf-8") as f:
        f.write(f"{order[12][0]},{order[12][1]},2,999.0\n")

    runner = FakeRunner()
    result = run_fake(config, runner)
    assert runner.calls == order[12:]  # none of the finished repeats ran again
    assert [r["cell_id"] for r in result.analysis.rows] == [c.id for c in cells]
    assert [s["step/time_ms"] for s in read_steps(out / "steps.csv")[order[12]]] == [100.0] * 4  # not the 999

    assert run_fake(config, FakeRunner()).ran == []  # nothing left
    # every session that ran is kept in environment.json, with the repeats already done when it started
    sessions = json.loads((out / "environment.json").read_text())["sessions"]
    assert [s["repeats_done_before"] for s in sessions[1:]] == [12, 2 * len(cells)]
    assert len(sessions) == 3 and all("git_commit" in s for s in sessions)
    config.run.repeats = 3  # more repeats: the same cell ids, only repeat 2 of every cell runs
    more = FakeRunner()
    run_fake(config, more)
    assert more.calls == [(c.id, 2) for c in cells]
    assert read_rows(out / "results.csv")[cells[0].id]["repeats_ok"] == 3


def test_failed_repeats_are_kept_and_retried_only_when_asked(tmp_path) -> None:
    config = sweep_config(tmp_path, strategies=["naive_ddp"], context_lengths=[32])  # reference, naive_ddp, ddp

    def runner(cell, run_dir):
        if cell.strategy == "naive_ddp" and run_dir.name == "r1":
            return CellOutcome("failed", "rank 0 (exit code 1): RuntimeError: bad")
        return CellOutcome("ok", "", fake_summary(100.0), 1.0)

    run_fake(config, runner)
    naive_ddp = next(c for c in expand_grid(config) if c.strategy == "naive_ddp")
    row = read_rows(tmp_path / "sweep" / "results.csv")[naive_ddp.id]
    # one ok repeat is enough for statistics; the reason says which repeat failed and how many
    assert row["status"] == "ok" and row["repeats_ok"] == 1 and row["repeats_run"] == 2 and row["measured_steps"] == 4
    assert row["reason"] == "r1: failed: rank 0 (exit code 1): RuntimeError: bad (1 of 2 repeats not ok)"
    assert run_fake(config, FakeRunner()).ran == []  # a failed repeat is done unless retry_failed
    config.output.retry_failed = True
    retry = FakeRunner()
    run_fake(config, retry)
    assert retry.calls == [(naive_ddp.id, 1)]
    assert read_rows(tmp_path / "sweep" / "results.csv")[naive_ddp.id]["repeats_ok"] == 2


def test_failing_cells_get_rows_and_the_sweep_goes_on(tmp_path) -> None:
    config = sweep_config(tmp_path)
    runner = FakeRunner({
        "naive_ddp": CellOutcome("oom", "rank 1: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
        "bucketed_ddp": CellOutcome("timeout", "no result after 600 s"),
        "ddp": CellOutcome("failed", "rank 0 (exit code 1): RuntimeError: bad"),
    })
    result = run_fake(config, runner)
    assert len(runner.calls) == 2 * len(expand_grid(config))  # every repeat of every cell was attempted
    by_strategy = {r["strategy"]: r for r in result.analysis.rows}
    assert by_strategy["naive_ddp"]["status"] == "oom" and "out of memory" in by_strategy["naive_ddp"]["reason"]
    assert by_strategy["bucketed_ddp"]["status"] == "timeout"
    assert by_strategy["ddp"]["status"] == "failed" and by_strategy["ddp"]["step_ms_median"] is None
    assert by_strategy["reference"]["status"] == "ok"
    report = (tmp_path / "sweep" / "results.md").read_text()
    assert "## Cell repeats that did not finish" in report and "CUDA out of memory" in report
    assert "not measurable" in report  # goals that need the failed cells


def test_report_only_rebuilds_everything_from_steps_and_repeats(tmp_path) -> None:
    config = sweep_config(tmp_path, repeats=3)
    with pytest.raises(ValueError, match="has no rows.*run the sweep first"):
        run_fake(SweepConfig(**{**config.__dict__, "output": OutputConfig(out_dir=str(tmp_path / "none"), report_only=True)}), FakeRunner())
    run_fake(config, FakeRunner(step_ms=lambda cell, k: [90.0 + 3 * k + len(cell.strategy), 95.0 + k, 97.0, 99.0 - k]))
    out = tmp_path / "sweep"
    csv_text, md_text = (out / "results.csv").read_text(), (out / "results.md").read_text()
    (out / "results.csv").unlink()
    (out / "results.md").unlink()
    config.output.report_only = True
    runner = FakeRunner()
    run_fake(config, runner)
    assert runner.calls == []
    # the same numbers: the raw files hold everything, and the bootstrap's seed makes the intervals reproducible
    assert (out / "results.csv").read_text() == csv_text and (out / "results.md").read_text() == md_text


# ---- classification of real and simulated failures -------------------------------------------------------


def test_classify() -> None:
    traceback = "Traceback (most recent call last):\n  File 'x'\n    y()\nRuntimeError: Connection closed by peer\n"
    oom = "Traceback:\n  File 'm.py'\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB\n"
    # rank 1 ran out of memory first; rank 0 then lost its peer and exited too
    status, reason = classify(ProcessResult([1, 1], False, set(), first_failed=1), [traceback, oom], summary_found=False)
    assert status == "oom" and reason.startswith("rank 1: torch.OutOfMemoryError: CUDA out of memory")
    assert classify(ProcessResult([1], False, set(), 0), ["MemoryError\n"], False)[0] == "oom"  # CPU
    # SIGKILL we did not send: the kernel's OOM killer; SIGKILL we sent after a peer failed: not an OOM
    assert classify(ProcessResult([-9, 1], False, set(), 0), ["", traceback], False)[0] == "oom"
    status, reason = classify(ProcessResult([1, -9], False, {1}, 0), ["ValueError: bad size\n", ""], False)
    assert (status, reason) == ("failed", "rank 0 (exit code 1): ValueError: bad size")
    assert classify(ProcessResult([-9, -9], True, {0, 1}, None), ["", "step 3\n"], False, 30)[0:1] == ("timeout",)
    assert classify(ProcessResult([0, 0], False, set(), None), ["", ""], summary_found=True) == ("ok", "")
    assert classify(ProcessResult([0], False, set(), None), ["done\n"], summary_found=False)[0] == "failed"


def test_error_line_finds_the_last_meaningful_line() -> None:
    jsonargparse = "usage: lightning_ddp [-h]\n                     [--trainer.x X]\ntip: run --help\nerror: unrecognized arguments: --trainer.bogus 1\n"
    assert error_line(jsonargparse) == "error: unrecognized arguments: --trainer.bogus 1"
    warnings = "RuntimeError: the real one\n/site-packages/x.py:3: UserWarning: noise\n  warnings.warn(\n"
    assert error_line(warnings) == "RuntimeError: the real one"
    assert error_line("just a line\n\n") == "just a line"
    assert error_line("") == ""


def test_run_processes_kills_on_timeout_and_after_a_peer_fails(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(launch_module, "_GRACE_S", 0.5)
    sleep = [sys.executable, "-c", "import os, sys, time; sys.exit(int(os.environ['CODE'])) if os.environ['CODE'] != 'sleep' else time.sleep(60)"]
    env = dict(os.environ)
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    # one rank fails at once, the other would wait forever: it is killed after the grace period
    result = run_processes(sleep, [{**env, "CODE": "3"}, {**env, "CODE": "sleep"}], logs, timeout_s=30)
    assert result.returncodes[0] == 3 and result.first_failed == 0 and result.killed_by_us == {1}
    assert not result.timed_out and result.wall_s < 20
    # nobody finishes: everything is killed at the limit
    result = run_processes(sleep, [{**env, "CODE": "sleep"}], logs[:1], timeout_s=1)
    assert result.timed_out and result.killed_by_us == {0}
    # a process that dies by SIGKILL on its own (as under the OOM killer) is an out-of-memory cell
    suicide = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    result = run_processes(suicide, [env], logs[:1], timeout_s=30)
    status, reason = classify(result, [""], False)
    assert status == "oom" and "SIGKILL" in reason


def test_a_real_cell_with_an_invalid_option_fails_with_its_error_line(tmp_path) -> None:
    # The reference cell is one process; the invalid option makes the CLI exit at parse time.
    config = sweep_config(tmp_path)
    config.workload.cli_args = ["--trainer.bogus_option", "1"]
    cell = next(c for c in expand_grid(config) if c.strategy == "reference")
    outcome = SubprocessCellRunner(config, CPU_LAYOUT, cwd=str(REPO))(cell, tmp_path / "run")
    assert outcome.status == "failed", outcome
    assert "unrecognized arguments: --trainer.bogus_option" in outcome.reason
    assert (tmp_path / "run" / "rank0.log").exists() and (tmp_path / "run" / "command.txt").exists()


# ---- the best bucket size, goals and verdicts ---------------------------------------------------------------


def selection_sweep(tmp_path, repeats: int):
    """bucketed_ddp at 1 and 4 MiB, ddp and the reference in one group. 1 MiB is lucky on the even repeats (80 ms) and
    slow on the odd ones (120 ms); 4 MiB is 95 ms always, ddp 100 ms, the reference 60 ms."""
    config = sweep_config(tmp_path, repeats=repeats, strategies=["bucketed_ddp"], context_lengths=[64],
                          bucket_sizes_mb=[1.0, 4.0])

    def step_ms(cell, k):
        if cell.strategy == "bucketed_ddp":
            return (80.0 if k % 2 == 0 else 120.0) if cell.bucket_size_mb == 1.0 else 95.0
        return {"ddp": 100.0, "reference": 60.0}[cell.strategy]

    return config, run_fake(config, FakeRunner(step_ms=step_ms))


def test_the_best_bucket_size_is_chosen_on_even_repeats_and_measured_on_odd_ones(tmp_path) -> None:
    config, result = selection_sweep(tmp_path, repeats=2)
    rows = {(r["strategy"], r["bucket_size_mb"]): r for r in result.analysis.rows}
    # Over all repeats 4 MiB looks best (95 ms; 1 MiB pools 4 x 80 and 4 x 120 -> 100 ms), and on the selection
    # repeat alone 1 MiB looks best (80 ms): picking and reporting the in-sample minimum would say 80 / 100 = 0.8.
    assert rows[("bucketed_ddp", 1.0)]["step_ms_median"] == 100.0 and rows[("bucketed_ddp", 4.0)]["step_ms_median"] == 95.0
    report = (tmp_path / "sweep" / "results.md").read_text()
    # chosen on repeat 0 (80 < 95), measured on repeat 1: 120 ms; 120 / 100 = 1.2 > 1 in every draw: missed
    assert "| 32-true | 2 | 64 | bucketed_ddp | 1 MiB, best of 2 on 0 | 80.0 ms | repeats 1: 120.0 ms [120.0, 120.0] |" in report
    assert ("| 1. bucketed_ddp (best) step time / ddp step time | 1.200 [1.200, 1.200] | 1 | **missed** | best size 1 MiB "
            "(chosen on repeats 0) |") in report
    # goal 3 from the same evaluation repeat: 120 / max(reference 60, busy 10) = 2.0
    assert "| 2.000 [2.000, 2.000] | 1.1 | **missed** |" in report
    assert "chosen on the *selection* repeats (even indices 0, 2, 4, ...)" in report  # and results.md says so
    # the table shows every cell over all its repeats (1 MiB pools to 100 ms); the selected size is bold
    assert "| bucketed_ddp 1 MiB | **100.0 ms [80.0, 120.0] (20.0 % [20.0, 20.0])** |" in report


def test_with_one_repeat_the_choice_is_in_sample_and_its_goals_inconclusive(tmp_path) -> None:
    _, result = selection_sweep(tmp_path, repeats=1)
    report = (tmp_path / "sweep" / "results.md").read_text()
    # 80 / 100 = 0.8 would be "met", but it was chosen and measured on the same repeat
    assert "| 1 MiB, best of 2 on 0 | 80.0 ms | in-sample, repeats 0: 80.0 ms [80.0, 80.0] |" in report
    assert ("| 1. bucketed_ddp (best) step time / ddp step time | 0.800 [0.800, 0.800] | 1 | inconclusive | best size 1 MiB, "
            "in-sample (no evaluation repeat) |") in report
    assert "**0 met, 0 missed, 2 inconclusive, 2 not measurable**" in report  # goals 1 and 3; goal 2 has no naive_ddp


def _study(cells: list[tuple], context: int = 64) -> tuple[list, list, list]:
    """repeats.csv and steps.csv rows for hand-made cells ``(strategy, bucket, [steps of repeat 0, of repeat 1, ...],
    share, busy[, engine settings text])``, in one group."""
    repeat_rows, step_rows = [], []
    for strategy, bucket, repeats, share, busy, *settings in cells:
        engine_settings = settings[0] if settings else ""
        cell_id = f"{strategy}{bucket}{engine_settings}-{context}"
        for k, steps in enumerate(repeats):
            repeat_rows.append(parse_row({"cell_id": cell_id, "repeat": str(k), "strategy": strategy,
                                          "bucket_size_mb": str(bucket), "engine_settings": engine_settings,
                                          "batch_size": "2", "context_length": str(context),
                                          "precision": "32-true", "status": "ok"}, REPEAT_COLUMNS))
            step_rows += [{"cell_id": cell_id, "repeat": k, "step": i, "step/time_ms": t, "comm/share": share,
                           "comm/busy_ms": busy} for i, t in enumerate(steps)]
    return repeat_rows, step_rows


def _report(repeat_rows, step_rows) -> str:
    return build_report(Analysis(cell_data(repeat_rows, step_rows), Bootstrapper(2000, seed=0)), "t")


def test_verdicts_met_missed_inconclusive_and_not_measurable_in_results_md() -> None:
    # Group ctx 64: bucketed_ddp (1 MiB) 90 ms on both repeats, ddp 100: 0.9 in every draw -> met.
    # Overlap share 0.15 / naive_ddp 0.6 = 0.25 and bucketed_ddp 0.1 / 0.6 = 0.167 <= 1/3 -> met, met.
    # Goal 3: 90 / reference, whose repeats are 80 and 84 ms: draws 90/80, 90/82, 90/84 = 1.125, 1.098, 1.071 around
    # 1.10 -> inconclusive (point 90 / 82 = 1.098, the pooled median of 4 x 80 and 4 x 84 being 82).
    g64 = _study([("reference", "", [[80.0] * 4, [84.0] * 4], 0.0, 0.0),
                  ("naive_ddp", "", [[150.0] * 4] * 2, 0.6, 60.0),
                  ("overlap_ddp", "", [[110.0] * 4] * 2, 0.15, 60.0),
                  ("bucketed_ddp", 1.0, [[90.0] * 4] * 2, 0.1, 50.0),
                  ("ddp", "", [[100.0] * 4] * 2, 0.1, 50.0)])
    # Group ctx 128: bucketed_ddp 90 / ddp 80 = 1.125 -> missed; no naive_ddp, no reference: 3 goals not measurable.
    g128 = _study([("bucketed_ddp", 1.0, [[90.0] * 4] * 2, 0.1, 50.0), ("ddp", "", [[80.0] * 4] * 2, 0.1, 50.0)], context=128)
    report = _report(g64[0] + g128[0], g64[1] + g128[1])
    assert "**3 met, 1 missed, 1 inconclusive, 3 not measurable**" in report
    assert "| 64 | 1. bucketed_ddp (best) step time / ddp step time | 0.900 [0.900, 0.900] | 1 | met |" in report
    assert "| 64 | 2. overlap_ddp comm share / naive_ddp comm share | 0.250 [0.250, 0.250] | 0.333 | met |" in report
    assert "| 64 | 3. bucketed_ddp (best) step time / max(reference step, busy comm) | 1.098 [1.071, 1.125] | 1.1 | inconclusive |" in report
    assert "floor 82.0 ms (compute)" in report
    assert "| 128 | 1. bucketed_ddp (best) step time / ddp step time | 1.125 [1.125, 1.125] | 1 | **missed** |" in report
    assert "| 128 | 2. overlap_ddp comm share / naive_ddp comm share | - | 0.333 | not measurable | no naive_ddp cell |" in report
    # Across groups: sqrt(0.9 x 1.125) = 1.006 > 0.95 in every draw: missed; one group met, one missed.
    assert "| all |  | 2 groups | 1. bucketed_ddp (best) / ddp step time, geometric mean over groups | 1.006 [1.006, 1.006] | 0.95 | **missed** | groups <= 1.00 met / missed / inconclusive / not measurable: 1 / 1 / 0 / 0 |" in report


@pytest.fixture
def second_bucketed_algorithm(monkeypatch):
    """A second algorithm with a bucket size (as bucketed_bf16_ddp will be), registered for one test."""
    from lightning_ddp import catalogue

    monkeypatch.setitem(catalogue.STRATEGIES, "bucketed_alt", catalogue.Entry(
        "bucketed_alt", "bucketed_ddp, again (a test's stand-in)", engine="lightning_ddp.sync.bucketed:BucketedDDP",
        has_bucket_size=True, memory="bucketed"))
    return "bucketed_alt"


def test_every_algorithm_with_buckets_gets_goal_1_and_an_across_groups_row(second_bucketed_algorithm) -> None:
    # bucketed_alt: 1 MiB 98 / 102 ms on repeats 0 / 1, 4 MiB 99 ms: chosen 1 MiB on repeat 0 (98 < 99), measured
    # on repeat 1: 102 / ddp 100 = 1.02 -> missed. Across one group the geometric mean is that ratio.
    repeat_rows, step_rows = _study([("bucketed_ddp", 1.0, [[90.0] * 4] * 2, 0.1, 50.0),
                                     ("bucketed_alt", 1.0, [[98.0] * 4, [102.0] * 4], 0.1, 50.0),
                                     ("bucketed_alt", 4.0, [[99.0] * 4] * 2, 0.1, 50.0),
                                     ("ddp", "", [[100.0] * 4] * 2, 0.1, 50.0)])
    report = _report(repeat_rows, step_rows)
    assert "| 1. bucketed_alt (best) step time / ddp step time | 1.020 [1.020, 1.020] | 1 | **missed** | best size 1 MiB" in report
    assert "| all |  | 1 groups | 1. bucketed_alt (best) / ddp step time, geometric mean over groups | 1.020 [1.020, 1.020] | 0.95 | **missed** | groups <= 1.00 met / missed / inconclusive / not measurable: 0 / 1 / 0 / 0 |" in report
    assert "| all |  | 1 groups | 1. bucketed_ddp (best) / ddp step time, geometric mean over groups | 0.900 [0.900, 0.900] | 0.95 | met | groups <= 1.00 met / missed / inconclusive / not measurable: 1 / 0 / 0 / 0 |" in report
    assert "| 32-true | 2 | 64 | bucketed_alt | 1 MiB, best of 2 on 0 | 98.0 ms | repeats 1: 102.0 ms [102.0, 102.0] |" in report


def test_each_engine_settings_variant_has_its_own_best_bucket_size_goal_and_rows() -> None:
    # bucketed_powersgd_ddp at rank 1 and rank 4 (grid.engine_settings), two bucket sizes each, chosen per variant:
    # rank=1: 1 MiB 70 / 72 ms on repeats 0 / 1, 4 MiB 75: chosen 1 MiB (70 < 75), measured 72 -> 72 / 100 = 0.72.
    # rank=4: 1 MiB 85, 4 MiB 80 / 90: chosen 4 MiB (80 < 85), measured 90 -> 0.9. Mixing the variants would
    # have chosen rank=1 at 1 MiB for both.
    repeat_rows, step_rows = _study([("bucketed_ddp", 1.0, [[95.0] * 4] * 2, 0.1, 50.0),
                                     ("bucketed_powersgd_ddp", 1.0, [[70.0] * 4, [72.0] * 4], 0.1, 20.0, "rank=1"),
                                     ("bucketed_powersgd_ddp", 4.0, [[75.0] * 4] * 2, 0.1, 20.0, "rank=1"),
                                     ("bucketed_powersgd_ddp", 1.0, [[85.0] * 4] * 2, 0.1, 30.0, "rank=4"),
                                     ("bucketed_powersgd_ddp", 4.0, [[80.0] * 4, [90.0] * 4], 0.1, 30.0, "rank=4"),
                                     ("ddp", "", [[100.0] * 4] * 2, 0.1, 50.0)])
    report = _report(repeat_rows, step_rows)
    lines = report.splitlines()
    assert "| 32-true | 2 | 64 | bucketed_powersgd_ddp rank=1 | 1 MiB, best of 2 on 0 | 70.0 ms | repeats 1: 72.0 ms" in report
    assert "| 32-true | 2 | 64 | bucketed_powersgd_ddp rank=4 | 4 MiB, best of 2 on 0 | 80.0 ms | repeats 1: 90.0 ms" in report
    assert "| 1. bucketed_powersgd_ddp rank=1 (best) step time / ddp step time | 0.720 [0.720, 0.720] | 1 | met |" in report
    assert "| 1. bucketed_powersgd_ddp rank=4 (best) step time / ddp step time | 0.900 [0.900, 0.900] | 1 | met |" in report
    assert "| all |  | 1 groups | 1. bucketed_powersgd_ddp rank=4 (best) / ddp step time, geometric mean over groups | 0.900 [0.900, 0.900] | 0.95 | met | groups <= 1.00 met / missed / inconclusive / not measurable: 1 / 0 / 0 / 0 |" in report
    # table rows: bucketed_ddp, then the variants in first-seen order, sizes ascending; the selected size in bold
    titles = [line.split(" | ")[0][2:] for line in lines if line.startswith("| bucketed_")][:5]
    assert titles == ["bucketed_ddp 1 MiB", "bucketed_powersgd_ddp 1 MiB rank=1", "bucketed_powersgd_ddp 4 MiB rank=1",
                      "bucketed_powersgd_ddp 1 MiB rank=4", "bucketed_powersgd_ddp 4 MiB rank=4"]
    assert "| bucketed_powersgd_ddp 4 MiB rank=4 | **85.0 ms [80.0, 90.0]" in report  # 4 x 80 and 4 x 90 pool to 85


def test_a_report_of_one_repeat_of_one_step_renders_with_the_auto_cells_resolved_size() -> None:
    repeat_rows, step_rows = _study([("reference", "", [[60.0]], 0.0, 0.0), ("bucketed_ddp", 4.0, [[90.0]], 0.1, 5.0),
                                     ("bucketed_ddp", "auto", [[92.0]], 0.1, 5.0), ("ddp", "", [[100.0]], 0.1, 5.0)])
    for row in repeat_rows:
        row["resolved_bucket_size_mb"] = 4.8828125 if row["bucket_size_mb"] == "auto" else None
    report = _report(repeat_rows, step_rows)
    assert "| bucketed_ddp 4 MiB | **90.0 ms [90.0, 90.0] (10.0 % [10.0, 10.0])** |" in report
    assert "| bucketed_ddp auto | 92.0 ms [92.0, 92.0] (10.0 % [10.0, 10.0]) |" in report
    assert "| 0.900 [0.900, 0.900] | 1 | inconclusive | best size 4 MiB, in-sample" in report
    assert "| - | 92.0 ms, auto (4.88 MiB) |" in report  # no prediction; the auto cell and the size it resolved to


def test_report_puts_the_predicted_bucket_size_next_to_the_measured_best(tmp_path) -> None:
    config, result = selection_sweep(tmp_path, repeats=2)
    # o = 0.5 ms, w = 1 GB/s, s = 16 MiB: sqrt(16 * 2**20 * 1e9 * 5e-4) = 2.9e6 bytes < largest 5 MiB -> 5 MiB
    prediction = {"overhead_s": 5e-4, "bandwidth_Bps": 1e9, "sizes": [4096, 2**26], "repeats": 10,
                  "grad_bytes": 16 * 2**20, "largest_param_bytes": 5 * 2**20, "bucket_bytes": 5 * 2**20}
    report = build_report(result.analysis, "t", prediction)
    assert "**o = 0.500 ms** per call and **w = 1.000 GB/s**" in report
    assert "= **5 MiB** (about 3.2 buckets" in report
    assert "| 5 MiB | not in grid |" in report
    report = build_report(result.analysis, "t", {**prediction, "bandwidth_Bps": None})  # time did not grow with size
    assert "unbounded" in report


def test_plots_have_a_figure_per_strategy_set_and_per_bucketed_algorithm(tmp_path) -> None:
    config, _ = selection_sweep(tmp_path, repeats=2)
    config.output.plots, config.output.report_only = True, True
    paths = run_fake(config, FakeRunner()).plots
    assert sorted(p.name for p in paths) == ["bucketed_ddp_32-true_bs2.png", "strategies_32-true_bs2.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


# ---- the load guard -----------------------------------------------------------------------------------------


class FakeMachine:
    """/proc/stat counters that advance by 100 jiffies per sample with the given busy fractions, and a clock that
    only the guard's sleeps move."""

    def __init__(self, busy: list[float]) -> None:
        self.busy = list(busy)
        self.idle = self.total = 0
        self.now = 0.0
        self.sleeps: list[float] = []

    def read(self):
        return self.idle, self.total

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        fraction = self.busy.pop(0) if len(self.busy) > 1 else self.busy[0]
        self.total += 100
        self.idle += round(100 * (1 - fraction))

    def guard(self, threshold=0.2, max_wait_s=300.0, sample_s=1.0) -> LoadCheck:
        return wait_until_idle(threshold, max_wait_s, sample_s, self.read, self.sleep, lambda: self.now)


def test_the_load_guard_starts_at_once_on_an_idle_machine() -> None:
    machine = FakeMachine([0.1])
    check = machine.guard()
    assert (check.busy_before, check.waited_s, check.busy) == (pytest.approx(0.1), 0.0, False)
    assert machine.sleeps == [1.0]  # one sample of run.load_sample_s


def test_the_load_guard_waits_while_someone_else_is_busy() -> None:
    # 50 % busy for two samples, then 10 %: two more samples after the first -> waited 2 s, starts idle
    check = FakeMachine([0.5, 0.5, 0.1]).guard()
    assert (check.busy_before, check.waited_s, check.busy) == (pytest.approx(0.1), 2.0, False)


def test_the_load_guard_gives_up_after_max_wait_and_records_a_busy_start() -> None:
    # always 50 % busy, max_wait 3 s with 1 s samples: the first sample, then 3 more, then it starts anyway
    machine = FakeMachine([0.5])
    assert machine.guard(max_wait_s=3.0) == LoadCheck(busy_before=0.5, waited_s=3.0, busy=True)
    assert len(machine.sleeps) == 4
    assert FakeMachine([0.5]).guard(max_wait_s=0.0) == LoadCheck(0.5, 0.0, True)  # max_wait 0: records only


def test_the_load_guard_without_proc_stat_or_switched_off_records_nothing_and_never_waits() -> None:
    slept = []
    assert wait_until_idle(0.2, 300.0, 1.0, reader=lambda: None, sleep=slept.append) == LoadCheck(None, 0.0, None)
    assert wait_until_idle(0.2, 300.0, 0.0, reader=lambda: pytest.fail("read"), sleep=slept.append) == LoadCheck()
    assert slept == []


def test_proc_stat_is_read_over_all_cores(tmp_path) -> None:
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice: idle = idle + iowait = 820, total up to
    # steal = 100 + 5 + 50 + 800 + 20 + 3 + 2 + 0 = 980 (guest time is already inside user)
    stat.write_text("cpu  100 5 50 800 20 3 2 0 7 0\ncpu0 50 2 25 400 10 1 1 0 0 0\n")
    assert read_proc_stat(str(stat)) == (820, 980)
    assert read_proc_stat(str(tmp_path / "missing")) is None
    assert busy_fraction((820, 980), (1720, 1980)) == pytest.approx(0.1)  # 900 of 1000 new jiffies idle
    assert busy_fraction((5, 5), (5, 5)) == 0.0  # no time on the counters: nothing was busy


def test_the_sweep_records_the_load_guard_per_repeat_and_counts_busy_starts(tmp_path) -> None:
    config = sweep_config(tmp_path, strategies=["naive_ddp"], context_lengths=[32])  # reference, naive_ddp, ddp; 2 repeats
    seen = iter([LoadCheck(0.05, 0.0, False), LoadCheck(0.6, 300.0, True), LoadCheck(0.1, 12.0, False)] * 2)
    run_fake(config, FakeRunner(), load_guard=lambda: next(seen))
    out = tmp_path / "sweep"
    repeats = list(read_rows(out / "repeats.csv", REPEAT_COLUMNS).values())
    assert [(r["busy_before"], r["waited_s"], r["busy"]) for r in repeats[:3]] == [
        (0.05, 0.0, False), (0.6, 300.0, True), (0.1, 12.0, False)]
    naive_ddp = next(c for c in expand_grid(config) if c.strategy == "naive_ddp")
    # naive_ddp's two repeats both started busy (the 2nd of every 3 in the round-robin), after 300 s each
    assert read_rows(out / "results.csv")[naive_ddp.id]["busy_repeats"] == 2
    assert read_rows(out / "results.csv")[naive_ddp.id]["waited_s"] == 600.0
    report = (out / "results.md").read_text()
    # 2 of 6 started busy; 0 + 300 + 12, twice = 624 s waited
    assert "load guard (busy fraction > 0.2 after up to 300.0 s): **2 of 6 cell repeats started busy**, 624 s waited" \
           in report


# ---- gradient bytes -------------------------------------------------------------------------------------

def test_gradient_bytes_of_the_tiny_model() -> None:
    # tiny, vocab 10 000: embedding and lm_head 10 000 x 128 (5,120,000 bytes each, the largest), 4 layers of
    # 4 x 128^2 + 3 x 128 x 512 weights + 2 norms of 128, and a final norm of 128: 3,624,064 floats.
    s, largest = gradient_bytes({"preset": "tiny", "vocab_size": 10000, "context_length": 64})
    assert largest == 10_000 * 128 * 4
    assert s == 4 * (2 * 10_000 * 128 + 4 * (4 * 128 * 128 + 3 * 128 * 512 + 2 * 128) + 128)



# ---- end to end -------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow  # the sweep's own run (~30 s): the slow tier, like the other benchmarks' runs
def test_tiny_sweep_end_to_end(tmp_path, monkeypatch) -> None:
    out = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_ddp.bench", "--config", "configs/bench/tiny_test.yaml",
         "--output.out_dir", str(out)],
        cwd=REPO, env=repo_first_on_path(), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_rows(out / "results.csv")
    assert [r["strategy"] for r in rows.values()] == ["reference", "ddp"]
    # 2 repeats of 4 measured steps each, pooled
    assert all(r["status"] == "ok" and r["step_ms_median"] > 0 and r["measured_steps"] == 8 for r in rows.values())
    assert all(r["repeats_ok"] == 2 and r["step_ms_lo"] <= r["step_ms_median"] <= r["step_ms_hi"] for r in rows.values())
    assert next(iter(rows.values()))["world_size"] == 1
    repeats = read_rows(out / "repeats.csv", REPEAT_COLUMNS)
    ids = list(rows)
    assert list(repeats) == [(ids[0], 0), (ids[1], 0), (ids[0], 1), (ids[1], 1)]  # interleaved
    assert all(r["busy"] in (True, False) and r["busy_before"] is not None for r in repeats.values())  # Linux
    steps = read_steps(out / "steps.csv")
    assert sorted(len(s) for s in steps.values()) == [4, 4, 4, 4]
    assert all((out / "runs" / cid / f"r{k}" / "timing_summary.json").exists() for cid, k in repeats)
    report = (out / "results.md").read_text()
    assert "| reference (1 process, no communication) |" in report and "## Performance goals" in report
    assert 'docs/benchmarks.md, "How to read results"' in report and "cell repeats started busy" in report
    assert "1-minute load average" in report
    assert (out / "strategies_32-true_bs2.png").read_bytes()[:4] == b"\x89PNG"
    environment = json.loads((out / "environment.json").read_text())
    assert environment["backend"] == "gloo" and environment["config"]["grid"]["strategies"] == ["ddp"]
    assert environment["config"]["workload"]["cli_args"] == ["--data.source", "synthetic"]
    assert environment["torch"] and environment["cpu"]["count"] >= 1
    assert "[4/4] ddp | batch 2 | ctx 32 | 32-true, repeat 2/2: ok" in proc.stdout + proc.stderr
    # rerunning the same command skips every repeat (in-process here, with a runner that must not be called)
    monkeypatch.chdir(REPO)  # the same relative base_config as the command: the same cell ids
    config = parse_config(["--config", "configs/bench/tiny_test.yaml", "--output.out_dir", str(out)])
    assert run_fake(config, lambda cell, run_dir: pytest.fail(f"{cell.id} ran again")).ran == []


def _processes_mentioning(marker: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # the process ended while we looked
            continue
        if marker in cmdline:
            pids.append(int(pid))
    return pids




@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_sweep_killed_by_sigkill_keeps_finished_repeats_leaves_no_process_and_resumes(tmp_path) -> None:
    # Three cells (reference, naive_ddp, ddp) x 2 repeats. Kill the sweep with SIGKILL once the first repeat is
    # written: it must survive intact, the repeat that was running must die with the sweep (PR_SET_PDEATHSIG), and
    # the same command must then finish the other repeats without rerunning the finished ones.
    out = tmp_path / "sweep"
    command = [sys.executable, "-m", "lightning_ddp.bench", "--config", "configs/bench/tiny_test.yaml",
               "--grid.strategies", "[naive_ddp, ddp]", "--output.out_dir", str(out)]
    env = repo_first_on_path()
    sweep = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and not (out / "repeats.csv").exists():
            time.sleep(0.5)
        assert (out / "repeats.csv").exists(), "no cell repeat finished in time"
        time.sleep(3)  # the next repeat is running now
    finally:
        sweep.kill()
        sweep.wait()
    first = read_rows(out / "repeats.csv", REPEAT_COLUMNS)
    first_steps = read_steps(out / "steps.csv")
    assert len(first) >= 1 and all(row["status"] == "ok" for row in first.values())
    time.sleep(2)
    assert _processes_mentioning(str(out)) == [], "a cell outlived the killed sweep"
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    repeats = read_rows(out / "repeats.csv", REPEAT_COLUMNS)
    assert len(repeats) == 6 and all(row["status"] == "ok" for row in repeats.values())
    steps = read_steps(out / "steps.csv")
    for key, row in first.items():
        assert repeats[key] == row and steps[key] == first_steps[key]  # kept, not rerun
    rows = read_rows(out / "results.csv")
    assert len(rows) == 3 and all(row["repeats_ok"] == 2 for row in rows.values())
    assert f"{len(first)} already done" in proc.stdout + proc.stderr
