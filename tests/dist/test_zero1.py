"""ZeRO-1: ``ShardedOptimizer`` trains like an unsharded optimizer, keeps only its shard's state, and checkpoints.

The multi-rank argument is the one of ``test_sync_equivalence``: with the global batch of 8 split 4/4 and the
loss a mean over the local batch, the average of the two local gradients is the full-batch gradient, so after
the same AdamW steps from the same weights the sharded run must match one process training plain AdamW on all
8 samples, up to float rounding of the batch sums. What sharding adds (each owner updates only its parameters,
then sends them) must change nothing, and every rank must end with bitwise identical weights.

One spawned job runs every (case, schedule, collectives) configuration on both ranks and, on rank 0, the
single-process reference of every case; the tests below only inspect what it returned (each spawned rank
spends ~8 s importing Lightning, so one job rather than one per case).
"""

from __future__ import annotations

import doctest
import io
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_ddp.compat import repoint_scheduler
from lightning_ddp.strategies import ZeRO1DDPStrategy
from lightning_ddp.sync import BucketedDDP, DeferredGradSync, Recorder, ShardedOptimizer, assign_owners
from lightning_ddp.sync import sharding
from tests.support.cli_utils import checkpoint_at, read_scalars
from tests.support.dist_utils import DEFAULT_TIMEOUT_S, run_on_ranks
from tests.support.lightning_fits import STEPS as FIT_STEPS
from tests.support.lightning_fits import assert_same_optimizer_state, assert_same_weights, fit
from tests.support.tolerance import (
    adam_moment_bounds,
    adam_weight_bounds,
    assert_within,
    reordered_gradient_bound,
    with_tied,
)

WORLD_SIZE = 2
GLOBAL_BATCH = 8  # 4 samples per rank
PER_RANK = GLOBAL_BATCH // WORLD_SIZE
STEPS = 4
MODEL_SEED = 1234
HP = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
# Weights after 4 AdamW steps vs one process on the full batch: the only difference is the order of the sums (the
# batch split over ranks), bounded per weight from the reference's own gradients by tests.support.tolerance: a
# gradient element sums TOKENS = 32 token terms through the inner sums of LayerNorm, fc1, fc2, extra, head (8, 8, 32,
# 8, 8) and the softmax (16), forward and back. A wrong update (a parameter stepped twice, skipped, given a zero
# instead of no gradient and so decayed, or an lr not propagated) moves a weight by ~lr * 0.1 = 1e-3 or more.
JOB_TIMEOUT_S = DEFAULT_TIMEOUT_S  # a bound on a hang, not on speed

VOCAB, SEQ, DIM = 16, 4, 8
TOKENS = GLOBAL_BATCH * SEQ
CHAIN = TOKENS + 2 * (DIM + DIM + 4 * DIM + DIM + DIM + VOCAB)


class TinyLM(nn.Module):
    """Embedding, a pre-norm MLP block, an ``extra`` linear layer (frozen in some cases) and an LM head.

    ``unused`` is never called: its parameters never get a gradient, so AdamW must skip them (no weight decay
    either). Tensors and bytes (fp32): embed 16x8 512 B, norm 8+8, fc1 32x8+32, fc2 8x32+8, extra 8x8+8,
    unused 8x8+8, head 16x8 512 B (absent when tied).
    """

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)
        self.extra = nn.Linear(DIM, DIM)
        self.unused = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)  # (B, T, D)
        h = h + self.fc2(F.gelu(self.fc1(self.norm(h))))  # (B, T, D)
        h = h + self.extra(h)  # (B, T, D)
        return self.head(h)  # (B, T, V)


@dataclass(frozen=True)
class Case:
    tie: bool = False
    frozen: bool = False
    """``extra`` has requires_grad=False but is in the optimizer: it must stay untouched."""
    groups: bool = False
    """Matrices and vectors in two groups with their own lr and weight decay, plus a LambdaLR on the optimizer."""
    unfreeze_at: int | None = None
    """``extra`` starts frozen and outside the optimizer; at this step it is unfrozen and added as a new group."""


