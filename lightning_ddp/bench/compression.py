"""``python -m lightning_ddp.bench.compression``: what communicating gradients in bf16 costs and saves.

    python -m lightning_ddp.bench.compression --config configs/text_bytes.yaml --steps 300 \
        --out benchmarks/results/compression_cpu

Two measurements, both on 2 ranks:

1. **Training**: per seed (``--seeds``, default 0 1 2), the same fit twice (same config, seed and data), once with
   ``bucketed`` (fp32 on the wire) and once with ``bucketed_bf16``, at the same bucket size; each a real
   ``python -m lightning_ddp fit`` run. From their logs: the ``train/loss`` curves, the paired difference of the
   final loss per seed next to the fp32 runs' own spread over the seeds (one pair of runs cannot tell a systematic
   effect from the trajectories drifting apart), and from the CommTimer's summary the median bytes per step, step
   time and exposed communication.
2. **Gradient error, step by step**: one fp32 training run without Lightning on the same data and model, in which
   every step's local gradients are also averaged the bf16 way (``BF16CompressedAllReduce``, on a copy): the
   relative error ``||avg_bf16 - avg_fp32|| / ||avg_fp32||`` of the whole flattened gradient, and the largest
   absolute error, per step.

Writes ``results.json``, ``results.md`` and ``loss_curves.png`` into ``--out`` (atomically), with the commands,
versions and git state.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_ddp.bench.runner import find_free_port, init_cpu_process_group

__all__ = ["gradient_error", "main", "summarize"]


def _fit(config: str, algorithm: str, bucket_size_mb: float, steps: int, out: Path, name: str,
         extra: list[str]) -> list[str]:
    strategy = json.dumps({"class_path": "lightning_ddp.strategies.GradSyncStrategy",
                           "init_args": {"algorithm": algorithm, "bucket_size_mb": bucket_size_mb}})
    command = [sys.executable, "-m", "lightning_ddp", "fit", "--config", config, *extra,
               "--trainer.strategy", strategy, "--trainer.max_steps", str(steps),
               "--trainer.enable_progress_bar", "false", "--timer.warmup_steps", "5",
               "--trainer.logger.init_args.save_dir", str(out), "--trainer.logger.init_args.name", name]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return command


def _read_run(log_dir: Path) -> dict[str, Any]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    losses: dict[int, float] = {}
    for path in sorted(log_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        if "train/loss" in acc.Tags()["scalars"]:
            losses.update({e.step: e.value for e in acc.Scalars("train/loss")})
    (summary_path,) = log_dir.rglob("timing_summary.json")
    summary = json.loads(summary_path.read_text())["summary"]
    return {
        "loss": [losses[k] for k in sorted(losses)],
        "step_ms_median": summary["step/time_ms"]["median"],
        "exposed_ms_median": summary["comm/exposed_ms"]["median"],
        "bytes_per_step": summary["comm/bytes"]["median"],
    }


def gradient_error(average_fp32: torch.Tensor, average_bf16: torch.Tensor) -> tuple[float, float]:
    """``(||bf16 - fp32|| / ||fp32||, max |bf16 - fp32|)`` of two averages of the same gradients.

    >>> gradient_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5]))  # 0.5 / 5
    (0.1, 0.5)
    """
    difference = (average_bf16 - average_fp32).float()
    norm = average_fp32.float().norm().item()
    return (difference.norm().item() / norm if norm > 0 else 0.0), difference.abs().max().item()


def _error_rank(rank: int, world: int, port: int, args: argparse.Namespace, result_file: str) -> None:
    from lightning_ddp.data import TextBytes
    from lightning_ddp.model import GPT, get_config
    from lightning_ddp.sync import Communicator
    from lightning_ddp.sync.bucketed_bf16 import BF16CompressedAllReduce

    init_cpu_process_group(rank, world, port)
    try:
        data = TextBytes(args.text, seq_len=args.seq_len)
        torch.manual_seed(0)
        model = GPT(get_config("tiny", vocab_size=256, context_length=args.seq_len))
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        comm = Communicator()
        compress = BF16CompressedAllReduce()
        params = [p for p in model.parameters() if p.requires_grad]
        errors = []
        for step in range(args.steps):
            start = (step * world + rank) * args.batch_size
            batch = [data[(start + k) % len(data)] for k in range(args.batch_size)]
            x, y = torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            exact = flat.clone().div_(world)
            dist.all_reduce(exact)
            compressed = compress.launch(comm, flat.clone(), "error probe").wait()
            errors.append(gradient_error(exact, compressed))
            offset = 0
            for p in params:  # train on the exact average: the trajectory is fp32 training's
                p.grad.copy_(exact[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            optimizer.step()
            optimizer.zero_grad()
        if rank == 0:
            Path(result_file).write_text(json.dumps(errors))
    finally:
        dist.destroy_process_group()


def _plot(path: Path, runs: dict[int, dict[str, dict[str, Any]]], errors: list[tuple[float, float]]) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.2), layout="constrained")
    ax_loss, ax_err = fig.subplots(1, 2)
    colors = {"bucketed": "tab:blue", "bucketed_bf16": "tab:orange"}
    for seed, by_algorithm in runs.items():
        for name, run in by_algorithm.items():
            label = f"{name} ({run['bytes_per_step'] / 2**20:.2f} MiB/step)" if seed == min(runs) else None
            ax_loss.plot(range(len(run["loss"])), run["loss"], color=colors[name], alpha=0.75, lw=1, label=label)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel(f"train/loss (rank 0), seeds {', '.join(map(str, runs))}")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_err.plot(range(len(errors)), [100 * e for e, _ in errors])
    ax_err.set_xlabel("step")
    ax_err.set_ylabel("relative error of the bf16 average (%)")
    ax_err.grid(alpha=0.3)
    fig.suptitle("bf16 gradient communication against fp32: loss curves and per-step gradient error")
    fig.savefig(path, dpi=110)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


ALGORITHMS = ("bucketed", "bucketed_bf16")


def summarize(runs: dict[int, dict[str, dict[str, Any]]], errors: list[tuple[float, float]],
              last: int = 20) -> dict[str, Any]:
    """The numbers of results.md from ``runs[seed][algorithm]`` (``_read_run``) and the per-step gradient errors.

    The loss effect is read per seed: ``loss_last_mean`` is each run's mean ``train/loss`` over its last ``last``
    steps; ``bf16_minus_fp32`` the paired difference per seed (same seed: same initial weights and data order);
    ``fp32_seed_spread`` the largest minus the smallest fp32 value over the seeds, the run-to-run variation a
    difference must exceed to mean anything.
    """
    seeds = sorted(runs)
    last_mean = {seed: {a: statistics.mean(runs[seed][a]["loss"][-last:]) for a in ALGORITHMS} for seed in seeds}
    fp32_last = [last_mean[seed]["bucketed"] for seed in seeds]
    first = runs[seeds[0]]
    return {
        "seeds": seeds,
        "last_steps": last,
        "loss_first": [first[a]["loss"][0] for a in ALGORITHMS],
        "loss_last_mean": {str(seed): [last_mean[seed][a] for a in ALGORITHMS] for seed in seeds},
        "bf16_minus_fp32": {str(seed): last_mean[seed]["bucketed_bf16"] - last_mean[seed]["bucketed"] for seed in seeds},
        "fp32_seed_spread": max(fp32_last) - min(fp32_last),
        "loss_max_abs_difference": max(max(abs(a - b) for a, b in zip(runs[seed]["bucketed"]["loss"],
                                                                        runs[seed]["bucketed_bf16"]["loss"]))
                                       for seed in seeds),
        "relative_gradient_error_median": statistics.median(e for e, _ in errors),
        "relative_gradient_error_max": max(e for e, _ in errors),
        "absolute_gradient_error_max": max(m for _, m in errors),
        **{key: [statistics.median(runs[seed][a][key] for seed in seeds) for a in ALGORITHMS]
           for key in ("bytes_per_step", "step_ms_median", "exposed_ms_median")},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m lightning_ddp.bench.compression", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/text_bytes.yaml", help="the fit config of the training runs")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="one fp32 and one bf16 training run per seed (seed_everything)")
    parser.add_argument("--text", default="README.md", help="the text file (raw bytes) of the gradient-error run")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--bucket_size_mb", type=float, default=1.0)
    parser.add_argument("--batch_size", type=int, default=8, help="per rank, in the gradient-error run")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", required=True, help="directory for results.json, results.md and loss_curves.png")
    args, extra = parser.parse_known_args(argv)
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {args.seeds} repeats a seed; give distinct seeds, e.g. --seeds 0 1 2")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[int, dict[str, dict[str, Any]]] = {}
    commands: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            runs[seed] = {}
            for algorithm in ALGORITHMS:
                print(f"training with {algorithm}, seed {seed} ...", flush=True)
                name = f"{algorithm}_seed{seed}"
                commands[name] = _fit(args.config, algorithm, args.bucket_size_mb, args.steps, Path(tmp), name,
                                      [*extra, "--seed_everything", str(seed)])
                runs[seed][algorithm] = _read_run(Path(tmp) / name)
        print("measuring the per-step gradient error ...", flush=True)
        import torch.multiprocessing as mp

        result_file = str(Path(tmp) / "errors.json")
        mp.spawn(_error_rank, args=(2, find_free_port(), args, result_file), nprocs=2, join=True)
        errors = [tuple(e) for e in json.loads(Path(result_file).read_text())]
    s = summary = summarize(runs, errors)
    from lightning_ddp.provenance import git_state

    command = "python -m lightning_ddp.bench.compression " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": command, "fit_commands": commands, "config": vars(args), "extra_args": extra,
              "summary": summary, "runs": {str(seed): r for seed, r in runs.items()}, "gradient_errors": errors,
              "torch": torch.__version__, "cpu_count": os.cpu_count(), **git_state(ignore=[out])}
    last = s["last_steps"]
    per_seed = [f"| {seed} | {fp:.3f} | {bf:.3f} | {bf - fp:+.3f} |" for seed, (fp, bf) in s["loss_last_mean"].items()]
    diffs = list(s["bf16_minus_fp32"].values())
    md = "\n".join([
        f"# bf16 gradient communication vs fp32: {args.steps} steps, 2 ranks, bucket {args.bucket_size_mb:g} MiB, "
        f"{len(args.seeds)} seeds", "",
        f"Command: `{command}` (commit {str(result['git_commit'])[:12]}"
        + (", uncommitted changes" if result["git_dirty"] else "") + f"; torch {torch.__version__}).", "",
        f"## Loss: mean train/loss over the last {last} steps, per seed", "",
        "| seed | fp32 (`bucketed`) | bf16 (`bucketed_bf16`) | bf16 - fp32 |", "|---:|---:|---:|---:|", *per_seed, "",
        f"bf16 - fp32 ranges from {min(diffs):+.3f} to {max(diffs):+.3f} nats over the seeds; the fp32 runs alone spread "
        f"over {s['fp32_seed_spread']:.3f} nats from seed to seed. Both runs of a seed start from the same weights and "
        f"data order (first loss {s['loss_first'][0]:.3f} and {s['loss_first'][1]:.3f}); the largest difference between "
        f"the curves of one seed at any step: {s['loss_max_abs_difference']:.3f} nats.", "",
        "## Gradients, bytes and time", "",
        f"Per-step relative error of the bf16 average against the fp32 one (same local gradients, fp32 training): "
        f"median {100 * s['relative_gradient_error_median']:.3f} %, largest {100 * s['relative_gradient_error_max']:.3f} %; "
        f"largest absolute error of one element {s['absolute_gradient_error_max']:.3g}.", "",
        "| median over the seeds of each run's median | fp32 | bf16 |", "|---|---:|---:|",
        f"| bytes communicated per step | {s['bytes_per_step'][0] / 2**20:.2f} MiB | {s['bytes_per_step'][1] / 2**20:.2f} MiB |",
        f"| step time | {s['step_ms_median'][0]:.1f} ms | {s['step_ms_median'][1]:.1f} ms |",
        f"| exposed communication | {s['exposed_ms_median'][0]:.1f} ms | {s['exposed_ms_median'][1]:.1f} ms |",
        "", "Step times come from single runs on a 2-core machine (about +-20 % noise): read them as indicative only; "
        "the benchmark sweep measures speed with repeats and intervals.", "",
        "![loss curves and gradient error](loss_curves.png)", "",
    ])
    _write(out / "results.json", json.dumps(result, indent=2) + "\n")
    _write(out / "results.md", md)
    _plot(out / "loss_curves.png", runs, errors)
    print(md)
    return result


if __name__ == "__main__":
    main()
