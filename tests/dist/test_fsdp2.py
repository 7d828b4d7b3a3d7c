"""``fsdp2`` (``lightning_ddp.strategies.fsdp2``): torch's FSDP2 through our sharding, equal to one process.

The equivalence matrix's argument (``tests/support/equivalence.py``) for a sharded model: with each rank's loss the
mean over its share of the global micro-batch, FSDP2 reduce-scatters the *average* of the ranks' gradients, which is
the full micro-batch's gradient; each rank then steps AdamW on its shard, which is elementwise, so the gathered
weights equal one process training on the whole batch, up to float rounding. In fp64 that rounding is ~1e-16
relative per operation: after 3 steps the weights agree to 1e-12, where a wrong gradient (a missing rank, a
micro-batch not accumulated, a clip by the local instead of the global norm) moves a weight by ~LR = 1e-2.

Every case here at once: tied embedding/``lm_head`` weights, a frozen parameter, gradient accumulation over 2
micro-batches (``set_requires_gradient_sync(False)`` on the first), clipping by the global norm, world sizes 2 and 3,
and the consolidated checkpoint (saved at world size 2, resumed at world size 3 and by one unsharded process).
Through Lightning (the CLI), ``fsdp2`` trains like ``ddp``, resumes from its own checkpoint under ``fsdp2`` and
``ddp``, and its timer records torch's own collectives (all-gathers, reduce-scatters) like any strategy's.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_ddp.model import GPT, get_config
from tests.support.cli_utils import checkpoint_at, read_scalars
from tests.support.dist_utils import run_on_ranks
from tests.support.lightning_fits import STEPS as FIT_STEPS
from tests.support.lightning_fits import assert_same_optimizer_state, assert_same_weights, fit
from tests.support.tolerance import adam_weight_bounds, assert_within, reordered_gradient_bound

MODEL_SEED, DATA_SEED = 1000, 7
LR, CLIP = 1e-2, 0.5
STEPS, CHECKPOINT_AFTER = 3, 2
MICRO_BATCHES, GLOBAL_MICRO_BATCH, SEQ = 2, 6, 8  # 6 rows split 3/3 on 2 ranks and 2/2/2 on 3
VOCAB = 64
TOL = dict(rtol=1e-10, atol=1e-12)  # fp64; see the module docstring
FROZEN = "model.blocks.0.attn_norm.weight"


class Root(nn.Module):
    """A tiny tied-embedding GPT with one frozen parameter; ``forward`` returns the mean loss (as a training_step)."""

    def __init__(self) -> None:
        super().__init__()
        config = get_config("tiny", vocab_size=VOCAB, context_length=SEQ, tie_embeddings=True, d_model=32,
                            n_layers=2, n_heads=2, d_ff=64)
        self.model = GPT(config).double()
        self.get_parameter(FROZEN).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)  # (B, T, V)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())


def _micro_batch(step: int, micro: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(DATA_SEED + 100 * step + micro)
    return torch.randint(0, VOCAB, (GLOBAL_MICRO_BATCH, SEQ), generator=generator)


def _optimizer(module: nn.Module) -> torch.optim.Optimizer:
    # Two groups, as LitGPT's (decay on matrices only), so the checkpoint's group numbering is exercised.
    params = [p for p in module.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=LR)


def _train(module: nn.Module, optimizer: torch.optim.Optimizer, steps: range, world_size: int,
           rank: int | None = None) -> list[float]:
    """``rank`` given: that rank's share of each micro-batch, FSDP2 averaging over the ranks. ``rank=None``: one
    process on every share in turn, averaging by hand.

    One process takes the whole batch in the ranks' shares, not at once: our GPT normalises in fp32 (RMSNorm), an
    fp32 island in an fp64 backward, where a gradient scaled by 1/21 (3 rows of 7 targets) rounds differently from
    one scaled by 1/42 (6 rows). That is 1e-7 relative (measured at 3 ranks; 1/2 is exact in binary, so 2 ranks
    agree bit for bit), and it would hide the fp64 agreement this test is about.
    """
    norms = []
    per_rank = GLOBAL_MICRO_BATCH // world_size
    shares = range(world_size) if rank is None else [rank]
    for step in steps:
        for micro in range(MICRO_BATCHES):
            if rank is not None:  # Lightning's block_backward_sync for the micro-batches before the last
                module.set_requires_gradient_sync(micro == MICRO_BATCHES - 1)
            for share in shares:
                rows = _micro_batch(step, micro)[share * per_rank:(share + 1) * per_rank]
                (module(rows) / MICRO_BATCHES).backward()
        if rank is None:
            for p in module.parameters():
                if p.grad is not None:
                    p.grad /= world_size
        norm = torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.requires_grad], CLIP)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        optimizer.step()
        optimizer.zero_grad()
    return norms


def _reference(steps: range, world_size: int, start: dict[str, Any] | None = None) -> dict[str, Any]:
    """One process on the whole batch (in ``world_size`` shares, see ``_train``); from ``start`` if given."""
    torch.manual_seed(MODEL_SEED)
    module = Root()
    optimizer = _optimizer(module)
    if start is not None:  # a copy: AdamW keeps the loaded `step` tensors and would advance the checkpoint's
        module.load_state_dict(start["model"])
        optimizer.load_state_dict(copy.deepcopy(start["optimizer"]))
    norms = _train(module, optimizer, steps, world_size)
    return {"weights": {k: v.clone() for k, v in module.state_dict().items()}, "norms": norms,
            "optimizer": copy.deepcopy(optimizer.state_dict())}


def _fsdp2_job(rank: int, world_size: int, resume: dict[str, Any] | None) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_optimizer_state_dict,
    )

    from lightning_ddp.strategies.fsdp2 import fqn_keys_to_ids, ids_to_fqn_keys, shard

    torch.manual_seed(MODEL_SEED + rank)  # the ranks differ until shard() broadcasts rank 0's weights
    module = Root()
    if resume is not None:  # Lightning loads the checkpoint's weights into the module before it is sharded
        module.load_state_dict(resume["model"])
    message = shard(module)
    tied = module.model.lm_head.weight is module.model.tok_emb.weight
    optimizer = _optimizer(module)
    if resume is not None:
        set_optimizer_state_dict(module, optimizer, ids_to_fqn_keys(resume["optimizer"], optimizer, module),
                                 options=StateDictOptions(full_state_dict=True))
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    first = range(CHECKPOINT_AFTER, STEPS) if resume is not None else range(CHECKPOINT_AFTER)
    norms = _train(module, optimizer, first, world_size, rank)
    checkpoint = None
    if resume is None:
        checkpoint = {"model": get_model_state_dict(module, options=full),
                      "optimizer": get_optimizer_state_dict(module, optimizer, options=full)}
        # No copy here: fqn_keys_to_ids copies AdamW's `step` tensors, which the next step would otherwise advance.
        checkpoint["optimizer"] = fqn_keys_to_ids(checkpoint["optimizer"]) if checkpoint["optimizer"] else {}
        norms += _train(module, optimizer, range(CHECKPOINT_AFTER, STEPS), world_size, rank)
    weights = get_model_state_dict(module, options=full)
    local_numel = sum(p.to_local().numel() for p in module.parameters())
    dist.barrier()
    return {"weights": weights, "norms": norms, "checkpoint": checkpoint, "tied": tied, "message": message,
            "local_numel": local_numel, "numel": sum(p.numel() for p in module.parameters())}


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    two = run_on_ranks(_fsdp2_job, 2, None)
    checkpoint = two[0]["checkpoint"]
    at_checkpoint = _reference(range(CHECKPOINT_AFTER), 2)
    return {
        "reference": {2: _reference(range(STEPS), 2), 3: _reference(range(STEPS), 3)},
        "reference_at_checkpoint": at_checkpoint,
        # 2 steps in 2 shares, the last in 3: the resumed runs' reference
        "reference_resumed": {2: _reference(range(CHECKPOINT_AFTER, STEPS), 2, start=_as_checkpoint(at_checkpoint)),
                              3: _reference(range(CHECKPOINT_AFTER, STEPS), 3, start=_as_checkpoint(at_checkpoint))},
        "two": two,
        "three": run_on_ranks(_fsdp2_job, 3, None),
        "three_resumed": run_on_ranks(_fsdp2_job, 3, checkpoint),
        "unsharded_resumed": _reference(range(CHECKPOINT_AFTER, STEPS), 2, start=checkpoint),
    }


def _as_checkpoint(reference: dict[str, Any]) -> dict[str, Any]:
    return {"model": reference["weights"], "optimizer": reference["optimizer"]}


def _assert_weights_equal(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == reference.keys()  # lm_head.weight included: the full state dict names both tied keys
    for name, value in reference.items():
        torch.testing.assert_close(ours[name], value, **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", ["two", "three"])
def test_fsdp2_equals_one_process(runs, world: str) -> None:
    ranks = runs[world]
    reference = runs["reference"][len(ranks)]
    # The global norm on every rank (clipping by one rank's shard would give a smaller, rank-dependent norm), and
    # larger than CLIP, so every step was really clipped.
    for result in ranks:
        assert result["norms"] == pytest.approx(reference["norms"], rel=1e-10)
    assert min(reference["norms"]) > CLIP
    _assert_weights_equal(ranks[0]["weights"], reference["weights"])
    # Rank 0's full state dict; the others take part in gathering it and get none.
    assert all(result["weights"] == {} for result in ranks[1:])


@pytest.mark.multiprocess
def test_tied_weights_stay_tied_and_the_frozen_parameter_stays(runs) -> None:
    for result in runs["two"]:
        assert result["tied"] and result["message"] == ""  # the GPT's Block modules were found
    weights, initial = runs["two"][0]["weights"], runs["reference_at_checkpoint"]
    torch.testing.assert_close(weights["model.lm_head.weight"], weights["model.tok_emb.weight"], rtol=0, atol=0)
    torch.manual_seed(MODEL_SEED)
    assert torch.equal(weights[FROZEN], Root().state_dict()[FROZEN])  # never stepped (no gradient, no state)
    assert initial["weights"].keys() == weights.keys()


@pytest.mark.multiprocess
def test_each_rank_keeps_its_shard_only(runs) -> None:
    # dim-0 sharding: each rank holds ceil(rows / N) rows of every parameter (the last rank possibly fewer), so
    # the ranks' local elements add up to the model exactly and none holds much more than 1/N of it.
    for world in ("two", "three"):
        ranks = runs[world]
        numel = ranks[0]["numel"]
        assert sum(r["local_numel"] for r in ranks) == numel
        assert max(r["local_numel"] for r in ranks) <= numel / len(ranks) * 1.1


@pytest.mark.multiprocess
def test_checkpoint_is_the_unsharded_one(runs) -> None:
    # The consolidated optimizer state is what one process's AdamW.state_dict() is after the same 2 steps:
    # integer keys over both groups in order, the same moments, the same groups (lr, weight decay, params).
    ours = runs["two"][0]["checkpoint"]["optimizer"]
    theirs = runs["reference_at_checkpoint"]["optimizer"]
    assert ours["param_groups"] == theirs["param_groups"]
    assert set(ours["state"]) == set(theirs["state"])
    for index, entry in theirs["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(ours["state"][index][key], value, **TOL)


@pytest.mark.multiprocess
@pytest.mark.parametrize("resumed", ["three_resumed", "unsharded_resumed"])
def test_resume_at_another_world_size_or_unsharded_is_exact(runs, resumed: str) -> None:
    # Saved by 2 ranks after step 2; resumed by 3 ranks (fsdp2) or one unsharded process (ddp's checkpoint format):
    # step 3 lands on the uninterrupted run's weights.
    result = runs[resumed]
    weights = result[0]["weights"] if isinstance(result, list) else result["weights"]
    _assert_weights_equal(weights, runs["reference_resumed"][3 if resumed == "three_resumed" else 2]["weights"])
    if resumed == "unsharded_resumed":  # the same shares as the run that saved it: the uninterrupted run exactly
        _assert_weights_equal(weights, runs["reference"][2]["weights"])


# ---- through Lightning: tests.support.lightning_fits, against ddp -----------------------------------------------


@pytest.mark.multiprocess
def test_fsdp2_trains_like_ddp_and_its_collectives_are_measured(lightning_fits) -> None:
    run_dir, ddp = lightning_fits["fsdp2"], lightning_fits["ddp"]
    assert_same_weights(run_dir / "weights.pt", ddp / "weights.pt", ddp / "history.pt")
    (summary_path,) = (run_dir / "logs").rglob("timing_summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["run"]["strategy"] == "fsdp2" and summary["run"]["strategy_class"] == "FSDP2Strategy"
    # Every collective torch issued was recorded at the process group: exposed, busy time and overlap measured,
    # the all-gathers and reduce-scatters apart in the call table.
    assert summary["summary"]["comm/exposed_ms"]["median"] > 0 and summary["summary"]["comm/busy_ms"]["median"] > 0
    assert 0 <= summary["summary"]["comm/overlap"]["median"] <= 1
    assert {"all_gather", "reduce_scatter"} <= {row["op"] for row in summary["collectives"]}
    scalars = read_scalars(run_dir / "logs")
    assert {"comm/exposed_ms", "comm/busy_ms", "comm/overlap", "comm/busbw_GBps"} <= scalars.keys()
    assert scalars["train/loss"] and all(math.isfinite(v) for _, v in scalars["train/loss"])
    profile = json.loads((summary_path.parent / "compute_profile.json").read_text())
    assert profile["backward_ms"] > 0  # the last gradient computed came after backward began


@pytest.mark.multiprocess
def test_fsdp2_checkpoint_is_ddps(lightning_fits) -> None:
    ddp = lightning_fits["ddp"]
    ours = torch.load(checkpoint_at(lightning_fits["fsdp2"], FIT_STEPS), weights_only=False)
    theirs = torch.load(checkpoint_at(ddp, FIT_STEPS), weights_only=False)
    assert ours["state_dict"].keys() == theirs["state_dict"].keys()
    assert_same_optimizer_state(ours["optimizer_states"], theirs["optimizer_states"], ddp / "history.pt")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2", "ddp"])
def test_fsdp2_checkpoint_resumes_exactly(lightning_fits, tmp_path: Path, strategy: str) -> None:
    run_dir, ddp = lightning_fits["fsdp2"], lightning_fits["ddp"]
    resumed = fit(tmp_path, "--trainer.strategy", strategy, "--ckpt_path", str(checkpoint_at(run_dir, 3)))
    assert_same_weights(resumed, run_dir / "weights.pt", ddp / "history.pt")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ddp_checkpoint_resumes_under_fsdp2(lightning_fits, tmp_path: Path) -> None:
    ddp = lightning_fits["ddp"]
    resumed = fit(tmp_path, "--trainer.strategy", "fsdp2", "--ckpt_path", str(checkpoint_at(ddp, 3)))
    assert_same_weights(resumed, ddp / "weights.pt", ddp / "history.pt")


# ---- a model that is not our GPT: nn.Transformer in a user's LightningModule -----------------------------------

TRANSFORMER_STEPS = 3


def _fit_transformer(rank: int, world_size: int, strategy: str) -> dict[str, Any]:
    """Fit a LightningModule around ``nn.Transformer`` (no ``Block`` class) for 3 steps of AdamW; rank 0 returns
    the full weights, every rank the modules fsdp2 sharded one group each."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from tests.support.lightning_toy import join_existing_group

    join_existing_group(rank, world_size)

    class Seq2Seq(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Embedding(16, 16)
            # dropout 0: both strategies must compute the same function, with no random mask to tell them apart
            self.transformer = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=2,
                                              dim_feedforward=32, dropout=0.0, batch_first=True)
            self.head = nn.Linear(16, 16)

        def training_step(self, batch, batch_idx):
            source, target = batch
            out = self.head(self.transformer(self.embed(source), self.embed(target)))  # (B, T, 16)
            return F.cross_entropy(out.flatten(0, 1), target.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    generator = torch.Generator().manual_seed(DATA_SEED)
    data = TensorDataset(torch.randint(0, 16, (24, 6), generator=generator),
                         torch.randint(0, 16, (24, 6), generator=generator))
    history: list[dict[str, torch.Tensor]] = []

    class KeepGradients(pl.Callback):  # the averaged gradients AdamW gets, for the fp32 bound (rank 0's, ddp's)
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            history.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None})

    module = Seq2Seq()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=TRANSFORMER_STEPS,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[KeepGradients()] if strategy == "ddp" else [])
    trainer.fit(module, DataLoader(data, batch_size=4))  # 4 rows per rank: a global batch of 8
    # fsdp2's parameters are DTensor shards: full_tensor() gathers each (a collective: every rank calls it).
    weights = {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
               for name, value in module.state_dict().items()}
    groups = sorted({type(m).__name__ for m in module.modules() if m is not module and "FSDP" in type(m).__name__})
    return {"weights": weights if rank == 0 else {}, "groups": groups, "history": history if rank == 0 else []}


