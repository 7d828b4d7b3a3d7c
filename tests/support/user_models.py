"""What a user of the CommTimer brings: their own small Transformer LM as a LightningModule (nothing in it knows about
lightning_ddp), a variant that shards itself with FSDP2 in ``configure_model`` (how Lightning's
``ModelParallelStrategy`` is used), and a logger that keeps what it is given. For fits inside a ``run_on_ranks`` job.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger
from torch import nn

VOCAB, SEQ_LEN, D_MODEL = 32, 8, 16
LR, MOMENTUM = 0.1, 0.9
"""The user's SGD."""


class UserTransformerLM(pl.LightningModule):
    """Embedding, two ``nn.TransformerEncoderLayer`` (causal, no dropout) and a head; SGD with momentum.

    Args:
        comm_hook: Register torch's ``fp16_compress_hook`` on the DDP model at ``on_train_start``, as a user who
            halves DDP's bytes would.
    """

    def __init__(self, comm_hook: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank and in every fit
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        layer = nn.TransformerEncoderLayer(D_MODEL, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(D_MODEL, VOCAB)
        self.comm_hook = comm_hook

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.encoder(self.embed(tokens), mask=mask, is_causal=True))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        return nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())

    def tokens_per_batch(self, batch: Any) -> int:
        return batch[0].numel()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

    def on_train_start(self) -> None:
        if self.comm_hook:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            self.trainer.strategy.model.register_comm_hook(None, default_hooks.fp16_compress_hook)


class ShardedUserTransformerLM(UserTransformerLM):
    """The same model, sharded by the user with FSDP2 over the data-parallel dimension of Lightning's mesh."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.encoder.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)


def user_data(samples: int = 24) -> torch.utils.data.TensorDataset:
    """Random (tokens, next tokens) sequences, the same on every rank."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (samples, SEQ_LEN + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


class KeptMetrics(Logger):
    """A logger that keeps every ``log_metrics`` call: ``logged[step] = metrics``."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "kept"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.setdefault(step, {}).update(metrics)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a sharded one gathered: a collective), as CPU copies by name."""
    weights = {}
    for name, tensor in module.state_dict().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        weights[name] = full.detach().cpu().clone()
    return weights


MODEL_PARALLEL = "model_parallel"
"""Lightning's ``ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)`` with the user's own
``fully_shard`` (``ShardedUserTransformerLM``), beside the names ``trainer.strategy`` takes."""
STEPS = 3


def _fit(name: str, accelerator: str, world_size: int, timed: bool, comm_hook: bool = False) -> dict:
    """One fit of the user's model under strategy ``name`` on ``world_size`` devices, inside a ``run_on_ranks`` job:
    its weights and, ``timed``, what ``CommTimer(every_n_steps=1)`` handed the logger and its collectives by group."""
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader

    from lightning_ddp.callbacks import CommTimer
    from lightning_ddp.metrics.recording import call_table

    if name == MODEL_PARALLEL:
        strategy: Any = ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
        module: UserTransformerLM = ShardedUserTransformerLM()
    else:
        strategy, module = name, UserTransformerLM(comm_hook=comm_hook)
    logger = KeptMetrics()
    timer = CommTimer(every_n_steps=1, warmup_steps=1)
    trainer = pl.Trainer(accelerator=accelerator, devices=world_size, strategy=strategy, max_steps=STEPS,
                         logger=logger if timed else False, callbacks=[timer] if timed else [],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir="logs")
    trainer.fit(module, DataLoader(user_data(), batch_size=4))
    return {"weights": full_weights(module), "logged": logger.logged,
            "calls": [(row["group"], row["op"]) for row in call_table(timer._calls)] if timed else [],
            "tensors": sum(1 for p in module.parameters() if p.requires_grad)}


def fits_with_and_without_the_timer(rank: int, world_size: int, names: list[str], accelerator: str) -> dict:
    """Spawned (``run_on_ranks``): per strategy of ``names``, a fit without the timer and the same fit with it;
    whether the weights are bitwise equal, and the timed fit's logged metrics and collectives. Then ``ddp`` with the
    user's own fp16 comm hook, timed, under ``ddp_fp16_hook``, and on CPU a short run with the timer's defaults
    (``short_run``)."""
    from tests.support.lightning_toy import join_existing_group

    join_existing_group(rank, world_size)
    results = {}
    for name in names:
        plain = _fit(name, accelerator, world_size, timed=False)
        timed = _fit(name, accelerator, world_size, timed=True)
        same_names = plain["weights"].keys() == timed["weights"].keys()
        equal = same_names and all(torch.equal(plain["weights"][key], value) for key, value in timed["weights"].items())
        results[name] = {"bitwise_equal": equal, "logged": timed["logged"], "calls": timed["calls"],
                         "tensors": timed["tensors"]}
    hooked = _fit("ddp", accelerator, world_size, timed=True, comm_hook=True)
    results["ddp_fp16_hook"] = {"logged": hooked["logged"], "calls": hooked["calls"]}
    if accelerator == "cpu":
        results["short_run"] = short_run_with_the_defaults(world_size)
    return results


def short_run_with_the_defaults(world_size: int) -> dict:
    """30 steps of ``ddp`` with ``CommTimer()`` as a script adds it, Lightning's default ``log_every_n_steps`` (50)
    left alone; how often the timer measured and how many steps its summary kept."""
    from torch.utils.data import DataLoader

    from lightning_ddp.callbacks import CommTimer

    timer = CommTimer()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy="ddp", max_steps=30, logger=KeptMetrics(),
                         callbacks=[timer], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir="logs")
    trainer.fit(UserTransformerLM(), DataLoader(user_data(samples=240), batch_size=4))
    summarized = timer.summary.summarize(timer.warmup_steps)["step/time_ms"]["n"]
    return {"every": timer._every, "measured": len(timer.summary), "summarized": summarized}
