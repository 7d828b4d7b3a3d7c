"""``validate`` and ``test`` on CUDA: the loss totals (float64 on the GPU) all-reduced by NCCL, under bf16 autocast.

The quickstart's tiny GPT, untrained, on a 32-token context: nearly uniform over the 10,000 tokens, so the held-out
loss is ln(10000) = 9.21 whatever the device, within bf16's rounding of the logits.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.support.cli_utils import REPO, read_scalars, run_cli
from tests.support.fits import strategy_json

pytestmark = [pytest.mark.cuda, pytest.mark.multiprocess]


@pytest.mark.parametrize(("subcommand", "stage"), [("validate", "val"), ("test", "test")])
@pytest.mark.parametrize("strategy", ["bucketed_ddp", "zero1_ddp", "ddp"])
def test_evaluation_on_cuda_at_nccl_world_size_1(tmp_path: Path, subcommand: str, stage: str, strategy: str) -> None:
    run_cli(subcommand, "--config", str(REPO / "configs" / "quickstart.yaml"), "--model.context_length", "32",
            "--data.seq_len", "32", "--data.batch_size", "4", f"--data.{stage}_samples", "10",
            "--trainer.accelerator", "cuda", "--trainer.devices", "1", "--trainer.precision", "bf16-mixed",
            "--trainer.strategy", strategy_json(strategy, "nccl"),
            "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"), cwd=tmp_path)
    scalars = read_scalars(tmp_path / "logs")
    ((_, loss),) = scalars[f"{stage}/loss"]
    assert abs(loss - math.log(10_000)) < 0.2, loss
    assert scalars[f"{stage}/ppl"][0][1] == pytest.approx(math.exp(loss), rel=1e-3)