CASES = {
    "plain": Case(),
    "tied": Case(tie=True),
    "frozen": Case(frozen=True),
    "groups": Case(groups=True),
    "unfreeze": Case(unfreeze_at=2),
}
# (case, schedule, collectives, gradient averaging for allreduce_broadcast: a BucketedDDP engine or by hand)
CONFIGS = [
    ("plain", "allreduce_broadcast", "per_owner", "engine"),
    ("plain", "allreduce_broadcast", "native", "manual"),
    ("plain", "reduce_scatter", "per_owner", "engine"),  # "engine" here: DeferredGradSync
    ("plain", "reduce_scatter", "native", "manual"),
    *[(case, schedule, "auto", "manual") for case in ("tied", "frozen", "groups", "unfreeze")
      for schedule in ("allreduce_broadcast", "reduce_scatter")],
]


def _config_id(config: tuple) -> str:
    return "-".join(config)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    y = torch.randint(VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    return x, y


def _build(case: Case) -> tuple[TinyLM, list[dict]]:
    """The model (same weights on every rank: same seed) and its parameter groups."""
    torch.manual_seed(MODEL_SEED)
    model = TinyLM(tie=case.tie)
    if case.frozen or case.unfreeze_at is not None:
        model.extra.requires_grad_(False)
    params = list(model.parameters())
    if case.unfreeze_at is not None:
        extra = set(model.extra.parameters())
        params = [p for p in params if p not in extra]
    if case.groups:
        return model, [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.2},
            {"params": [p for p in params if p.dim() < 2], "lr": 3e-2, "weight_decay": 0.0},
        ]
    return model, [{"params": params}]


