"""Tests for lightning_ddp.module: what validation and test log (one process; the 2-rank runs are in tests/dist)."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch

from lightning_ddp.data import LMDataModule
from lightning_ddp.module import LitGPT


def _model_and_data(**data_kwargs) -> tuple[LitGPT, LMDataModule]:
    torch.manual_seed(0)
    data = LMDataModule(source="markov", vocab_size=64, seq_len=8, num_samples=16, batch_size=4, **data_kwargs)
    return LitGPT(preset="tiny", vocab_size=64, context_length=8), data


def _trainer() -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)


@pytest.mark.parametrize(("stage", "kwargs"), [("val", dict(val_samples=10)), ("test", dict(test_samples=10))])
def test_eval_loss_is_the_mean_over_every_held_out_token_and_ppl_its_exp(stage, kwargs):
    model, data = _model_and_data(**kwargs)
    run = _trainer().validate if stage == "val" else _trainer().test
    (metrics,) = run(model, datamodule=data)
    # 10 samples in batches of 4, 4 and 2: the mean over the 80 tokens weighs the last batch half, not a third.
    dataset = getattr(data, f"{stage}_dataset")
    with torch.no_grad():
        per_sample = [model._loss((x[None], y[None])).item() for x, y in (dataset[i] for i in range(10))]
    expected = sum(per_sample) / 10  # every sample has 8 tokens: the token mean is the sample mean
    assert metrics[f"{stage}/loss"] == pytest.approx(expected, rel=1e-5)
    # An untrained model predicts nearly uniformly over the 64 tokens: ln 64 = 4.16.
    assert abs(expected - math.log(64)) < 0.5
    # Perplexity of the mean loss, not the mean of per-batch perplexities (which is larger, by Jensen).
    assert metrics[f"{stage}/ppl"] == pytest.approx(math.exp(metrics[f"{stage}/loss"]), rel=1e-5)


def test_validation_does_not_count_towards_the_next_training_batchs_throughput():
    model, _ = _model_and_data()
    model._last_batch_end = 123.0  # a training batch just ended
    model.on_validation_start()
    assert model._last_batch_end is None  # the next batch logs no tokens/s rather than one spanning the validation


def test_an_unknown_lr_schedule_is_refused_from_python_too():
    with pytest.raises(ValueError, match=r"lr_schedule='cosin' is not supported; use 'constant' or 'cosine'"):
        LitGPT(lr_schedule="cosin")
