"""Tests for lightning_ddp.sync.bucketed.assign_buckets (pure) and the engines on a 1-rank gloo group (one process)."""

from __future__ import annotations

import copy
import random
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_ddp.sync import BucketedDDP, FlatDDP, NaiveDDP, OverlapDDP, Recorder, assign_buckets
from tests.support.dist_utils import find_free_port

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16


# ---- assign_buckets ------------------------------------------------------------------------------


def test_walks_parameters_in_reverse():
    # Backward produces the last parameter's gradient first, so bucket 0 starts at the last index.
    assert assign_buckets([4, 4, 4, 12], [F32] * 4, cap_bytes=8) == [[3], [2, 1], [0]]
    assert assign_buckets([1, 2, 3], [F32] * 3, cap_bytes=None) == [[2, 1, 0]]


def test_bucket_exactly_at_the_cap_stays_open():
    # Reverse walk over 4-byte tensors: 4 + 4 = 8 <= cap 8 keeps [3, 2] together; a third would make 12 > 8.
    assert assign_buckets([4, 4, 4, 4], [F32] * 4, cap_bytes=8) == [[3, 2], [1, 0]]
    # One byte less and no two tensors fit together (8 > 7).
    assert assign_buckets([4, 4, 4, 4], [F32] * 4, cap_bytes=7) == [[3], [2], [1], [0]]
    # One byte more changes nothing: a third tensor would still make 12 > 9.
    assert assign_buckets([4, 4, 4, 4], [F32] * 4, cap_bytes=9) == [[3, 2], [1, 0]]


def test_parameter_larger_than_cap_sits_alone():
    # Reverse: [3, 2] = 4 bytes; index 1 (100 bytes) would make 104 > 10 -> closes; 100 alone; index 0 would
    # make 102 > 10 -> closes again.
    assert assign_buckets([2, 100, 2, 2], [F32] * 4, cap_bytes=10) == [[3, 2], [1], [0]]
    # Oversized first or last parameter: still its own bucket, and never an empty bucket before it.
    assert assign_buckets([2, 100], [F32] * 2, cap_bytes=10) == [[1], [0]]
    assert assign_buckets([100, 2], [F32] * 2, cap_bytes=10) == [[1], [0]]
    assert assign_buckets([100], [F32], cap_bytes=10) == [[0]]


def test_none_cap_is_one_bucket_per_dtype():
    assert assign_buckets([10**9, 1, 10**9], [F32] * 3, cap_bytes=None) == [[2, 1, 0]]
    assert assign_buckets([], [], cap_bytes=None) == []


def test_dtype_change_starts_a_new_bucket():
    # Reverse: 4 (f32) | 3, 2 (f64) | 1, 0 (f32): each change of dtype closes the bucket, cap or not.
    dtypes = [F32, F32, F64, F64, F32]
    assert assign_buckets([4] * 5, dtypes, cap_bytes=None) == [[4], [3, 2], [1, 0]]
    assert assign_buckets([4] * 5, dtypes, cap_bytes=1000) == [[4], [3, 2], [1, 0]]
    # Same dtype after a change does not merge with the earlier run of that dtype: buckets are contiguous.
    assert assign_buckets([2, 2, 2], [BF16, F32, BF16], cap_bytes=None) == [[2], [1], [0]]