def _train(case: Case, optimizer, model: TinyLM, steps: range, rows: slice, average=None, recorder=None,
           history: list | None = None) -> None:
    """``history``: each step's gradients and learning rates by name are appended to it."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s) if case.groups else None
    for step in steps:
        if recorder is not None:
            recorder.open_step(step)
        if step == case.unfreeze_at:
            model.extra.requires_grad_(True)
            optimizer.add_param_group({"params": list(model.extra.parameters()), "lr": 5e-3})
        x, y = _batch(step)
        logits = model(x[rows])
        F.cross_entropy(logits.flatten(0, 1), y[rows].flatten()).backward()
        if average is not None:
            average()
        if history is not None:
            history.append(_gradients_and_lrs(model, optimizer))
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()


def _gradients_and_lrs(model: nn.Module, optimizer) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    names = {id(p): n for n, p in model.named_parameters()}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, {names[id(p)]: g["lr"] for g in optimizer.param_groups for p in g["params"]}


def _weight_bounds(history: list, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """How far the sharded run's weights can be from the reference's ``state`` (the comment above TOKENS)."""
    grads = [step for step, _ in history]
    lrs = {name: [step_lrs.get(name, 0.0) for _, step_lrs in history] for name in history[-1][1]}
    bounds = [{n: reordered_gradient_bound(g, CHAIN, TOKENS) for n, g in step.items()} for step in grads]
    return with_tied(adam_weight_bounds(grads, bounds, lrs, HP["betas"], weights=state), state)


def _average_by_hand(model: nn.Module, world_size: int) -> None:
    for p in model.parameters():
        if p.grad is not None:  # every rank uses the same parameters here, so presence agrees
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _sharded_run(rank: int, world_size: int, config: tuple) -> dict:
    case_name, schedule, collectives, averaging = config
    case = CASES[case_name]
    model, groups = _build(case)
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    engine = None
    average = None
    if averaging == "engine":
        # A real engine: BucketedDDP all-reduces in backward; DeferredGradSync leaves gradients local.
        engine = DeferredGradSync(model) if schedule == "reduce_scatter" else BucketedDDP(model, bucket_size_mb=None)
    elif schedule == "allreduce_broadcast":
        average = lambda: _average_by_hand(model, world_size)  # noqa: E731
    optimizer = ShardedOptimizer(groups, torch.optim.AdamW, schedule=schedule, collectives=collectives, **HP)
    recorder = Recorder()  # the engine's and the optimizer's collectives land in one record per step
    optimizer.recorder = recorder
    if engine is not None:
        engine.recorder = recorder
        average = engine.finish_gradient_synchronization
    _train(case, optimizer, model, range(STEPS), rows, average, recorder)
    names = {id(p): n for n, p in model.named_parameters()}
    record = recorder.finish_step()  # the last step's
    return {
        "weights": _weights(model),
        "state": {names[id(p)]: {k: tuple(v.shape) for k, v in s.items()} for p, s in optimizer.state.items()},
        "owners": {names[id(p)]: optimizer.owner(p) for g in optimizer.param_groups for p in g["params"]},
        "ops": [(c.op, c.nbytes) for c in record.collectives],
        "lrs": [g["lr"] for g in optimizer.optim.param_groups],
    }


def _checkpoint_run(rank: int, world_size: int, schedule: str) -> dict:
    """2 steps, state_dict through bytes (as a checkpoint file), a fresh model and optimizer, 2 more steps."""
    case = CASES["groups"]  # two groups and a scheduler: the most state to carry over
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    average = None

    def train_from_scratch(steps: range):
        """A new model, sharded optimizer and scheduler, trained over ``steps``."""
        model, groups = _build(case)
        optimizer = ShardedOptimizer(groups, torch.optim.AdamW, schedule=schedule, **HP)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s)
        average = None
        if schedule == "allreduce_broadcast":
            average = lambda: _average_by_hand(model, world_size)  # noqa: E731
        _train_with(model, optimizer, scheduler, steps, rows, average)
        return model, optimizer, scheduler

    model, optimizer, scheduler = train_from_scratch(range(2))
    buffer = io.BytesIO()
    full_state = optimizer.state_dict()  # a collective: every rank calls it and gets everything
    torch.save({"model": model.state_dict(), "optimizer": full_state, "scheduler": scheduler.state_dict()}, buffer)

    torch.manual_seed(MODEL_SEED + 1 + rank)  # different weights: the load must bring them back
    resumed = TinyLM()
    checkpoint = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    resumed.load_state_dict(checkpoint["model"])
    _, resumed_groups = _build_groups_for(resumed, case)
    resumed_opt = ShardedOptimizer(resumed_groups, torch.optim.AdamW, schedule=schedule, **HP)
    resumed_sched = torch.optim.lr_scheduler.LambdaLR(resumed_opt, lambda s: 0.5**s)
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    resumed_sched.load_state_dict(checkpoint["scheduler"])
    if schedule == "allreduce_broadcast":
        average = lambda: _average_by_hand(resumed, world_size)  # noqa: E731
    _train_with(resumed, resumed_opt, resumed_sched, range(2, 4), rows, average)

    uninterrupted, _, _ = train_from_scratch(range(4))
    return {"resumed": _weights(resumed), "uninterrupted": _weights(uninterrupted), "full_state": full_state}


def _build_groups_for(model: TinyLM, case: Case) -> tuple[TinyLM, list[dict]]:
    params = list(model.parameters())
    return model, [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.2},
        {"params": [p for p in params if p.dim() < 2], "lr": 3e-2, "weight_decay": 0.0},
    ]


def _train_with(model, optimizer, scheduler, steps: range, rows: slice, average, history: list | None = None) -> None:
    for step in steps:
        x, y = _batch(step)
        F.cross_entropy(model(x[rows]).flatten(0, 1), y[rows].flatten()).backward()
        if average is not None:
            average()
        if history is not None:
            history.append(_gradients_and_lrs(model, optimizer))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


def _reference(case: Case) -> tuple[dict[str, torch.Tensor], list]:
    """One process, the full batch of 8, plain AdamW: the weights after STEPS steps and each step's gradients and
    learning rates."""
    model, groups = _build(case)
    optimizer = torch.optim.AdamW(groups, **HP)
    history: list = []
    _train(case, optimizer, model, range(STEPS), slice(0, GLOBAL_BATCH), history=history)
    return _weights(model), history


def _reference_two_steps() -> dict:
    """The plain AdamW state_dict after 2 steps of the checkpoint case (what a consolidated state must equal), the
    names of its parameter indices and the steps' gradients."""
    case = CASES["groups"]
    model, groups = _build(case)
    optimizer = torch.optim.AdamW(groups, **HP)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s)
    history: list = []
    _train_with(model, optimizer, scheduler, range(2), slice(0, GLOBAL_BATCH), None, history)
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    return {"state": optimizer.state_dict(), "names": order,
            "grads": [step for step, _ in history]}


