"""A small, readable decoder-only Transformer language model (GPT-2 family, modern variant), nanoGPT-style.

    idx (B, T) -> token embedding -> n_layers x Block -> RMSNorm -> lm_head -> logits (B, T, V)
    Block:  x = x + Attention(RMSNorm(x));  x = x + SwiGLU(RMSNorm(x))

RMSNorm, rotary position embeddings, a SwiGLU feed-forward, no biases, no dropout; embedding and ``lm_head``
untied by default. ``GPT.flops_per_token`` gives the training FLOPs used for MFU; presets are chosen by name.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn


@dataclass(kw_only=True)
class GPTConfig:
    """Shape of the model. Pick a preset with ``get_config("small")`` or set every field."""

    vocab_size: int = 10_000  # distinct tokens: the size of the embedding table and of the logits
    context_length: int = 256  # the longest sequence the model accepts; also the RoPE cos/sin cache's length
    d_model: int  # width of the residual stream (the embedding dimension)
    n_layers: int  # Transformer blocks
    n_heads: int  # attention heads; must divide d_model
    d_ff: int  # hidden width of the SwiGLU feed-forward (the outputs of w1 and w3)
    rope_theta: float = 10_000.0  # RoPE base; larger values rotate slower and suit longer contexts
    norm_eps: float = 1e-5  # added inside the RMSNorm square root, for numerical safety
    tie_embeddings: bool = False  # one matrix for the token embedding and lm_head (saves vocab_size * d_model)

    def __post_init__(self) -> None:
        positive = ("vocab_size", "context_length", "d_model", "n_layers", "n_heads", "d_ff", "rope_theta", "norm_eps")
        for name in positive:
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {value}; set {name} > 0.")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                f"choose n_heads that divides d_model (head dim = d_model // n_heads)."
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head dim d_model // n_heads = {self.head_dim} is odd, but RoPE rotates pairs of "
                f"channels; choose d_model and n_heads so that d_model // n_heads is even."
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# GPT-2 shapes (small .. xl) plus a GPT-3-2.7B-like shape, with d_ff = 4 * d_model throughout.
# `tiny` is for CPU tests and the quickstart (~3.6M parameters, 2.6M of them in the two vocab 10 000 tables).
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(d_model=128, d_ff=512, n_layers=4, n_heads=4),
    "small": GPTConfig(d_model=768, d_ff=3072, n_layers=12, n_heads=12),
    "medium": GPTConfig(d_model=1024, d_ff=4096, n_layers=24, n_heads=16),
    "large": GPTConfig(d_model=1280, d_ff=5120, n_layers=36, n_heads=20),
    "xl": GPTConfig(d_model=1600, d_ff=6400, n_layers=48, n_heads=25),
    "2.7b": GPTConfig(d_model=2560, d_ff=10240, n_layers=32, n_heads=32),
}


def get_config(name: str, **overrides) -> GPTConfig:
    """A copy of preset ``name`` with ``overrides`` applied: ``get_config("tiny", vocab_size=256)``."""
    if name not in PRESETS:
        raise ValueError(f"{name!r} is not a supported preset; choose one of: {', '.join(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown GPTConfig field(s) {unknown}; valid fields: {', '.join(sorted(fields))}")
    # replace() builds a new object, so __post_init__ validates the overridden config too.
    return dataclasses.replace(PRESETS[name], **overrides)


class RMSNorm(nn.Module):
    """x / rms(x) * weight. Cheaper than LayerNorm (no mean, no bias) and works as well in LMs."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32: the mean of squares loses too much precision in bf16.
        x_f = x.float()
        x_f = x_f * torch.rsqrt(x_f.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return x_f.type_as(x) * self.weight


def rope_cache(
    context_length: int, head_dim: int, theta: float, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the RoPE angles, each (context_length, head_dim // 2), float32, on ``device`` (None: the
    default device, so building under ``torch.device("meta")`` works)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)  # (hs/2,)
    positions = torch.arange(context_length, dtype=torch.float32, device=device)  # (T,)
    angles = torch.outer(positions, inv_freq)  # (T, hs/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + hs/2) of x (B, nh, T, hs) by the angles in cos/sin (T, hs/2) ("rotate half")."""
    x1, x2 = x.float().chunk(2, dim=-1)  # each (B, nh, T, hs/2)
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, nh, T, hs)
    # Back to the input dtype: under autocast q/k arrive in bf16 and SDPA wants q, k, v to match.
    return rotated.type_as(x)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with rotary positions: ``(B, T, C) -> (B, T, C)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        # Separate q/k/v matrices (not one fused qkv) keep each weight's role obvious.
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.k_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.v_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.out_proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = (rearrange(projection(x), "B T (nh hs) -> B nh T hs", nh=self.n_heads)  # each (B, nh, T, hs)
                   for projection in (self.q_proj, self.k_proj, self.v_proj))
        # Position enters only through q and k, so attention scores depend on relative offsets.
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # is_causal=True masks future keys and lets PyTorch pick a fused (flash) kernel.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = rearrange(y, "B nh T hs -> B T (nh hs)")  # (B, T, C)
        return self.out_proj(y)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): a gated feed-forward; the gate w3 x lets each unit scale its output."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.w2 = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.w3 = nn.Linear(config.d_model, config.d_ff, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, d_ff) -> (B, T, C)


