"""``fsdp2`` on a device layout (``tests.support.device_matrix``): gradients after the first step and weights after
three, against one process on the whole batch.

The gradients are the point: FSDP2 averages them with ``ReduceOp.AVG``, which gloo has been reported to carry out as
a sum (pytorch/pytorch#162338), and AdamW's scale invariance would hide a gradient N times too large in the
weights. So each rank gathers the full gradients after the first backward (``DTensor.full_tensor``) and the parent
compares them with the reference's. fp32 on any device: agreement to the rounding of sums in another order
(``tests.support.tolerance``: TOKENS = 4 x 7 predicted positions through the tiny GPT's inner sums), where a sum
instead of an average is off by a factor of the world size; the weights within the bound AdamW's steps carry
that to, from the reference's own gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_ddp.model import GPT, get_config

MODEL_SEED = 1000  # rank r seeds MODEL_SEED + r; shard() broadcasts rank 0's weights, the reference uses them too
STEPS, GLOBAL_BATCH, SEQ, VOCAB = 3, 4, 8, 64
LR = 1e-2
TOKENS = GLOBAL_BATCH * (SEQ - 1)  # the positions whose next token is predicted


class TinyGPT(nn.Module):
    """A two-block tied-embedding GPT whose ``forward`` is the mean next-token loss."""

    def __init__(self) -> None:
        super().__init__()
        config = get_config("tiny", vocab_size=VOCAB, context_length=SEQ, tie_embeddings=True, d_model=32,
                            n_layers=2, n_heads=2, d_ff=64)
        self.model = GPT(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)  # (B, T, V)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())


def _batch(step: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)  # the same global batch on every rank and the reference
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator).to(device)


def _where(device: str) -> torch.device:
    where = torch.device(device)
    if where.type == "cuda" and where.index is None:
        where = torch.device("cuda", torch.cuda.current_device())
    return where


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().cpu().clone()


def _train(module: nn.Module, rows: slice, where: torch.device) -> dict[str, Any]:
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    history: list[dict[str, torch.Tensor]] = []  # every step's full gradients (the reference's bound weights by them)
    for step in range(STEPS):
        module(_batch(step, where)[rows]).backward()
        history.append({n: _full(p.grad) for n, p in module.named_parameters() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad()
    weights = {n: _full(p) for n, p in module.named_parameters()}
    return {"first_grads": history[0], "history": history, "weights": weights}


def fsdp2_job(rank: int, world_size: int, device: str) -> dict[str, Any]:
    """Spawned on each rank: FSDP2 (our ``shard``) on ``device``; rank 0 also trains the one-process reference."""
    from lightning_ddp.strategies.fsdp2 import shard

    where = _where(device)
    torch.manual_seed(MODEL_SEED + rank)
    module = TinyGPT().to(where)
    shard(module)
    start = {n: _full(p) for n, p in module.named_parameters()}  # rank 0's weights, broadcast by shard()
    per_rank = GLOBAL_BATCH // world_size
    ours = _train(module, slice(rank * per_rank, (rank + 1) * per_rank), where)
    result = {"world_size": world_size, "device": str(where), **ours}
    if rank == 0:
        reference = TinyGPT().to(where)
        reference.load_state_dict({n: t.to(where) for n, t in start.items()}, strict=False)
        result["reference"] = _train(reference, slice(0, GLOBAL_BATCH), where)
    return result


def check_fsdp2_matches_one_process(ranks: list[dict[str, Any]]) -> None:
    """Every rank's first-step gradients and final weights equal the one-process reference's."""
    from tests.support.tolerance import adam_weight_bounds, assert_within, gpt_gradient_chain, reordered_gradient_bound

    reference = ranks[0]["reference"]
    chain = gpt_gradient_chain(TinyGPT().model.config, TOKENS)
    grad_bounds = [{n: reordered_gradient_bound(g, chain, TOKENS) for n, g in step.items()}
                   for step in reference["history"]]
    weight_bounds = adam_weight_bounds(reference["history"], grad_bounds, [LR] * STEPS, weights=reference["weights"])
    for rank, run in enumerate(ranks):
        assert run["first_grads"].keys() == reference["first_grads"].keys()
        first = reference["first_grads"]
        ratios = {n: f"{float(g.norm() / first[n].norm()):.3f}" for n, g in run["first_grads"].items()}
        assert_within(run["first_grads"], reference["first_grads"], grad_bounds[0],
                      f"rank {rank} step 0 gradients (norm ratios {ratios})")
        assert_within(run["weights"], reference["weights"], weight_bounds, f"rank {rank} weights after {STEPS} steps")
