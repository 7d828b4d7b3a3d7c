"""The ZeRO-1 memory benchmark: its analytic figures and its configs (the end-to-end run on 2 gloo ranks is
``tests/dist/test_memory_bench_run.py``)."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest
import torch

from lightning_ddp.bench import memory
from lightning_ddp.bench.memory import MODES, MemoryBenchConfig, expected_bytes, parse_config, sent_bytes_per_rank
from lightning_ddp.model import GPT, get_config
from tests.support.cli_utils import REPO

MEMORY_CONFIGS = sorted((REPO / "configs" / "memory").glob("*.yaml"))
GiB = 2**30


def test_doctests() -> None:
    assert doctest.testmod(memory).failed == 0


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


@pytest.mark.parametrize("path", MEMORY_CONFIGS, ids=lambda p: p.name)
def test_every_memory_config_parses(path: Path) -> None:
    config = parse_config(["--config", str(path)])
    assert isinstance(config, MemoryBenchConfig) and config.modes == list(MODES)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "huge"], "not a supported preset"),
        (["--steps", "1"], "steps must be >= 2"),
        (["--modes", "[zero3]"], "not valid"),
        (["--backend", "nccl"], "needs accelerator cuda"),
    ],
)
def test_config_errors_name_the_flag(args: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_config(args)


def _family_results(zero2_steps: list[float]) -> dict:
    """Hand-made results of 2 ranks: DDP holds 8 MiB of gradients, ZeRO-2 4 MiB (half) with 1 MiB buckets."""
    MiB = 2**20

    def mode(name: str, grads: float, state: float, steps: list[float], peak: float) -> dict:
        snap = {"parameters": 8 * MiB, "gradients": int(grads * MiB), "optimizer_state": int(state * MiB)}
        ranks = [{"rank": r, "snapshots": {"before_step": snap}, "step_ms": [999.0, *steps], "peak_bytes": int(peak * MiB)}
                 for r in range(2)]
        return {"mode": name, "ranks": ranks, "matches_expected": True}

    return {
        "config": {"devices": 2, "bucket_size_mb": 1, "accelerator": "cpu", "preset": "tiny"},
        "modes": [mode("unsharded", 8, 16, [100.0] * 9, 64), mode("reduce_scatter", 8, 8, [100.0] * 9, 56),
                  mode("zero2", 4, 8, zero2_steps, 50)],
    }


def test_family_table_reads_each_mode_and_judges_the_zero2_goals(tmp_path: Path) -> None:
    from lightning_ddp.bench.memory_report import family_goals, family_rows, format_family_table, write_family_plot

    # ZeRO-2 at 105 ms against ZeRO-1's 100 ms every step: ratio 1.05 with a zero-width interval -> met; its 4 MiB
    # of gradients against 8 / 2 + 1 = 5 MiB -> met. The first step (999 ms) is warm-up and left out.
    results = _family_results([105.0] * 9)
    rows = family_rows(results)
    assert [row["step"].point for row in rows] == [100.0, 100.0, 105.0]
    goals = family_goals(results, rows)
    assert "5.00 MiB: **met**" in goals[0] and "1.050 [1.050, 1.050]: **met**" in goals[1]
    assert "| ZeRO-2 | 8.00 | 4.00 | 8.00 | 50.00 | 105.0 [105.0, 105.0] | yes |" in format_family_table(results)
    assert write_family_plot(results, tmp_path / "memory_vs_step.png").stat().st_size > 0

    # 130 ms every step: 1.3 > 1.10 on the whole interval -> missed.
    slow = _family_results([130.0] * 9)
    assert "**missed**" in family_goals(slow, family_rows(slow))[1]
