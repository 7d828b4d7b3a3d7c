"""The CLI's memory pre-flight: a run that cannot fit is refused at once, with one message, and nothing written."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_ddp import catalogue, cli
from lightning_ddp.cli import EstimatedStrategy, LightningDDPCLI, _strategy_for_estimate
from lightning_ddp.data import LMDataModule
from lightning_ddp.memory import GiB, MemoryPreflightError, preflight
from lightning_ddp.model import get_config
from lightning_ddp.module import LitGPT
from tests.support.cli_utils import REPO, repo_first_on_path

QUICKSTART = str(REPO / "configs" / "quickstart.yaml")


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["lightning_ddp"])


def _parse(*args: str) -> LightningDDPCLI:
    """Parse and instantiate without running (``run=False``: no subcommand, the pre-flight still runs)."""
    return LightningDDPCLI(LitGPT, LMDataModule, args=["--config", QUICKSTART, *args], run=False)


def test_xl_is_refused_while_parsing_before_anything_is_built(monkeypatch) -> None:
    # What makes the refusal fast, checked without a clock: it comes from parsing the arguments, before any model,
    # data module or Trainer exists (the timed end-to-end run below is the slow tier's).
    def must_not_build(*args, **kwargs):
        raise AssertionError("the classes were instantiated before the pre-flight refused the run")

    monkeypatch.setattr(LightningDDPCLI, "instantiate_classes", must_not_build)
    with pytest.raises(MemoryPreflightError, match="this run would run out of memory") as info:
        _parse("--model.preset", "xl")
    for needle in ("optimizer_state", "peak per rank", "available RAM", "--model.preset medium", "--preflight false"):
        assert needle in str(info.value), needle


@pytest.mark.slow  # a 20-second threshold on a subprocess: noisy on a loaded machine
def test_xl_on_the_quickstart_is_refused_fast_with_one_message_and_writes_nothing(tmp_path: Path) -> None:
    # A new user's first try at the xl preset on a CPU machine: 2 processes of ~31 GiB each (fp32 weights,
    # gradients and AdamW state of 2.0 B parameters alone are 7.4 + 7.4 + 14.9 GiB) cannot fit in any CPU host
    # this suite runs on (the budget is MemAvailable / 2; the test machine has 24 GiB). It must end in seconds,
    # refused by the pre-flight, not minutes later by the OOM killer.
    env = {**repo_first_on_path(), "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_ddp", "fit", "--config", QUICKSTART, "--model.preset", "xl"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    elapsed = time.perf_counter() - start
    assert proc.returncode != 0
    message = proc.stderr
    assert "Memory pre-flight: this run would run out of memory: it needs about" in message, message[-3000:]
    for needle in ("optimizer_state", "peak per rank", "available RAM", "--model.preset medium", "--preflight false"):
        assert needle in message, (needle, message[-3000:])
    assert "Traceback" not in message  # one message, not a stack
    assert elapsed < 20, f"the refusal took {elapsed:.1f} s"
    assert list(tmp_path.iterdir()) == []  # no logs/ directory, no config.yaml, nothing


def test_the_quickstart_passes_the_preflight() -> None:
    # tiny preset, batch 8 x 128, fp32, 2 CPU ranks: ~0.7 GiB per rank (0.5 of it the fixed process overhead).
    _parse()  # raises MemoryPreflightError if it did not pass


def test_preflight_false_skips_the_check(monkeypatch) -> None:
    # Make the budget 1 MiB so that even the tiny quickstart is refused, then skip the check.
    monkeypatch.setattr(cli, "memory_budget_bytes", lambda device_type, ranks: 2**20)
    with pytest.raises(MemoryPreflightError, match="--data.batch_size 1"):
        _parse()
    _parse("--preflight", "false")


def test_fixes_are_the_ones_that_help(monkeypatch) -> None:
    # A 2.75 GiB budget per rank for the small preset at batch 8 x 128 in fp32 with bucketed_ddp: the weights,
    # gradients and state of its 129M parameters are 0.48 + 0.48 + 0.96 GiB, plus 0.5 GiB overhead, and the
    # activations ~0.13 GiB per sequence: a peak of 3.0 GiB at batch 8, 2.45 at batch 1. A smaller batch fits
    # (named with its peak), and so does the tiny preset; bf16-mixed and zero1_ddp lower the peak too.
    monkeypatch.setattr(cli, "memory_budget_bytes", lambda device_type, ranks: int(2.75 * GiB))
    with pytest.raises(MemoryPreflightError) as info:
        _parse("--model.preset", "small")
    message = str(info.value)
    assert "--data.batch_size " in message and "the largest that fits" in message
    assert "--model.preset tiny" in message
    assert "--trainer.precision bf16-mixed" in message
    assert "--trainer.strategy zero1_ddp" in message
    # Every sharding the memory model knows is listed with its peak: zero2 also shards the gradients (0.48 -> 0.24
    # GiB), fsdp2 the parameters too (0.48 -> 0.24 + the gathered embedding, head and two blocks).
    assert "--trainer.strategy zero2_ddp (peak 2.5 GiB, fits)" in message
    assert "--trainer.strategy fsdp2 (peak 2.4 GiB, fits)" in message


def test_a_refused_sweep_cell_is_recorded_as_oom(monkeypatch) -> None:
    # The benchmark sweep classifies a cell by its ranks' logs: the refusal must read as out of memory, with the
    # refusal's first line as the reason.
    from lightning_ddp.bench.launch import is_oom

    monkeypatch.setattr(cli, "memory_budget_bytes", lambda device_type, ranks: 2**20)
    with pytest.raises(MemoryPreflightError) as info:
        _parse()
    assert is_oom(str(info.value).splitlines()[0])


def test_ranks_sharing_a_gpu_split_its_memory(monkeypatch) -> None:
    # The sweep's one-GPU layout: 2 ranks as 2 "nodes" of one device each, on this host, each seeing one GPU.
    monkeypatch.setattr(cli.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert cli._ranks_per_gpu(world_size=2, num_nodes=2) == 2
    assert cli._ranks_per_gpu(world_size=2, num_nodes=1) == 1  # one node: Lightning puts a rank on each GPU
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")  # a real multi-node job: a GPU per rank
    assert cli._ranks_per_gpu(world_size=16, num_nodes=2) == 1


def test_strategy_configs_map_to_the_estimates_names() -> None:
    assert _strategy_for_estimate("naive_ddp") == EstimatedStrategy("naive_ddp")
    bucketed = {"class_path": "lightning_ddp.strategies.GradSyncStrategy",
                "init_args": {"algorithm": "bucketed_ddp", "bucket_size_mb": 2}}
    assert _strategy_for_estimate(bucketed) == EstimatedStrategy("bucketed_ddp", 2)
    # the class under its module's path, and the algorithm left to its default
    generic = {"class_path": "lightning_ddp.strategies.base.GradSyncStrategy", "init_args": {}}
    assert _strategy_for_estimate(generic) == EstimatedStrategy(catalogue.DEFAULT_ENGINE)
    zero2 = {"class_path": "lightning_ddp.strategies.ZeRO2DDPStrategy", "init_args": {"bucket_size_mb": 4}}
    assert _strategy_for_estimate(zero2) == EstimatedStrategy("zero2_ddp", 4)
    # ZeRO-1 over an all-reducing engine: that engine's buffers, and the state sharded.
    broadcast = {"class_path": "lightning_ddp.strategies.ZeRO1DDPStrategy",
                 "init_args": {"schedule": "allreduce_broadcast", "grad_sync": "overlap_ddp"}}
    assert _strategy_for_estimate(broadcast) == EstimatedStrategy("overlap_ddp", sharded_by="zero1_ddp")
    # A strategy the estimate does not model is not guessed at: the pre-flight is skipped.
    assert _strategy_for_estimate({"class_path": "lightning.pytorch.strategies.FSDPStrategy"}) is None
    hsdp = {"class_path": "lightning_ddp.strategies.HSDPStrategy", "init_args": {"shard_size": 2}}
    assert _strategy_for_estimate(hsdp) == EstimatedStrategy("hsdp", shard_size=2)


@pytest.mark.parametrize("shard_size, listed", [(8, True), (16, False)])
def test_hsdp_is_a_fix_where_its_shard_group_is_not_the_world(shard_size: int, listed: bool) -> None:
    # xl, batch 1 x 128, bf16-mixed, ddp on 16 GPUs with 10 GiB each: ddp needs 38.7 GiB; fsdp2 7.7 GiB; hsdp on 2
    # nodes of 8 holds twice fsdp2's shard of the parameters, gradients and AdamW state (0.93 + 0.93 + 1.86 GiB
    # over 8 ranks: +1.4 GiB): 9.0 GiB, fits. With one shard group of 16 it is fsdp2: not named twice.
    with pytest.raises(MemoryPreflightError) as info:
        preflight(get_config, "xl", 10 * GiB, "a 10 GiB test budget", batch_size=1, seq_len=128,
                  precision="bf16-mixed", strategy="ddp", world_size=16, device_type="cuda", shard_size=shard_size)
    message = str(info.value)
    assert "--trainer.strategy fsdp2 (peak 7.7 GiB, fits)" in message
    assert ("--trainer.strategy hsdp (peak 9.0 GiB, fits)" in message) == listed, message
