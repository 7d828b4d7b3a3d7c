"""The one memory model (``lightning_ddp.sync.memory_model``): its rules worked out by hand, the engine building its
buffers by it, and the pre-flight and the projection pricing the same buffers and shards."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_ddp import catalogue
from lightning_ddp.memory import ADAM_STEP_BYTES_PER_TENSOR, estimate_rank_memory, gpt_parameter_shapes
from lightning_ddp.model import GPT, get_config
from lightning_ddp.projection.comm import FABRICS
from lightning_ddp.projection.flops import ModelShape, modelled_profile
from lightning_ddp.projection.simulators import StepModel, simulate
from lightning_ddp.sync.memory_model import (
    MiB, bucket_cap_bytes, buffer_numel, dim0_shard_numel, fully_sharded_unsharded_peak, owns_buffer, sentinel_numel,
    zero2_buffer_bytes,
)

TINY = {"vocab_size": 64, "context_length": 16, "n_layers": 2}  # 2 blocks: a prefetched block exists


def test_the_last_bucket_and_every_bucket_of_several_tensors_own_a_buffer() -> None:
    # Three buckets: [one tensor], [two tensors], [one tensor, the last]. Only the middle and the last own one; the
    # last ends in the sentinel, one element more than its gradient.
    assert [owns_buffer(b, 3, tensors) for b, tensors in enumerate([1, 2, 1])] == [False, True, True]
    assert [sentinel_numel(b, 3) for b in range(3)] == [0, 0, 1]
    assert buffer_numel(1, 3, [6, 4]) == 10 and buffer_numel(2, 3, [5]) == 6


def test_dim0_shards_are_torch_chunks() -> None:
    # fully_shard splits dim 0 as torch.chunk does: ceil(rows / ranks) rows each, the last ranks shorter or empty
    # (5 rows on 4 ranks: 2, 2, 1, 0); every element is on exactly one rank.
    for rows in range(0, 10):
        for ranks in range(1, 5):
            chunks = list(torch.arange(rows * 3).reshape(rows, 3).chunk(ranks)) if rows else []
            held = [dim0_shard_numel((rows, 3), ranks, rank) for rank in range(ranks)]
            assert held == [c.numel() for c in chunks] + [0] * (ranks - len(chunks)), (rows, ranks)
    assert dim0_shard_numel((), 4, 0) == 1 and dim0_shard_numel((), 4, 1) == 0  # a 0-d tensor is one row


def test_the_unsharded_peak_counts_the_root_two_blocks_and_one_blocks_gradients() -> None:
    # root 10, blocks 3, 5, 4: the two largest (5 and 4) gathered beside the root, the largest's gradients
    assert fully_sharded_unsharded_peak(10, [3, 5, 4]) == (19, 5)
    assert fully_sharded_unsharded_peak(10, [7]) == (17, 7)  # one block: nothing to prefetch
    assert fully_sharded_unsharded_peak(10, []) == (10, 0)


def test_zero2_keeps_its_buckets_in_flight_and_the_one_filling() -> None:
    # 2 send buffers and the bucket filling, each the 64-byte cap; with no cap (or a cap over the 80 gradient
    # bytes) each holds every gradient
    assert zero2_buffer_bytes(64, 80) == 3 * 64
    assert zero2_buffer_bytes(None, 80) == zero2_buffer_bytes(1000, 80) == 3 * 80
    assert zero2_buffer_bytes(64, 80, buckets_in_flight=1) == 2 * 64


def _profile(precision: str = "32-true"):
    config = get_config("tiny", **TINY)
    shape = ModelShape(d_model=config.d_model, n_layers=config.n_layers, n_heads=config.n_heads, d_ff=config.d_ff,
                       vocab_size=config.vocab_size, tie_embeddings=config.tie_embeddings)
    return config, modelled_profile(shape, 2, 16, precision=precision)


@pytest.mark.parametrize("bucket_size_mb", [0.01, 0.1, 25.0])
def test_the_engine_the_preflight_and_the_projection_keep_the_same_bucket_buffers(world_of_one,
                                                                                  bucket_size_mb: float) -> None:
    config, profile = _profile()
    torch.manual_seed(0)
    engine = catalogue.get("bucketed_ddp").make_engine(GPT(config), bucket_size_mb=bucket_size_mb)
    buffers = [bucket.buffer for bucket in engine._buckets if bucket.buffer is not None]
    buffer_bytes = sum(buffer.numel() * buffer.element_size() for buffer in buffers)
    viewed_bytes = sum(bucket.buffer.numel() - bucket.has_sentinel for bucket in engine._buckets
                       if bucket.buffer is not None) * 4
    assert len(engine._buckets) > 1 or bucket_size_mb == 25.0  # the small caps make several buckets

    estimate = estimate_rank_memory(config, batch_size=2, seq_len=16, precision="32-true", strategy="bucketed_ddp",
                                    world_size=2, bucket_size_mb=bucket_size_mb)
    assert estimate.parts["bucket_buffers"] == buffer_bytes
    assert estimate.parts["regrown_gradients"] == viewed_bytes

    # The projection: parameters, gradients and AdamW's two moments (4 x the gradient bytes), and the buffers at
    # their gradients' bytes (the last bucket's 4-byte sentinel left out)
    result = simulate("bucketed_ddp", StepModel(profile, FABRICS["nvlink4"], 2, 2.7e12), bucket_size_mb)
    assert result.memory_bytes == 4 * profile.grad_bytes + buffer_bytes - 4


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_the_preflight_and_the_projection_price_fsdp2_alike(world_size: int) -> None:
    # Both count rank 0's shard of every parameter, gradient and AdamW moment, the root and two blocks unsharded
    # and one block's gradients; the pre-flight adds AdamW's 4-byte step counter per tensor, the projection not.
    config, profile = _profile()
    estimate = estimate_rank_memory(config, batch_size=2, seq_len=16, precision="32-true", strategy="fsdp2",
                                    world_size=world_size)
    tensors = len(gpt_parameter_shapes(config))
    model_state = sum(estimate.parts[part] for part in ("parameters", "gradients", "optimizer_state",
                                                          "bucket_buffers"))
    result = simulate("fsdp2", StepModel(profile, FABRICS["nvlink4"], world_size, 2.7e12))
    assert model_state - ADAM_STEP_BYTES_PER_TENSOR * tensors == result.memory_bytes
    # and rank 0's shard is the dim-0 rows worked out per tensor (4 bytes each)
    held = sum(dim0_shard_numel(shape, world_size) for shape in gpt_parameter_shapes(config).values())
    assert estimate.parts["parameters"] == 4 * held < 4 * sum(map(math.prod, gpt_parameter_shapes(config).values()))


MODEL_STATE = ("parameters", "gradients", "optimizer_state", "bucket_buffers")


def test_hsdp_over_the_whole_world_is_priced_as_fsdp2() -> None:
    config, _ = _profile()
    common = dict(batch_size=2, seq_len=16, precision="32-true", world_size=4)
    hsdp = estimate_rank_memory(config, strategy="hsdp", shard_size=4, **common)
    assert hsdp.parts == estimate_rank_memory(config, strategy="fsdp2", **common).parts
    assert estimate_rank_memory(config, strategy="hsdp", **common).parts == hsdp.parts  # None: every rank


@pytest.mark.parametrize("preset, world_size, shard_size", [("tiny", 4, 2), ("xl", 16, 8)])
def test_hsdp_holds_fsdp2s_state_over_its_shard_group(preset: str, world_size: int, shard_size: int) -> None:
    # 4 ranks as 2 replicas x 2 shards, 16 as 2 nodes x 8: rank 0 holds its dim-0 rows over the shard group of every
    # parameter, gradient and AdamW moment (4 bytes each) and one 4-byte step counter per tensor; beside them, as
    # fsdp2, the root and the two largest blocks gathered, and the largest block's gradients.
    config = get_config(preset, **(TINY if preset == "tiny" else {}))
    shapes = list(gpt_parameter_shapes(config).values())
    held = sum(dim0_shard_numel(shape, shard_size) for shape in shapes)
    root = sum(math.prod(s) for name, s in gpt_parameter_shapes(config).items() if not name.startswith("blocks."))
    block = sum(math.prod(s) for name, s in gpt_parameter_shapes(config).items() if name.startswith("blocks.0."))
    estimate = estimate_rank_memory(config, batch_size=2, seq_len=16, precision="32-true", strategy="hsdp",
                                    world_size=world_size, shard_size=shard_size)
    assert [estimate.parts[part] for part in MODEL_STATE] == [
        4 * held, 4 * held + 4 * block, 2 * 4 * held + ADAM_STEP_BYTES_PER_TENSOR * len(shapes),
        4 * (root + 2 * block)]
    # the same as fsdp2 on a world of one shard group
    fsdp2 = estimate_rank_memory(config, batch_size=2, seq_len=16, precision="32-true", strategy="fsdp2",
                                 world_size=shard_size)
    assert [estimate.parts[part] for part in MODEL_STATE] == [fsdp2.parts[part] for part in MODEL_STATE]
    with pytest.raises(ValueError, match="shard_size 3 does not divide the world of 4 ranks"):
        estimate_rank_memory(config, batch_size=2, seq_len=16, precision="32-true", strategy="hsdp", world_size=4,
                             shard_size=3)


def test_a_bucket_cap_is_whole_bytes_of_mib() -> None:
    assert (bucket_cap_bytes(None), bucket_cap_bytes(25.0), bucket_cap_bytes(0.5)) == (None, 25 * MiB, MiB // 2)
