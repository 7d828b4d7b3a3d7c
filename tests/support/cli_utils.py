"""Run the CLI as a subprocess and read back what it logged.

Lightning's default launcher re-executes the current command for rank 1, so a multi-process Trainer must never
be started inside the pytest process itself: every multi-process run goes through ``run_cli``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def repo_first_on_path(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with the checkout first on ``PYTHONPATH``, the rest kept:
    a child runs this checkout's code, and packages installed to a folder on ``PYTHONPATH`` (wheels on a GPU
    machine, ``pip install --target``) stay importable."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def run_cli(
    *args: str, cwd: Path, timeout: float = 300, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python -m lightning_ddp ARGS`` in ``cwd`` with the progress bar off; fails with its output on error."""
    env = {**repo_first_on_path(env), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_ddp", *args, "--trainer.enable_progress_bar", "false"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"CLI exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files under ``log_dir``: tag -> [(step, value), ...]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(log_dir.rglob("events.out.tfevents.*"))
    assert events, f"no TensorBoard event file under {log_dir}"
    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in events:
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return scalars


SAVE_FINAL_WEIGHTS = "--trainer.callbacks+=lightning_ddp.bench.gpu_study.processes.SaveFinalWeights"
"""Add the study's ``SaveFinalWeights`` to a fit; ``--trainer.callbacks.path FILE`` after it says where."""


GRADIENT_HISTORY = "--trainer.callbacks+=tests.support.callbacks_for_tests.GradientHistory"
"""Keep a fit's gradients for ``tests.support.tolerance.history_weight_bounds``; ``--trainer.callbacks.path FILE``."""


def quickstart_chain(tokens: int, context_length: int) -> int:
    """``tests.support.tolerance``'s ``chain`` for the quickstart's tiny GPT at ``context_length`` over ``tokens``."""
    from lightning_ddp.data.module import DEFAULT_VOCAB_SIZE
    from lightning_ddp.model import get_config
    from tests.support.tolerance import gpt_gradient_chain

    return gpt_gradient_chain(get_config("tiny", context_length=context_length, vocab_size=DEFAULT_VOCAB_SIZE), tokens)


def checkpointing_args(run_dir: Path, weights: Path, every_n_train_steps: int = 3) -> list[str]:
    """Fit arguments that log under ``run_dir/logs``, keep a checkpoint every ``every_n_train_steps`` optimizer steps
    (all of them) and save the final weights to ``weights`` (``SAVE_FINAL_WEIGHTS``)."""
    return [
        "--trainer.logger.init_args.save_dir", str(run_dir / "logs"), "--trainer.enable_checkpointing", "true",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.every_n_train_steps={every_n_train_steps}", "--trainer.callbacks.save_top_k=-1",
        SAVE_FINAL_WEIGHTS, f"--trainer.callbacks.path={weights}",
    ]


def checkpoint_at(run_dir: Path, step: int) -> Path:
    """The one checkpoint ``checkpointing_args`` kept at optimizer step ``step`` under ``run_dir/logs``."""
    (path,) = (run_dir / "logs").rglob(f"*step={step}.ckpt")
    return path
