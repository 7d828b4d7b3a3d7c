"""``hsdp`` (``lightning_ddp.strategies.hsdp``): FSDP2 over a ``(dp_replicate, dp_shard)`` mesh, equal to one process.

The argument is ``test_fsdp2``'s with one more reduction: each rank's loss is the mean over its share of the global
micro-batch; FSDP2 reduce-scatters the gradients in the shard group and all-reduces each shard across the replica
group (both with SUM on gloo), then divides by N = replicas x shard_size, so every shard holds the average of all N
ranks' gradients, the full micro-batch's. AdamW is elementwise, so the gathered weights equal one process training on
the whole batch up to fp64 rounding (1e-12 after 3 steps; a missing or doubled replica moves the gradient by 2x,
which clipping's norm sees at once, and a wrong step moves a weight by ~LR = 1e-2).

One spawned job of 4 ranks runs every layout, each with tied weights, a frozen parameter, accumulation over 2
micro-batches and clipping by the global norm (``test_fsdp2``'s model and loop): 2 replicas x 2 shards, 4 x 1
(replicated) and 1 x 4 (``fsdp2``); the consolidated checkpoint saved by 2 x 2 after step 2 and resumed by 2 x 2 and
by 4 x 1; and a Lightning fit at 2 x 2 with the CommTimer, beside ``ddp``'s, whose call table puts each collective on
its mesh dimension's group.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.dist.test_fsdp2 import (
    CHECKPOINT_AFTER, CLIP, MODEL_SEED, STEPS, Root, _as_checkpoint, _assert_weights_equal, _optimizer, _reference,
    _train,
)
from tests.support.cli_utils import (
    GRADIENT_HISTORY, REPO, SAVE_FINAL_WEIGHTS, quickstart_chain, repo_first_on_path, run_cli,
)
from tests.support.tolerance import (
    assert_within, gpt_gradient_chain, history_weight_bounds, reordered_gradient_bound, sgd_momentum_weight_bounds,
)
from tests.support.user_models import D_MODEL, LR, MOMENTUM, SEQ_LEN, VOCAB
from tests.support.dist_utils import run_on_ranks

WORLD = 4
LAYOUTS = {"2x2": 2, "replicated": 1, "fsdp2": WORLD}  # name -> shard_size at 4 ranks
LIGHTNING_STEPS = 3
ROWS_PER_RANK = 4  # the Lightning fits' global batch: 16 rows


def _train_layout(rank: int, world_size: int, shard_size: int, resume: dict[str, Any] | None) -> dict[str, Any]:
    """``test_fsdp2``'s job on ``hsdp``'s mesh: 3 steps (the checkpoint after 2), or from ``resume`` the last one."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_optimizer_state_dict,
    )

    from lightning_ddp.strategies.fsdp2 import fqn_keys_to_ids, ids_to_fqn_keys, shard
    from lightning_ddp.strategies.hsdp import HybridLayout, hybrid_mesh

    mesh = hybrid_mesh("cpu", HybridLayout.of(world_size, shard_size))
    torch.manual_seed(MODEL_SEED + rank)  # the ranks differ until shard() broadcasts rank 0's weights
    module = Root()
    if resume is not None:  # Lightning loads the checkpoint's weights into the module before it is sharded
        module.load_state_dict(resume["model"])
    shard(module, mesh=mesh)
    optimizer = _optimizer(module)
    if resume is not None:
        set_optimizer_state_dict(module, optimizer, ids_to_fqn_keys(resume["optimizer"], optimizer, module),
                                 options=StateDictOptions(full_state_dict=True))
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    checkpoint = None
    if resume is None:
        norms = _train(module, optimizer, range(CHECKPOINT_AFTER), world_size, rank)
        checkpoint = {"model": get_model_state_dict(module, options=full),
                      "optimizer": get_optimizer_state_dict(module, optimizer, options=full)}
        checkpoint["optimizer"] = fqn_keys_to_ids(checkpoint["optimizer"]) if checkpoint["optimizer"] else {}
    else:
        norms = []
    norms += _train(module, optimizer, range(CHECKPOINT_AFTER, STEPS), world_size, rank)
    local = {name: p.to_local().detach().clone() for name, p in module.named_parameters()}
    return {"weights": get_model_state_dict(module, options=full), "norms": norms, "checkpoint": checkpoint,
            "local": local, "numel": sum(p.numel() for p in module.parameters()),
            "mesh": None if mesh is None else mesh.shape}