def _job(rank: int, world_size: int) -> dict:
    results: dict = {"runs": {}, "checkpoint": {}}
    for config in CONFIGS:
        try:
            results["runs"][_config_id(config)] = _sharded_run(rank, world_size, config)
        except Exception as error:  # name the configuration in the traceback the parent shows
            raise RuntimeError(f"configuration {config} failed") from error
    for schedule in ("allreduce_broadcast", "reduce_scatter"):
        results["checkpoint"][schedule] = _checkpoint_run(rank, world_size, schedule)
    if rank == 0:
        results["reference"] = {name: _reference(case) for name, case in CASES.items()}
        results["reference_two_steps"] = _reference_two_steps()
    return results


@pytest.fixture(scope="module")
def job() -> list[dict]:
    return run_on_ranks(_job, WORLD_SIZE, timeout=JOB_TIMEOUT_S)


# ---- equivalence -------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_sharded_training_matches_one_process_adamw(job, config) -> None:
    rank0, rank1 = (r["runs"][_config_id(config)] for r in job)
    expected, history = job[0]["reference"][config[0]]
    for name, value in expected.items():
        # Every rank holds the owner's update bit for bit: parameters travel, they are not recomputed.
        assert torch.equal(rank0["weights"][name], rank1["weights"][name]), name
    assert_within(rank0["weights"], expected, _weight_bounds(history, expected), _config_id(config))


@pytest.mark.multiprocess
def test_parameters_without_gradient_are_not_stepped(job) -> None:
    # `unused` never gets a gradient: AdamW skips it (no state, no weight decay), so it equals its initial value.
    torch.manual_seed(MODEL_SEED)
    initial = TinyLM().state_dict()
    for config in CONFIGS:
        run = job[0]["runs"][_config_id(config)]
        assert torch.equal(run["weights"]["unused.weight"], initial["unused.weight"]), config
        if config[0] == "frozen":  # frozen but in the optimizer: untouched too
            assert torch.equal(run["weights"]["extra.weight"], initial["extra.weight"]), config


@pytest.mark.multiprocess
def test_scheduler_on_the_sharded_optimizer_reaches_the_inner_optimizer(job) -> None:
    # LambdaLR(0.5**s) stepped 4 times: the inner groups last ran at factor 0.5**3 and now read 0.5**4.
    for schedule in ("allreduce_broadcast", "reduce_scatter"):
        lrs = job[0]["runs"][f"groups-{schedule}-auto-manual"]["lrs"]
        assert lrs == pytest.approx([1e-2 * 0.5**3, 3e-2 * 0.5**3])  # copied in at the start of the last step


