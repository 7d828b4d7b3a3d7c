"""An engine's own state in Lightning checkpoints: every rank's saved, each rank's own restored, resume bitwise.

PowerSGD's state (step counter, warm-start ``Q``, and each rank's *own* error feedback ``E``) lives on the engine,
not on the LightningModule whose ``state_dict`` Lightning saves. ``GradSyncStrategy`` gathers every rank's
``engine_state_dict()`` to rank 0 on save (``gather_rank_states``, ZeRO-1's mechanism) and gives each rank its
entry back on resume; a checkpoint from another world size or algorithm, or with no engine state, starts the engine
fresh with a warning.

- ``gather_rank_states`` and the engine-state round trip: one 2-rank spawn;
- the Lightning resume (2-rank fit, compression from step 0, checkpoint after 4 steps, resume to 8 == 8 in one go,
  bitwise; a control resumed without the engine state must differ): another 2-rank spawn, ~30 s on 2 cores.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_ddp.strategies.base import ENGINE_STATES_KEY, engine_state_to_restore
from tests.support.dist_utils import run_on_ranks
from tests.support.equivalence import JOB_TIMEOUT_S, TinyLM
from tests.support.lightning_toy import join_existing_group, tiny_lm_data, tiny_lm_module

# ---- which state a resumed rank takes (pure) ------------------------------------------------------------------

SAVED = {"algorithm": "bucketed_powersgd_ddp", "world_size": 2, "states": [{"_extra_state": "rank 0's"},
                                                                       {"_extra_state": "rank 1's"}]}


def test_each_rank_takes_its_own_entry_when_algorithm_and_world_size_match() -> None:
    assert engine_state_to_restore(SAVED, "bucketed_powersgd_ddp", 2, 1, True) == ({"_extra_state": "rank 1's"}, "")
    assert engine_state_to_restore(SAVED, "bucketed_powersgd_ddp", 2, 0, True) == ({"_extra_state": "rank 0's"}, "")


def test_another_world_size_algorithm_or_none_at_all_drops_the_state_and_says_why() -> None:
    # 4 ranks cannot share out 2 ranks' error buffers: each was its rank's own.
    state, why = engine_state_to_restore(SAVED, "bucketed_powersgd_ddp", 4, 3, True)
    assert state is None and why == ("the checkpoint's engine state was saved by 2 ranks, each its own, and this run "
                                     "has 4; dropped")
    state, why = engine_state_to_restore(SAVED, "bucketed_ddp", 2, 0, False)
    assert state is None and why == ("the checkpoint's engine state was saved by the 'bucketed_powersgd_ddp' "
                                     "algorithm, this run uses 'bucketed_ddp'; dropped")
    state, why = engine_state_to_restore(None, "bucketed_powersgd_ddp", 2, 0, True)  # e.g. a `ddp` checkpoint
    assert state is None and why.startswith("the checkpoint holds no 'bucketed_powersgd_ddp' engine state")
    assert engine_state_to_restore(None, "bucketed_ddp", 2, 0, False) == (None, "")  # nothing saved, nothing to keep


# ---- the gather and the engine's state, on 2 ranks -----------------------------------------------------------


def _gather_and_round_trip(rank: int, world_size: int) -> dict:
    from lightning_ddp.sync import BucketedDDP, Communicator
    from lightning_ddp.sync.bucketed_powersgd import BucketedPowerSGDDDP
    from lightning_ddp.sync.comm import gather_rank_states

    comm = Communicator()
    # Different structures and shapes per rank, plain values among the tensors.
    local = {"step": 3 + rank, "tensors": [torch.full((rank + 1, 2), float(rank)), torch.arange(rank + 2)],
             "name": f"rank {rank}", "nested": {"e": torch.tensor([rank], dtype=torch.float64)}}
    everywhere = gather_rank_states(local, comm, "cpu")
    to_rank_1 = gather_rank_states(local, comm, "cpu", dst=1)

    torch.manual_seed(rank)
    model = TinyLM()
    engine = BucketedPowerSGDDDP(model, rank=1, start_iter=0, min_compression_rate=0)
    tokens = torch.randint(0, 16, (4, 4), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # two compressed steps: E and Q exist
        engine.on_train_batch_start()
        engine(tokens).sum().backward()
        engine.finish_gradient_synchronization()
        model.zero_grad()
    saved = engine.engine_state_dict()
    fresh = BucketedPowerSGDDDP(TinyLM(), rank=1, start_iter=0, min_compression_rate=0)
    fresh_before = fresh.engine_state_dict()
    fresh.load_engine_state_dict(saved)
    try:
        fresh.load_engine_state_dict({})
        wrong_keys = "no error"
    except ValueError as error:
        wrong_keys = str(error)
    return {"everywhere": everywhere, "to_rank_1": to_rank_1, "saved": saved, "restored": fresh.engine_state_dict(),
            "fresh_before": fresh_before, "bucketed_ddp": BucketedDDP(TinyLM()).engine_state_dict(),
            "wrong_keys": wrong_keys}


@pytest.fixture(scope="module")
def gathered() -> list[dict]:
    return run_on_ranks(_gather_and_round_trip, 2, timeout=JOB_TIMEOUT_S)


def _equal(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.multiprocess
def test_gather_rank_states_returns_every_ranks_state_where_asked(gathered) -> None:
    expected = [{"step": 3 + r, "tensors": [torch.full((r + 1, 2), float(r)), torch.arange(r + 2)],
                 "name": f"rank {r}", "nested": {"e": torch.tensor([r], dtype=torch.float64)}} for r in range(2)]
    assert all(_equal(ranks["everywhere"], expected) for ranks in gathered)  # dst=None: on every rank
    assert gathered[0]["to_rank_1"] is None and _equal(gathered[1]["to_rank_1"], expected)  # dst=1: only there


@pytest.mark.multiprocess
def test_engine_state_is_the_powersgd_state_and_round_trips(gathered) -> None:
    for ranks in gathered:
        saved = ranks["saved"]
        assert list(saved) == ["_extra_state"] and saved["_extra_state"]["iteration"] == 2
        assert set(saved["_extra_state"]["errors"]) == {"embed.weight", "fc1.weight", "fc2.weight", "head.weight"}
        assert _equal(ranks["restored"], saved)
        assert ranks["fresh_before"]["_extra_state"]["iteration"] == 0  # so the round trip changed something
        assert ranks["bucketed_ddp"] == {}  # an engine without state of its own
        assert ranks["wrong_keys"].startswith("the engine state has [] but BucketedPowerSGDDDP has ['_extra_state']")
    # Each rank's error is its own (local gradients differ); Q is averaged, the same on both.
    e0, e1 = (r["saved"]["_extra_state"]["errors"]["fc1.weight"] for r in gathered)
    q0, q1 = (r["saved"]["_extra_state"]["qs"]["fc1.weight"] for r in gathered)
    assert not torch.equal(e0, e1) and torch.equal(q0, q1)


# ---- through Lightning: resume is bitwise ------------------------------------------------------------------

STEPS_PER_EPOCH = 4  # 32 samples, 2 ranks, 4 per rank and step
SETTINGS = {"rank": 1, "start_iter": 0, "min_compression_rate": 0}  # every matrix compressed from the first step


def _fit(rank: int, world_size: int, algorithm: str, settings: dict, epochs: int, ckpt_path: str | None,
         checkpoint_dir: str | None) -> dict:
    """2-rank fit of TinyLM for ``epochs`` epochs on the process group run_on_ranks made; weights and warnings."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from lightning_ddp.strategies import GradSyncStrategy

    join_existing_group(rank, world_size)
    data = tiny_lm_data(32)
    callbacks = [] if checkpoint_dir is None else [
        ModelCheckpoint(dirpath=checkpoint_dir, every_n_epochs=1, save_top_k=-1)]  # after each epoch
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=GradSyncStrategy(algorithm=algorithm, engine_settings=settings),
        max_epochs=epochs, logger=False, enable_checkpointing=checkpoint_dir is not None, callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False,
    )
    module = tiny_lm_module(seed=1000 + rank)  # different per rank: the engine broadcasts rank 0's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
    return {"weights": {k: v.detach().clone() for k, v in module.state_dict().items()}, "step": trainer.global_step,
            "warnings": [str(w.message) for w in caught if "fresh" in str(w.message)]}


