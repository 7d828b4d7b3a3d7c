"""Every bad input gives one clear error naming the fix, exits non-zero, and writes nothing.

One row per input: the extra CLI arguments (on top of the quickstart config) and a phrase the error must
contain. Most fail while parsing, in one process; the NCCL and token-file rows fail after the 2 ranks start, so
the whole table is a multi-process test (each row is a real CLI run).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_ddp.data import write_token_file
from tests.support.cli_utils import REPO, run_cli

pytestmark = pytest.mark.multiprocess


def _token_file_with_large_ids(tmp_path: Path) -> list[str]:
    path = tmp_path / "train.bin"
    write_token_file(path, np.arange(20_000) % 12_000, dtype="uint16")  # ids up to 11 999 >= vocab 10 000
    return ["--data.source", "tokens", "--data.path", str(path), "--data.vocab_size", "10000"]


def _truncated_checkpoint(tmp_path: Path) -> list[str]:
    path = tmp_path / "cut.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1000)}}, path)
    path.write_bytes(path.read_bytes()[:2000])  # a write interrupted half-way: the zip directory at the end is gone
    return ["--ckpt_path", str(path)]


CASES = {
    "unknown strategy": (lambda tmp: ["--trainer.strategy", "foo_ddp"], "Unknown strategy 'foo_ddp'. Ours (ddp is Lightning's, the baseline): naive_ddp"),
    "bucket size 0": (
        lambda tmp: ["--config", str(REPO / "configs" / "strategy" / "bucketed.yaml"),
                     "--trainer.strategy.init_args.bucket_size_mb", "0"],
        "bucket_size_mb must be > 0",
    ),
    "nccl without gpus": (
        lambda tmp: ["--trainer.strategy", "lightning_ddp.strategies.GradSyncStrategy",
                     "--trainer.strategy.init_args.process_group_backend", "nccl"],
        "process_group_backend='nccl' needs CUDA GPUs",
    ),
    "more devices than cores": (lambda tmp: ["--trainer.devices", "4096"], "set --trainer.devices to at most"),
    "per-rank batch of 0": (lambda tmp: ["--data.batch_size", "0"], "set --data.batch_size to at least 1"),
    "context above the model's": (
        lambda tmp: ["--data.seq_len", "512"], "exceeds the model's context length 128; lower --data.seq_len"
    ),
    "token ids >= vocab": (_token_file_with_large_ids, "--data.vocab_size"),
    "truncated checkpoint": (_truncated_checkpoint, "is not a readable checkpoint"),
}


CHECKED_IN_ONE_PROCESS = {"unknown strategy", "bucket size 0", "per-rank batch of 0", "truncated checkpoint"}
"""Rows whose twins (a strategy typo, a bucket size of -1, a batch of 0, not a checkpoint) tests/unit/test_cli_errors.py
checks in one process: here they run in the slow tier; the rows that fail only once the ranks start stay in the
default run."""


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case in CHECKED_IN_ONE_PROCESS else case
                                  for case in CASES])
def test_bad_input_gives_one_clear_error_and_writes_nothing(tmp_path: Path, case: str) -> None:
    make_args, phrase = CASES[case]
    proc = run_cli(
        "fit", "--config", str(REPO / "configs" / "quickstart.yaml"), *make_args(tmp_path),
        "--trainer.max_steps", "2", "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"),
        cwd=tmp_path, check=False, timeout=180,
    )
    assert proc.returncode != 0
    assert phrase in proc.stderr, proc.stderr[-3000:]
    written = [p for p in (tmp_path / "logs").rglob("*") if p.is_file()] if (tmp_path / "logs").exists() else []
    assert written == [], written