# ---- what each rank keeps ----------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", [c for c in CONFIGS if c[0] in ("plain", "tied", "unfreeze")], ids=_config_id)
def test_each_rank_keeps_only_its_shard(job, config) -> None:
    runs = [r["runs"][_config_id(config)] for r in job]
    owners = runs[0]["owners"]
    assert runs[1]["owners"] == owners  # the assignment is the same on every rank
    keys = [set(run["state"]) for run in runs]
    assert not keys[0] & keys[1], "a parameter has optimizer state on both ranks"
    torch.manual_seed(MODEL_SEED)
    model = TinyLM(tie=CASES[config[0]].tie)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    stepped = {n for n in shapes if not n.startswith("unused.")}  # everything that had a gradient
    assert keys[0] | keys[1] == stepped
    for rank, run in enumerate(runs):
        for name, entry in run["state"].items():
            assert owners[name] == rank
            # AdamW: two moments the shape of the parameter, and a 0-d step counter
            assert entry == {"step": (), "exp_avg": shapes[name], "exp_avg_sq": shapes[name]}, name


@pytest.mark.multiprocess
def test_shards_are_balanced_by_bytes(job) -> None:
    owners = job[0]["runs"]["plain-allreduce_broadcast-per_owner-engine"]["owners"]
    sizes = {n: p.numel() * 4 for n, p in TinyLM().named_parameters()}
    load = [sum(sizes[n] for n, r in owners.items() if r == rank) for rank in range(WORLD_SIZE)]
    # 3872 bytes. Largest first, onto the lighter rank (ties: lower rank): fc1.weight 1024 -> r0, fc2.weight 1024
    # -> r1, embed 512 -> r0, head 512 -> r1, extra.weight 256 -> r0, unused.weight 256 -> r1, fc1.bias 128 -> r0
    # (1920 : 1792), four 32-byte vectors -> r1 (1920 : 1920), the last (unused.bias) -> r0 on the tie.
    assert load == [1952, 1920]


@pytest.mark.multiprocess
def test_collectives_are_recorded_per_schedule(job) -> None:
    psi_bytes = sum(p.numel() * 4 for n, p in TinyLM().named_parameters() if not n.startswith("unused."))
    unused_bytes = (DIM * DIM + DIM) * 4
    trainable_bytes = psi_bytes + unused_bytes  # `unused` requires grad, so it is shared (unchanged) too
    # allreduce_broadcast with an engine: the engine's all-reduce (one bucket + presence flags), then one
    # broadcast per owner; the broadcasts carry every trainable parameter once.
    ops = job[0]["runs"]["plain-allreduce_broadcast-per_owner-engine"]["ops"]
    assert [op for op, _ in ops] == ["all_reduce", "all_reduce", "broadcast", "broadcast"]
    assert sum(n for op, n in ops if op == "broadcast") == trainable_bytes
    # reduce_scatter per owner on gloo: presence flags, one reduce per owner of the gradients that exist (not
    # `unused`), one broadcast per owner.
    ops = job[0]["runs"]["plain-reduce_scatter-per_owner-engine"]["ops"]
    assert [op for op, _ in ops] == ["all_reduce", "reduce", "reduce", "broadcast", "broadcast"]
    assert sum(n for op, n in ops if op == "reduce") == psi_bytes
    # native: one reduce-scatter and one all-gather of padded flat buffers (no engine: the optimizer's collectives).
    ops = job[0]["runs"]["plain-reduce_scatter-native-manual"]["ops"]
    assert [op for op, _ in ops] == ["all_reduce", "reduce_scatter", "all_gather"]
    assert ops[1][1] >= psi_bytes and ops[2][1] >= trainable_bytes / WORLD_SIZE


