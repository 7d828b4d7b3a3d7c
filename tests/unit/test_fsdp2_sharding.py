"""What ``fsdp2`` shards one group each (``lightning_ddp.strategies.fsdp2.modules_to_shard``), on models we know
and on ones we do not; pure module walking, no process group."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_ddp.model import GPT, get_config
from lightning_ddp.strategies.fsdp2 import DEFAULT_SHARD_MODULES, modules_to_shard


def test_our_gpt_shards_its_blocks_silently() -> None:
    gpt = GPT(get_config("tiny"))
    blocks, message = modules_to_shard(gpt, DEFAULT_SHARD_MODULES)
    assert blocks == list(gpt.blocks) and message == ""  # tiny has 4 Blocks, named by the default


@pytest.mark.filterwarnings("ignore:enable_nested_tensor")
def test_a_model_without_block_shards_its_repeated_layers() -> None:
    # The bug this guards: a module with a multi-element parameter used to raise "Boolean value of Tensor with more
    # than one value is ambiguous". nn.Transformer: 2 encoder + 3 decoder layers, each in a ModuleList.
    model = nn.Transformer(d_model=8, nhead=2, num_encoder_layers=2, num_decoder_layers=3, dim_feedforward=16)
    layers, message = modules_to_shard(model, DEFAULT_SHARD_MODULES)
    assert layers == [*model.encoder.layers, *model.decoder.layers]
    assert "5 repeated layers (TransformerDecoderLayer, TransformerEncoderLayer)" in message


def test_outermost_repeated_layers_only_and_mixed_stacks_are_one_unit() -> None:
    inner = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])  # repeated, but inside a repeated layer
    outer = nn.ModuleList([nn.Sequential(inner, nn.LayerNorm(2)), nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))])
    model = nn.Sequential(nn.Embedding(4, 2), outer)  # Embedding then a ModuleList: two classes, not a stack
    layers, _ = modules_to_shard(model, DEFAULT_SHARD_MODULES)
    assert layers == list(outer)


def test_nothing_repeated_shards_at_the_root_and_names_the_fix() -> None:
    model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
    layers, message = modules_to_shard(model, DEFAULT_SHARD_MODULES)
    assert layers == []
    assert "at the root only" in message and "`shard_modules`, e.g. one of: LayerNorm, Linear." in message


def test_named_classes_win_over_repeated_layers() -> None:
    model = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]), nn.LayerNorm(2))
    layers, message = modules_to_shard(model, ("LayerNorm",))
    assert layers == [model[1]] and message == ""
