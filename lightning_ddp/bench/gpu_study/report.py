"""``results.md``, built from ``stages.json`` and each stage's ``<name>.json`` only (a study cut off halfway, or
copied off the GPU machine, renders what it has): one section per stage, with the published 2-GPU xl runs beside
our numbers where they answer the same question.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

from lightning_ddp.bench.study import read_json
from lightning_ddp.projection.published import PUBLISHED_RUNS, calibrated_compute_ms
from lightning_ddp.projection.tables import markdown_table as table

__all__ = ["build_report"]

GiB = 2**30
ONE_GPU_CAVEAT = (
    "**Two ranks on one GPU time-slice it.** The step times of stages `one_gpu_pair` and `traces` are not 2-GPU "
    "step times. What transfers is correctness, the CUDA code paths and the compute figures of one GPU, from which "
    "`ready_times` projects 2 GPUs (docs/gpu.md, \"Reading the 2-rank numbers\")."
)


def _fmt(value: Any, spec: str = ",.1f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:{spec}}" if isinstance(value, (int, float)) else str(value)


def _published_cell(strategy: str, batch: int = 4, seq_len: int = 512) -> str:
    """``step ms, comm share`` of the published 2-GPU xl run of ``strategy`` at (batch, context), at its best
    bucket size; ``–`` where there is none."""
    runs = [r for r in PUBLISHED_RUNS if r.strategy == strategy and r.batch_size == batch and r.seq_len == seq_len]
    if not runs:
        return "–"
    best = min(runs, key=lambda r: r.total_s)
    bucket = f" ({best.bucket_size_mb:g} MB)" if best.bucket_size_mb is not None else ""
    return f"{best.total_s * 1e3:,.0f} ms, {best.ratio:.0%} comm{bucket}"


def _status(row: dict[str, Any], why: str = "error") -> str:
    return row.get("status") if row.get("status") == "ok" else f"{row.get('status')}: {row.get(why)}"


def _cells(row: dict[str, Any], columns: tuple[tuple[str, str], ...]) -> list[str]:
    """``row``'s values of ``columns`` (key, format spec), formatted."""
    return [_fmt(row.get(key), spec) for key, spec in columns]


def _gib(value: Any) -> str:
    return _fmt(value / GiB if value else None, ".1f")


def _environment(data: dict[str, Any]) -> list[str]:
    rows = []
    for gpu in data.get("gpus") or []:
        hw = gpu.get("hardware_table") or {}
        peaks = hw.get("dense_tflops") or {}
        rows.append([gpu["name"], _gib(gpu["total_memory_bytes"]) + " GiB", gpu["sm_count"],
                     gpu["compute_capability"], hw.get("key", "not in the table"),
                     f"{_fmt(peaks.get('bf16'), ',.1f')} / {_fmt(peaks.get('fp32'), ',.1f')}",
                     f"{gpu['mig_profile'][0]}g.{gpu['mig_profile'][1]}gb" if gpu.get("mig_profile") else "no"])
    cpu = data.get("cpu") or {}
    lines = [f"No GPU (device: {data.get('device')}; CPU: {cpu.get('model')}, {cpu.get('count')} cores)."]
    if rows:
        lines = table(["GPU", "memory", "SMs", "CC", "hardware table", "dense TFLOP/s bf16 / fp32", "MIG"], rows)
    lines += ["", f"NVIDIA driver {_fmt(data.get('nvidia_driver'))}, CUDA driver API "
                  f"{_fmt(data.get('cuda_driver_api'), 'd')}, torch {data.get('torch')} (CUDA "
                  f"{_fmt(data.get('torch_cuda'))}, cuDNN {_fmt(data.get('cudnn'), 'd')}, "
                  f"NCCL {_fmt(data.get('nccl'))}), Lightning {data.get('lightning')}, Python {data.get('python')}; "
                  f"commit {str(data.get('git_commit') or '–')[:12]}{' (dirty)' if data.get('git_dirty') else ''}."]
    return lines