@pytest.mark.parametrize("seed", range(5))
def test_random_sizes_keep_invariants(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    nbytes = [rng.choice([4, 64, 1000, 5000]) for _ in range(n)]
    dtypes = [rng.choice([F32, F32, F32, BF16]) for _ in range(n)]
    cap = rng.choice([1, 100, 4096, 10**6])
    buckets = assign_buckets(nbytes, dtypes, cap)
    # Every index exactly once, in reverse order when the buckets are read one after another.
    assert [i for bucket in buckets for i in bucket] == list(reversed(range(n)))
    for bucket in buckets:
        assert len({dtypes[i] for i in bucket}) == 1
        assert len(bucket) == 1 or sum(nbytes[i] for i in bucket) <= cap
    # Greedy: a bucket closed for size could not have taken the next index without exceeding the cap.
    for this, following in zip(buckets, buckets[1:]):
        if dtypes[this[-1]] == dtypes[following[0]]:
            assert sum(nbytes[i] for i in this) + nbytes[following[0]] > cap


# ---- engines on one rank ------------------------------------------------------------------------


@pytest.fixture
def one_rank_group(monkeypatch):
    """A 1-rank gloo default group in this process, destroyed after the test whatever happens."""
    if sys.platform.startswith("linux"):
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # everything is on this host
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_engines_need_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        NaiveDDP(nn.Linear(2, 2))


@pytest.mark.parametrize("size", [0, 0.0, -1, -0.5, float("nan")])
def test_bucketed_rejects_non_positive_bucket_size(one_rank_group, size):
    with pytest.raises(ValueError, match="bucket_size_mb must be > 0"):
        BucketedDDP(nn.Linear(2, 2), bucket_size_mb=size)


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 7)  # 35 + 7 floats
        self.fc2 = nn.Linear(7, 3)  # 21 + 3 floats
        self.unused = nn.Linear(3, 3)  # never called: its .grad must stay None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


ONE_RANK_ENGINES = {
    "naive": NaiveDDP,
    "flat": FlatDDP,
    "overlap": OverlapDDP,
    "bucketed": lambda m: BucketedDDP(m, bucket_size_mb=100 / 2**20),  # 100-byte cap: several buckets
    "bucketed_one": lambda m: BucketedDDP(m, bucket_size_mb=None),
}


@pytest.mark.parametrize("engine", list(ONE_RANK_ENGINES))
def test_one_rank_engine_is_exactly_plain_training(one_rank_group, engine):
    torch.manual_seed(0)
    plain = _Small()
    wrapped = ONE_RANK_ENGINES[engine](copy.deepcopy(plain))
    recorder = Recorder()
    wrapped.recorder = recorder
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    opt_wrapped = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
    data = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(6, 5, generator=data), torch.randn(6, 3, generator=data)
        for model, opt in ((plain, opt_plain), (wrapped, opt_wrapped)):
            if model is wrapped:
                recorder.open_step()
                wrapped.on_train_batch_start()
            nn.functional.mse_loss(model(x), y).backward()
            if model is wrapped:
                wrapped.finish_gradient_synchronization()
            opt.step()
            opt.zero_grad()
        # One rank: the all-reduce SUM is the identity and dividing by 1 is exact, so bitwise equality.
        for (name, p), q in zip(plain.named_parameters(), wrapped.module.parameters()):
            assert torch.equal(p, q), name
        assert wrapped.module.unused.weight.grad is None and wrapped.module.unused.bias.grad is None
        # 6 trainable tensors -> the flags call carries 6 int32 = 24 bytes, once per step.
        record = recorder.finish_step()
        flags = [c for c in record.collectives if c.label == "gradient presence flags"]
        assert len(flags) == 1 and flags[0].nbytes == 24
        assert all(c.completed is not None and c.launched <= c.completed for c in record.collectives)


@pytest.mark.parametrize("engine", ["NaiveDDP", "FlatDDP", "OverlapDDP", "BucketedDDP"])
def test_a_parameter_unfrozen_after_wrapping_is_an_error(one_rank_group, engine):
    # The engine only synchronises what was trainable when it wrapped the model; training a parameter unfrozen
    # later would silently use each rank's own gradient, so it must fail loudly instead.
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model[0].weight.requires_grad_(False)
    ddp = {"NaiveDDP": NaiveDDP, "FlatDDP": FlatDDP, "OverlapDDP": OverlapDDP, "BucketedDDP": BucketedDDP}[engine](model)
    model[0].weight.requires_grad_(True)
    ddp.on_train_batch_start()
    ddp(torch.randn(2, 3)).sum().backward()
    with pytest.raises(RuntimeError, match=r"0\.weight had requires_grad=False when .* wrapped the model"):
        ddp.finish_gradient_synchronization()
