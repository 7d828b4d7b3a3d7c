"""The bucket-size model (lightning_ddp.sync.bucket_model): the fit, the optimum, the clamps, and the
microbenchmark on a 1-rank gloo group in this process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_ddp.sync.bucket_model import (
    DEFAULT_SIZES,
    BucketPrediction,
    fit_latency_bandwidth,
    measure_allreduce,
    optimal_bucket_bytes,
    predict_bucket_size,
)
from tests.support.dist_utils import find_free_port

# ---- fit_latency_bandwidth ------------------------------------------------------------------------------


@pytest.mark.parametrize("relative", [True, False])
def test_fit_recovers_overhead_and_bandwidth_exactly_from_noiseless_data(relative):
    # gloo-like numbers: 0.5 ms per call, 1 GB/s. t = o + b / w for 4 KiB .. 64 MiB.
    o, w = 5e-4, 1e9
    times = [o + b / w for b in DEFAULT_SIZES]
    assert fit_latency_bandwidth(DEFAULT_SIZES, times, relative=relative) == (o, w)
    # NCCL-like numbers: 20 us per call, 150 GB/s.
    o, w = 2e-5, 1.5e11
    fitted_o, fitted_w = fit_latency_bandwidth(DEFAULT_SIZES, [o + b / w for b in DEFAULT_SIZES], relative=relative)
    assert fitted_o == pytest.approx(o, rel=1e-9) and fitted_w == pytest.approx(w, rel=1e-9)


def test_relative_fit_finds_the_overhead_where_plain_least_squares_does_not():
    # +-3 % multiplicative noise, alternating. On the 64 MiB message (67 ms) 3 % is 2 ms, four times the 0.5 ms
    # overhead, so plain least squares misplaces the intercept; relative residuals weigh every size alike.
    o, w = 5e-4, 1e9
    times = [(o + b / w) * (1.03 if i % 2 else 0.97) for i, b in enumerate(DEFAULT_SIZES)]
    fitted_o, fitted_w = fit_latency_bandwidth(DEFAULT_SIZES, times)
    assert fitted_o == pytest.approx(o, rel=0.05) and fitted_w == pytest.approx(w, rel=0.05)
    plain_o, _ = fit_latency_bandwidth(DEFAULT_SIZES, times, relative=False)
    assert abs(plain_o - o) / o > 0.1  # why relative is the default


def test_fit_clips_a_negative_overhead_and_reports_unbounded_bandwidth():
    # Time falls with size (pure noise): no bandwidth cost is measurable -> w = inf.
    assert fit_latency_bandwidth([1e3, 1e6], [2e-3, 1e-3])[1] == math.inf
    # Intercept below zero: t = -1 ms + b / (1 GB/s) at b = 2 MB and 3 MB -> o clipped to 0.
    assert fit_latency_bandwidth([2e6, 3e6], [1e-3, 2e-3]) == (0.0, 1e9)


@pytest.mark.parametrize(
    "sizes, times, match",
    [([1, 2], [1.0], "same length"), ([4, 4], [1.0, 2.0], "two distinct"), ([1, 2], [1.0, 0.0], "> 0")],
)
def test_fit_rejects_unusable_measurements(sizes, times, match):
    with pytest.raises(ValueError, match=match):
        fit_latency_bandwidth(sizes, times)


# ---- optimal_bucket_bytes --------------------------------------------------------------------------------


def test_optimal_bucket_is_sqrt_of_s_w_o():
    # s = 400 MB of gradients, w = 10 GB/s, o = 100 us:
    #   n_b* = sqrt(s / (w o)) = sqrt(4e8 / (1e10 * 1e-4)) = sqrt(4e2) = 20 buckets
    #   b*   = s / n_b* = sqrt(s w o) = sqrt(4e8 * 1e10 * 1e-4) = sqrt(4e14) = 2e7 bytes (20 MB)
    s, w, o = 4e8, 1e10, 1e-4
    assert optimal_bucket_bytes(s, o, w) == 20_000_000

    # ...and it is the minimum of the modelled time left after backward, T(n) = s / (n w) + n o (= 4 ms at n = 20).
    def left(n: float) -> float:
        return s / (n * w) + n * o

    assert left(20) == pytest.approx(4e-3)
    assert left(20) < left(19) and left(20) < left(21)


def test_optimal_bucket_never_splits_the_largest_parameter():
    # b* = 20 MB as above, but one parameter has 50 MB: a bucket holds whole parameters, so 50 MB.
    assert optimal_bucket_bytes(4e8, 1e-4, 1e10, largest_param_bytes=5e7) == 50_000_000
    # A largest parameter below b* changes nothing.
    assert optimal_bucket_bytes(4e8, 1e-4, 1e10, largest_param_bytes=1e6) == 20_000_000


def test_optimal_bucket_is_capped_at_all_gradients_and_floored_when_calls_are_free():
    # o = 1 s: sqrt(4e8 * 1e10 * 1) = 2e9 > s = 4e8 -> one bucket holding everything.
    assert optimal_bucket_bytes(4e8, 1.0, 1e10) == 400_000_000
    # No per-call cost (o = 0) or free transfer (w = inf): more buckets never hurt -> the smallest allowed.
    assert optimal_bucket_bytes(4e8, 0.0, 1e10, largest_param_bytes=1234) == 1234
    assert optimal_bucket_bytes(4e8, 1e-4, math.inf, largest_param_bytes=1234) == 1234


@pytest.mark.parametrize("s, o, w, largest", [(0, 1e-4, 1e9, 0), (1e6, -1.0, 1e9, 0), (1e6, 1e-4, 0.0, 0), (1e6, 1e-4, 1e9, -1)])
def test_optimal_bucket_rejects_impossible_inputs(s, o, w, largest):
    with pytest.raises(ValueError):
        optimal_bucket_bytes(s, o, w, largest)


def test_prediction_properties():
    p = BucketPrediction(5e-4, 1e9, grad_bytes=16 * 2**20, largest_param_bytes=2**20, bucket_bytes=4 * 2**20)
    assert p.bucket_size_mb == 4.0 and p.n_buckets == 4.0


# ---- on a 1-rank gloo group ------------------------------------------------------------------------------


@pytest.fixture
def one_rank_group():
    """A 1-rank gloo default group in this process, destroyed after the test whatever happens."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_measure_allreduce_on_one_rank(one_rank_group):
    sizes = [4096, 65536, 2**20]
    times = measure_allreduce(sizes, repeats=3)
    assert len(times) == 3 and all(t > 0 for t in times)
    with pytest.raises(ValueError, match="repeats"):
        measure_allreduce(sizes, repeats=0)


