"""ZeRO-2 (``ZeRO2DDP`` + ``ShardedOptimizer(schedule="reduce_in_backward")``) and clipping under sharding, in fp64.

The argument is the equivalence matrix's (``tests.support.equivalence``): with the global batch of 12 split evenly
over 2 or 3 ranks and the loss a mean over the local batch, the average of the local gradients is the full-batch
gradient, so N ranks must end where one process training plain AdamW on all 12 samples ends. In fp64 the only
difference left is the association of the batch sums (and, with clipping, of the norm's sum), ~1e-16 relative, so
the tolerance is 1e-10: a wrong update (a parameter skipped, stepped twice, a rank's gradient missing, clipping by a
local instead of the global norm) moves a weight by ~lr * 1e-2 or more.

Clipping: ``gradient_clip_val`` 0.05 by norm (the gradients' global norm is ~1, measured in the reference and
checked > 0.05 so the clip is active) and 0.01 by value, for ZeRO-2 and for ZeRO-1 under both schedules, against
one process calling ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``.

The model has every corner ZeRO-2 must handle: a tied embedding/head, a frozen layer, a layer never called (no rank
has its gradient: AdamW must skip it) and, with ``accumulation``, two micro-batches (the first under ``no_sync``).

One spawned job per world size (2, then 3) runs every configuration; the 3-rank job also resumes from the 2-rank
job's checkpoint (consolidated optimizer state): a checkpoint of N ranks resumes under M, and, in the parent, under a
plain AdamW in one process (what ``ddp`` would load).
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_ddp.sync import BucketedDDP, DeferredGradSync, Recorder, ShardedOptimizer
from lightning_ddp.sync.zero2 import ZeRO2DDP
from tests.support.cli_utils import checkpoint_at
from tests.support.dist_utils import DEFAULT_TIMEOUT_S, run_on_ranks
from tests.support.lightning_fits import assert_same_weights, fit

pytestmark = pytest.mark.multiprocess

GLOBAL_BATCH = 12  # splits over 1, 2, 3 ranks
STEPS = 3
MODEL_SEED = 4321
LR, WEIGHT_DECAY = 1e-2, 0.1
NORM_CLIP, VALUE_CLIP = 0.05, 0.01
TOL = dict(rtol=1e-10, atol=1e-12)
VOCAB, SEQ, DIM = 16, 4, 8
BUCKET_BYTES = 1200  # a few buckets for this fp64 model (fc1.weight alone is 2048 B: a bucket of its own)
MEMORY_BUCKET_BYTES = 2200  # fc2's bias (64 B) and weight (2048 B) share a bucket: the bias waits for the weight
JOB_TIMEOUT_S = DEFAULT_TIMEOUT_S  # a bound on a hang, not on speed


class TiedNet(nn.Module):
    """fp64: tied embedding/head (16x8), an MLP (fc1 32x8, fc2 8x32, biases), a frozen ``extra`` 8x8 and ``unused``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)
        self.extra = nn.Linear(DIM, DIM)
        self.unused = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.extra.requires_grad_(False)
        self.double()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return self.head(h + self.extra(h))


@dataclass(frozen=True)
class Config:
    kind: str  # zero2 | zero1_reduce_scatter | zero1_allreduce_broadcast
    collectives: str = "auto"
    clip: tuple[str, float] | None = None  # (algorithm, limit)
    micro_batches: int = 1
    bf16: bool = False


CONFIGS = {
    "zero2_per_owner": Config("zero2", "per_owner"),
    "zero2_native": Config("zero2", "native"),
    "zero2_accumulation": Config("zero2", micro_batches=2),
    "zero2_bf16": Config("zero2", bf16=True),
    "zero2_clip_norm": Config("zero2", "per_owner", clip=("norm", NORM_CLIP)),
    "zero2_clip_norm_native": Config("zero2", "native", clip=("norm", NORM_CLIP)),
    "zero2_clip_value": Config("zero2", clip=("value", VALUE_CLIP)),
    "zero1_reduce_scatter_clip_norm": Config("zero1_reduce_scatter", clip=("norm", NORM_CLIP)),
    "zero1_allreduce_broadcast_clip_norm": Config("zero1_allreduce_broadcast", clip=("norm", NORM_CLIP)),
    "zero1_reduce_scatter_clip_value": Config("zero1_reduce_scatter", clip=("value", VALUE_CLIP)),
}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    x = torch.randint(VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    return x, torch.randint(VOCAB, (GLOBAL_BATCH, SEQ), generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, bf16: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
        logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1).double(), y.flatten())


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _build(seed: int) -> TiedNet:
    torch.manual_seed(seed)
    return TiedNet()