def _cuda_tests(data: dict[str, Any]) -> list[str]:
    lines = [f"pytest: {data.get('summary_line') or '–'} ({data.get('tests', 0)} tests: {data.get('passed', 0)} "
             f"passed, {data.get('failed', 0)} failed, {data.get('errors', 0)} errors, {data.get('skipped', 0)} "
             "skipped)."]
    if data.get("failures"):
        lines += [""] + table(["failed test", "message"], [[f["test"], f["message"]] for f in data["failures"][:30]])
    return lines


def _compute(data: dict[str, Any]) -> list[str]:
    rows = []
    for precision, run in (data.get("runs") or {}).items():
        if run.get("status") != "ok":
            rows.append([precision, run.get("error") or f"pre-flight batch {run.get('preflight_batch')}, attempts "
                         f"{run.get('attempts')}"] + ["–"] * 7)
            continue
        tried = " → ".join(f"{a['batch']}{' OOM' if a['status'] == 'oom' else ''}" for a in run.get("attempts", []))
        reserved, estimate = run.get("peak_reserved_bytes"), run.get("estimate_bytes")
        rows.append([
            f"{precision} ({run.get('compute_dtype')})",
            f"{run['batch']} (pre-flight {run['preflight_batch']}: {tried})",
            _fmt(run.get("step_ms_median")), _fmt(run.get("tokens_per_s"), ",.0f"), _fmt(run.get("mfu"), ".1%"),
            _gib(run.get("peak_allocated_bytes")), _gib(reserved), _gib(estimate),
            _fmt(estimate / reserved if estimate and reserved else None, ".2f"),
        ])
    lines = table(["precision", "batch", "step ms", "tokens/s", "MFU", "peak alloc GiB", "peak reserved GiB",
                   "estimate GiB", "estimate / reserved"], rows)
    published = []
    for (batch, seq), (ms, extrapolated) in calibrated_compute_ms().items():
        if seq == data.get("seq_len"):
            published.append(f"batch {batch}: {ms:,.0f} ms = {batch * seq / (ms / 1e3):,.0f} tokens/s per GPU"
                             + (" (extrapolated)" if extrapolated else ""))
    lines += ["", f"Beside: the published 2-GPU xl runs' compute-only step at context {data.get('seq_len')} "
                  "(naive's step minus its all-reduce time; their GPU is not named, and they ran bf16-mixed): "
                  + ("; ".join(published) or "none at this context") + "."]
    return lines


def _strategies(data: dict[str, Any]) -> list[str]:
    columns = (("step/time_ms", ",.1f"), ("overhead_vs_ddp", "+.1%"), ("comm/exposed_ms", ",.2f"),
               ("comm/calls", ",.0f"), ("step/mfu", ".1%"), ("memory/peak_MiB", ",.0f"))
    rows = [[name, _status(row), *_cells(row, columns), _published_cell(name)]
            for name, row in (data.get("rows") or {}).items()]
    head = (f"{data.get('preset')} preset, batch {data.get('batch')} x {data.get('seq_len')} tokens, "
            f"{data.get('precision')}, one rank ({data.get('backend')}), median of "
            f"{data.get('steps', 0) - data.get('warmup', 0)} steps after {data.get('warmup')}: the step over ddp's "
            "is what each strategy's hooks cost. Last column, for scale only: the published 2-GPU xl run (batch 4, "
            "context 512; step, and its share waiting for communication).")
    return [head, ""] + table(["strategy", "status", "step ms", "vs ddp", "exposed ms", "calls", "MFU", "peak MiB",
                               "published 2-GPU xl"], rows)


