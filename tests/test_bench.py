"""The benchmark sweep (lightning_ddp.bench): grid, ids, configs, resume, failure rows, CSV schema, report, and
one real 2-cell sweep end to end."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_ddp.bench import runner as runner_module
from lightning_ddp.bench.__main__ import parse_config
from lightning_ddp.bench.config import GridConfig, OutputConfig, RunConfig, SweepConfig, WorkloadConfig
from lightning_ddp.bench.grid import RankLayout, cell_command, expand_grid, rank_environments, rank_layout
from lightning_ddp.bench.report import build_report, goal_checks
from lightning_ddp.bench.results import RESULT_COLUMNS, make_row, parse_row, read_results, write_results
from lightning_ddp.bench.runner import CellOutcome, SubprocessCellRunner, classify, error_line, run_processes
from lightning_ddp.bench.sweep import gradient_bytes, run_sweep
from tests.cli_utils import REPO

BENCH_CONFIGS = sorted((REPO / "configs" / "bench").glob("*.yaml"))
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
CPU_LAYOUT = RankLayout("gloo", 2, 1)


def sweep_config(tmp_path: Path, **grid) -> SweepConfig:
    """A small grid writing to tmp_path, with the all-reduce job off (the runner is faked in these tests)."""
    return SweepConfig(
        grid=GridConfig(**{"strategies": ["naive", "bucketed"], "batch_sizes": [2], "context_lengths": [32, 64],
                           "bucket_sizes_mb": [1.0, "auto"], **grid}),
        workload=WorkloadConfig(base_config=QUICKSTART),
        run=RunConfig(predict_bucket_size=False),
        output=OutputConfig(out_dir=str(tmp_path / "sweep"), plots=False),
    )


def fake_summary(step_ms: float, share: float = 0.2, busy_ms: float = 10.0) -> dict:
    stat = lambda v: {"median": v, "p10": 0.9 * v, "p90": 1.1 * v, "n": 4.0}  # noqa: E731
    return {
        "run": {"bucket_size_mb": 4.0, "hparams": {"preset": "tiny", "vocab_size": 10000, "context_length": 64}},
        "warmup_steps": 2,
        "summary": {"step/time_ms": stat(step_ms), "comm/exposed_ms": stat(share * step_ms), "comm/share": stat(share),
                    "comm/busy_ms": stat(busy_ms), "comm/overlap": stat(0.5), "comm/busbw_GBps": stat(1.0),
                    "step/tokens_per_s": stat(1000.0)},
        "steps": [{"step": i, "memory/peak_MiB": 100.0 + i} for i in range(6)],
    }


class FakeRunner:
    """Records the cells it is asked to run; answers with ``outcomes[strategy]`` or an ok outcome."""

    def __init__(self, outcomes: dict[str, CellOutcome] | None = None) -> None:
        self.calls: list[str] = []
        self.outcomes = outcomes or {}

    def __call__(self, cell, run_dir: Path) -> CellOutcome:
        self.calls.append(cell.id)
        return self.outcomes.get(cell.strategy, CellOutcome("ok", "", fake_summary(100.0), 1.0))


def run_fake(config: SweepConfig, runner) -> object:
    return run_sweep(config, runner=runner, layout=CPU_LAYOUT, progress=False, log=lambda line: None)


# ---- configuration ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", BENCH_CONFIGS, ids=lambda p: p.name)
def test_every_bench_config_validates(config: Path) -> None:
    sweep = parse_config(["--config", str(config)])
    assert expand_grid(sweep)


def test_cpu_config_grid_counts() -> None:
    sweep = parse_config(["--config", str(REPO / "configs" / "bench" / "cpu.yaml")])
    cells = expand_grid(sweep)
    groups = len(sweep.grid.batch_sizes) * len(sweep.grid.context_lengths) * len(sweep.grid.precisions)
    # per group: reference + naive + flat + overlap + ddp + one bucketed cell per bucket size (4 sizes + auto)
    assert len(cells) == groups * (5 + len(sweep.grid.bucket_sizes_mb))
    assert "auto" in sweep.grid.bucket_sizes_mb


def test_xl_gpu_config_is_the_study_grid() -> None:
    sweep = parse_config(["--config", str(REPO / "configs" / "bench" / "xl_gpu.yaml")])
    assert sweep.workload.preset == "xl" and sweep.run.accelerator == "cuda" and sweep.run.backend == "auto"
    assert sweep.grid.batch_sizes == [2, 4] and sweep.grid.context_lengths == [128, 256, 512]
    assert set(sweep.grid.precisions) == {"bf16-mixed", "32-true"}
    assert [b for b in sweep.grid.bucket_sizes_mb if b != "auto"] == [1, 10, 100, 1000]


def test_empty_grid_is_an_error_that_names_the_fix(capsys) -> None:
    with pytest.raises(ValueError, match=r"the sweep has no cells: `strategies` is empty; list at least one of naive"):
        GridConfig(strategies=[])
    # ...and on the command line: exit 2, the message, no traceback.
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--grid.strategies", "[]"])
    assert exit_info.value.code == 2
    assert "the sweep has no cells: `strategies` is empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: GridConfig(strategies=["nccl_magic"]), "unknown strategy 'nccl_magic'.*choose from naive"),
        (lambda: GridConfig(batch_sizes=[]), "`batch_sizes` is empty"),
        (lambda: GridConfig(context_lengths=[0]), "integers >= 1"),
        (lambda: GridConfig(bucket_sizes_mb=[]), "`bucketed` is in `grid.strategies` but `grid.bucket_sizes_mb` is empty"),
        (lambda: GridConfig(bucket_sizes_mb=[-1.0]), "sizes > 0"),
        (lambda: GridConfig(precisions=["fp8"]), "unknown precision 'fp8'"),
        (lambda: RunConfig(devices=1), "reference is added"),
        (lambda: RunConfig(backend="nccl"), "nccl` needs CUDA"),
        (lambda: RunConfig(steps=0), "run.steps"),
        (lambda: WorkloadConfig(cli_args=["--data.batch_size", "8"]), "use `grid.batch_sizes` instead"),
        (lambda: WorkloadConfig(cli_args=["--trainer.strategy.init_args.x=1"]), "grid.strategies"),
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
                        ("--run.launcher", "torchrun"), ("--output.retry_failed", "Rerun")]:
        assert flag in out and words in out, flag


# ---- grid and cells ---------------------------------------------------------------------------------------


def test_grid_always_has_ddp_and_reference_and_buckets_only_for_bucketed(tmp_path) -> None:
    config = sweep_config(tmp_path)  # naive + bucketed (1 MiB, auto), 1 batch size x 2 context lengths
    cells = expand_grid(config)
    # per group: reference, naive, bucketed 1, bucketed auto, ddp = 5; 2 groups
    assert len(cells) == 10
    for context in (32, 64):
        group = [c for c in cells if c.context_length == context]
        assert [(c.strategy, c.bucket_size_mb) for c in group] == [
            ("reference", None), ("naive", None), ("bucketed", 1.0), ("bucketed", "auto"), ("ddp", None)]
    assert all((c.bucket_size_mb is not None) == (c.strategy == "bucketed") for c in cells)
    assert {c.world_size for c in cells if c.strategy == "reference"} == {1}
    assert {c.world_size for c in cells if c.strategy != "reference"} == {2}
    # without bucketed the bucket sizes are ignored; ddp/reference listed explicitly are not duplicated
    cells = expand_grid(sweep_config(tmp_path, strategies=["ddp", "reference", "flat"]))
    assert [c.strategy for c in cells[:3]] == ["reference", "ddp", "flat"] and len(cells) == 6


def test_cell_ids_are_stable_unique_and_follow_what_is_measured(tmp_path) -> None:
    config = sweep_config(tmp_path)
    ids = [c.id for c in expand_grid(config)]
    assert ids == [c.id for c in expand_grid(sweep_config(tmp_path))]  # same config, same ids
    assert len(set(ids)) == len(ids)
    assert ids[2].startswith("bucketed-1mb-b2-t32-32-true-") and ids[3].startswith("bucketed-auto-b2-t32-")
    # Where results go and how long a cell may take do not change what it measures...
    config.output.out_dir, config.run.timeout_s, config.run.launcher = "/elsewhere", 5.0, "lightning"
    assert [c.id for c in expand_grid(config)] == ids
    # ...the number of measured steps does.
    config.run.steps += 1
    assert not set(c.id for c in expand_grid(config)) & set(ids)


def test_cell_command_sets_the_axes_and_the_strategy(tmp_path) -> None:
    config = sweep_config(tmp_path)
    cells = {(c.strategy, c.bucket_size_mb, c.context_length): c for c in expand_grid(config)}
    command = cell_command(cells[("bucketed", 1.0, 64)], config, CPU_LAYOUT, tmp_path / "run")
    assert command[1:5] == ["-m", "lightning_ddp", "fit", "--config"]
    args = dict(zip(command[4::2], command[5::2]))  # flag/value pairs after `fit`
    assert args["--data.batch_size"] == "2" and args["--data.seq_len"] == "64" and args["--model.context_length"] == "64"
    assert args["--trainer.max_steps"] == str(config.run.warmup_steps + config.run.steps)
    assert args["--timer.warmup_steps"] == str(config.run.warmup_steps)
    assert json.loads(args["--trainer.strategy"]) == {
        "class_path": "lightning_ddp.strategies.GradSyncStrategy",
        "init_args": {"algorithm": "bucketed", "process_group_backend": "gloo", "bucket_size_mb": 1.0},
    }
    assert json.loads(args["--trainer.logger"])["init_args"]["save_dir"] == str(tmp_path / "run")
    reference_command = cell_command(cells[("reference", None, 64)], config, CPU_LAYOUT, tmp_path)
    reference = dict(zip(reference_command[4::2], reference_command[5::2]))
    assert reference["--trainer.devices"] == "1" and reference["--trainer.strategy"] == "auto"


def test_rank_layout_picks_the_backend() -> None:
    def layout(accelerator="cuda", backend="auto", launcher="ranks", gpus=0, visible=None):
        config = SweepConfig(run=RunConfig(accelerator=accelerator, backend=backend, launcher=launcher))
        return rank_layout(config, gpus, visible)

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
    envs = rank_environments(cells["naive"], config, CPU_LAYOUT, 12345, parent)
    assert [(e["RANK"], e["LOCAL_RANK"], e["NODE_RANK"], e["WORLD_SIZE"], e["MASTER_PORT"]) for e in envs] == [
        ("0", "0", "0", "2", "12345"), ("1", "1", "0", "2", "12345")]
    assert all("SLURM_NTASKS" not in e and "TORCHELASTIC_RUN_ID" not in e and e["PATH"] == "/bin" for e in envs)
    # the reference: one process without launcher variables, the same threads as a rank
    (reference,) = rank_environments(cells["reference"], config, CPU_LAYOUT, 12345, parent)
    assert "MASTER_PORT" not in reference and "RANK" not in reference
    assert reference["OMP_NUM_THREADS"] == envs[0]["OMP_NUM_THREADS"]
    # shared GPU: every rank a node of one device, its own CUDA_VISIBLE_DEVICES
    shared = RankLayout("gloo", 1, 2, ("0", "0"))
    envs = rank_environments(cells["naive"], config, shared, 1, parent)
    assert [(e["NODE_RANK"], e["LOCAL_RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in envs] == [("0", "0", "0"), ("1", "0", "0")]


# ---- results.csv ------------------------------------------------------------------------------------------


def test_csv_schema_is_exactly_these_columns(tmp_path) -> None:
    assert RESULT_COLUMNS == (
        "cell_id", "strategy", "bucket_size_mb", "batch_size", "context_length", "precision", "model",
        "world_size", "accelerator", "backend", "status", "reason",
        "step_ms_median", "step_ms_p10", "step_ms_p90", "exposed_comm_ms", "busy_comm_ms", "comm_share", "overlap",
        "busbw_GBps", "tokens_per_s", "mfu", "peak_memory_MiB", "resolved_bucket_size_mb", "measured_steps", "wall_s",
        "load_avg_1m",
    )
    config = sweep_config(tmp_path)
    cell = next(c for c in expand_grid(config) if c.strategy == "bucketed")
    row = make_row(cell, CellOutcome("ok", "", fake_summary(120.0, share=0.25), 7.5), "tiny", "cpu", CPU_LAYOUT, 1.234)
    path = tmp_path / "results.csv"
    write_results(path, [row])
    with open(path, newline="") as f:
        assert tuple(next(csv.reader(f))) == RESULT_COLUMNS
    back = read_results(path)[cell.id]
    assert back["step_ms_median"] == 120.0 and back["step_ms_p10"] == 108.0 and back["comm_share"] == 0.25
    assert back["exposed_comm_ms"] == 30.0 and back["peak_memory_MiB"] == 105.0  # max over all steps
    assert back["bucket_size_mb"] == 1.0 and back["resolved_bucket_size_mb"] == 4.0 and back["measured_steps"] == 4.0
    assert back["mfu"] is None  # not logged on CPU: an empty cell
    assert back["wall_s"] == 7.5 and back["load_avg_1m"] == 1.23
    assert not list(tmp_path.glob("*.tmp"))  # the atomic write leaves no temporary file
    # a strategy that did not record the size it resolved `auto` to leaves the numeric column empty
    unresolved = fake_summary(120.0)
    unresolved["run"]["bucket_size_mb"] = "auto"
    row = make_row(cell, CellOutcome("ok", "", unresolved, 1.0), "tiny", "cpu", CPU_LAYOUT)
    assert row["resolved_bucket_size_mb"] == ""


# ---- the sweep with a fake cell runner --------------------------------------------------------------------


def test_finished_cells_are_skipped_on_rerun(tmp_path) -> None:
    config = sweep_config(tmp_path)
    cells = expand_grid(config)
    # A killed sweep left rows for the first three cells (one of them failed).
    rows = [make_row(c, CellOutcome("ok", "", fake_summary(100.0), 1.0), "tiny", "cpu", CPU_LAYOUT) for c in cells[:2]]
    rows.append(make_row(cells[2], CellOutcome("failed", "boom"), "tiny", "cpu", CPU_LAYOUT))
    write_results(tmp_path / "sweep" / "results.csv", rows)

    runner = FakeRunner()
    result = run_fake(config, runner)
    assert runner.calls == [c.id for c in cells[3:]]  # none of the finished cells ran again
    assert [r["cell_id"] for r in result.rows] == [c.id for c in cells]  # every cell has its row, in grid order
    assert read_results(tmp_path / "sweep" / "results.csv")[cells[2].id]["reason"] == "boom"

    # Nothing left: a rerun runs nothing. With retry_failed only the failed cell runs again.
    assert run_fake(config, FakeRunner()).ran == []
    config.output.retry_failed = True
    retry = FakeRunner()
    run_fake(config, retry)
    assert retry.calls == [cells[2].id]


def test_failing_cells_get_rows_and_the_sweep_goes_on(tmp_path) -> None:
    config = sweep_config(tmp_path)
    runner = FakeRunner({
        "naive": CellOutcome("oom", "rank 1: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
        "bucketed": CellOutcome("timeout", "no result after 600 s"),
        "ddp": CellOutcome("failed", "rank 0 (exit code 1): RuntimeError: bad"),
    })
    result = run_fake(config, runner)
    assert len(runner.calls) == len(expand_grid(config))  # every cell was attempted
    by_strategy = {r["strategy"]: r for r in result.rows}
    assert by_strategy["naive"]["status"] == "oom" and "out of memory" in by_strategy["naive"]["reason"]
    assert by_strategy["bucketed"]["status"] == "timeout"
    assert by_strategy["ddp"]["status"] == "failed" and by_strategy["ddp"]["step_ms_median"] is None
    assert by_strategy["reference"]["status"] == "ok"
    report = (tmp_path / "sweep" / "results.md").read_text()
    assert "## Cells that did not finish" in report and "CUDA out of memory" in report


def test_report_only_rebuilds_from_the_csv(tmp_path) -> None:
    config = sweep_config(tmp_path)
    with pytest.raises(ValueError, match="run the sweep first"):
        run_fake(SweepConfig(**{**config.__dict__, "output": OutputConfig(out_dir=str(tmp_path / "none"), report_only=True)}), FakeRunner())
    run_fake(config, FakeRunner())
    (tmp_path / "sweep" / "results.md").unlink()
    config.output.report_only = True
    runner = FakeRunner()
    run_fake(config, runner)
    assert runner.calls == [] and (tmp_path / "sweep" / "results.md").exists()


# ---- classification of real and simulated failures -------------------------------------------------------


def test_classify() -> None:
    traceback = "Traceback (most recent call last):\n  File 'x'\n    y()\nRuntimeError: Connection closed by peer\n"
    oom = "Traceback:\n  File 'm.py'\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB\n"
    # rank 1 ran out of memory first; rank 0 then lost its peer and exited too
    status, reason = classify([1, 1], [traceback, oom], False, set(), first_failed=1, summary_found=False)
    assert status == "oom" and reason.startswith("rank 1: torch.OutOfMemoryError: CUDA out of memory")
    assert classify([1], ["MemoryError\n"], False, set(), 0, False)[0] == "oom"  # CPU
    # SIGKILL we did not send: the kernel's OOM killer; SIGKILL we sent after a peer failed: not an OOM
    assert classify([-9, 1], ["", traceback], False, set(), 0, False)[0] == "oom"
    status, reason = classify([1, -9], ["ValueError: bad size\n", ""], False, {1}, 0, False)
    assert (status, reason) == ("failed", "rank 0 (exit code 1): ValueError: bad size")
    assert classify([-9, -9], ["", "step 3\n"], True, {0, 1}, None, False, 30)[0:1] == ("timeout",)
    assert classify([0, 0], ["", ""], False, set(), None, summary_found=True) == ("ok", "")
    assert classify([0], ["done\n"], False, set(), None, summary_found=False)[0] == "failed"


def test_error_line_finds_the_last_meaningful_line() -> None:
    jsonargparse = "usage: lightning_ddp [-h]\n                     [--trainer.x X]\ntip: run --help\nerror: unrecognized arguments: --trainer.bogus 1\n"
    assert error_line(jsonargparse) == "error: unrecognized arguments: --trainer.bogus 1"
    warnings = "RuntimeError: the real one\n/site-packages/x.py:3: UserWarning: noise\n  warnings.warn(\n"
    assert error_line(warnings) == "RuntimeError: the real one"
    assert error_line("just a line\n\n") == "just a line"
    assert error_line("") == ""


def test_run_processes_kills_on_timeout_and_after_a_peer_fails(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(runner_module, "_GRACE_S", 0.5)
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
    status, reason = classify(result.returncodes, [""], result.timed_out, result.killed_by_us, result.first_failed, False)
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


# ---- report -----------------------------------------------------------------------------------------------


def _row(strategy, step, share=None, busy=None, bucket="", status="ok", context=64):
    return parse_row({"cell_id": f"{strategy}{bucket}-{context}", "strategy": strategy, "bucket_size_mb": str(bucket),
                      "batch_size": "2", "context_length": str(context), "precision": "32-true", "status": status,
                      "step_ms_median": "" if step is None else str(step), "comm_share": "" if share is None else str(share),
                      "busy_comm_ms": "" if busy is None else str(busy)})


def test_goals_are_ratios_from_the_same_group() -> None:
    rows = [_row("reference", 60.0), _row("naive", 150.0, share=0.6), _row("overlap", 110.0, share=0.15),
            _row("bucketed", 95.0, share=0.25, busy=70.0, bucket=1.0), _row("bucketed", 90.0, share=0.1, busy=80.0, bucket=4.0),
            _row("ddp", 100.0, share=0.1)]
    checks = goal_checks(("32-true", 2, 64), rows)
    ratios = {c.goal.split(".")[0] + (" overlap" if "overlap" in c.goal else ""): c for c in checks}
    # 1. best bucketed (4 MiB, 90 ms) / ddp (100 ms) = 0.9 <= 1: met
    assert ratios["1"].ratio == pytest.approx(0.9) and ratios["1"].met and "4 MiB" in ratios["1"].note
    # 2. overlap share 0.15 / naive 0.6 = 0.25 <= 1/3: met; best bucketed 0.1 / 0.6 = 0.167: met
    assert ratios["2 overlap"].ratio == pytest.approx(0.25) and ratios["2 overlap"].met
    assert ratios["2"].ratio == pytest.approx(0.1 / 0.6) and ratios["2"].met
    # 3. 90 ms / max(reference 60 ms, busy 80 ms) = 1.125 > 1.10: missed, and the report says so
    assert ratios["3"].ratio == pytest.approx(1.125) and ratios["3"].met is False
    report = build_report(rows, "t")
    assert "**4 met, 1 missed" not in report and "**3 met, 1 missed, 0 not measurable**" in report
    assert "| 1.125 | 1.1 | **missed** |" in report
    assert "**90.0 ms (10.0 %)**" in report  # the best bucket size is bold in the table


def test_report_puts_the_predicted_bucket_size_next_to_the_measured_best() -> None:
    rows = [_row("reference", 60.0), _row("naive", 150.0, share=0.6), _row("ddp", 100.0, share=0.1),
            _row("bucketed", 95.0, share=0.25, bucket=1.0), _row("bucketed", 90.0, share=0.1, bucket=4.0),
            parse_row({**{k: str(v) for k, v in _row("bucketed", 92.0, share=0.1).items() if v is not None},
                       "bucket_size_mb": "auto", "resolved_bucket_size_mb": "4.8828125", "cell_id": "auto"})]
    # o = 0.5 ms, w = 1 GB/s, s = 16 MiB: sqrt(16 * 2**20 * 1e9 * 5e-4) = 2.9e6 bytes < largest 5 MiB -> 5 MiB
    prediction = {"overhead_s": 5e-4, "bandwidth_Bps": 1e9, "sizes": [4096, 2**26], "repeats": 10,
                  "grad_bytes": 16 * 2**20, "largest_param_bytes": 5 * 2**20, "bucket_bytes": 5 * 2**20}
    report = build_report(rows, "t", prediction)
    assert "**o = 0.500 ms** per call and **w = 1.000 GB/s**" in report
    assert "= **5 MiB** (about 3.2 buckets" in report
    assert "| 32-true | 2 | 64 | 4 MiB | 90.0 | 5 MiB | 92.0 ms, auto (4.88 MiB) |" in report
    assert "| bucketed auto | 92.0 ms (10.0 %) |" in report
    report = build_report(rows, "t", {**prediction, "bandwidth_Bps": None})  # time did not grow with size
    assert "unbounded" in report


def test_goals_without_a_needed_cell_are_not_measurable() -> None:
    rows = [_row("reference", 60.0), _row("naive", None, status="oom"), _row("ddp", 100.0, share=0.1)]
    checks = goal_checks(("32-true", 2, 64), rows)
    assert all(c.met is None for c in checks)
    assert "naive cell oom" in " ".join(c.note for c in checks)


def test_plots_are_written(tmp_path) -> None:
    from lightning_ddp.bench.plots import write_plots

    rows = [_row("reference", 60.0, context=c) for c in (32, 64)] + [
        _row("bucketed", 90.0 + b, share=0.1, bucket=b, context=c) for b in (1.0, 4.0) for c in (32, 64)]
    paths = write_plots(tmp_path, rows, predicted_mb=2.0)
    assert sorted(p.name for p in paths) == ["bucketed_32-true_bs2.png", "strategies_32-true_bs2.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_gradient_bytes_of_the_tiny_model() -> None:
    # tiny, vocab 10 000: embedding and lm_head 10 000 x 128 (5,120,000 bytes each, the largest), 4 layers of
    # 4 x 128^2 + 3 x 128 x 512 weights + 2 norms of 128, and a final norm of 128: 3,624,064 floats.
    s, largest = gradient_bytes({"preset": "tiny", "vocab_size": 10000, "context_length": 64})
    assert largest == 10_000 * 128 * 4
    assert s == 4 * (2 * 10_000 * 128 + 4 * (4 * 128 * 128 + 3 * 128 * 512 + 2 * 128) + 128)


# ---- end to end -------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_tiny_sweep_end_to_end(tmp_path, monkeypatch) -> None:
    out = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_ddp.bench", "--config", "configs/bench/tiny_test.yaml",
         "--output.out_dir", str(out)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_results(out / "results.csv")
    assert [r["strategy"] for r in rows.values()] == ["reference", "ddp"]
    assert all(r["status"] == "ok" and r["step_ms_median"] > 0 and r["measured_steps"] == 4 for r in rows.values())
    assert math.isclose(rows[next(iter(rows))]["world_size"], 1)
    report = (out / "results.md").read_text()
    assert "| reference (1 process, no communication) |" in report and "## Performance goals" in report
    assert "1-minute load average" in report
    assert (out / "strategies_32-true_bs2.png").read_bytes()[:4] == b"\x89PNG"
    environment = json.loads((out / "environment.json").read_text())
    assert environment["backend"] == "gloo" and environment["config"]["grid"]["strategies"] == ["ddp"]
    assert environment["torch"] and environment["cpu"]["count"] >= 1
    assert "[2/2] ddp | batch 2 | ctx 32 | 32-true: ok" in proc.stdout + proc.stderr
    # rerunning the same command skips both cells (in-process here, with a runner that must not be called)
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
def test_a_sweep_killed_by_sigkill_keeps_finished_rows_leaves_no_process_and_resumes(tmp_path) -> None:
    # Three cells (reference, naive, ddp). Kill the sweep with SIGKILL once the first row is written: that row
    # must survive intact, the cell that was running must die with the sweep (PR_SET_PDEATHSIG), and the same
    # command must then finish the other cells without rerunning the first.
    out = tmp_path / "sweep"
    command = [sys.executable, "-m", "lightning_ddp.bench", "--config", "configs/bench/tiny_test.yaml",
               "--grid.strategies", "[naive, ddp]", "--output.out_dir", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    sweep = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and not (out / "results.csv").exists():
            time.sleep(0.5)
        assert (out / "results.csv").exists(), "no cell finished in time"
        time.sleep(2)  # the next cell is running now
    finally:
        sweep.kill()
        sweep.wait()
    first = read_results(out / "results.csv")
    assert len(first) >= 1 and all(row["status"] == "ok" for row in first.values())
    time.sleep(2)
    assert _processes_mentioning(str(out)) == [], "a cell outlived the killed sweep"
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_results(out / "results.csv")
    assert len(rows) == 3 and all(row["status"] == "ok" for row in rows.values())
    for cell_id, row in first.items():
        assert rows[cell_id] == row  # the rows finished before the kill were kept, not rerun
    assert f"{len(first)} already done" in proc.stdout + proc.stderr