def _resume_runs(rank: int, world_size: int, tmp: str) -> dict:
    directory = Path(tmp)
    full = _fit(rank, world_size, "bucketed_powersgd_ddp", SETTINGS, 2, None, str(directory / "full"))
    checkpoint = directory / "full" / f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"
    resumed = _fit(rank, world_size, "bucketed_powersgd_ddp", SETTINGS, 2, str(checkpoint), None)
    # The control: the same checkpoint without the engine state (as a `ddp` checkpoint would be).
    control_path = directory / "without_engine_state.ckpt"
    if rank == 0:
        saved = torch.load(checkpoint, weights_only=False)
        saved.pop(ENGINE_STATES_KEY)
        torch.save(saved, control_path)
    dist.barrier()
    control = _fit(rank, world_size, "bucketed_powersgd_ddp", SETTINGS, 2, str(control_path), None)
    # Another algorithm resumes the model and optimizer, and drops PowerSGD's state with a warning.
    bucketed = _fit(rank, world_size, "bucketed_ddp", {}, 2, str(checkpoint), None)
    # Another PowerSGD rank: the saved factors do not fit, so the engine starts fresh, with a warning saying why.
    other_rank = _fit(rank, world_size, "bucketed_powersgd_ddp", {**SETTINGS, "rank": 2}, 2, str(checkpoint), None)
    return {"full": full, "resumed": resumed, "control": control, "bucketed_ddp": bucketed, "other_rank": other_rank,
            "checkpoint": torch.load(checkpoint, weights_only=True)[ENGINE_STATES_KEY]}


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory) -> list[dict]:
    return run_on_ranks(_resume_runs, 2, str(tmp_path_factory.mktemp("powersgd_resume")), timeout=JOB_TIMEOUT_S)


