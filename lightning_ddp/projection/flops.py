"""A compute profile modelled from FLOPs: a model preset on a named GPU (``GPUS``) at a stated MFU (the recipe:
docs/projection.md)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from lightning_ddp.hardware import DEVICES, DeviceSpec
from lightning_ddp.memory import gpt_parameter_shapes
from lightning_ddp.profile import ComputeProfile, ParamTiming

ADAMW_BYTES_PER_PARAM = 80.0
"""Bytes read + written per parameter by one step of torch's foreach AdamW on fp32 state (docs/projection.md)."""


@dataclass(frozen=True)
class GPUSpec:
    """The two numbers the model needs from a GPU (built from ``lightning_ddp.hardware``, or given by hand)."""

    name: str
    """The GPU's name as the hardware table spells it."""
    bf16_flops: float  # dense bf16 tensor-core peak, FLOP/s
    memory_Bps: float  # HBM bandwidth, bytes/s
    source: str = ""
    """Where the two numbers come from (the hardware table row's source); empty if not said."""


# The projection's first five GPUs lead, so that its listings and messages keep their order; then the rest.
_FIRST = ("h100-sxm", "h100-pcie", "h200-sxm", "a100-sxm-80gb", "a100-pcie-40gb")


def _gpu_spec(device: DeviceSpec) -> GPUSpec:
    """A hardware-table row as a ``GPUSpec``: TFLOP/s and GB/s turned into FLOP/s and bytes/s."""
    return GPUSpec(name=device.name, bf16_flops=device.dense_tflops["bf16"] * 1e12,
                   memory_Bps=device.memory_GBps * 1e9, source=device.source)


GPUS: dict[str, GPUSpec] = {key: _gpu_spec(DEVICES[key]) for key in (*_FIRST, *(k for k in DEVICES if k not in _FIRST))}
"""GPUs by name (``compute.gpu``): every row of ``lightning_ddp.hardware.DEVICES``."""


def get_gpu(name: str) -> GPUSpec:
    """``GPUS[name]``; an unknown name lists the known ones."""
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown `compute.gpu` {name!r}; choose one of {', '.join(GPUS)} (or set "
                         "`compute.peak_tflops` and `compute.memory_bandwidth_GBps`)") from None


