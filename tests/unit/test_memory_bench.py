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
