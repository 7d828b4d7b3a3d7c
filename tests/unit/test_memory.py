"""The memory pre-flight's estimate (``lightning_ddp.memory``) against the tensors of real models and steps."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from lightning_ddp import memory
from lightning_ddp.memory import (
    GiB,
    MemoryEstimate,
    MemoryPreflightError,
    activation_bytes_per_token,
    estimate_rank_memory,
    expected_bytes,
    largest_batch,
    memory_budget_bytes,
    preflight,
)
from lightning_ddp.model import GPT, Block, GPTConfig, get_config, rope_cache
from lightning_ddp.memory import gpt_parameter_shapes
from lightning_ddp.sync.memory_model import zero2_buffer_bytes
from lightning_ddp import catalogue


def saved_tensor_bytes(fn, exclude=()) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn()`` runs, ``exclude``'s storages not
    counted (the parameters): how the activation formula was measured (docs/memory.md)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(seen.values())


def parameter_shapes(config: GPTConfig) -> list[tuple[int, ...]]:
    return list(gpt_parameter_shapes(config).values())


def _estimate(config: GPTConfig, **overrides) -> MemoryEstimate:
    kwargs = dict(batch_size=2, seq_len=64, precision="32-true", strategy="bucketed_ddp", world_size=1,
                  device_type="cpu")
    return estimate_rank_memory(config, **{**kwargs, **overrides})


@pytest.mark.parametrize("preset,tie", [("tiny", False), ("small", False), ("tiny", True)])
def test_parameter_shapes_are_the_models_in_order(preset: str, tie: bool) -> None:
    config = get_config(preset, tie_embeddings=tie)
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        model = GPT(config)
    assert parameter_shapes(config) == [tuple(p.shape) for p in model.parameters()]
    xl = parameter_shapes(get_config("xl"))
    assert (len(xl), sum(math.prod(s) for s in xl)) == (435, 1998235200)  # T tensors, Ψ scalars


# ---- activations: the measured per-block formula ---------------------------------------------------------


def _block_saved_bytes_per_token(batch: int, seq: int, d: int, d_ff: int, heads: int, precision: str) -> float:
    config = GPTConfig(d_model=d, d_ff=d_ff, n_layers=1, n_heads=heads, context_length=seq)
    block = Block(config)
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    block = block.to(dtype)
    cos, sin = rope_cache(seq, d // heads, config.rope_theta)
    x = torch.randn(batch, seq, d, dtype=dtype, requires_grad=True)

    def forward():
        if precision == "bf16-mixed":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return block(x, cos, sin)
        return block(x, cos, sin)

    saved = saved_tensor_bytes(forward, exclude=list(block.parameters()))
    if precision == "bf16-mixed":  # the autocast weight copies are estimated apart (low_precision_weights)
        saved -= 2 * sum(p.numel() for p in block.parameters() if p.dim() == 2)
    return saved / (batch * seq)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_block_activation_formula_matches_measurement(precision: str) -> None:
    # The formula in lightning_ddp.memory was fitted to exactly this measurement; shapes other than the fitted
    # ones (d 192 with 3 heads, d_ff 3x instead of 4x) check that it generalises, and batch x seq varies to show
    # it is per token (no T^2 term: CPU's SDPA is a flash kernel, as CUDA's are).
    for batch, seq, d, d_ff, heads in [(2, 64, 128, 512, 4), (1, 128, 192, 576, 3), (3, 32, 256, 1024, 8)]:
        measured = _block_saved_bytes_per_token(batch, seq, d, d_ff, heads, precision)
        formula = activation_bytes_per_token(d, d_ff, precision)
        assert formula == pytest.approx(measured, rel=0.03), (batch, seq, d, d_ff, heads)
    assert activation_bytes_per_token(1600, 6400, "bf16-mixed") == 36 * 1600 + 8 * 6400 + 100 == 108900  # xl block


def test_activations_grow_linearly_in_tokens() -> None:
    config = get_config("small")
    one = _estimate(config, batch_size=1).parts["activations"]
    assert _estimate(config, batch_size=4).parts["activations"] == 4 * one
    assert _estimate(config, batch_size=1, seq_len=128).parts["activations"] == 2 * one


# ---- every tensor category against a real step -------------------------------------------------------------


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# bf16-mixed: ten times the fp32 case's time on CPU (autocast's casts), so in the slow tier; fp32 checks every category
@pytest.mark.parametrize("precision", ["32-true", pytest.param("bf16-mixed", marks=pytest.mark.slow)])
def test_estimate_matches_a_real_bucketed_step_on_the_small_preset(world_of_one, precision: str) -> None:
    # The small preset (129M parameters with vocab 10,000) at batch 1 x 64 tokens, one rank, BucketedDDP with
    # the default 25 MiB cap and AdamW: every tensor category of the estimate within 15 % of what the real
    # tensors hold (the task's tolerance; the parameter, gradient and state categories are exact).
    batch, seq = 1, 64
    config = get_config("small", context_length=seq)
    torch.manual_seed(0)
    model = GPT(config)
    engine = catalogue.get("bucketed_ddp").make_engine(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(config.vocab_size, (batch, seq + 1))
    params = list(model.parameters())
    measured: dict[str, int] = {}

    def forward_and_loss():
        if precision == "bf16-mixed":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = engine(tokens[:, :-1])
        else:
            logits = engine(tokens[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())

    for step in range(2):  # the second step runs on the buffers and state the first created, as in training
        engine.on_train_batch_start()
        if step == 1:
            holder = {}
            measured["saved"] = saved_tensor_bytes(lambda: holder.setdefault("loss", forward_and_loss()), params)
            loss = holder.pop("loss")
        else:
            loss = forward_and_loss()
        loss.backward()
        if step == 1:  # set_to_none dropped last step's views: backward allocated every gradient afresh
            measured["fresh_gradients"] = sum(p.grad.untyped_storage().nbytes() for p in params)
        engine.finish_gradient_synchronization()
        optimizer.step()
        if step == 1:
            buffers = [b.buffer for b in engine._buckets if b.buffer is not None]
            buffer_ptrs = {_storage(b) for b in buffers}
            measured["bucket_buffers"] = sum(b.numel() * b.element_size() for b in buffers)
            measured["viewed"] = sum(p.grad.numel() * 4 for p in params if _storage(p.grad) in buffer_ptrs)
            measured["own_gradients"] = sum(p.grad.numel() * 4 for p in params if _storage(p.grad) not in buffer_ptrs)
            measured["optimizer_state"] = sum(
                v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
            )
        optimizer.zero_grad(set_to_none=True)

    est = _estimate(config, batch_size=batch, seq_len=seq, precision=precision).parts
    n_params = sum(p.numel() for p in params)
    assert est["parameters"] == 4 * n_params
    # The .grad tensors backward allocates are the estimate's gradients plus regrown gradients (4 bytes each).
    assert est["gradients"] + est["regrown_gradients"] == measured["fresh_gradients"] == 4 * n_params
    assert est["regrown_gradients"] == measured["viewed"]
    assert est["gradients"] == measured["own_gradients"]
    assert est["bucket_buffers"] == measured["bucket_buffers"]
    assert est["optimizer_state"] == measured["optimizer_state"]
    # Saved tensors: the activations, less what is alive but not saved (the fp32 logits and, later, their
    # gradient: 8 bytes x vocab per token; the half logits under autocast: 2 more), plus the weight copies.
    tokens_n = batch * seq
    not_saved = (8 + (2 if precision == "bf16-mixed" else 0)) * config.vocab_size * tokens_n
    expected_saved = est["activations"] - not_saved + est["low_precision_weights"]
    assert expected_saved == pytest.approx(measured["saved"], rel=0.15)


# ---- strategies, precision, sharding ------------------------------------------------------------------------


def test_buffers_and_phases_per_strategy() -> None:
    config = get_config("tiny")
    psi4 = 4 * sum(math.prod(s) for s in parameter_shapes(config))
    naive = _estimate(config, strategy="naive_ddp").parts
    assert naive["bucket_buffers"] == 0 and naive["gradients"] == psi4 and naive["regrown_gradients"] == 0
    # torch DDP: the reducer's buckets are separate from .grad (gradient_as_bucket_view off) and persistent.
    ddp = _estimate(config, strategy="ddp", world_size=2)
    assert ddp.parts["bucket_buffers"] == psi4 and ddp.parts["gradients"] == psi4
    assert "bucket_buffers" not in {name for phase in ddp.phases for name in phase}
    # flat: the packed buffer exists only during the sync, with the gradients (the step's phase).
    flat = _estimate(config, strategy="flat_ddp")
    assert flat.parts["bucket_buffers"] == psi4 and "bucket_buffers" in flat.phases[1]
    # overlap: one tensor per bucket; only the last bucket (the embedding, 10,000 x 128) has a buffer, + sentinel.
    overlap = _estimate(config, strategy="overlap_ddp").parts
    assert overlap["bucket_buffers"] == 4 * (10_000 * 128 + 1)
    assert overlap["regrown_gradients"] == 4 * 10_000 * 128
    # bucketed with one unbounded bucket: every gradient is a view, so all of them regrow under set_to_none.
    one = _estimate(config, strategy="bucketed_ddp", bucket_size_mb=None).parts
    assert one["bucket_buffers"] == psi4 + 4 and one["regrown_gradients"] == psi4 and one["gradients"] == 0


def test_zero1_shards_the_state_like_the_benchmarks_expectation() -> None:
    config = get_config("small")
    shapes = parameter_shapes(config)
    sharded = _estimate(config, strategy="zero1_ddp", world_size=2).parts["optimizer_state"]
    per_rank = [expected_bytes(shapes, 2, "reduce_scatter", r)["optimizer_state"] for r in range(2)]
    assert sharded == max(per_rank)  # the pre-flight must fit the more loaded rank
    unsharded = _estimate(config, strategy="bucketed_ddp", world_size=2).parts["optimizer_state"]
    assert unsharded == expected_bytes(shapes, 2, "unsharded", 0)["optimizer_state"]
    assert sharded < 0.55 * unsharded  # greedy balance: within a few percent of half


def test_bf16_true_halves_the_weight_categories() -> None:
    config = get_config("small")
    full, half = _estimate(config).parts, _estimate(config, precision="bf16-true").parts
    assert half["parameters"] * 2 == full["parameters"]
    assert half["low_precision_weights"] == 0  # no autocast copies: the weights are already bf16
    mixed = _estimate(config, precision="bf16-mixed").parts
    # bf16-mixed: a 2-byte copy of every matmul weight (all 2-D parameters but the token embedding).
    matmul = sum(math.prod(s) for s in parameter_shapes(config) if len(s) == 2) - config.vocab_size * config.d_model
    assert mixed["low_precision_weights"] == 2 * matmul


def test_peak_is_persistent_parts_plus_the_larger_phase() -> None:
    e = MemoryEstimate({"parameters": 10, "activations": 5, "low_precision_weights": 1, "gradients": 4,
                        "regrown_gradients": 3}, phases=(("activations", "low_precision_weights"),
                                                         ("gradients", "regrown_gradients")))
    assert e.total_bytes == 10 + max(5 + 1, 4 + 3) == 17
    assert sum(e.parts.values()) == 23 and "sum of parts" in e.table()  # every part at once: listed, not the peak
    assert MemoryEstimate({"parameters": 10, "activations": 5}).total_bytes == 15  # no phases: all at once
    assert MemoryEstimate({"parameters": 2 * GiB, "activations": GiB // 2}).table().splitlines() == [
        "parameters             2.00 GiB", "activations            0.50 GiB", "peak per rank          2.50 GiB"]


def test_largest_batch_is_the_boundary() -> None:
    config = get_config("small", context_length=128)
    kw = dict(seq_len=128, precision="32-true", strategy="ddp", world_size=2, device_type="cpu")
    budget = 4 * GiB
    best = largest_batch(config, budget_bytes=budget, **kw)
    assert best >= 1
    assert estimate_rank_memory(config, batch_size=best, **kw).total_bytes <= budget
    assert estimate_rank_memory(config, batch_size=best + 1, **kw).total_bytes > budget
    assert largest_batch(config, budget_bytes=GiB // 2, **kw) == 0  # the fp32 weights and state alone are 1.5 GiB


def test_preflight_message_has_breakdown_budget_and_fixes() -> None:
    estimate = _estimate(get_config("small"))
    kwargs = dict(batch_size=2, seq_len=64, precision="32-true", strategy="bucketed_ddp", world_size=1,
                  device_type="cpu")
    preflight(get_config, "small", estimate.total_bytes, "test", **kwargs)  # exactly the budget fits
    with pytest.raises(MemoryPreflightError) as info:
        preflight(get_config, "small", estimate.total_bytes - 1, "test", **kwargs)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    for needle in ("this run would run out of memory: it needs about", "optimizer_state", "peak per rank", "Fixes:",
                   "--data.batch_size 1 (peak"):
        assert needle in message


def test_memory_budget_cpu_is_available_ram_over_ranks(monkeypatch) -> None:
    monkeypatch.setattr(memory, "_available_ram_bytes", lambda: 24 * GiB)
    assert memory_budget_bytes("cpu", 2) == 12 * GiB


def test_memory_budget_cuda_is_what_is_free_on_the_current_device(monkeypatch) -> None:
    # No GPU here: a fake torch.cuda whose current device is 1, an 80 GiB card of which another process holds 10:
    # 70 GiB free, shared by 2 ranks -> 35 GiB each (the card's total would promise 40 and run out of memory).
    free = {1: (70 * GiB, 80 * GiB)}
    fake = SimpleNamespace(is_available=lambda: True, current_device=lambda: 1, mem_get_info=lambda index: free[index])
    monkeypatch.setattr(torch, "cuda", fake)
    assert memory_budget_bytes("cuda", 2) == 35 * GiB


def test_bad_inputs_name_the_fix() -> None:
    config = get_config("tiny")
    with pytest.raises(ValueError, match="--trainer.strategy"):
        _estimate(config, strategy="fsdp")
    with pytest.raises(ValueError, match="--trainer.precision"):
        _estimate(config, precision="transformer-engine")
    with pytest.raises(ValueError, match="batch_size"):
        _estimate(config, batch_size=0)
    with pytest.raises(ValueError, match="ranks_per_device"):
        memory_budget_bytes("cpu", 0)


def test_expected_bytes_per_mode() -> None:
    shapes = [(4, 4), (4,)]
    assert expected_bytes(shapes, 2, "unsharded", 1) == {"parameters": 80, "gradients": 80, "optimizer_state": 168}
    # rank 1 owns the (4,) vector: its state, and under zero2 only its gradient
    assert expected_bytes(shapes, 2, "reduce_scatter", 1) == {"parameters": 80, "gradients": 80,
                                                              "optimizer_state": 36}
    assert expected_bytes(shapes, 2, "zero2", 1) == {"parameters": 80, "gradients": 16, "optimizer_state": 36}
    # fsdp2: rank 1 holds row 2 of (3, 2) and rows 2..3 of (4,)
    assert expected_bytes([(3, 2), (4,)], 2, "fully_sharded", 1) == {"parameters": 16, "gradients": 16,
                                                                      "optimizer_state": 40}


def test_the_published_xl_configuration_and_small_cases() -> None:
    # configs/xl_2gpu.yaml's run (docs/memory.md): 7.44 x 2 + 14.89 + 1.5 overhead + max(10.26 + 3.69, 7.44 x 2)
    xl = estimate_rank_memory(get_config("xl", context_length=512), batch_size=4, seq_len=512,
                              precision="bf16-mixed", strategy="bucketed_ddp", world_size=2, bucket_size_mb=100)
    assert (round(xl.parts["optimizer_state"] / GiB, 2), round(xl.parts["activations"] / GiB, 1)) == (14.89, 10.3)
    assert round(xl.total_bytes / GiB, 1) == 45.2
    assert memory.fsdp2_groups(get_config("tiny")) == (2560128, [262400] * 4)  # of 3.61M in all
    # ZeRO-2's gradient peak: rank 1's 16-byte shard plus 3 caps of 64 bytes
    shard = expected_bytes([(4, 4), (4,)], 2, "zero2", 1)["gradients"]
    assert shard + zero2_buffer_bytes(64, memory.FP32 * 20) == 208
    shapes = gpt_parameter_shapes(SimpleNamespace(d_model=8, d_ff=32, n_layers=1, vocab_size=50,
                                                  tie_embeddings=False))
    assert (shapes["blocks.0.ffn.w1.weight"], len(shapes)) == ((32, 8), 12)  # 1 + 9 per block + 2
