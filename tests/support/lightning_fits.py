"""The sharded strategies against Lightning's ``ddp`` through the CLI, in one configuration for all of them: 2 CPU
ranks train the quickstart's tiny GPT for ``STEPS`` optimizer steps of 2 micro-batches each, clipped by norm at every
step, on a cosine schedule with 2 warm-up steps, keeping a checkpoint every 3 steps. ``zero1_ddp``, ``zero2_ddp`` and
``fsdp2`` are each compared with the same ``ddp`` run, which keeps its gradients for the derived fp32 bounds
(``tests.support.tolerance``). Each fit runs once per session, the first time a test asks for it (``LightningFits``,
the ``lightning_fits`` fixture in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.cli_utils import GRADIENT_HISTORY, REPO, checkpointing_args, quickstart_chain, run_cli
from tests.support.tolerance import assert_within, history_moment_bounds, history_weight_bounds

STEPS = 6
CONTEXT = 64
TOKENS = 2 * 2 * 4 * CONTEXT  # per optimizer step: 2 ranks x 2 micro-batches of 4 sequences x 64 positions
CLIP = 0.1
"""Below the tiny GPT's gradient norm in these steps (~1): the clip is active at every step, so equal weights prove
the sharded strategies clip by the global norm."""

STRATEGY_ARGS = {
    "ddp": ("--trainer.strategy", "ddp"),
    "zero1_ddp": ("--trainer.strategy", "zero1_ddp"),  # the reduce_scatter schedule, by default
    "zero2_ddp": ("--config", str(REPO / "configs" / "strategy" / "zero2.yaml")),  # from its YAML, as users write it
    "fsdp2": ("--trainer.strategy", "fsdp2"),
}


def fit(run_dir: Path, *args: str, history: bool = False) -> Path:
    """The configuration above with ``args`` added; returns the weights ``SaveFinalWeights`` wrote at the end (with
    ``history``: every step's gradients in ``run_dir/history.pt``). Checkpoints: ``checkpoint_at(run_dir, step)``."""
    weights = run_dir / "weights.pt"
    keep = [GRADIENT_HISTORY, f"--trainer.callbacks.path={run_dir / 'history.pt'}"] if history else []
    run_cli(
        "fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--data.source", "synthetic",
        "--model.context_length", str(CONTEXT), "--data.seq_len", str(CONTEXT), "--data.batch_size", "4",
        "--trainer.max_steps", str(STEPS), "--trainer.accumulate_grad_batches", "2",
        "--trainer.gradient_clip_val", str(CLIP), "--model.lr_schedule", "cosine", "--model.warmup_steps", "2",
        "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0", "--timer.warmup_steps", "1",
        *checkpointing_args(run_dir, weights), *keep,
        *args,
        cwd=run_dir,
    )
    return weights


class LightningFits:
    """Each strategy's fit in its own folder under ``root``, run the first time it is asked for: ``fits["fsdp2"]``
    is its run directory (``weights.pt``, ``logs/``); ``ddp``'s also holds ``history.pt``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs: dict[str, Path] = {}

    def __getitem__(self, name: str) -> Path:
        if name not in self.runs:
            run_dir = self.root / name
            run_dir.mkdir(parents=True)
            fit(run_dir, *STRATEGY_ARGS[name], history=name == "ddp")
            self.runs[name] = run_dir
        return self.runs[name]


def assert_same_weights(ours: Path, theirs: Path, history: Path) -> None:
    """fp32, 6 clipped AdamW steps: the runs differ only in the order of their sums (reduce-scatter or sums by owner
    vs all-reduce, the global norm by shard), so every weight is within the bound tests.support.tolerance derives from
    the ddp run's own gradients (``history``): a few 1e-7 where gradients are healthy, up to 2 lr per step where one
    was within its rounding of zero and Adam's sqrt(v) ~ eps made its step linear in it. A wrong or missing gradient,
    or a clip or schedule that did not reach the sharded optimizer, moves nearly every weight by ~lr per step."""
    a, b = torch.load(ours), torch.load(theirs)
    bounds = history_weight_bounds(history, quickstart_chain(TOKENS, context_length=CONTEXT), TOKENS, CLIP, b)
    assert_within(a, b, bounds, f"{ours} vs {theirs}")


def assert_same_optimizer_state(ours: dict, theirs: dict, history: Path) -> None:
    """Two checkpoints' ``optimizer_states``: the same param groups (the schedule's lr, AdamW's settings), a state
    for every parameter (not one rank's shard), the moments within their derived bounds, the step counts exact."""
    (a,), (b,) = ours, theirs
    assert a["param_groups"] == b["param_groups"] and set(a["state"]) == set(b["state"])
    moments = history_moment_bounds(history, quickstart_chain(TOKENS, context_length=CONTEXT), TOKENS, CLIP)
    for index, entry in b["state"].items():
        for key, value in entry.items():
            bound = moments[index].get(key, 0.0)
            assert_within({key: a["state"][index][key]}, {key: value}, {key: bound}, f"state {index}")