# ---- checkpoints -------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["allreduce_broadcast", "reduce_scatter"])
def test_resume_from_state_dict_continues_identically(job, schedule) -> None:
    for rank_results in job:
        run = rank_results["checkpoint"][schedule]
        for name, value in run["uninterrupted"].items():
            # Same operations in the same order on the same numbers: bit for bit.
            assert torch.equal(run["resumed"][name], value), name


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["allreduce_broadcast", "reduce_scatter"])
def test_state_dict_is_consolidated_in_the_unsharded_format(job, schedule) -> None:
    states = [r["checkpoint"][schedule]["full_state"] for r in job]
    two_steps = job[0]["reference_two_steps"]
    reference = two_steps["state"]
    grads = two_steps["grads"]
    moments = adam_moment_bounds(grads, [{n: reordered_gradient_bound(g, CHAIN, TOKENS) for n, g in step.items()}
                                         for step in grads], HP["betas"])
    # Every rank returns the whole state ...
    assert states[0]["param_groups"] == states[1]["param_groups"]
    for index, entry in states[0]["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, states[1]["state"][index][key]), (index, key)
    # ... and it is what plain AdamW would save: same groups (indices, hyperparameters), same entries.
    assert states[0]["param_groups"] == reference["param_groups"]
    assert set(states[0]["state"]) == set(reference["state"])
    for index, entry in reference["state"].items():
        assert set(states[0]["state"][index]) == set(entry)
        for key, value in entry.items():
            got = states[0]["state"][index][key]
            assert got.device.type == "cpu" and got.dtype == value.dtype and got.shape == value.shape
            # moments of gradients that differ in the order of their sums (adam_moment_bounds); the step count exact
            bound = moments[two_steps["names"][index]].get(key, 0.0)
            assert_within({key: got}, {key: value}, {key: bound}, f"state {index}")


# ---- one process, a world of one -----------------------------------------------------------------------


def test_assign_owners_doctest_and_rules() -> None:
    assert doctest.testmod(sharding).failed == 0
    # Deterministic and pure: the same input gives the same owners (every rank computes it on its own).
    sizes = [400, 4, 1600, 1600, 36, 400, 4]
    assert assign_owners(sizes, 3) == assign_owners(list(sizes), 3)
    # Greedy largest first: 1600 (idx 2) -> r0, 1600 (idx 3) -> r1, 400 (idx 0) -> r2, 400 (idx 5) -> r2,
    # 36 -> r2 (836 < 1600), 4 (idx 1) -> r2, 4 (idx 6) -> r2: loads 1600, 1600, 844.
    assert assign_owners(sizes, 3) == [2, 2, 0, 1, 2, 2, 2]
    assert assign_owners([], 2) == []
    assert assign_owners([8, 8], 1) == [0, 0]
    with pytest.raises(ValueError, match="world_size"):
        assign_owners([1], 0)
    with pytest.raises(ValueError, match="one per rank"):
        assign_owners([1], 2, loads=[0])


def test_configuration_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="reduce_scatter"):
        ZeRO1DDPStrategy(schedule="zero3")
    with pytest.raises(ValueError, match="bucketed"):
        ZeRO1DDPStrategy(grad_sync="ring")
    with pytest.raises(ValueError, match="per_owner"):
        ZeRO1DDPStrategy(collectives="nccl")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ShardedOptimizer([nn.Parameter(torch.zeros(1))], torch.optim.AdamW)