@dataclass(frozen=True)
class ModelShape:
    """The fields of ``lightning_ddp.model.GPTConfig`` that fix parameter shapes and FLOPs."""

    d_model: int
    """Width of the residual stream."""
    n_layers: int
    """Transformer blocks."""
    n_heads: int
    """Attention heads per block."""
    d_ff: int
    """Hidden width of each block's MLP."""
    vocab_size: int = 10_000
    """Rows of the token embedding (and of the output head)."""
    tie_embeddings: bool = False
    """Whether the output head reuses the token embedding's weight (its gradient counted once)."""

    @classmethod
    def from_preset(cls, name: str) -> ModelShape:
        """The shape of ``lightning_ddp.model.PRESETS[name]`` (imports the model module, hence torch)."""
        from lightning_ddp.model import get_config  # the presets' one source of truth

        config = get_config(name)
        return cls(d_model=config.d_model, n_layers=config.n_layers, n_heads=config.n_heads, d_ff=config.d_ff,
                   vocab_size=config.vocab_size, tie_embeddings=config.tie_embeddings)

    def parameters(self) -> list[tuple[str, int]]:
        """``(name, numel)`` of every trainable parameter in ``module.parameters()`` order."""
        return [(name, math.prod(shape)) for name, shape in gpt_parameter_shapes(self).items()]

    @property
    def num_params(self) -> int:
        """Trainable parameters, every one counted once."""
        return sum(n for _, n in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, forward + backward: ``6 N_matmul + 12 n_layers d_model seq_len`` (PaLM), with
        ``N_matmul`` the weights of every Linear, lm_head included even when tied (as ``GPT.flops_per_token``)."""
        per_block = 4 * self.d_model**2 + 3 * self.d_model * self.d_ff
        matmul_params = self.n_layers * per_block + self.vocab_size * self.d_model
        return float(6 * matmul_params + 12 * self.n_layers * self.d_model * seq_len)

    def backward_ready_flops(self, seq_len: int) -> list[Optional[float]]:
        """Per parameter, backward FLOPs per token done when its gradient is ready (``None``: when backward ends)."""
        numel = dict(self.parameters())  # in parameters() order
        attention = 8 * seq_len * self.d_model  # backward of Q K^T and A V for one layer, per token
        done = 4.0 * self.vocab_size * self.d_model  # lm_head's backward comes first, tied or not
        ready: dict[str, Optional[float]] = {"lm_head.weight": done, "norm.weight": done, "tok_emb.weight": None}
        block = ("ffn.w3", "ffn.w2", "ffn.w1", "ffn_norm", "attn.out_proj", "attn.v_proj", "attn.k_proj", "attn.q_proj",
                 "attn_norm")  # a block's weights in backward order
        for i in reversed(range(self.n_layers)):
            for short in block:
                if short == "attn.v_proj":
                    done += attention  # the attention core's backward comes before its projections'
                if "norm" not in short:  # a norm's weight: no matmul
                    done += 4 * numel[f"blocks.{i}.{short}.weight"]
                ready[f"blocks.{i}.{short}.weight"] = done
        # every backward FLOP is accounted for: 2/3 of flops_per_token
        assert abs(done - 2 * self.flops_per_token(seq_len) / 3) <= 1e-9 * done, "backward FLOPs do not add up"
        return [ready[name] for name in numel]


def modelled_profile(
    shape: ModelShape,
    batch_size: int,
    seq_len: int,
    *,
    gpu: str | GPUSpec = "h100-sxm",
    mfu: float = 0.4,
    precision: str = "bf16-mixed",
    optimizer_bytes_per_param: float = ADAMW_BYTES_PER_PARAM,
    memory_efficiency: float = 0.8,
    calibrate_step_ms: Optional[float] = None,
    preset: Optional[str] = None,
    world_size: Optional[int] = None,
) -> ComputeProfile:
    """One step of ``shape`` at ``batch_size x seq_len`` tokens per rank, every parameter with its shape; the rest:
    ``ComputeConfig``'s fields (checked there)."""
    spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    tokens = batch_size * seq_len
    peak = spec.bf16_flops / 2 if precision == "32-true" else spec.bf16_flops
    fwd_bwd_ms = 1e3 * tokens * shape.flops_per_token(seq_len) / (peak * mfu)
    optimizer_ms = 1e3 * shape.num_params * optimizer_bytes_per_param / (spec.memory_Bps * memory_efficiency)
    source = (f"modelled: {spec.name}, MFU {mfu:g}, AdamW {optimizer_bytes_per_param:g} B/param at "
              f"{memory_efficiency:g} x HBM")
    if calibrate_step_ms is not None:
        if not calibrate_step_ms > optimizer_ms:
            raise ValueError(f"calibrate_step_ms={calibrate_step_ms:g} ms leaves no time for forward and backward "
                             f"after the modelled optimizer ({optimizer_ms:.4g} ms); give a larger step or a faster "
                             "GPU")
        fwd_bwd_ms = calibrate_step_ms - optimizer_ms
        source += f"; forward + backward calibrated to a {calibrate_step_ms:g} ms compute-only step"
    forward_ms, backward_ms = fwd_bwd_ms / 3, 2 * fwd_bwd_ms / 3
    total_bwd = 2 * shape.flops_per_token(seq_len) / 3
    element = 2 if precision in ("bf16-true", "16-true") else 4  # mixed precision keeps fp32 gradients
    params = []
    for (name, dims), done in zip(gpt_parameter_shapes(shape).items(), shape.backward_ready_flops(seq_len)):
        ready_ms = backward_ms if done is None else backward_ms * done / total_bwd  # None: when backward ends
        params.append(ParamTiming(name=name, numel=math.prod(dims), bytes=math.prod(dims) * element,
                                  ready_ms=ready_ms, shape=dims))
    return ComputeProfile(forward_ms=forward_ms, backward_ms=backward_ms, optimizer_ms=optimizer_ms,
                          params=tuple(params), source=source, device=spec.name, preset=preset,
                          batch_size=batch_size, seq_len=seq_len, precision=precision, world_size=world_size,
                          extra={"mfu": mfu, "gpu": dataclasses.asdict(spec)})