def _engine_and_optimizer(config: Config, model: nn.Module) -> tuple[nn.Module, ShardedOptimizer]:
    if config.kind == "zero2":
        engine = ZeRO2DDP(model, bucket_size_mb=BUCKET_BYTES / 2**20, collectives=config.collectives)
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, schedule="reduce_in_backward",
                                     collectives=config.collectives, placement=engine.owner_of, lr=LR,
                                     weight_decay=WEIGHT_DECAY)
        return engine, optimizer
    schedule = config.kind.removeprefix("zero1_")
    engine = DeferredGradSync(model) if schedule == "reduce_scatter" else BucketedDDP(model, BUCKET_BYTES / 2**20)
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, schedule=schedule, lr=LR,
                                 weight_decay=WEIGHT_DECAY)
    return engine, optimizer


def _request_clip(optimizer: ShardedOptimizer, clip: tuple[str, float] | None) -> None:
    if clip is not None:  # what the strategies' routed precision plugin does when Lightning clips
        (optimizer.clip_grad_norm_ if clip[0] == "norm" else optimizer.clip_grad_value_)(clip[1])


def _train(rank: int, world_size: int, engine, optimizer, config: Config, steps: range, probe=None) -> list:
    per_rank = GLOBAL_BATCH // world_size
    norms = []
    for step in steps:
        x, y = _batch(step)
        xs = x[rank * per_rank : (rank + 1) * per_rank].chunk(config.micro_batches)
        ys = y[rank * per_rank : (rank + 1) * per_rank].chunk(config.micro_batches)
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            engine.on_train_batch_start()
            last = i == config.micro_batches - 1
            with contextlib.nullcontext() if last else engine.no_sync():
                (_loss(engine, xm, ym, config.bf16) / config.micro_batches).backward()
        engine.finish_gradient_synchronization()
        if probe is not None:
            probe(step)
        _request_clip(optimizer, config.clip)
        optimizer.step()
        norms.append(None if optimizer.last_grad_norm is None else optimizer.last_grad_norm.item())
        optimizer.zero_grad()
    return norms


def _sharded_run(rank: int, world_size: int, name: str) -> dict:
    config = CONFIGS[name]
    model = _build(MODEL_SEED + rank)  # the engine broadcasts rank 0's weights
    engine, optimizer = _engine_and_optimizer(config, model)
    recorder = Recorder()
    engine.recorder = optimizer.recorder = recorder
    recorder.open_step(0)
    norms = _train(rank, world_size, engine, optimizer, config, range(STEPS))
    ops = [c.op for c in recorder.finish_step().collectives]  # every step, as one record: presence of each op
    return {"weights": _weights(model), "norms": norms, "ops": sorted(set(ops))}


def _memory_run(rank: int, world_size: int) -> dict:
    """After backward: which gradients a rank holds, and the most local gradient bytes and send buffers seen during it."""
    model = _build(MODEL_SEED)
    # `unused` never gets a gradient, so its bucket (the first: buckets run in reverse parameter order) would only
    # launch at finish_gradient_synchronization, holding back every later bucket (strict order): frozen here, the
    # buckets launch as backward fills them, which is the bound this run checks.
    model.unused.requires_grad_(False)
    engine = ZeRO2DDP(model, bucket_size_mb=MEMORY_BUCKET_BYTES / 2**20, buckets_in_flight=1)
    peak = {"local_bytes": 0, "in_flight": 0}

    def watch(param: torch.Tensor) -> None:  # registered after the engine's hooks: sees the state right after them
        shards = {t.untyped_storage().data_ptr() for t in engine.shards.values()}  # this step's, so far
        local = sum(p.grad.nbytes for p in engine.params
                    if p.grad is not None and p.grad.untyped_storage().data_ptr() not in shards)
        peak["local_bytes"] = max(peak["local_bytes"], local)
        peak["in_flight"] = max(peak["in_flight"], len(engine._in_flight))

    for p in engine.params:
        p.register_post_accumulate_grad_hook(watch)
    recorder = Recorder()
    engine.recorder = recorder
    recorder.open_step(0)
    x, y = _batch(0)
    per_rank = GLOBAL_BATCH // world_size
    _loss(engine, x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank], False).backward()
    engine.finish_gradient_synchronization()
    record = recorder.finish_step()
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        "holding": sorted(names[id(p)] for p in engine.params if p.grad is not None),
        "owned": sorted(names[id(p)] for p in engine.params if engine.owner_of(p) == rank),
        "grad_bytes": sum(p.grad.nbytes for p in engine.params if p.grad is not None),
        "shard_bytes": engine.shard_bytes,
        "shards_kept_by_engine": len(engine.shards),  # none: the owned .grad views hold this step's shard
        "param_bytes": sum(p.nbytes for p in engine.params),
        "largest_param": max(p.nbytes for p in engine.params),
        "peak": peak,
        "buckets": len(engine.bucket_indices),
        "exposed_spans": len(record.exposed),
    }


