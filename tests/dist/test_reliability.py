"""How the tool fails and recovers: a dying rank ends the job, resume is exact, 2 nodes == 1 node.

Every test launches real 2-process runs through the CLI (seconds each), so they are marked ``slow``: out of the
default run, ``pytest -m slow`` runs them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_ddp import catalogue
from tests.support.cli_utils import REPO, SAVE_FINAL_WEIGHTS, repo_first_on_path, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

CUSTOM_STRATEGIES = catalogue.names(engines_only=True) + ["zero1_ddp"]
SMALL = ("--config", str(REPO / "configs" / "quickstart.yaml"), "--model.context_length", "32", "--data.seq_len", "32",
         "--data.batch_size", "2", "--data.num_samples", "24", "--timer.enabled", "false")


def _processes_mentioning(marker: str) -> list[int]:
    """PIDs of live processes whose command line contains ``marker`` (our runs carry their tmp dir in it)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and int(pid) != os.getpid():
            pids.append(int(pid))
    return pids


# A rank killed outright leaves its peer blocked wherever its engine waits (a blocking all-reduce, a bucket's wait,
# ZeRO-1's all-gather): every strategy. A rank that raises goes through Lightning's exception handling, which
# depends on the strategy class, not the algorithm: one GradSyncStrategy algorithm and ZeRO-1's own class.
FAILURES = [(strategy, "sigkill") for strategy in CUSTOM_STRATEGIES] + [("naive_ddp", "raise"), ("zero1_ddp", "raise")]


@pytest.mark.parametrize(("strategy", "mode"), FAILURES)
def test_a_failing_rank_ends_the_whole_job_quickly(tmp_path: Path, strategy: str, mode: str) -> None:
    proc = run_cli(
        "fit", *SMALL, "--trainer.strategy", strategy, "--trainer.max_steps", "50",
        "--trainer.callbacks+=tests.support.callbacks_for_tests.FailAt", "--trainer.callbacks.step", "3",
        "--trainer.callbacks.rank", "1", "--trainer.callbacks.mode", mode,
        "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"),
        cwd=tmp_path, check=False, timeout=120,
    )
    ended = time.time()
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    # Measured from the failure, not from the start: starting 2 processes can take long on a loaded machine.
    failed_at = float(output.split("[FailAt] failing at t=")[1].split()[0])
    assert ended - failed_at < 60, f"the job took {ended - failed_at:.0f} s to end after rank 1 failed"
    if mode == "raise":
        assert "injected failure on rank 1 at step 3" in output, output[-3000:]  # the failing rank's own error
    else:
        # Rank 0 only sees gloo's "Connection closed by peer"; our strategy adds which sibling died and how.
        assert "[lightning_ddp] rank 1 (pid" in output and "was killed by SIGKILL" in output, output[-3000:]
    time.sleep(1)
    assert _processes_mentioning(str(tmp_path)) == [], "processes were left behind"


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


RESUME_CASES = {
    **{name: ["--trainer.strategy", name] for name in [*CUSTOM_STRATEGIES, "ddp"]},
    "bucketed_auto": ["--trainer.strategy", "lightning_ddp.strategies.GradSyncStrategy",
                      "--trainer.strategy.init_args.bucket_size_mb", "auto"],
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_from_a_mid_epoch_checkpoint_is_exact(tmp_path: Path, case: str) -> None:
    # One uninterrupted run of 10 steps that also writes a checkpoint after step 4 (mid-epoch: 24 samples over 2
    # ranks with batch 2 is 6 steps per epoch), then a run resumed from that checkpoint. A cosine schedule with
    # warm-up makes the learning rate depend on the step, so a resume at the wrong step or sample shows up.
    common = (*SMALL, *RESUME_CASES[case], "--trainer.max_steps", "10", "--model.warmup_steps", "2",
              "--model.lr_schedule", "cosine", SAVE_FINAL_WEIGHTS)
    run_cli("fit", *common, "--trainer.callbacks.path", str(tmp_path / "full.pt"),
            "--trainer.enable_checkpointing", "true", "--trainer.callbacks+=ModelCheckpoint",
            "--trainer.callbacks.dirpath", str(tmp_path / "ckpt"), "--trainer.callbacks.every_n_train_steps", "4",
            "--trainer.callbacks.save_top_k", "-1",
            "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"), cwd=tmp_path)
    checkpoint = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    assert checkpoint.exists(), sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    run_cli("fit", *common, "--trainer.callbacks.path", str(tmp_path / "resumed.pt"), "--ckpt_path", str(checkpoint),
            "--trainer.logger.init_args.save_dir", str(tmp_path / "logs_resumed"), cwd=tmp_path)
    full, resumed = _weights(tmp_path / "full.pt"), _weights(tmp_path / "resumed.pt")
    assert full.keys() == resumed.keys()
    different = [k for k in full if not torch.equal(full[k], resumed[k])]
    assert different == [], f"{len(different)} tensors differ after resume, e.g. {different[:3]}"


def test_two_nodes_of_one_process_equal_one_node_of_two(tmp_path: Path) -> None:
    # torchrun on localhost, twice (node_rank 0 and 1), as on a real 2-node cluster; Lightning reads torchrun's
    # environment. One thread per process in both runs: the thread count changes the order of float sums.
    args = (*SMALL, "--trainer.strategy", "bucketed_ddp", "--trainer.max_steps", "5",
            SAVE_FINAL_WEIGHTS, "--trainer.enable_progress_bar", "false")
    env = {**repo_first_on_path(), "OMP_NUM_THREADS": "1"}
    run_cli("fit", *args, "--trainer.callbacks.path", str(tmp_path / "one_node.pt"),
            "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"), cwd=tmp_path, env=env)
    port = str(29_000 + os.getpid() % 1000)
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
             "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", port,
             "-m", "lightning_ddp", "fit", *args, "--trainer.num_nodes", "2", "--trainer.devices", "1",
             "--trainer.callbacks.path", str(tmp_path / "two_nodes.pt"),
             "--trainer.logger.init_args.save_dir", str(tmp_path / f"logs_node{node}")],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.send_signal(signal.SIGKILL)
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    one, two = _weights(tmp_path / "one_node.pt"), _weights(tmp_path / "two_nodes.pt")
    assert all(torch.equal(one[k], two[k]) for k in one)
