"""Lightning fits on CUDA: the CommTimer's CUDA path for every strategy, a per-device backend spec, ``auto`` buckets.

Each fit is the quickstart's tiny GPT for 8 steps in ``bf16-mixed`` (``tests.support.fits``); every logged step must have
finite numbers with exposed and busy communication inside the step and no clock anomaly (``check_step_rows``).
At NCCL world size 1 nothing crosses a wire, but every CUDA line of the accounting runs: events on the current
stream, NCCL completions from the future's callback stream, the one synchronize per step, peak memory.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_ddp import catalogue
from tests.support.device_matrix import completion_clocks
from tests.support.dist_utils import run_on_ranks
from tests.support.fits import check_step_rows, fit_one_device, strategy_json

pytestmark = [pytest.mark.cuda, pytest.mark.multiprocess]

STRATEGIES = catalogue.names(engines_only=True) + ["zero1_ddp", "zero2_ddp", "ddp"]
BF16 = ("--trainer.precision", "bf16-mixed")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_comm_timer_on_cuda_at_nccl_world_size_1(tmp_path: Path, strategy: str) -> None:
    summary = fit_one_device(tmp_path, "--trainer.strategy", strategy_json(strategy, "nccl"), *BF16)
    check_step_rows(summary)
    assert summary["run"]["backend"] == "nccl" and summary["run"]["world_size"] == 1
    # On CUDA the timer reads the allocator: peak allocated and reserved memory of every step, reserved >= allocated.
    for row in summary["steps"]:
        assert 0 < row["memory/peak_MiB"] <= row["memory/peak_reserved_MiB"], row
    # An H100/H200 is in the peak table, so MFU is logged, as a fraction.
    assert 0 < summary["summary"]["step/mfu"]["median"] < 1


@pytest.mark.parametrize("strategy", ["bucketed_ddp", "zero1_ddp", "zero2_ddp"])
def test_comm_timer_on_two_ranks_sharing_one_gpu_over_gloo(tmp_path: Path, strategy: str) -> None:
    summary = fit_one_device(tmp_path, "--trainer.strategy", strategy_json(strategy, "gloo"), *BF16, ranks=2)
    check_step_rows(summary)
    assert summary["run"]["backend"] == "gloo" and summary["run"]["world_size"] == 2
    # gloo moves the gradients through the host: communication really happened and took time.
    assert summary["summary"]["comm/busy_ms"]["median"] > 0 and summary["summary"]["comm/bytes"]["median"] > 0


def test_per_device_backend_spec_runs_a_fit(tmp_path: Path) -> None:
    summary = fit_one_device(tmp_path, "--trainer.strategy", strategy_json("bucketed_ddp", "cpu:gloo,cuda:nccl"), *BF16)
    check_step_rows(summary)


def test_per_device_backend_spec_records_device_completions() -> None:
    # cpu:gloo,cuda:nccl: CUDA tensors go through NCCL, so each completion is an event on the callback's stream.
    (result,) = run_on_ranks(completion_clocks, 1, "cuda", backend="cpu:gloo,cuda:nccl", timeout=180)
    assert result["backend_for_device"] == "nccl", result
    assert result["clocks"] and set(result["clocks"]) == {"device"}, result
    assert result["ordered"], result


def test_nccl_records_device_completions() -> None:
    (result,) = run_on_ranks(completion_clocks, 1, "cuda", backend="nccl", timeout=180)
    assert result["backend_for_device"] == "nccl" and set(result["clocks"]) == {"device"}, result


def test_gloo_with_cuda_tensors_records_host_completions() -> None:
    # gloo completes on its own thread once the data is back on the GPU: the host clock, on both ranks.
    results = run_on_ranks(completion_clocks, 2, "cuda", backend="gloo", timeout=180)
    for result in results:
        assert result["backend_for_device"] == "gloo" and set(result["clocks"]) == {"host"}, result
        assert result["ordered"], result


@pytest.mark.parametrize("ranks, backend", [(1, "nccl"), (2, "gloo")], ids=["nccl_1rank", "gloo_2ranks_one_gpu"])
def test_bucket_size_auto_on_cuda(tmp_path: Path, ranks: int, backend: str) -> None:
    summary = fit_one_device(tmp_path, "--trainer.strategy", strategy_json("bucketed_ddp", backend, bucket_size_mb="auto"),
                             *BF16, ranks=ranks)
    check_step_rows(summary)
    # The microbenchmark ran on the GPU and picked a cap, which optimal_bucket_bytes clamps between the largest
    # tensor (the 10,000 x 128 fp32 embedding: 5,120,000 B = 4.883 MiB) and all the gradients (the tiny GPT's 39
    # tensors: 14,438,912 B = 13.770 MiB).
    size = summary["run"]["bucket_size_mb"]
    assert isinstance(size, float) and 4.882 < size < 13.771, size