def _checkpoint_run(rank: int, world_size: int, resume_from: bytes | None) -> dict:
    """Without ``resume_from``: 2 zero2 steps, then the checkpoint (model + consolidated optimizer state) as bytes.
    With it: load it (saved by another world size) into a fresh zero2 run and train steps 2..STEPS+1."""
    config = CONFIGS["zero2_clip_norm"]
    out: dict = {}
    if resume_from is None:
        model = _build(MODEL_SEED)
        engine, optimizer = _engine_and_optimizer(config, model)
        _train(rank, world_size, engine, optimizer, config, range(2))
        state = optimizer.state_dict()  # a collective: every rank gets the consolidated state
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": state}, buffer)
        out["checkpoint"] = buffer.getvalue() if rank == 0 else None
    else:
        checkpoint = torch.load(io.BytesIO(resume_from), weights_only=False)
        model = _build(MODEL_SEED + 7 + rank)  # other weights: the load must bring the saved ones back
        model.load_state_dict(checkpoint["model"])
        engine, optimizer = _engine_and_optimizer(config, model)
        optimizer.load_state_dict(checkpoint["optimizer"])
        _train(rank, world_size, engine, optimizer, config, range(2, 4))
        out["resumed"] = _weights(model)
    return out


def _job(rank: int, world_size: int, resume_from: bytes | None) -> dict:
    results: dict = {"runs": {}}
    for name in CONFIGS:
        try:
            results["runs"][name] = _sharded_run(rank, world_size, name)
        except Exception as error:  # name the configuration in the traceback the parent shows
            raise RuntimeError(f"configuration {name} failed on rank {rank}") from error
    results["memory"] = _memory_run(rank, world_size)
    results["checkpoint"] = _checkpoint_run(rank, world_size, resume_from)
    return results


def _reference(config: Config, steps: range = range(STEPS), model=None, optimizer=None) -> dict:
    """One process, the full batch, plain AdamW and torch's own clipping."""
    if model is None:
        model = _build(MODEL_SEED)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    norms = []
    for step in steps:
        x, y = _batch(step)
        _loss(model, x, y, config.bf16).backward()
        params = [p for p in model.parameters() if p.grad is not None]
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in params]).item())
        if config.clip is not None:
            if config.clip[0] == "norm":
                torch.nn.utils.clip_grad_norm_(params, config.clip[1])
            else:
                torch.nn.utils.clip_grad_value_(params, config.clip[1])
        optimizer.step()
        optimizer.zero_grad()
    return {"weights": _weights(model), "norms": norms, "model": model, "optimizer": optimizer}


@pytest.fixture(scope="module")
def two() -> list[dict]:
    return run_on_ranks(_job, 2, None, timeout=JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def three(two) -> list[dict]:
    return run_on_ranks(_job, 3, two[0]["checkpoint"]["checkpoint"], timeout=JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def jobs(two, three) -> dict[int, list[dict]]:
    return {2: two, 3: three}


def _assert_close(actual: dict, expected: dict, what: str, tol: dict = TOL) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], **tol, msg=lambda m: f"{what} {key}: {m}")


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_sharded_run_matches_one_process_in_fp64(jobs, world_size: int, name: str) -> None:
    config = CONFIGS[name]
    reference = _reference(config)
    # bf16 autocast rounds each matmul to 8 mantissa bits, differently for a batch of 4 or 6 than of 12.
    tol = dict(rtol=1e-3, atol=2e-3) if config.bf16 else TOL
    runs = [r["runs"][name] for r in jobs[world_size]]
    for rank, run in enumerate(runs):
        _assert_close(run["weights"], reference["weights"], f"{name} rank {rank}/{world_size}", tol)
        assert all(torch.equal(v, runs[0]["weights"][k]) for k, v in run["weights"].items()), rank  # sent, not recomputed
    if config.clip is not None and config.clip[0] == "norm":
        # The clip was active (so equality proves the global norm was used) and every rank clipped by the same norm,
        # the reference's.
        assert min(reference["norms"]) > 10 * NORM_CLIP, reference["norms"]
        for run in runs:
            torch.testing.assert_close(run["norms"], reference["norms"], rtol=1e-10, atol=0.0)


def test_clipping_changes_the_result(jobs) -> None:
    # Without clipping the same run ends elsewhere: the clipped comparisons above could not pass by accident.
    plain = jobs[2][0]["runs"]["zero2_per_owner"]["weights"]
    for name in ("zero2_clip_norm", "zero2_clip_value"):
        clipped = jobs[2][0]["runs"][name]["weights"]
        assert max((plain[k] - clipped[k]).abs().max().item() for k in plain) > 1e-4, name


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_of_each_implementation(jobs, world_size: int) -> None:
    runs = jobs[world_size][0]["runs"]
    assert runs["zero2_per_owner"]["ops"] == ["broadcast", "reduce"]
    assert "all_gather" in runs["zero2_native"]["ops"] and "broadcast" not in runs["zero2_native"]["ops"]
    # Clipping by norm adds one scalar all-reduce per step (the squared norms of the owned gradients).
    assert runs["zero2_clip_norm"]["ops"] == ["all_reduce", "broadcast", "reduce"]
    assert runs["zero2_clip_value"]["ops"] == ["broadcast", "reduce"]  # elementwise: nothing to agree on