@pytest.mark.multiprocess
def test_the_checkpoint_holds_every_ranks_powersgd_state(resume_runs) -> None:
    saved = resume_runs[0]["checkpoint"]  # weights_only=True loaded it: plain types only
    assert saved["algorithm"] == "bucketed_powersgd_ddp" and saved["world_size"] == 2 and len(saved["states"]) == 2
    states = [s["_extra_state"] for s in saved["states"]]
    assert [s["iteration"] for s in states] == [STEPS_PER_EPOCH] * 2  # saved after epoch 0's 4 steps
    # Rank 1's own error, not a copy of rank 0's: their local gradients differ. (Names are the LightningModule's.)
    assert not torch.equal(states[0]["errors"]["model.fc1.weight"], states[1]["errors"]["model.fc1.weight"])


@pytest.mark.multiprocess
def test_resume_with_the_engine_state_is_bitwise_and_without_it_is_not(resume_runs) -> None:
    for rank, runs in enumerate(resume_runs):
        full, resumed, control = runs["full"], runs["resumed"], runs["control"]
        assert full["step"] == resumed["step"] == control["step"] == 2 * STEPS_PER_EPOCH
        different = [k for k in full["weights"] if not torch.equal(full["weights"][k], resumed["weights"][k])]
        assert different == [], (rank, different)
        assert resumed["warnings"] == [] and full["warnings"] == []
        # Without E and Q (error feedback lost, Q drawn anew) the compressed gradients of steps 5-8 differ: so would
        # the weights of a resume that ignored the saved state. Every matrix is compressed, so each one differs.
        changed = {k for k in full["weights"] if not torch.equal(full["weights"][k], control["weights"][k])}
        assert {"model.fc1.weight", "model.fc2.weight", "model.embed.weight", "model.head.weight"} <= changed, rank
    # The warning, once (rank 0), says what was dropped and what the engine starts with.
    (message,) = resume_runs[0]["control"]["warnings"]
    assert message.startswith("Resuming with a fresh BucketedPowerSGDDDP state: the checkpoint holds no "
                              "'bucketed_powersgd_ddp' engine state"), message
    assert "step counter at 0 (so the start_iter exact steps run again)" in message
    assert resume_runs[1]["control"]["warnings"] == []


@pytest.mark.multiprocess
def test_resuming_under_another_algorithm_drops_the_state_with_a_warning(resume_runs) -> None:
    (message,) = resume_runs[0]["bucketed_ddp"]["warnings"]
    assert message.startswith("Resuming with a fresh BucketedDDP state: the checkpoint's engine state was saved by "
                              "the 'bucketed_powersgd_ddp' algorithm, this run uses 'bucketed_ddp'; dropped"), message
    assert resume_runs[0]["bucketed_ddp"]["step"] == 2 * STEPS_PER_EPOCH


@pytest.mark.multiprocess
def test_resuming_with_another_powersgd_rank_drops_the_state_with_a_warning(resume_runs) -> None:
    (message,) = resume_runs[0]["other_rank"]["warnings"]
    assert message.startswith("Resuming with a fresh BucketedPowerSGDDDP state: the checkpoint's engine state does "
                              "not fit this engine (the PowerSGD state was saved with rank=1, "
                              "min_compression_rate=0.0, but this engine has rank=2"), message
    assert resume_runs[0]["other_rank"]["step"] == 2 * STEPS_PER_EPOCH