def test_world_of_one_equals_adamw_and_scheduler_is_repointed(world_of_one) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    reference = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    reference.load_state_dict(model.state_dict())
    with pytest.raises(TypeError, match="AdamW"):
        ShardedOptimizer(model.parameters(), "adamw")  # type: ignore[arg-type]

    # As the strategy does: configure_optimizers' optimizer and scheduler, then shard and re-point.
    plain = torch.optim.AdamW(model.parameters(), **HP)
    schedule = torch.optim.lr_scheduler.LambdaLR(plain, lambda s: 1.0 / (s + 1))
    sharded = ShardedOptimizer.from_optimizer(plain)
    assert sharded.param_groups[0] is plain.param_groups[0]  # shared dicts: the scheduler's writes land here
    repoint_scheduler(schedule, sharded)
    ref_opt = torch.optim.AdamW(reference.parameters(), **HP)
    ref_schedule = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (s + 1))
    x = torch.randn(16, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "optimizer.step() has been overridden" warning from the scheduler
        for _ in range(3):
            for net, opt, sched in ((model, sharded, schedule), (reference, ref_opt, ref_schedule)):
                net(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                sched.step()
    assert sharded.optim.param_groups[0]["lr"] == pytest.approx(HP["lr"] / 3)  # the last step ran at factor 1/3
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    # One rank owns everything: the state is AdamW's, and so is the state_dict (hyperparameters included).
    ours, theirs = sharded.state_dict(), ref_opt.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    for index, entry in theirs["state"].items():
        for key, value in entry.items():
            assert torch.equal(ours["state"][index][key], value)


def test_load_state_dict_rejects_another_model(world_of_one) -> None:
    one = ShardedOptimizer([nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))], torch.optim.AdamW)
    other = torch.optim.AdamW([nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="parameter group 0 has 2 parameters"):
        one.load_state_dict(other.state_dict())
    param = nn.Parameter(torch.zeros(2))
    param.grad = torch.ones(2)
    stepped = torch.optim.AdamW([param])
    stepped.step()
    with pytest.raises(ValueError, match="already has state"):
        ShardedOptimizer.from_optimizer(stepped)


# ---- through Lightning: tests.support.lightning_fits, against ddp ------------------------------------------


@pytest.mark.multiprocess
def test_zero1_ddp_trains_like_lightning_ddp(lightning_fits) -> None:
    run_dir, ddp = lightning_fits["zero1_ddp"], lightning_fits["ddp"]
    summaries = list((run_dir / "logs").rglob("timing_summary.json"))
    assert summaries, "the CommTimer wrote no summary"
    summary = json.loads(summaries[0].read_text())
    assert summary["run"]["strategy"] == "zero1_ddp" and summary["run"]["strategy_class"] == "ZeRO1DDPStrategy"
    losses = read_scalars(run_dir / "logs")["train/loss"]
    assert {step for step, _ in losses} == set(range(FIT_STEPS)) and all(math.isfinite(v) for _, v in losses)
    # Same seed, so the same initial weights and the same DistributedSampler order; both average the same local
    # gradients and clip by the global norm, so the weights agree to rounding. A warm-up or cosine schedule, or a
    # clip, that did not reach the sharded optimizer would move every weight by ~lr.
    assert_same_weights(run_dir / "weights.pt", ddp / "weights.pt", ddp / "history.pt")


@pytest.mark.multiprocess
def test_zero1_ddp_checkpoint_is_the_unsharded_checkpoint(lightning_fits) -> None:
    # Lightning saves rank 0's `optimizer.state_dict()`, which for ShardedOptimizer gathers every rank's shard.
    ddp = lightning_fits["ddp"]
    ours = torch.load(checkpoint_at(lightning_fits["zero1_ddp"], FIT_STEPS), weights_only=False)["optimizer_states"]
    theirs = torch.load(checkpoint_at(ddp, FIT_STEPS), weights_only=False)["optimizer_states"]
    assert_same_optimizer_state(ours, theirs, ddp / "history.pt")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_zero1_ddp_resumes_under_the_other_schedule(lightning_fits, tmp_path: Path) -> None:
    # Resume the reduce_scatter run at step 3 under allreduce_broadcast with the overlap engine: the checkpoint
    # holds the full, unsharded state, so it does not depend on the schedule (nor on the world size).
    run_dir, ddp = lightning_fits["zero1_ddp"], lightning_fits["ddp"]
    resumed = fit(
        tmp_path, "--trainer.strategy", "lightning_ddp.strategies.ZeRO1DDPStrategy",
        "--trainer.strategy.schedule", "allreduce_broadcast", "--trainer.strategy.grad_sync", "overlap_ddp",
        "--ckpt_path", str(checkpoint_at(run_dir, 3)),
    )
    assert_same_weights(resumed, run_dir / "weights.pt", ddp / "history.pt")