@pytest.mark.parametrize("world_size", [2, 3])
def test_after_backward_a_rank_holds_only_its_owned_gradients(jobs, world_size: int) -> None:
    memories = [r["memory"] for r in jobs[world_size]]
    for memory in memories:
        assert memory["holding"] == memory["owned"]  # every non-owned .grad is None
        # Owned gradient bytes are the shard, which greedy balance keeps within one tensor of Ψ/N, so within Ψ/N plus
        # one bucket (every tensor here fits the cap).
        assert memory["grad_bytes"] == memory["shard_bytes"] and memory["shards_kept_by_engine"] == 0
        bound = memory["param_bytes"] / world_size + MEMORY_BUCKET_BYTES
        assert memory["grad_bytes"] <= bound, (memory["grad_bytes"], bound)
        # During backward: at most buckets_in_flight (1) send buffers, and local gradients outside the shard of at
        # most the bucket filling plus the one being launched.
        assert memory["peak"]["in_flight"] == 1
        # fc2.bias's gradient waits (64 B) for fc2.weight's; none lingers once its bucket launched.
        assert 0 < memory["peak"]["local_bytes"] <= MEMORY_BUCKET_BYTES
        # Every bucket launches during backward here; with one allowed in flight, launching buckets 2..n each waits
        # for the one before (an exposed span each), and finish_gradient_synchronization is one more.
        assert memory["exposed_spans"] == memory["buckets"] >= 3
    owned = [name for memory in memories for name in memory["owned"]]
    assert len(owned) == len(set(owned))  # each gradient on exactly one rank


def test_checkpoint_of_two_ranks_resumes_under_three_and_under_plain_adamw(jobs) -> None:
    config = CONFIGS["zero2_clip_norm"]
    uninterrupted = _reference(config, range(4))
    for rank, r in enumerate(jobs[3]):
        _assert_close(r["checkpoint"]["resumed"], uninterrupted["weights"], f"3 ranks resumed, rank {rank}")
    # Under one process with plain AdamW (what `ddp` loads): the consolidated state is torch's own format.
    checkpoint = torch.load(io.BytesIO(jobs[2][0]["checkpoint"]["checkpoint"]), weights_only=False)
    model = _build(MODEL_SEED + 99)
    model.load_state_dict(checkpoint["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    optimizer.load_state_dict(checkpoint["optimizer"])
    resumed = _reference(config, range(2, 4), model, optimizer)
    _assert_close(resumed["weights"], uninterrupted["weights"], "plain AdamW resumed")


# ---- through Lightning: tests.support.lightning_fits, against ddp ------------------------------------------


def test_zero2_ddp_and_zero1_ddp_clip_like_lightning_ddp(lightning_fits) -> None:
    # Lightning clips ddp's all-reduced gradients with torch's clip_grad_norm_; the sharded strategies hand the
    # clipping to their optimizers, which clip the owned averages by the global norm: the same weights.
    ddp = lightning_fits["ddp"]
    for name in ("zero2_ddp", "zero1_ddp"):
        assert_same_weights(lightning_fits[name] / "weights.pt", ddp / "weights.pt", ddp / "history.pt")


@pytest.mark.slow
def test_zero2_ddp_checkpoint_resumes_under_ddp(lightning_fits, tmp_path) -> None:
    # The zero2 checkpoint holds the consolidated (unsharded) optimizer state: Lightning's ddp resumes it exactly.
    run_dir, ddp = lightning_fits["zero2_ddp"], lightning_fits["ddp"]
    resumed = fit(tmp_path, "--trainer.strategy", "ddp", "--ckpt_path", str(checkpoint_at(run_dir, 3)))
    assert_same_weights(resumed, run_dir / "weights.pt", ddp / "history.pt")  # the runs' gradients: ddp's


def test_reduce_in_backward_needs_the_engines_placement(world_of_one) -> None:
    # Without the engine's owners the optimizer would step parameters whose averaged gradients another rank holds.
    with pytest.raises(ValueError, match="placement=engine.owner_of"):
        ShardedOptimizer([nn.Parameter(torch.zeros(2))], torch.optim.AdamW, schedule="reduce_in_backward")
    with pytest.raises(ValueError, match="buckets_in_flight"):
        ZeRO2DDP.check_settings(buckets_in_flight=0)