class Block(nn.Module):
    """Pre-norm Transformer block: normalise the input of each sublayer, never the residual stream."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.ffn = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)  # (B, T, C)
        x = x + self.ffn(self.ffn_norm(x))  # (B, T, C)
        return x


class GPT(nn.Module):
    """Decoder-only Transformer LM: ``GPT(config)(idx)`` maps token ids (B, T) to logits (B, T, V)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            # One Parameter object in two places: parameters() yields it once, and its gradient
            # is the sum of the embedding and output contributions.
            self.lm_head.weight = self.tok_emb.weight

        # One cos/sin cache shared by all blocks. Non-persistent: derived from the config, so it
        # is neither a parameter (no gradient sync) nor in the state_dict (checkpoints stay clean).
        cos, sin = rope_cache(config.context_length, config.head_dim, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # (T_max, hs/2)
        self.register_buffer("rope_sin", sin, persistent=False)  # (T_max, hs/2)

        self.apply(self._init_weights)
        # GPT-2: each block adds two residual outputs to the stream; scaling their init by
        # 1/sqrt(2 * n_layers) keeps the stream's variance from growing with depth.
        residual_std = 0.02 / math.sqrt(2 * config.n_layers)
        for block in self.blocks:
            nn.init.normal_(block.attn.out_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.ffn.w2.weight, mean=0.0, std=residual_std)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001 - nn.Module's signature
        super()._apply(fn, recurse)
        # A cast of the whole model (bf16-true's `.to(torch.bfloat16)`, `.half()`) would round the RoPE angles to
        # 8 mantissa bits (~0.4 % error, growing with the position). Keep them float32 wherever they now live.
        if self.rope_cos.dtype != torch.float32:
            c = self.config
            self.rope_cos, self.rope_sin = rope_cache(c.context_length, c.head_dim, c.rope_theta, self.rope_cos.device)
        return self

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``(B, T, vocab_size)`` of token ids ``idx`` ``(B, T)``; ``ValueError`` past the context."""
        B, T = idx.shape
        if T > self.config.context_length:
            raise ValueError(
                f"sequence length {T} exceeds context_length={self.config.context_length}; "
                f"feed shorter sequences or build the model with a larger context_length."
            )
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, hs/2)
        x = self.tok_emb(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x, cos, sin)  # (B, T, C)
        x = self.norm(x)  # (B, T, C)
        return self.lm_head(x).float()  # (B, T, V); float32 so the loss is computed in full precision

    def num_params(self) -> int:
        """Number of trainable scalars; a tied embedding/lm_head matrix is counted once."""
        # parameters() already de-duplicates shared Parameters.
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token at ``seq_len`` (default ``config.context_length``): PaLM's
        ``6 * N_matmul + 12 * n_layers * d_model * seq_len``, ``N_matmul`` every Linear weight, lm_head included
        (``docs/projection.md``)."""
        if seq_len is None:
            seq_len = self.config.context_length
        if seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len}.")
        n_matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        attention = 12 * self.config.n_layers * self.config.d_model * seq_len
        return float(6 * n_matmul + attention)
