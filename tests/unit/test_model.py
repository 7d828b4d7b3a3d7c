"""Tests for lightning_ddp/model.py: exact sizes, causality, mixed precision and the FLOP formula."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from lightning_ddp.model import GPT, PRESETS, GPTConfig, get_config
from lightning_ddp.memory import gpt_parameter_shapes


def expected_num_params(c: GPTConfig) -> int:
    # Token embedding + untied lm_head:           2 * V * d
    # Per block: q, k, v, out projections          4 * d * d
    #            SwiGLU w1, w3 (d -> d_ff), w2     3 * d * d_ff
    #            two RMSNorm scales                2 * d
    # Final RMSNorm:                               d
    per_block = 4 * c.d_model**2 + 3 * c.d_model * c.d_ff + 2 * c.d_model
    return 2 * c.vocab_size * c.d_model + c.n_layers * per_block + c.d_model


def expected_num_tensors(c: GPTConfig) -> int:
    # Embedding and lm_head (2), 9 per block (4 attention + 3 SwiGLU + 2 norms), final norm (1).
    return 2 + 9 * c.n_layers + 1


def meta_model(config: GPTConfig) -> GPT:
    # The meta device allocates no memory, so even the 2.7B preset is instant to count.
    with torch.device("meta"):
        return GPT(config)


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_sizes_on_meta_device(name):
    config = PRESETS[name]
    model = meta_model(config)
    assert model.num_params() == expected_num_params(config)
    assert len(list(model.parameters())) == expected_num_tensors(config)


def test_xl_size_literal():
    # 2 * 10_000 * 1600                                   =    32_000_000  (embedding + lm_head)
    # 48 * (4 * 1600**2 + 3 * 1600 * 6400 + 2 * 1600)
    #   = 48 * (10_240_000 + 30_720_000 + 3_200)         = 1_966_233_600
    # final norm                                          =         1_600
    #                                               total = 1_998_235_200 in 2 + 48 * 9 + 1 = 435 tensors
    model = meta_model(PRESETS["xl"])
    assert model.num_params() == 1_998_235_200
    assert len(list(model.parameters())) == 435


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("name", list(PRESETS))
def test_the_closed_form_shapes_are_the_modules_in_order(name, tie):
    # lightning_ddp.memory.gpt_parameter_shapes states every parameter's name and shape without torch, for the memory
    # pre-flight and the projection; it must be the module's own, in parameters() order (named_parameters() yields a
    # tied table once, under its first name, tok_emb.weight).
    config = get_config(name, tie_embeddings=tie)
    expected = [(n, tuple(p.shape)) for n, p in meta_model(config).named_parameters()]
    assert list(gpt_parameter_shapes(config).items()) == expected
    assert len(expected) == expected_num_tensors(config) - tie


def test_tie_embeddings_shares_one_parameter():
    untied = meta_model(get_config("small"))
    tied = meta_model(get_config("small", tie_embeddings=True))
    assert tied.lm_head.weight is tied.tok_emb.weight
    # The shared matrix is counted once: one vocab_size x d_model table fewer.
    assert untied.num_params() - tied.num_params() == 10_000 * 768
    assert len(list(tied.parameters())) == len(list(untied.parameters())) - 1


def test_rope_cache_is_a_non_persistent_buffer():
    model = GPT(get_config("tiny", vocab_size=64, context_length=16))
    param_names = {name for name, _ in model.named_parameters()}
    assert "rope_cos" not in param_names and "rope_sin" not in param_names
    assert not any("rope" in key for key in model.state_dict())
    # (context_length, head_dim / 2) = (16, 128 / 4 / 2)
    assert model.rope_cos.shape == model.rope_sin.shape == (16, 16)


def test_init_gpt2_style():
    torch.manual_seed(0)
    config = get_config("small", vocab_size=256, n_layers=8)
    model = GPT(config)
    assert torch.all(model.norm.weight == 1)
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    # Residual outputs are scaled by 1 / sqrt(2 * n_layers) = 1 / 4 here.
    assert model.blocks[0].attn.out_proj.weight.std().item() == pytest.approx(0.005, rel=0.05)
    assert model.blocks[0].ffn.w2.weight.std().item() == pytest.approx(0.005, rel=0.05)


def test_causality():
    torch.manual_seed(0)
    model = GPT(get_config("tiny", vocab_size=64, context_length=16)).eval()
    idx = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        base = model(idx)
        for t in (0, 1, 7, 15):
            changed = idx.clone()
            changed[:, t] = (changed[:, t] + 1) % 64
            logits = model(changed)
            # Earlier positions must not see token t at all: their rows go through the same operations on the same
            # numbers (a masked score adds exp(-inf) = 0 exactly), so bit for bit...
            assert torch.equal(logits[:, :t], base[:, :t])
            # ...while position t itself does.
            assert not torch.equal(logits[:, t], base[:, t])


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="'huge' is not a supported preset") as err:
        get_config("huge")
    for name in PRESETS:
        assert name in str(err.value)


def test_get_config_overrides_and_validation():
    config = get_config("tiny", vocab_size=256, context_length=32)
    assert (config.vocab_size, config.context_length, config.d_model) == (256, 32, 128)
    assert PRESETS["tiny"].vocab_size == 10_000  # the preset itself is untouched
    with pytest.raises(ValueError, match="unknown GPTConfig field"):
        get_config("tiny", hidden_size=64)
    with pytest.raises(ValueError, match="not divisible by n_heads"):
        get_config("tiny", n_heads=3)
    with pytest.raises(ValueError, match="odd"):
        get_config("tiny", n_heads=128)  # head dim 1
    with pytest.raises(ValueError, match="positive"):
        get_config("tiny", n_layers=0)


def test_sequence_longer_than_context_raises():
    model = GPT(get_config("tiny", vocab_size=64, context_length=8))
    with pytest.raises(ValueError, match="exceeds context_length=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_bf16_autocast_forward_and_backward():
    torch.manual_seed(0)
    model = GPT(get_config("tiny", vocab_size=64, context_length=16))
    idx = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(idx)
    assert logits.shape == (2, 16, 64)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    loss = F.cross_entropy(logits.flatten(0, 1), idx.roll(-1, dims=1).flatten())
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_flops_per_token():
    config = GPTConfig(vocab_size=100, context_length=8, d_model=16, n_layers=2, n_heads=2, d_ff=32)
    model = meta_model(config)
    # N_matmul = n_layers * (4 * d^2 + 3 * d * d_ff) + V * d   (lm_head counts, embedding does not)
    #          = 2 * (4 * 256 + 3 * 16 * 32) + 100 * 16 = 2 * 2560 + 1600 = 6720
    # 6 * N_matmul = 40_320; attention 12 * n_layers * d * T = 12 * 2 * 16 * 8 = 3_072
    assert model.flops_per_token() == 43_392
    # T = 4 halves the attention term: 40_320 + 1_536
    assert model.flops_per_token(seq_len=4) == 41_856
    # Tying removes a parameter but not a matmul: the FLOPs are unchanged.
    tied = meta_model(dataclasses.replace(config, tie_embeddings=True))
    assert tied.flops_per_token() == 43_392
