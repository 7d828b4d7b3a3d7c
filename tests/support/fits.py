"""Short Lightning fits through the CLI on one device, and the checks every step's numbers must pass.

``fit_one_device`` runs ``python -m lightning_ddp fit`` on 1 rank, or on 2 ranks sharing the device (each rank a
"node" of one device that sees the same GPU, started together with the launcher variables, as the benchmark
sweep does: NCCL refuses two ranks on one GPU, so those two talk over gloo). ``check_step_rows`` is what the
``CommTimer``'s accounting guarantees for every step, whatever the strategy and device.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from lightning_ddp import catalogue
from lightning_ddp.metrics.accounting import METRIC_KEYS
from tests.support.cli_utils import REPO, repo_first_on_path, run_cli

QUICK = ("--config", str(REPO / "configs" / "quickstart.yaml"), "--data.source", "synthetic",
         "--model.context_length", "64", "--data.seq_len", "64", "--data.batch_size", "4",
         "--trainer.max_steps", "8", "--timer.warmup_steps", "3", "--trainer.limit_val_batches", "0",
         "--trainer.num_sanity_val_steps", "0")
"""The quickstart's tiny GPT, 8 steps of which 3 are warm-up, uniform random tokens (nothing to learn)."""


def strategy_json(name: str, backend: str, **init_args: Any) -> str:
    """``--trainer.strategy`` for a catalogue name with its backend (and ``init_args`` over the entry's own)."""
    argument = catalogue.get(name).strategy_argument(backend)
    argument["init_args"].update(init_args)
    return json.dumps(argument)


def fit_one_device(tmp_path: Path, *args: str, accelerator: str = "cuda", ranks: int = 1,
                   timeout: float = 300) -> dict:
    """Fit on one device with 1 or 2 ranks; ``timing_summary.json`` (rank 0's logs) as a dict."""
    logs = tmp_path / "logs"
    common = (*QUICK, "--trainer.accelerator", accelerator, "--trainer.devices", "1",
              "--trainer.logger.init_args.save_dir", str(logs), *args)
    if ranks == 1:
        run_cli("fit", *common, cwd=tmp_path, timeout=timeout)
    else:
        _run_ranks_sharing_one_device(tmp_path, ranks, ("fit", *common, "--trainer.num_nodes", str(ranks)), timeout)
    (summary,) = sorted(logs.rglob("timing_summary.json"))
    return json.loads(summary.read_text())


def _run_ranks_sharing_one_device(tmp_path: Path, ranks: int, args: tuple[str, ...], timeout: float) -> None:
    from lightning_ddp.bench.launch import LOOPBACK_INTERFACE
    from lightning_ddp.bench.launch import run_processes
    from lightning_ddp.local_group import find_free_port

    port = str(find_free_port())
    command = [sys.executable, "-m", "lightning_ddp", *args, "--trainer.enable_progress_bar", "false"]
    base = {"GLOO_SOCKET_IFNAME": LOOPBACK_INTERFACE, **repo_first_on_path(), "PYTHONUNBUFFERED": "1"}
    envs = [{**base, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(ranks),
             "NODE_RANK": str(rank), "LOCAL_RANK": "0", "RANK": str(rank)} for rank in range(ranks)]
    logs = [tmp_path / f"rank{rank}.log" for rank in range(ranks)]
    result = run_processes(command, envs, logs, timeout, cwd=str(tmp_path))
    if result.timed_out or any(code != 0 for code in result.returncodes):
        raise AssertionError(f"ranks exited {result.returncodes} (timed out: {result.timed_out})\n"
                             + "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in logs))


def check_step_rows(summary: dict) -> None:
    """Every logged step of a ``timing_summary.json``: every number finite, and the accounting's inequalities.

    ``comm/exposed_ms`` and ``comm/busy_ms`` are unions of intervals inside the step (exposed from the last
    gradient computed to the gradients usable; busy from each collective's launch, after the step began, to its
    completion, before the optimizer used the result), so neither can exceed ``step/time_ms``; the time-slicing of
    one GPU or a slow host copy changes how long they are, never that. ``comm/clock_anomalies`` counts intervals
    the accounting had to clamp (marks from two clocks out of order): a healthy run has none. ``comm/wait_ms`` and
    ``comm/transfer_ms`` split ``comm/exposed_ms``: both >= 0, summing to it.
    """
    rows = summary["steps"]
    assert rows, "no step was logged"
    for row in rows:
        step = row["step"]
        for key, value in row.items():
            assert isinstance(value, (int, float)) and math.isfinite(value), f"step {step}: {key} = {value!r}"
        step_ms = row["step/time_ms"]
        assert step_ms > 0, (step, step_ms)
        # 1e-3 ms of slack for the rounding of summed interval lengths; nothing else lets them exceed the step.
        for key in ("comm/exposed_ms", "comm/busy_ms"):
            assert row[key] <= step_ms + 1e-3, f"step {step}: {key} = {row[key]} > step/time_ms = {step_ms}"
        for key in ("comm/share", "comm/overlap"):
            assert 0 <= row[key] <= 1 + 1e-6, f"step {step}: {key} = {row[key]} is not a fraction"
        # exposed communication splits into waiting for the last rank and the rest, both parts of it
        wait, transfer, exposed = row["comm/wait_ms"], row["comm/transfer_ms"], row["comm/exposed_ms"]
        assert 0 <= wait <= exposed + 1e-6 and abs(wait + transfer - exposed) <= 1e-6, (
            f"step {step}: comm/wait_ms = {wait} and comm/transfer_ms = {transfer} do not split comm/exposed_ms = {exposed}")
        if "comm/clock_anomalies" in METRIC_KEYS:
            assert row["comm/clock_anomalies"] == 0, f"step {step}: comm/clock_anomalies = {row['comm/clock_anomalies']}"
