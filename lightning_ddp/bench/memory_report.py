"""The memory benchmark's results, summarised and written up (``results.md``); pure Python, no torch.

``summarise_modes`` turns what the ranks of ``lightning_ddp.bench.memory`` measured into one entry per mode: the
median step time, whether every snapshot holds exactly the analytic bytes (``lightning_ddp.memory.expected_bytes``),
and the bytes each rank sends by the ring model (``sent_bytes_per_rank``); ``format_report`` renders them as a
summary table and one table per mode.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

__all__ = ["POINTS", "format_report", "sent_bytes_per_rank", "summarise_modes"]

POINTS: tuple[str, ...] = ("setup", "before_step", "after_step")
"""When snapshots are taken: after model and optimizer set-up; on the last step before and after ``step()``."""

MiB = 2**20


def sent_bytes_per_rank(param_bytes: int, world_size: int, mode: str) -> float:
    """Bytes each rank sends per step with bandwidth-optimal collectives (ring model; see ``sync.zero1``).

    >>> [sent_bytes_per_rank(1000, 2, mode) for mode in ("unsharded", "allreduce_broadcast", "reduce_scatter")]
    [1000.0, 1500.0, 1000.0]
    >>> sent_bytes_per_rank(1000, 2, "zero2")  # ZeRO-2: the reduce-scatter's volume, in backward, + the all-gather
    1000.0
    >>> sent_bytes_per_rank(1000, 2, "fsdp2")  # FSDP2: two all-gathers (forward, backward) + one reduce-scatter
    1500.0
    """
    n = world_size
    all_reduce = 2 * (n - 1) / n * param_bytes
    one_way = (n - 1) / n * param_bytes  # a reduce-scatter, an all-gather, or the N per-owner broadcasts/reduces
    # zero2: the reduce-scatter (in backward) + the all-gather; fsdp2 (reshard after forward): all-gather in forward,
    # again in backward, reduce-scatter of the gradients
    return {"unsharded": all_reduce, "allreduce_broadcast": all_reduce + one_way, "reduce_scatter": 2 * one_way,
            "zero2": 2 * one_way, "fsdp2": 3 * one_way}[mode]


def summarise_modes(
    modes: Sequence[str], world_size: int, per_mode: list[list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """Per mode (``per_mode[m][r]``: rank ``r``'s result in mode ``modes[m]``): its ranks, each with what every
    snapshot should hold (``expected_at``), the median step time after the warm-up step, whether every snapshot equals
    the expectation, and the bytes each rank sends (``sent_bytes_per_rank``)."""
    summaries = []
    for mode, ranks in zip(modes, per_mode):
        matches = True
        for entry in ranks:
            full = entry["expected"]
            # Before any step: parameters only (AdamW allocates its state lazily, .grad is None).
            entry["expected_at"] = {
                "setup": {"parameters": full["parameters"], "gradients": 0, "optimizer_state": 0},
                "before_step": full,
                "after_step": full,
            }
            for point in POINTS:
                snap = entry["snapshots"][point]
                for key, value in entry["expected_at"][point].items():
                    matches &= snap[key] == value
        measured = ranks[0]["step_ms"][1:]  # the first step allocates the optimizer state: warm-up
        summaries.append(
            {
                "mode": mode,
                "ranks": ranks,
                "step_ms_median": statistics.median(measured),
                "matches_expected": matches,
                "sent_bytes_per_rank": sent_bytes_per_rank(
                    ranks[0].get("full_parameter_bytes", ranks[0]["expected"]["parameters"]), world_size, mode),
            }
        )
    return summaries


def _mib(value: int | float | None) -> str:
    return "" if value is None else f"{value / MiB:,.2f}"


def format_report(results: dict[str, Any]) -> str:
    """``results.md``: a summary table across modes, then one table per mode (a row per rank and point)."""
    config, env = results["config"], results["environment"]
    cuda = config["accelerator"] == "cuda"
    lines = [
        f"# ZeRO-1 memory benchmark: {config['preset']}, {config['devices']} ranks, {config['accelerator']}",
        "",
        f"torch {env['torch']}, {env['device']}, {env['cpu_count']} CPUs, backend {env['backend']}; batch "
        f"{config['batch_size']} x {config['seq_len']} tokens per rank, {config['steps']} steps per mode, engine "
        f"{config['grad_sync']}. Bytes are MiB (2^20). `tensors` = parameters + gradients + optimizer state, summed "
        "over the tensors themselves; `expected` is the analytic figure (see `lightning_ddp.bench.memory`); "
        + ("`rest` = `torch.cuda.memory_allocated()` minus our tensors on the GPU." if cuda else
           "`rest` = process RSS minus our tensors (a secondary figure: interpreter, libraries, activations, "
           "communication buffers, allocator caches"
           + ("; each mode runs in fresh processes)." if config["separate_processes"] else
              "; the modes share processes, so memory freed by an earlier mode can stay in a later one's RSS).")),
        "",
        "`recorded comm` sums the input sizes of the step's collectives in the `SyncRecord` (a reduce-scatter's "
        "input is the whole buffer, a broadcast counts on every rank); `sent per rank` is the bandwidth-optimal "
        "volume each rank sends (ring model, see `lightning_ddp.sync.zero1`).",
        "",
        "| mode | rank | optimizer state MiB (expected) | tensors before step MiB | step ms (median, max over ranks) "
        "| recorded comm MiB/step | sent per rank MiB/step (ring model) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in results["modes"]:
        for per_rank in mode["ranks"]:
            before = per_rank["snapshots"]["before_step"]
            tensors = before["parameters"] + before["gradients"] + before["optimizer_state"]
            lines.append(
                f"| {mode['mode']} | {per_rank['rank']} | {_mib(before['optimizer_state'])} "
                f"({_mib(per_rank['expected']['optimizer_state'])}) | {_mib(tensors)} | {mode['step_ms_median']:,.1f} "
                f"| {_mib(per_rank['comm_bytes_recorded'])} | {_mib(mode['sent_bytes_per_rank'])} |"
            )
    for mode in results["modes"]:
        lines += [
            "",
            f"## {mode['mode']}",
            "",
            f"Step time: median {mode['step_ms_median']:,.1f} ms over steps 2..{config['steps']} (max over ranks). "
            f"Measured tensors equal the analytic expectation: **{'yes' if mode['matches_expected'] else 'NO'}**.",
            "",
            "| rank | point | parameters | gradients | optimizer state | tensors | expected | "
            + ("allocated | max allocated | reserved | max reserved | rest |" if cuda else "RSS | rest |"),
            "|---:|---|---:|---:|---:|---:|---:|" + ("---:|---:|---:|---:|---:|" if cuda else "---:|---:|"),
        ]
        for per_rank in mode["ranks"]:
            for point in POINTS:
                snap = per_rank["snapshots"][point]
                exp = per_rank["expected_at"][point]
                tensors = snap["parameters"] + snap["gradients"] + snap["optimizer_state"]
                row = (
                    f"| {per_rank['rank']} | {point} | {_mib(snap['parameters'])} | {_mib(snap['gradients'])} | "
                    f"{_mib(snap['optimizer_state'])} | {_mib(tensors)} | {_mib(sum(exp.values()))} | "
                )
                if cuda:
                    row += (f"{_mib(snap['allocated'])} | {_mib(snap['max_allocated'])} | {_mib(snap['reserved'])} | "
                            f"{_mib(snap['max_reserved'])} | {_mib(snap['rest'])} |")
                else:
                    row += f"{_mib(snap['rss'])} | {_mib(snap['rest'])} |"
                lines.append(row)
    return "\n".join(lines) + "\n"