def _lightning_fit(rank: int, world_size: int, strategy: Any) -> dict[str, Any]:
    """A user's Transformer LM for 3 steps on 4 ranks (4 rows each) with the CommTimer: its weights (rank 0) and the
    call table the timer writes to ``timing_summary.json`` as (group, op) pairs."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_ddp.callbacks import CommTimer
    from lightning_ddp.metrics.recording import call_table
    from tests.support.callbacks_for_tests import GradientHistory
    from tests.support.user_models import KeptMetrics, UserTransformerLM, full_weights, user_data

    module, timer = UserTransformerLM(), CommTimer(every_n_steps=1, warmup_steps=1)
    history = GradientHistory()  # rank 0's gradients, for the fp32 bounds
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=LIGHTNING_STEPS,
                         logger=KeptMetrics(), callbacks=[timer, history], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir="logs")
    trainer.fit(module, DataLoader(user_data(32), batch_size=ROWS_PER_RANK))
    weights = full_weights(module)
    return {"weights": weights if rank == 0 else {}, "strategy": trainer.strategy, "gradients": history.steps,
            "calls": {(row["group"], row["op"]) for row in call_table(timer._calls)}}


def _every_layout(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_ddp.strategies import HSDPStrategy
    from tests.support.lightning_toy import join_existing_group

    results: dict[str, Any] = {name: _train_layout(rank, world_size, size, None) for name, size in LAYOUTS.items()}
    shared = [results["2x2"]["checkpoint"]]  # rank 0's; Lightning loads the file on every rank
    dist.broadcast_object_list(shared, src=0)
    results["2x2_resumed"] = _train_layout(rank, world_size, LAYOUTS["2x2"], shared[0])
    results["replicated_resumed"] = _train_layout(rank, world_size, LAYOUTS["replicated"], shared[0])
    join_existing_group(rank, world_size)
    results["lightning_hsdp"] = hsdp = _lightning_fit(rank, world_size, HSDPStrategy(shard_size=2))
    strategy = hsdp.pop("strategy")
    hsdp.update(name=strategy.strategy_name, settings=strategy.reported_settings())
    results["lightning_ddp"] = _lightning_fit(rank, world_size, "ddp")
    results["lightning_ddp"].pop("strategy")
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_on_ranks(_every_layout, WORLD, timeout=600)


@pytest.fixture(scope="module")
def references() -> dict[str, Any]:
    at_checkpoint = _reference(range(CHECKPOINT_AFTER), WORLD)
    return {"whole": _reference(range(STEPS), WORLD),
            "resumed": _reference(range(CHECKPOINT_AFTER, STEPS), WORLD, start=_as_checkpoint(at_checkpoint))}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [*LAYOUTS, "2x2_resumed", "replicated_resumed"])
def test_every_layout_equals_one_process(ranks, references, layout: str) -> None:
    resumed = layout.endswith("_resumed")
    reference = references["resumed" if resumed else "whole"]
    # The global norm on every rank, and above CLIP: every step was clipped by the norm over all 4 ranks' average.
    for result in ranks:
        assert result[layout]["norms"] == pytest.approx(reference["norms"], rel=1e-10)
    assert min(reference["norms"]) > CLIP
    _assert_weights_equal(ranks[0][layout]["weights"], reference["weights"])
    if resumed:  # from the checkpoint, the last step lands on the uninterrupted run's weights
        _assert_weights_equal(ranks[0][layout]["weights"], references["whole"]["weights"])
    assert all(result[layout]["weights"] == {} for result in ranks[1:])  # rank 0 alone holds the full state


@pytest.mark.multiprocess
def test_each_shard_group_holds_the_model_once_and_the_replicas_agree_bitwise(ranks) -> None:
    # Ranks 0,1 and 2,3 are the shard groups (one node each under torchrun), 0,2 and 1,3 the replica groups.
    assert [r["2x2"]["mesh"] for r in ranks] == [(2, 2)] * 4
    assert [r["replicated"]["mesh"] for r in ranks] == [(4, 1)] * 4
    assert [r["fsdp2"]["mesh"] for r in ranks] == [None] * 4  # one replica: fsdp2's own 1-D mesh over the world
    numel = ranks[0]["2x2"]["numel"]
    for layout, groups in (("2x2", [[0, 1], [2, 3]]), ("replicated", [[0], [1], [2], [3]]), ("fsdp2", [[0, 1, 2, 3]])):
        local = [sum(t.numel() for t in r[layout]["local"].values()) for r in ranks]
        # dim-0 chunks of ceil(rows / shard_size): a group's shards add up to the model exactly
        assert all(sum(local[i] for i in group) == numel for group in groups), (layout, local)
        assert max(local) <= numel / len(groups[0]) * 1.1, (layout, local)
    # Same reduced gradients, same optimizer step: a replica's shard is bitwise its partner's.
    for first, second in ((0, 2), (1, 3)):
        a, b = ranks[first]["2x2"]["local"], ranks[second]["2x2"]["local"]
        assert all(torch.equal(a[name], b[name]) for name in a), (first, second)


@pytest.mark.multiprocess
def test_a_lightning_fit_trains_like_ddp_and_its_collectives_are_on_their_mesh_groups(ranks) -> None:
    hsdp, ddp = ranks[0]["lightning_hsdp"], ranks[0]["lightning_ddp"]
    assert hsdp["name"] == "hsdp"
    assert hsdp["settings"] == ("n/a", {"shard_size": 2, "reshard_after_forward": True, "mixed_precision": True})
    # fp32: both average the same 16 rows' gradients (reduce-scatter plus all-reduce against one all-reduce: another
    # order of the sums) and step the same SGD with momentum: each gradient within its reordered sums' bound of
    # ddp's, carried through the buffer to the weights. The user's model has GPT's inner sums (no final norm: one
    # d_model more is counted, a looser bound). The bounds come to ~1e-6; a missing replica's rows would move the
    # weights by a share of lr x the sum of their gradients' sizes, 1e-4 and more in this run.
    tokens = WORLD * ROWS_PER_RANK * SEQ_LEN
    chain = gpt_gradient_chain(SimpleNamespace(d_model=D_MODEL, n_heads=2, d_ff=32, context_length=SEQ_LEN,
                                               n_layers=2, vocab_size=VOCAB), tokens=tokens)
    bounds = [{name: reordered_gradient_bound(g, chain, tokens) for name, g in step.items()}
              for step in ddp["gradients"]]
    assert len(bounds) == LIGHTNING_STEPS and hsdp["weights"]
    assert_within(hsdp["weights"], ddp["weights"], sgd_momentum_weight_bounds(
        ddp["gradients"], bounds, lr=LR, momentum=MOMENTUM, weights=ddp["weights"]), "hsdp against ddp")
    # The shard group gathers parameters and reduce-scatters gradients; only shards cross the replica group, in one
    # all-reduce per FSDP group. (The world carries the start-up broadcasts, before the measured steps.)
    for result in ranks:
        calls = result["lightning_hsdp"]["calls"]
        assert {op for group, op in calls if group == "dp_shard"} == {"all_gather", "reduce_scatter"}, calls
        assert {op for group, op in calls if group == "dp_replicate"} == {"all_reduce"}, calls


# ---- docs/multi_node.md's recipe: two torchrun "nodes" of 2 processes on this host ------------------------------

PER_RANK_BATCH = 2
QUICKSTART = ("--config", str(REPO / "configs" / "quickstart.yaml"), "--model.context_length", "32",
              "--data.seq_len", "32", "--trainer.max_steps", "6", "--trainer.accumulate_grad_batches", "2",
              "--trainer.gradient_clip_val", "0.5", "--trainer.limit_val_batches", "0",
              "--trainer.num_sanity_val_steps", "0", "--trainer.enable_checkpointing", "false",
              "--timer.warmup_steps", "1")
"""The quickstart, shortened: 6 steps of 2 micro-batches each, clipped."""


@pytest.mark.multiprocess
@pytest.mark.slow  # two torchrun launchers of 2 processes and a reference fit: ~2 min on 2 shared cores
def test_two_torchrun_nodes_train_the_quickstart_to_one_process_weights(tmp_path: Path) -> None:
    from lightning_ddp.bench.launch import LOOPBACK_INTERFACE, run_processes
    from lightning_ddp.local_group import find_free_port

    hsdp, one = tmp_path / "hsdp", tmp_path / "one"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(find_free_port()),
               "-m", "lightning_ddp", "fit", *QUICKSTART, "--data.batch_size", str(PER_RANK_BATCH),
               "--trainer.devices", "2", "--trainer.num_nodes", "2", "--trainer.strategy", "hsdp",
               "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(hsdp / "logs"),
               SAVE_FINAL_WEIGHTS, f"--trainer.callbacks.path={hsdp / 'weights.pt'}"]
    base = {"GLOO_SOCKET_IFNAME": LOOPBACK_INTERFACE, **repo_first_on_path(), "PYTHONUNBUFFERED": "1"}
    envs = [{**base, "PET_NODE_RANK": str(node)} for node in range(2)]  # torchrun reads --node_rank from PET_*
    logs = [tmp_path / f"node{node}.log" for node in range(2)]
    result = run_processes(command, envs, logs, 420, cwd=str(tmp_path))
    assert not result.timed_out and result.returncodes == [0, 0], "\n".join(p.read_text()[-3000:] for p in logs)
    said = logs[0].read_text()
    assert said.count("hsdp: 4 ranks as 2 replicas x 2 shards") == 1, said[-3000:]  # once, by global rank 0
    # One process on the same global batch of 4 x 2 rows: DistributedSampler deals one shuffled order over the ranks,
    # so each global micro-batch holds the same rows; the weights within the bounds derived from its own gradients
    # (tests.support.lightning_fits.assert_same_weights says why they hold).
    one.mkdir()
    run_cli("fit", *QUICKSTART, "--data.batch_size", str(4 * PER_RANK_BATCH), "--trainer.devices", "1",
            "--trainer.logger.init_args.save_dir", str(one / "logs"), SAVE_FINAL_WEIGHTS,
            f"--trainer.callbacks.path={one / 'weights.pt'}", GRADIENT_HISTORY,
            f"--trainer.callbacks.path={one / 'history.pt'}", cwd=one)
    tokens = 4 * 2 * PER_RANK_BATCH * 32  # per optimizer step: 4 ranks x 2 micro-batches x PER_RANK_BATCH x 32
    theirs = torch.load(one / "weights.pt")
    bounds = history_weight_bounds(one / "history.pt", quickstart_chain(tokens, context_length=32), tokens, 0.5, theirs)
    assert_within(torch.load(hsdp / "weights.pt"), theirs, bounds, "hsdp vs one process")
    # Each node a shard group: all-gathers and reduce-scatters within it; across nodes only each reduce-scatter's
    # output, 1/shard_size of its input, all-reduced (one per FSDP group and step: accumulation sends nothing before
    # the last micro-batch).
    (summary,) = (hsdp / "logs").rglob("timing_summary.json")
    rows = json.loads(summary.read_text())["collectives"]
    on_shard = {row["op"] for row in rows if row["group"] == "dp_shard"}
    assert {row["op"] for row in rows if row["group"] == "dp_replicate"} == {"all_reduce"}, rows
    assert on_shard == {"all_gather", "reduce_scatter", "all_reduce"}, rows
    scattered = sorted((row["bytes"] // 2, row["count"]) for row in rows if row["op"] == "reduce_scatter")
    assert sorted((row["bytes"], row["count"]) for row in rows if row["group"] == "dp_replicate") == scattered, rows
    # The shard group's one all-reduce: clipping's norm, the tiny GPT's 39 per-tensor fp32 norms summed over the
    # shards once a step (the replicas hold the same shards, so they agree without one).
    assert {row["bytes"] for row in rows if row["group"] == "dp_shard" and row["op"] == "all_reduce"} == {39 * 4}, rows