def test_measure_allreduce_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        measure_allreduce([4096], repeats=1)


def test_predict_bucket_size_on_one_rank(one_rank_group):
    # Linear(256 -> 512) weight: 512 * 256 * 4 = 512 KiB; its bias 2 KiB; a frozen 1 MiB parameter not counted.
    model = nn.Linear(256, 512)
    model.register_parameter("frozen", nn.Parameter(torch.zeros(2**18), requires_grad=False))
    prediction = predict_bucket_size(model, sizes=[4096, 65536, 2**20], repeats=3)
    assert prediction.grad_bytes == 512 * 256 * 4 + 512 * 4
    assert prediction.largest_param_bytes == 512 * 256 * 4
    # Whatever one rank measures, the answer lies between the largest parameter and all gradients.
    assert prediction.largest_param_bytes <= prediction.bucket_bytes <= prediction.grad_bytes
    from_params = predict_bucket_size(model.parameters(), sizes=[4096, 65536], repeats=1)
    assert from_params.bucket_size_mb <= prediction.grad_bytes / 2**20


def test_bucketed_engine_resolves_auto_with_the_prediction(one_rank_group):
    from lightning_ddp.sync import BucketedDDP

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    ddp = BucketedDDP(model, bucket_size_mb="auto")
    largest, total = 64 * 64 * 4, sum(p.numel() * 4 for p in model.parameters())
    assert isinstance(ddp.bucket_size_mb, float)
    assert largest / 2**20 - 1e-9 <= ddp.bucket_size_mb <= total / 2**20 + 1e-9