@pytest.mark.multiprocess
def test_fsdp2_shards_a_model_without_block_class_and_trains_like_ddp() -> None:
    fsdp2 = run_on_ranks(_fit_transformer, 2, "fsdp2")
    ddp = run_on_ranks(_fit_transformer, 2, "ddp")
    # The repeated encoder and decoder layers became FSDP groups (fully_shard swaps each class for an FSDP one);
    # under ddp nothing did.
    assert fsdp2[0]["groups"] == ["FSDPTransformerDecoderLayer", "FSDPTransformerEncoderLayer"]
    assert ddp[0]["groups"] == []
    # Same weights after 3 steps: both average the same gradients and step AdamW elementwise, so they differ only
    # in the order of their sums (the reduce-scatter adds in another order than the all-reduce), within the bound
    # tests.support.tolerance derives from ddp's gradients: 48 token terms (8 rows x 6 positions) through 4 layers
    # of inner sums (attention and cross-attention over 16 and 6, heads of 8, FFN 16 and 32, norms 16) and the head
    # and softmax (16), forward and back. A wrong step moves a weight by ~lr = 1e-2.
    ours, reference = fsdp2[0]["weights"], ddp[0]["weights"]
    assert len(ours) > 0
    tokens = 8 * 6
    chain = tokens + 2 * (4 * (8 * 16 + 32 + 8 + 4 * 6) + 16 + 16)
    history = ddp[0]["history"]
    bounds = [{n: reordered_gradient_bound(g, chain, tokens) for n, g in step.items()} for step in history]
    weight_bounds = adam_weight_bounds(history, bounds, [1e-2] * TRANSFORMER_STEPS, weights=reference)
    assert_within(ours, reference, weight_bounds, "fsdp2 vs ddp")
