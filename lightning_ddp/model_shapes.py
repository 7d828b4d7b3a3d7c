"""The GPT's parameters, name and shape, from its config alone, without torch (for the memory pre-flight and the
projection; ``tests/unit/test_model.py`` holds it to ``lightning_ddp.model.GPT``).
"""

from __future__ import annotations

from typing import Protocol


class GPTShape(Protocol):
    """What fixes the parameter shapes: ``lightning_ddp.model.GPTConfig`` or the projection's ``ModelShape``."""

    d_model: int
    d_ff: int
    n_layers: int
    vocab_size: int
    tie_embeddings: bool


def gpt_parameter_shapes(config: GPTShape) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of every parameter of ``GPT(config)``, in ``parameters()`` order (a tied table once).

    >>> from types import SimpleNamespace
    >>> shapes = gpt_parameter_shapes(SimpleNamespace(d_model=8, d_ff=32, n_layers=1, vocab_size=50,
    ...                                                tie_embeddings=False))
    >>> shapes["blocks.0.ffn.w1.weight"], len(shapes)  # 1 + 9 per block + 2
    ((32, 8), 12)
    """
    d, f, v = config.d_model, config.d_ff, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"tok_emb.weight": (v, d)}
    for i in range(config.n_layers):
        b = f"blocks.{i}"
        shapes[f"{b}.attn_norm.weight"] = (d,)
        for projection in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{b}.attn.{projection}.weight"] = (d, d)
        shapes[f"{b}.ffn_norm.weight"] = (d,)
        shapes.update({f"{b}.ffn.w1.weight": (f, d), f"{b}.ffn.w2.weight": (d, f), f"{b}.ffn.w3.weight": (f, d)})
    shapes["norm.weight"] = (d,)
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes
