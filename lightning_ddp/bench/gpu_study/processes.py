"""What runs in the study's child processes (its own never creates a CUDA context): CLI fits (``run_fits``), the
machine (``environment``), one device's compute (``compute``); the module's CLI: {environment,compute,fits}."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_ddp import compat
from lightning_ddp.bench.launch import (
    RankLayout, error_line, first_error_line, fit_command, is_oom, rank_environments, run_processes,
)
from lightning_ddp.bench.study import find_timing_summary
from lightning_ddp.files import write_json_atomically
from lightning_ddp.local_group import find_free_port
from lightning_ddp.reporting.provenance import package_version

RESULT_FILE = "fit_result.json"
"""What a fit's process writes into the fit's folder when the fit ends: its status, error and seconds."""


# ---- CLI fits, several to a set of processes -------------------------------------------------------------------


@dataclass(frozen=True)
class FitSpec:
    """One fit: a name (its directory under the batch's ``out_dir``) and the CLI arguments after ``fit``."""

    name: str
    args: tuple[str, ...]


@dataclass
class FitResult:
    """How one fit went, and what it wrote."""

    name: str
    status: str  # ok, oom, failed, timeout or "not run" (no time was left to start it)
    error: str  # the error line; empty when ok
    log_dir: Path
    """The fit's folder, ``<out_dir>/<name>``: its logs and what the CommTimer wrote."""
    seconds: float = 0.0  # of the fit itself, the processes' start-up not included
    summary: dict[str, Any] | None = None  # the CommTimer's timing_summary.json, when it wrote one

    @property
    def ok(self) -> bool:
        """Whether the fit ended with status ``ok``."""
        return self.status == "ok"

    def file(self, name: str) -> Path | None:
        """A file the fit wrote under its log directory (the first match of ``name``), or ``None``."""
        return min(self.log_dir.rglob(name), default=None)


def run_fits(specs: list[FitSpec], out_dir: Path, *, ranks: int = 1, timeout_s: float, cwd: str | None = None,
             env: dict[str, str] | None = None, threads: int | None = None) -> list[FitResult]:
    """One ``FitResult`` per spec (unique names), in order, run on ``ranks`` processes sharing one device within
    ``timeout_s``, logged to ``out_dir/<name>/`` (the processes: ``out_dir/_processes/``); ``threads``: per process."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"fit names must be unique (each is a directory), got {names}")
    out_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    results: dict[str, FitResult] = {}
    pending = list(specs)
    while pending and deadline - time.monotonic() > 1:
        remaining = deadline - time.monotonic()
        work = out_dir / "_processes" / f"launch{len(list((out_dir / '_processes').glob('launch*')))}"
        work.mkdir(parents=True, exist_ok=True)
        for spec in pending:  # a result of an earlier call (--resume) would make a fit look finished
            (out_dir / spec.name / RESULT_FILE).unlink(missing_ok=True)
        plan = work / "plan.json"
        # Each fit its own rendezvous port: torch keeps a finished fit's store alive in the process (FSDP2's mesh
        # stays cached), and a later fit meeting on the same port could read that fit's stale addresses and hang.
        fits_of_plan = [{"name": s.name, "args": list(s.args), "port": find_free_port()} for s in pending]
        plan.write_text(json.dumps({"out_dir": str(out_dir.resolve()), "stop_on_failure": ranks > 1,
                                    "fits": fits_of_plan}, indent=2))
        # Each rank a "node" of one device: 2 ranks then share it over gloo (NCCL refuses two ranks on one GPU).
        layout = RankLayout(backend="gloo", devices_per_node=1, num_nodes=ranks)
        envs = rank_environments(layout, find_free_port(), every_rank=True, threads=threads, extra=env)
        logs = [work / f"rank{r}.log" for r in range(ranks)]
        command = [sys.executable, "-m", "lightning_ddp.bench.gpu_study.processes", "fits", str(plan.resolve())]
        outcome = run_processes(command, envs, logs, remaining, cwd=cwd)
        finished: dict[str, FitResult] = {}
        for spec in pending:
            path = out_dir / spec.name / RESULT_FILE
            if path.exists():
                data = json.loads(path.read_text())
                summary = find_timing_summary(path.parent) if data["status"] == "ok" else None
                finished[spec.name] = FitResult(name=spec.name, status=data["status"], error=data["error"],
                                                seconds=data["seconds"], log_dir=path.parent, summary=summary)
        results.update(finished)
        missing = [s for s in pending if s.name not in results]
        if not missing:
            break
        last_finished_failed = bool(finished) and not list(finished.values())[-1].ok
        if ranks > 1 and last_finished_failed and not outcome.timed_out:
            pending = missing  # the ranks stopped after a fit that failed (and said so): start the rest afresh
            continue
        # Else the first fit without a result is the one the processes died in (or ran out of time in), or, when
        # none started, the start-up that failed: either way it gets the error.
        results[missing[0].name] = _lost(missing[0].name, out_dir, outcome, logs, remaining)
        pending = missing[1:]
    for spec in specs:
        if spec.name not in results:
            results[spec.name] = FitResult(name=spec.name, status="not run", error="no time was left to start it",
                                           log_dir=out_dir / spec.name)
    return [results[spec.name] for spec in specs]


def _lost(name: str, out_dir: Path, outcome, logs: list[Path], remaining: float) -> FitResult:
    """The result of a fit the processes left without one: out of time, out of memory, or failed."""
    texts = [p.read_text(encoding="utf-8", errors="replace") if p.exists() else "" for p in logs]
    # the logs of the ranks that exited with an error; every rank's where none did
    failed = [text for text, code in zip(texts, outcome.returncodes) if code not in (0, None)] or texts
    line = first_error_line(failed)
    if outcome.timed_out:
        line = f"no result within the time left ({remaining:.0f} s)" + (f"; last output: {line}" if line else "")
        return FitResult(name=name, status="timeout", error=line, log_dir=out_dir / name)
    status = "oom" if any(is_oom(text) for text in failed) else "failed"
    line = line or f"the processes exited {outcome.returncodes} without a result for this fit"
    return FitResult(name=name, status=status, error=line, log_dir=out_dir / name)


def fits(plan_path: str) -> int:
    """Run the fits of the plan ``run_fits`` wrote, one after another in this process, through the CLI's ``main``."""
    from lightning_ddp.cli import main as cli_main

    plan = json.loads(Path(plan_path).read_text())
    rank = int(os.environ.get("RANK", "0"))
    for fit in plan["fits"]:
        log_dir = Path(plan["out_dir"]) / fit["name"]
        log_dir.mkdir(parents=True, exist_ok=True)
        print(f"[gpu_study] fit {fit['name']} on rank {rank}", flush=True)
        os.environ["MASTER_PORT"] = str(fit["port"])
        start, status, error = time.perf_counter(), "ok", ""
        try:
            cli_main(fit_command([*fit["args"], "--trainer.enable_progress_bar", "false"], log_dir)[3:])
        except (Exception, SystemExit) as exc:  # SystemExit from argument parsing included; reported, not raised
            text = traceback.format_exc()
            print(text, file=sys.stderr, flush=True)
            status = "oom" if is_oom(text) else "failed"
            error = error_line(text) or f"{type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - start
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        if rank == 0:
            write_json_atomically(log_dir / RESULT_FILE, {"status": status, "error": error, "seconds": seconds})
        if status != "ok" and plan["stop_on_failure"]:
            return 1
    return 0


class SaveFinalWeights(Callback):
    """At the end of fit, rank 0 saves the module's whole ``state_dict`` (gathered as for a checkpoint, on the CPU) to
    ``path`` (``--trainer.callbacks.path FILE``); read it with ``torch.load(path, weights_only=True)``."""

    def __init__(self, path: str) -> None:
        """``path``: the file rank 0 writes; its parent folders are created."""
        self.path = path

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Every rank gathers the state (a collective under fsdp2); rank 0 writes it, on the CPU, to ``path``."""
        state = trainer.strategy.lightning_module_state_dict()  # every rank: a collective under fsdp2
        if trainer.is_global_zero:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            torch.save({k: v.detach().cpu() for k, v in state.items()}, self.path)


# ---- compute: a preset's steps at the largest batch that fits, without a Trainer or communication --------------


def batch_candidates(first: int) -> list[int]:
    """``first`` and the batches to fall back to on out-of-memory errors, each about 20 % smaller, down to 1."""
    out = [first] if first >= 1 else []
    while out and out[-1] > 1:
        out.append(min(out[-1] - 1, int(out[-1] * 0.8)))
    return out


def first_that_fits(candidates: list[int], attempt: Callable[[int], dict[str, Any]], after_oom: Callable[[], None],
                    ) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """``attempt(batch)`` per candidate until one does not run out of memory (other errors propagate): its result (or
    None) and every ``{"batch", "status": ok|oom}``; ``after_oom`` runs once the failed attempt's tensors are gone."""
    attempts: list[dict[str, Any]] = []
    for batch in candidates:
        try:
            return attempt(batch), [*attempts, {"batch": batch, "status": "ok"}]
        except BaseException as error:  # noqa: BLE001 - re-raised unless it is an out-of-memory error
            if not is_oom(f"{type(error).__name__}: {error}"):
                raise
        attempts.append({"batch": batch, "status": "oom"})
        after_oom()
    return None, attempts


def _timed_steps(model, optimizer, where: torch.device, batch: int, seq_len: int, precision: str, steps: int,
                 warmup: int) -> dict[str, Any]:
    """``warmup`` + ``steps`` training steps at ``batch``; the times of the last ``steps``."""
    autocast = precision.startswith(("bf16", "16")) and precision.endswith("mixed")
    amp_dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16
    cuda = where.type == "cuda"
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq_len + 1), device=where)
    x, y = tokens[:, :-1], tokens[:, 1:]
    if cuda:
        torch.cuda.reset_peak_memory_stats(where)
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        with torch.autocast(where.type, dtype=amp_dtype, enabled=autocast):
            logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(where)  # the step's kernels done: the host clock times the whole step
        if step >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return {"batch": batch, "step_ms": times}


def compute(out: str, preset: str, precision: str, seq_len: int, max_batch: int, steps: int, warmup: int,
            device: str = "cuda") -> int:
    """Steps of ``preset`` at the largest batch that fits, from the pre-flight's batch down; everything measured, as
    JSON to ``out`` (the study passes its arguments as ``--config REQUEST.json``)."""
    from lightning_ddp.hardware import dense_peak_flops
    from lightning_ddp.memory import estimate_rank_memory, largest_batch, memory_budget_bytes
    from lightning_ddp.model import get_config
    from lightning_ddp.module import LitGPT

    where = torch.device(device)
    cuda = where.type == "cuda"
    config = get_config(preset, context_length=seq_len)
    estimate_kwargs = dict(seq_len=seq_len, precision=precision, strategy="single", world_size=1,
                           device_type=where.type)
    budget = memory_budget_bytes(where.type, 1)
    proposed = largest_batch(config, budget_bytes=budget, max_batch=max_batch, **estimate_kwargs)
    torch.manual_seed(0)
    with torch.device(where):  # built on the device: initialising 2 B parameters on the host takes a minute
        module = LitGPT(preset, context_length=seq_len)
    model, optimizer = module.model, module.configure_optimizers()  # AdamW with the training run's groups

    def free() -> None:
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    def steps_at(batch: int) -> dict[str, Any]:
        return _timed_steps(model, optimizer, where, batch, seq_len, precision, steps, warmup)

    results, attempts = first_that_fits(batch_candidates(proposed), steps_at, free)
    # The compute dtype of the precision and the device's dense peak for it (a MIG slice: its share of the SMs).
    if precision.startswith(("bf16", "16")):
        dtype = "bf16" if precision.startswith("bf16") else "fp16"
    else:
        dtype = "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    if cuda:
        properties = torch.cuda.get_device_properties(where)
        peak = dense_peak_flops(properties.name, dtype, sm_count=properties.multi_processor_count)
    else:
        peak = dense_peak_flops("cpu", dtype, threads=torch.get_num_threads())
    result: dict[str, Any] = {
        "preset": preset, "precision": precision, "seq_len": seq_len, "device": str(where),
        "device_name": torch.cuda.get_device_name(where) if cuda else "cpu",
        "parameters": sum(p.numel() for p in model.parameters()), "budget_bytes": budget,
        "preflight_batch": proposed, "max_batch": max_batch, "attempts": attempts,
        "compute_dtype": dtype, "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if results is not None:
        batch = results["batch"]
        step_ms = statistics.median(results["step_ms"])
        tokens_per_s = batch * seq_len / (step_ms / 1e3)
        estimate = estimate_rank_memory(config, batch_size=batch, **estimate_kwargs)
        result.update(
            batch=batch, step_ms=results["step_ms"], step_ms_median=step_ms, tokens_per_s=tokens_per_s,
            flops_per_token=model.flops_per_token(seq_len), peak_flops=peak,
            mfu=tokens_per_s * model.flops_per_token(seq_len) / peak if peak else None,
            peak_allocated_bytes=torch.cuda.max_memory_allocated(where) if cuda else None,
            peak_reserved_bytes=torch.cuda.max_memory_reserved(where) if cuda else None,
            estimate_bytes=estimate.total_bytes, estimate_parts=estimate.parts, estimate_table=estimate.table(),
        )
    write_json_atomically(out, result)
    return 0


# ---- environment: what the study ran on ------------------------------------------------------------------------


def _gpu(index: int) -> dict[str, Any]:
    """GPU ``index``: name, memory, SMs, MIG slice and its row of ``hardware.DEVICES`` (None if not there)."""
    from lightning_ddp.hardware import compute_share, find_device, mig_profile

    p = torch.cuda.get_device_properties(index)
    spec = find_device(p.name)
    return {"name": p.name, "total_memory_bytes": p.total_memory, "sm_count": p.multi_processor_count,
            "compute_capability": f"{p.major}.{p.minor}", "uuid": str(getattr(p, "uuid", "")) or None,
            "mig_profile": mig_profile(p.name), "compute_share": compute_share(p.name, p.multi_processor_count),
            "hardware_table": None if spec is None else dataclasses.asdict(spec)}


def _or_none(read: Callable[[], Any]) -> Any:
    """``read()``, or None where the machine cannot say (no nvidia-smi, a build without NCCL, ...)."""
    try:
        return read()
    except (AttributeError, IndexError, OSError, RuntimeError, TypeError, subprocess.SubprocessError):
        return None


def _nvidia_driver() -> str:
    """The NVIDIA driver's version as ``nvidia-smi`` prints it; raises where there is none."""
    smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    return subprocess.run(smi, capture_output=True, text=True, timeout=20, check=True).stdout.split()[0]


def _nccl_version() -> str:
    """torch's NCCL version, e.g. ``2.21.5``; raises in a build without NCCL."""
    return ".".join(map(str, torch.cuda.nccl.version()))  # (2, 21, 5) -> 2.21.5


def environment(out: str, device: str = "cuda") -> int:
    """Write the machine to ``out`` (JSON): for ``cuda`` every visible GPU, for ``cpu`` (a dry run) the host only;
    the NVIDIA driver, the CUDA driver API (e.g. 12040 for CUDA 12.4), cuDNN and NCCL are None where unknown."""
    from lightning_ddp.bench.study import provenance
    from lightning_ddp.memory import memory_budget_bytes

    cuda = device == "cuda" and torch.cuda.is_available()
    write_json_atomically(Path(out), provenance(
        str(Path(out).parent), device="cuda" if cuda else "cpu",
        gpus=[_gpu(i) for i in range(torch.cuda.device_count())] if cuda else [],
        nvidia_driver=_or_none(_nvidia_driver), cuda_driver_api=_or_none(compat.cuda_driver_version),
        cudnn=torch.backends.cudnn.version(), nccl=_or_none(_nccl_version),
        torch_cuda=torch.version.cuda, jsonargparse=package_version("jsonargparse"), hostname=platform.node(),
        memory_budget_bytes=memory_budget_bytes("cuda" if cuda else "cpu", 1),
        float32_matmul_precision=torch.get_float32_matmul_precision(),
    ), default=str)
    return 0


if __name__ == "__main__":
    from jsonargparse import auto_cli

    sys.exit(auto_cli([environment, compute, fits], prog="python -m lightning_ddp.bench.gpu_study.processes"))
