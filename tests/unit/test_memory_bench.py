"""The memory benchmark of the data-parallel family: its analytic figures, its configs, and its report (the family's
table, the goals' verdicts and the plot, from hand-made results); the end-to-end run on 2 gloo ranks is
``tests/dist/test_memory_bench_run.py``."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest
import torch

from lightning_ddp.bench import memory_per_rank
from lightning_ddp.bench.memory_per_rank import (
    MODES, PLOT_NAME, MemoryBenchConfig, format_report, sent_bytes_per_rank, summarise,
    write_memory_plot,
)
from lightning_ddp.command_line import parse_dataclass
from lightning_ddp.memory import expected_bytes
from lightning_ddp.model import GPT, get_config
from tests.support.cli_utils import REPO

MEMORY_CONFIGS = sorted((REPO / "configs" / "memory").glob("*.yaml"))
GiB = 2**30


def parse_config(args: list[str]) -> MemoryBenchConfig:
    return parse_dataclass(MemoryBenchConfig, args, prog="python -m lightning_ddp.bench.memory_per_rank")


def test_doctests() -> None:
    assert doctest.testmod(memory_per_rank).failed == 0


def test_xl_expectation_matches_the_issue() -> None:
    # xl: Ψ = 1,998,235,200 parameters in T = 435 tensors (tests/unit/test_model.py). fp32: 4Ψ = 7.44 GiB of
    # parameters and as much gradient; AdamW keeps 2 moments (8Ψ = 14.89 GiB) plus a 4-byte step per tensor.
    with torch.device("meta"):
        model = GPT(get_config("xl"))
    shapes = [tuple(p.shape) for p in model.parameters()]
    full = expected_bytes(shapes, world_size=2, mode="unsharded", rank=0)
    assert full["parameters"] == full["gradients"] == 4 * 1_998_235_200
    assert full["optimizer_state"] == 8 * 1_998_235_200 + 4 * 435
    assert round(full["parameters"] / GiB, 2) == 7.44 and round(full["optimizer_state"] / GiB, 2) == 14.89
    shards = [expected_bytes(shapes, 2, "reduce_scatter", rank)["optimizer_state"] for rank in range(2)]
    # The two shards together are exactly the unsharded state, and each is within one tensor (the 10000 x 1600
    # embedding, 8 * 16 M bytes of state) of half of it.
    assert sum(shards) == full["optimizer_state"]
    assert all(abs(s - full["optimizer_state"] / 2) <= 8 * 10_000 * 1600 for s in shards)


def test_sent_bytes_follow_the_ring_model() -> None:
    # N = 4, 400 bytes: all-reduce 2 * 3/4 * 400 = 600; a broadcast round and a reduce-scatter are 3/4 * 400 = 300.
    assert sent_bytes_per_rank(400, 4, "unsharded") == 600
    assert sent_bytes_per_rank(400, 4, "allreduce_broadcast") == 900
    assert sent_bytes_per_rank(400, 4, "reduce_scatter") == 600
    # ZeRO-2: the reduce-scatter's volume in backward + the all-gather; FSDP2: two all-gathers + one reduce-scatter
    assert sent_bytes_per_rank(1000, 2, "zero2") == 1000
    assert sent_bytes_per_rank(1000, 2, "fsdp2") == 1500


@pytest.mark.parametrize("path", MEMORY_CONFIGS, ids=lambda p: p.name)
def test_every_memory_config_parses(path: Path) -> None:
    config = parse_config(["--config", str(path)])
    assert isinstance(config, MemoryBenchConfig) and config.modes == [mode for mode in MODES if mode in config.modes]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "huge"], "(?s)preset.*'tiny', 'small'.*Got value: huge"),
        (["--steps", "3"], "steps >= warmup_steps \\+ 2 = 4"),  # default warmup_steps 2: 1 measured step
        (["--warmup_steps", "0"], "warmup_steps must be >= 1"),
        (["--modes", "[zero3]"], "(?s)modes.*'unsharded'.*Got value: zero3"),
        (["--backend", "nccl"], "needs accelerator cuda"),
        (["--repeats", "2"], "repeats must be 1 \\(one run per mode\\), got 2; drop --repeats"),
        (["--modes", "[hsdp]", "--hsdp_shard_size", "3"], "shard_size 3 does not divide the world of 2 ranks"),
    ],
)
def test_config_errors_name_the_flag(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(args)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_fsdp2_and_zero2_send_the_ring_volumes() -> None:
    # N = 4, 400 bytes: ZeRO-2 reduce-scatters in backward and all-gathers after the step (300 + 300); FSDP2
    # all-gathers in forward and again in backward, and reduce-scatters the gradients (3 x 300).
    assert sent_bytes_per_rank(400, 4, "zero2") == 600
    assert sent_bytes_per_rank(400, 4, "fsdp2") == 900
    # HSDP, 2 replicas x 2: FSDP2's three passes in a shard group of 2 (3 x 200), then an all-reduce of its 200-byte
    # shard across the 2 replicas (2 x 100)
    assert sent_bytes_per_rank(400, 4, "hsdp", shard_size=2) == 800


# ---- the report, from hand-made results: 2 ranks, a model of 1000 fp32 parameters in 10 tensors ---------------

PARAMS = 4000  # bytes of parameters (and of full gradients)
STATE = 8000 + 4 * 10  # AdamW: two moments + a 4-byte step per tensor


def _rank(mode: str, rank: int, step_ms: list[float], *, grads: int = PARAMS, state: int = STATE // 2,
          params: int = PARAMS, peak: int = 100_000, transient: int = 0) -> dict:
    expected = {"parameters": params, "gradients": grads, "optimizer_state": state}
    snap = {**expected, "rss": 200_000, "rest": 0, "max_rss": peak}
    return {"mode": mode, "rank": rank, "step_ms": step_ms, "expected": expected, "expected_transient": transient,
            "snapshots": {"setup": {"parameters": params, "gradients": 0, "optimizer_state": 0, "rss": 1,
                                    "rest": 0, "max_rss": peak // 2},
                          "before_step": snap, "after_step": snap},
            "comm_bytes_recorded": None, "full_parameter_bytes": PARAMS}


def _results(step_ms: dict[str, list[float]], zero2_grads: int = PARAMS // 2, bucket_size_mb: float | None = 25.0,
             modes: tuple[str, ...] = MODES) -> dict:
    """Every mode on 2 ranks; ``step_ms[mode]`` its steps (2 warm-up steps first), peaks 100 000 B less 10 000 per
    mode, in MODES order."""
    specs = {
        "unsharded": dict(state=STATE),
        "allreduce_broadcast": {},
        "reduce_scatter": {},
        "zero2": dict(grads=zero2_grads, transient=3 * 1000),
        "fsdp2": dict(params=PARAMS // 2, grads=PARAMS // 2, transient=800),
        "hsdp": dict(state=STATE, transient=800),  # shard_size 1 on 2 ranks: the whole model on each (replicated)
    }
    per_mode = [[_rank(mode, r, step_ms[mode], peak=100_000 - 10_000 * MODES.index(mode), **specs[mode])
                 for r in range(2)] for mode in modes]
    config = {"preset": "tiny", "devices": 2, "accelerator": "cpu", "batch_size": 1, "seq_len": 8,
              "steps": len(next(iter(step_ms.values()))), "warmup_steps": 2, "grad_sync": "bucketed",
              "bucket_size_mb": bucket_size_mb, "separate_processes": True, "seed": 0, "modes": list(modes),
              "hsdp_shard_size": 1,
              "bootstrap_samples": 2000}
    environment = {"torch": "2.x", "device": "cpu", "cpu_count": 2, "backend": "gloo"}
    return {"config": config, "environment": environment, **summarise(config, per_mode)}


def _steps(level: float) -> list[float]:
    # 2 warm-up steps far off (left out), then 10 steps around ``level`` +- 1 %
    return [10 * level, 5 * level] + [level * (1 + 0.01 * ((i % 5) - 2) / 2) for i in range(10)]


def test_family_table_has_a_row_per_mode_with_measured_and_expected_bytes() -> None:
    results = _results({mode: _steps(100.0) for mode in MODES})
    family = results["family"]
    rows = {row["mode"]: row for row in family["rows"]}
    assert [row["label"] for row in family["rows"]] == [
        "DDP", "ZeRO-1 (all-reduce + broadcast)", "ZeRO-1 (reduce-scatter)", "ZeRO-2", "FSDP2", "HSDP"]
    assert rows["unsharded"]["optimizer_state"] == rows["unsharded"]["expected_optimizer_state"] == STATE
    assert rows["zero2"]["gradients"] == PARAMS // 2
    # The expected peak is our tensors at their most: parameters + gradients + state + the transient
    # (ZeRO-2: 4000 + 2000 + 4020 + 3000 buckets; FSDP2: 2000 + 2000 + 4020 + 800 of the largest group).
    assert rows["zero2"]["expected_peak"] == 4000 + 2000 + 4020 + 3000
    assert rows["fsdp2"]["expected_peak"] == 2000 + 2000 + 4020 + 800
    assert rows["fsdp2"]["peak"] == 60_000  # the largest max_rss of the snapshots
    # HSDP as 2 replicas x 1: the whole model and state on each rank, and FSDP2's gathered group on top
    assert rows["hsdp"]["expected_peak"] == 4000 + 4000 + 8040 + 800
    # The warm-up steps (1000 and 500 ms) are left out: the median is the level, and the interval is within +-1 %.
    step = rows["zero2"]["step_ms"]
    assert step["point"] == pytest.approx(100.0, rel=0.01) and 99.0 <= step["lo"] <= step["hi"] <= 101.0
    ratio = rows["reduce_scatter"]["step_ratio_to_zero1"]
    assert ratio["point"] == 1.0 and ratio["lo"] <= 1.0 <= ratio["hi"]


@pytest.mark.parametrize(
    "zero2_level, expected",
    [
        (105.0, "met"),  # ratio 1.05 +- ~2 %: the interval's upper end is under 1.10
        (120.0, "missed"),  # 1.20 +- ~2 %: its lower end is over 1.10
        (110.0, "inconclusive"),  # the interval straddles 1.10
    ],
)
def test_the_step_goal_reads_the_ratio_interval(zero2_level: float, expected: str) -> None:
    step_ms = {mode: _steps(100.0) for mode in MODES} | {"zero2": _steps(zero2_level)}
    goals = _results(step_ms)["family"]["goals"]
    assert goals[1]["verdict"] == expected, goals[1]
    assert goals[1]["ratio"]["point"] == pytest.approx(zero2_level / 100.0, rel=0.01)


@pytest.mark.parametrize(
    "zero2_grads, bucket_size_mb, expected",
    [
        (PARAMS // 2, 25.0, "met"),  # half of DDP's 4000 B: under 2000 + one bucket (the whole 4000 B, < 25 MiB)
        (PARAMS // 2 + PARAMS, 25.0, "met"),  # 6000 B = 2000 + the one 4000-byte bucket: on the bound
        (PARAMS // 2 + PARAMS + 4, 25.0, "missed"),  # 4 bytes over it
        (PARAMS // 2 + 2, 2 / 2**20, "met"),  # a 2-byte bucket: the bound is 2000 + 2
        (PARAMS // 2 + 3, 2 / 2**20, "missed"),
        (PARAMS // 2 + PARAMS, None, "met"),  # no cap: one bucket of all 4000 B
    ],
)
def test_the_gradient_goal_is_n_times_smaller_plus_one_bucket(zero2_grads: int, bucket_size_mb: float | None,
                                                              expected: str) -> None:
    step_ms = {mode: _steps(100.0) for mode in MODES}
    goals = _results(step_ms, zero2_grads=zero2_grads, bucket_size_mb=bucket_size_mb)["family"]["goals"]
    assert goals[0]["verdict"] == expected, goals[0]


def test_goals_without_their_modes_are_not_measurable() -> None:
    modes = ("unsharded", "allreduce_broadcast", "fsdp2")
    results = _results({mode: _steps(100.0) for mode in modes}, modes=modes)
    family = results["family"]
    assert [goal["verdict"] for goal in family["goals"]] == ["not measurable", "not measurable"]
    assert all("step_ratio_to_zero1" not in row for row in family["rows"])  # no ZeRO-1 reduce_scatter to divide by
    assert "| ZeRO-2 gradients per rank <= DDP's / N + one bucket |  |  | **not measurable** |" in format_report(results)


def test_report_shows_the_family_table_and_the_verdicts() -> None:
    step_ms = {mode: _steps(100.0) for mode in MODES} | {"zero2": _steps(120.0)}
    results = _results(step_ms)
    report = format_report(results)
    table = report.split("## The data-parallel family", 1)[1].split(f"## {MODES[0]}", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(MODES) + 1 + 2  # header, a row per mode, the goals' header and 2 goals
    # DDP, MiB measured (expected): parameters and gradients 4000 B, state 8040 B, peak RSS 100 000 B against the
    # tensors' 16 040 B.
    assert rows[1].startswith("| DDP | 0.00 (0.00) | 0.00 (0.00) | 0.01 (0.01) | 0.10 (0.02) | 100.0 [")
    assert "**missed**" in rows[-1] and "ZeRO-2 step time" in rows[-1]
    assert "**met**" in rows[-2]


def test_plot_is_written_atomically_next_to_the_results(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = _results({mode: _steps(100.0) for mode in MODES})
    path = write_memory_plot(results, tmp_path / PLOT_NAME)
    assert path == tmp_path / PLOT_NAME
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # a PNG, whole
    assert [p.name for p in tmp_path.iterdir()] == [PLOT_NAME]  # no temporary file left
