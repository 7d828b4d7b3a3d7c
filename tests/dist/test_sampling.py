"""The CommTimer measures only every n-th step, and drops into a user's own project (issue 23, items 4-5): real
2-process CPU fits over gloo, with counters on everything measuring costs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli_utils import REPO, read_scalars, repo_first_on_path

pytestmark = pytest.mark.multiprocess


def _run_script(script: Path, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**repo_first_on_path(), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
    return proc


def test_only_every_third_step_is_measured_and_the_others_cost_nothing(tmp_path: Path) -> None:
    _run_script(REPO / "tests" / "support" / "sampling_probe.py", str(tmp_path), cwd=tmp_path)
    for rank in (0, 1):
        probe = json.loads((tmp_path / f"rank{rank}.json").read_text())
        steps = {int(step): counts for step, counts in probe["steps"].items()}
        assert sorted(steps) == list(range(7))  # max_steps=7
        sampled = [0, 3, 6]  # every_n_steps=3: step s iff s % 3 == 0, decided alike on both ranks
        for step, counts in steps.items():
            if step in sampled:
                # the step's one synchronize point, the timer's one exchange (an all-gather), the engine's one bucket
                # (the tiny MLP's 306 gradient bytes in one 25 MiB bucket) recorded, and clock marks
                assert counts["StepClock.synchronize"] == 1 and counts["timer collective"] == 1, (step, counts)
                assert counts["Recorder.launch"] == 1 and counts["StepClock.mark"] > 0, (step, counts)
                assert counts["dist.all_reduce"] == 1, (step, counts)  # the bucket; the timer gathers with all_gather
            else:
                # nothing but training: the engine's bucket all-reduce, unrecorded; no clock read, no synchronize,
                # no collective of the timer's, no torch.cuda.synchronize
                assert counts == {"dist.all_reduce": 1}, (step, counts)
        # the gradient-ready hooks are registered in sampled steps only
        assert {int(s): w for s, w in probe["watching"].items()} == {s: s in sampled for s in range(7)}
        assert probe["summary_steps"] == sampled  # the summary keeps the measured steps (warmup_steps=1: 3 and 6)
    # what reached the logger (rank 0's): exactly the sampled steps, each with the comm keys and no tokens/s or MFU
    # (the MLP does not say how to count tokens or FLOPs)
    logged = json.loads((tmp_path / "rank0.json").read_text())["logged"]
    assert [step for step, _ in logged] == sampled
    for _, keys in logged:
        assert {"step/time_ms", "comm/exposed_ms", "comm/busy_ms", "comm/overlap"} <= set(keys)
        assert "step/tokens_per_s" not in keys and "step/mfu" not in keys


def test_the_readme_example_measures_a_plain_module_through_our_strategy_name(tmp_path: Path) -> None:
    # examples/measure_your_training.py is the README's "Measure your own training" section, verbatim: a plain
    # LightningModule, Trainer(strategy="bucketed_ddp") after importing lightning_ddp, CommTimer() with defaults.
    _run_script(REPO / "examples" / "measure_your_training.py", cwd=tmp_path)
    logs = tmp_path / "logs" / "lightning_logs"  # default_root_dir="logs": under the git-ignored logs/
    scalars = read_scalars(logs)
    # every_n_steps defaults to the trainer's log_every_n_steps=2: steps 0, 2, ..., 38 of the 40
    for key in ("step/time_ms", "comm/exposed_ms", "comm/share", "comm/busy_ms", "comm/overlap", "comm/calls"):
        assert [step for step, _ in scalars[key]] == list(range(0, 40, 2)), key
    assert all(value > 0 for _, value in scalars["step/time_ms"])
    # the module says nothing about tokens or FLOPs: no throughput in tokens, no MFU (absent, not 0)
    assert "step/tokens_per_s" not in scalars and "step/mfu" not in scalars
    summary = json.loads(next(logs.rglob("timing_summary.json")).read_text())
    # 20 measured steps, the first 5 of them (warmup_steps counts measured steps) left out of the summary: 15
    assert summary["warmup_steps"] == 5 and summary["summary"]["step/time_ms"]["n"] == 15
    assert summary["run"]["strategy"] == "bucketed_ddp" and summary["run"]["every_n_steps"] == 2


@pytest.mark.slow  # three short fits in a row (~1 minute on 2 busy cores); the arithmetic is unit-tested
def test_the_timer_overhead_benchmark_runs_its_three_arms(tmp_path: Path) -> None:
    from lightning_ddp.bench.timer_overhead import main

    result = main(["--strategies", '["bucketed_ddp"]', "--steps", "5", "--warmup_steps", "1", "--repeats", "1",
                   "--sampled_every", "2", "--out_dir",
                   str(tmp_path), "--fit_args", '["--trainer.devices", "1", "--model.context_length", "32", '
                   '"--data.seq_len", "32", "--data.batch_size", "2"]'])
    measured = result["strategies"]["bucketed_ddp"]
    assert list(measured["arms"]) == ["off", "every step", "every 2 steps"]
    assert measured["steps_measured"] == {"off": 3, "every step": 3, "every 2 steps": 3}  # 5 steps: 4 deltas - 1
    table = (tmp_path / "timer_overhead.md").read_text()
    assert "| bucketed_ddp | every step |" in table and "| bucketed_ddp | every 2 steps |" in table
