"""The configs say what is so: cell counts and memory figures stated in YAML comments are what the code gives,
and the sweep's cells use the loopback interface for gloo."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from functools import partial
from pathlib import Path

import pytest
from jsonargparse import auto_cli

from lightning_ddp import memory
from lightning_ddp.bench.config import GridConfig, OutputConfig, RunConfig, SweepConfig, WorkloadConfig, expand_grid
from lightning_ddp.bench.launch import LOOPBACK_INTERFACE, RankLayout
from lightning_ddp.bench.sweep import cell_environments
from lightning_ddp.command_line import parse_dataclass
from tests.support.cli_utils import REPO

parse_config = partial(parse_dataclass, SweepConfig, prog="python -m lightning_ddp.bench")

BENCH_CONFIGS = sorted((REPO / "configs" / "bench").glob("*.yaml"))
# "= 180 cells x 3 repeats": the total after "=" (a "15 cells" per group is not a total), repeats if stated.
CELLS = re.compile(r"= (\d[\d,]*) cells(?: x (\d+) repeats)?")


def _comments(path: Path) -> str:
    return " ".join(line.lstrip("# ").strip() for line in path.read_text().splitlines() if line.lstrip().startswith("#"))


def test_every_bench_config_states_its_cell_count() -> None:
    # So that the next test checks all of them: a config without the statement would pass it silently.
    missing = [p.name for p in BENCH_CONFIGS if not CELLS.search(_comments(p))]
    assert missing == [], f"state '= N cells x R repeats' in the comments of {missing}"


@pytest.mark.parametrize("path", BENCH_CONFIGS, ids=lambda p: p.name)
def test_stated_cell_count_is_the_grid(path: Path) -> None:
    stated = CELLS.findall(_comments(path))
    if not stated:
        pytest.skip("states no cell count")
    assert len(stated) == 1, f"{path.name} states {len(stated)} cell totals: {stated}"
    cells, repeats = stated[0]
    sweep = parse_config(["--config", str(path)])
    assert len(expand_grid(sweep)) == int(cells.replace(",", "")), path.name
    if repeats:
        assert sweep.run.repeats == int(repeats), path.name


def test_xl_gpu_is_180_cells_of_3_repeats() -> None:
    # 2 precisions x 2 batch sizes x 3 contexts = 12 groups; per group the reference, naive_ddp, flat_ddp, overlap_ddp
    # and ddp (5) plus bucketed_ddp and bucketed_bf16_ddp at 1 / 10 / 100 / 1000 MB and auto (10) = 15: 180 cells.
    sweep = parse_config(["--config", str(REPO / "configs" / "bench" / "xl_gpu.yaml")])
    assert len(expand_grid(sweep)) == 12 * 15 == 180 and sweep.run.repeats == 3


def _peak_gib_printed(command: str) -> float:
    args = shlex.split(command.split("python -m lightning_ddp.memory", 1)[1])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        auto_cli(memory.print_estimate, args=args)  # python -m lightning_ddp.memory <args>
    return float(re.search(r"peak per rank\s+([\d.]+) GiB", out.getvalue()).group(1))


@pytest.mark.parametrize("name,stated", [("xl_2gpu.yaml", 45), ("bench/xl_gpu.yaml", 47), ("bench/one_gpu.yaml", 24)])
def test_memory_figures_in_comments_are_the_estimates(name: str, stated: int) -> None:
    # Each config names the command that prints its figure; running it gives the figure the comment states:
    # xl bf16-mixed 45 GiB, xl 32-true 47 GiB, large bf16-mixed 24 GiB per rank.
    text = (REPO / "configs" / name).read_text()
    (command,) = [line for line in text.splitlines() if "python -m lightning_ddp.memory" in line]
    assert f"~{stated} GiB" in text
    assert round(_peak_gib_printed(command)) == stated


def _sweep(tmp_path: Path, env: dict[str, str] | None = None) -> SweepConfig:
    return SweepConfig(
        grid=GridConfig(strategies=["naive_ddp"], batch_sizes=[2], context_lengths=[32], bucket_sizes_mb=[1.0]),
        workload=WorkloadConfig(base_config=str(REPO / "configs" / "quickstart.yaml")),
        run=RunConfig(predict_bucket_size=False, repeats=2, load_sample_s=0.0, env=env or {}),
        output=OutputConfig(out_dir=str(tmp_path / "sweep"), plots=False),
    )


def test_cells_use_the_loopback_interface_for_gloo_unless_told_otherwise(tmp_path: Path) -> None:
    # Every rank of a cell is on this host; gloo left to itself may bind an interface that does not route back.
    config = _sweep(tmp_path)
    cells = {c.strategy: c for c in expand_grid(config)}
    layout = RankLayout("gloo", 2, 1)
    for cell in (cells["naive_ddp"], cells["reference"]):
        for env in cell_environments(cell, config, layout, 12345, parent={"PATH": "/bin"}):
            assert env["GLOO_SOCKET_IFNAME"] == LOOPBACK_INTERFACE
    # The user's value wins, from the sweep's environment or from run.env.
    (env, _) = cell_environments(cells["naive_ddp"], config, layout, 1, parent={"GLOO_SOCKET_IFNAME": "eth1"})
    assert env["GLOO_SOCKET_IFNAME"] == "eth1"
    configured = _sweep(tmp_path, env={"GLOO_SOCKET_IFNAME": "ib0"})
    (env, _) = cell_environments(cells["naive_ddp"], configured, layout, 1, parent={})
    assert env["GLOO_SOCKET_IFNAME"] == "ib0"
