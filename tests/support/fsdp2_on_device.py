"""``fsdp2`` on a device layout (``tests.support.device_matrix``): gradients after the first step and weights after
three, against one process on the whole batch.

The gradients are the point: FSDP2 averages them with ``ReduceOp.AVG``, which gloo has been reported to carry out as
a sum (pytorch/pytorch#162338), and AdamW's scale invariance would hide a gradient N times too large in the
weights. So each rank gathers the full gradients after the first backward (``DTensor.full_tensor``) and the parent
compares them with the reference's. fp32 on any device: agreement to float rounding (rtol 1e-5), where a sum instead
of an average is off by a factor of the world size.
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
GRAD_TOL = dict(rtol=1e-5, atol=1e-7)  # fp32 rounding of sums in another order; a factor of 2 is far outside
WEIGHT_TOL = dict(rtol=1e-4, atol=1e-5)


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
    first_grads: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        module(_batch(step, where)[rows]).backward()
        if step == 0:
            first_grads = {n: _full(p.grad) for n, p in module.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad()
    return {"first_grads": first_grads, "weights": {n: _full(p) for n, p in module.named_parameters()}}


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
    reference = ranks[0]["reference"]
    for rank, run in enumerate(ranks):
        assert run["first_grads"].keys() == reference["first_grads"].keys()
        for name, expected in reference["first_grads"].items():
            ratio = float(run["first_grads"][name].norm() / expected.norm())
            what = f"rank {rank} step 0 gradient of {name} (norm ratio {ratio:.3f})"
            torch.testing.assert_close(run["first_grads"][name], expected, **GRAD_TOL, msg=lambda m: f"{what}: {m}")
        for name, expected in reference["weights"].items():
            torch.testing.assert_close(run["weights"][name], expected, **WEIGHT_TOL,
                                       msg=lambda m: f"rank {rank} weight {name} after {STEPS} steps: {m}")