def _one_gpu_pair(data: dict[str, Any]) -> list[str]:
    eq = data.get("equivalence") or {}
    lines = [f"**Equivalence** ({eq.get('preset')} preset, fp32, {eq.get('steps')} steps at lr {eq.get('lr')}): each "
             f"strategy on 2 ranks with batch {eq.get('per_rank_batch')} each against one process with batch "
             f"{2 * (eq.get('per_rank_batch') or 0)}, the same samples. Weight differences in updates (lr x steps); "
             "*off*: more than 0.1 update (docs/gpu.md, \"How the stages measure\").", "",
             f"Tolerances: {eq.get('tolerance_origin', '–')}", ""]
    columns = (("off_fraction", ".3%"), ("tolerance", ".2%"), ("median_updates", ".1e"), ("p99_updates", ".1e"))
    headers = ["strategy", "status", "weights off", "tolerance", "median", "99th pct", "largest (tensor)", "equal"]
    lines += table(headers,
                   [[name, _status(row), *_cells(row, columns),
                     f"{_fmt(row.get('max_updates'), '.2g')} ({_fmt(row.get('worst_tensor'))})",
                     {True: "yes", False: "**no**"}.get(row.get("equal"), "–")]
                    for name, row in (eq.get("rows") or {}).items()])
    sweep = (data.get("sweep") or {}).get("rows") or []
    lines += ["", "**Short sweep** (2 gloo ranks time-slicing one GPU; `one_gpu_pair/sweep/results.md` has the "
                  "intervals): the comparison between strategies transfers, the milliseconds do not.", ""]
    lines += table(["strategy", "bucket MB", "batch x context", "status", "step ms", "comm share", "overlap",
                    "tokens/s", "published 2-GPU xl (same batch, context)"],
                   [[r.get("strategy"), _fmt(r.get("resolved_bucket_size_mb") or r.get("bucket_size_mb"), ".3g"),
                     f"{r.get('batch_size')} x {r.get('context_length')}",
                     _status(r, why="reason"),
                     *_cells(r, (("step_ms_median", ",.1f"), ("comm_share", ".1%"), ("overlap", ".0%"),
                                 ("tokens_per_s", ",.0f"))),
                     _published_cell(str(r.get("strategy")), int(r.get("batch_size") or 0),
                                     int(r.get("context_length") or 0))]
                    for r in sweep]) if sweep else ["No sweep cell finished."]
    return lines


def _traces(data: dict[str, Any]) -> list[str]:
    rows = [[label, _fmt(run["overlap"], ".0%"), _fmt(run["comm_ms"]), _fmt(run["hidden_ms"]),
             _fmt(run["gpu_kernel_bars"], ",d") if run.get("gpu_rows") else "no GPU row",
             _published_cell(label, 2, 512)] for label, run in (data.get("runs") or {}).items()]
    head = (f"{data.get('preset')} preset, {data.get('precision')}, 2 gloo ranks on the one device, 3 traced steps. "
            "Overlap: the share of communication time during which the rank computed (on CUDA: its non-communication "
            "kernels ran).")
    headers = ["run", "overlap", "comm ms", "hidden ms", "GPU kernels drawn", "published 2-GPU xl (batch 2, ctx 512)"]
    return [head, ""] + table(headers, rows) + ["", "![naive vs overlap](traces/timeline.png)"]


def _ready_times(data: dict[str, Any]) -> list[str]:
    batch, seq_len = int(data.get("batch") or 0), int(data.get("seq_len") or 0)
    lines = [f"{data.get('preset')} preset on {data.get('device')}, batch {batch} x {seq_len}, "
             f"{data.get('precision')}: forward {_fmt(data.get('forward_ms'))} ms, "
             f"backward {_fmt(data.get('backward_ms'))} ms, optimizer {_fmt(data.get('optimizer_ms'))} ms; "
             f"{data.get('tensors')} gradients ready from "
             f"{_fmt(data.get('first_ready_ms'))} to {_fmt(data.get('last_ready_ms'))} ms into backward "
             f"(`{data.get('profile')}`).", ""]
    for network, projection in (data.get("projections") or {}).items():
        lines += [f"Projected to 2 x {projection.get('gpu')} over `{network}` (best bucket size per strategy), beside "
                  "the published 2-GPU xl runs at the same batch and context:", ""]
        lines += table(["strategy", "bucket MB", "step ms", "exposed ms", "comm share", "published 2-GPU xl"],
                       [[r.get("strategy"), *_cells(r, (("bucket_size_mb", "g"), ("step_ms", ",.1f"),
                                                         ("exposed_comm_ms", ",.1f"), ("comm_share", ".1%"))),
                         _published_cell(str(r.get("strategy")), batch, seq_len)]
                        for r in projection.get("rows") or []])
        lines.append("")
    return lines


def _timer_overhead(data: dict[str, Any]) -> list[str]:
    return [f"{data.get('preset')} preset, {data.get('repeats')} off/on pairs of {data.get('steps')} steps "
            f"({data.get('warmup')} left out): median step {_fmt(data.get('median_step_ms_timer_off'), ',.2f')} ms "
            f"off, {_fmt(data.get('median_step_ms_timer_on'), ',.2f')} ms on: overhead "
            f"{_fmt(data.get('overhead'), '+.2%')} [95 %: {_fmt(data.get('overhead_lo'), '+.2%')}, "
            f"{_fmt(data.get('overhead_hi'), '+.2%')}], goal < 2 %: **{data.get('verdict')}**; over whole runs "
            f"{_fmt(data.get('window_overhead'), '+.2%')}."]


RENDERERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "environment": _environment, "cuda_tests": _cuda_tests, "compute": _compute, "strategies": _strategies,
    "one_gpu_pair": _one_gpu_pair, "traces": _traces, "ready_times": _ready_times, "timer_overhead": _timer_overhead,
}


def _calls_line(document: dict[str, Any]) -> str:
    """When and in how many calls the study ran, e.g. "2 calls (budgets 9 + 9 min, 16.2 min in all); started ..."."""
    calls = document.get("calls") or [{"budget_min": document.get("budget_min", 0),
                                       "elapsed_s": document.get("elapsed_s", 0)}]
    budgets = " + ".join(f"{c.get('budget_min', 0):g}" for c in calls)
    elapsed = sum(c.get("elapsed_s") or 0 for c in calls) / 60
    commit = (document.get("commit") or {}).get("git_commit")
    plural = "s" if len(calls) != 1 else ""
    return (f"{len(calls)} call{plural} (budget{plural} {budgets} min, "
            f"{elapsed:.1f} min in all); started {document.get('created')}"
            + (f", commit {str(commit)[:12]}." if commit else "."))


def build_report(document: dict[str, Any], out: Path) -> str:
    """results.md for ``document`` (the stages.json dict), reading each stage's ``<name>.json`` from ``out``."""
    environment = read_json(out / "environment.json", missing_ok=True) or {}
    gpus = environment.get("gpus") or []
    device = gpus[0]["name"] if gpus else document.get("device", "?")
    title = "GPU study" + (" (CPU dry run: tiny preset, no CUDA)" if document.get("cpu_dry_run") else f" on {device}")
    lines = [f"# {title}", "",
             f"{_calls_line(document)} `stages.json` has each stage's status, seconds and error line.", "",
             ONE_GPU_CAVEAT, ""]
    if document.get("cpu_dry_run"):
        lines += ["This is a rehearsal on CPU: every stage's code ran with the tiny preset, stages that need CUDA "
                  "were skipped, and no number below says anything about a GPU.", ""]
    lines += table(["stage", "status", "seconds", "estimate s", "error"],
                   [[f"[{e['name']}](#{e['name'].replace('_', '-')})", e["status"], _fmt(e.get("seconds"), ",.0f"),
                     _fmt(e.get("estimate_s"), ",.0f"), e.get("error") or ""] for e in document.get("stages", [])])
    for entry in document.get("stages", []):
        lines += ["", f"## {entry['name']}", "", f"*{entry['title']}.* {entry.get('shows', '')}", ""]
        data = read_json(out / f"{entry['name']}.json", missing_ok=True)
        if entry["status"] in ("pending", "running") or data is None:
            lines.append(f"Status: {entry['status']}" + (f" ({entry['error']})" if entry.get("error") else "") + ".")
            continue
        renderer = RENDERERS.get(entry["name"])
        lines += renderer(data) if renderer else ["```json", json.dumps(data, indent=2)[:4000], "```"]
        problems = entry.get("problems") or []
        if problems:
            lines += ["", "Problems:", *[f"- {p}" for p in problems[:20]]]
    return "\n".join(lines).rstrip() + "\n"
