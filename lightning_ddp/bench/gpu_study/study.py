"""Run the stages in order against this call's budget, rewriting ``stages.json`` and ``results.md`` after every
stage, so that several short calls (``--resume true``) finish the study.

A stage's status: ``pending``, ``running``, ``ok``, ``failed`` (with one error line), ``interrupted``, ``skipped:
not selected``, ``skipped: no CUDA`` or ``skipped: budget`` (its estimate exceeds what is left). docs/gpu.md says
how a call is budgeted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from lightning_ddp.bench.gpu_study.archive import write_archive
from lightning_ddp.bench.gpu_study.config import GPUStudyConfig, scale_of
from lightning_ddp.bench.gpu_study.stages import STAGES, Stage, StageResult, StudyContext
from lightning_ddp.files import write_atomically, write_json_atomically
from lightning_ddp.provenance import git_state, repo_relative

__all__ = ["DONE", "cuda_available", "plan_calls", "repository_root", "run_study"]

DONE = ("ok", "skipped: no CUDA", "skipped: not selected")
"""The statuses that leave nothing to do (``complete`` in stages.json); ``--resume true`` runs every other again."""


def repository_root(root: str | None = None) -> Path:
    """The checkout the stages read configs/ and tests/ from: ``root``, else the one holding this package, else the
    current directory; it must have ``configs/bench``."""
    candidates = [Path(root)] if root else [Path(__file__).resolve().parents[3], Path.cwd()]
    for candidate in candidates:
        if (candidate / "configs" / "bench").is_dir():
            return candidate.resolve()
    where = root or f"{candidates[0]} or {candidates[1]}"
    raise ValueError(f"no configs/bench under {where}: the study reads the repository's configs and tests; run it "
                     "from a checkout of the repository or pass --root CHECKOUT")


def cuda_available(env: dict[str, str] | None = None) -> bool:
    """Whether a child process sees a CUDA device, without touching CUDA here."""
    try:
        code = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**os.environ, **(env or {})}, timeout=300)
    except subprocess.TimeoutExpired:  # a driver that hangs on the device query: no usable GPU
        return False
    return proc.returncode == 0


def plan_calls(stages: Sequence[Stage], budget_min: float, dry_run: bool = False) -> list[list[str]]:
    """The stages each call of ``--resume true --budget_min budget_min`` runs if every stage takes its estimate: a
    stage runs when its estimate fits what is left of the call. Raises ``ValueError`` if a stage fits no call."""
    budget_s = budget_min * 60
    for stage in stages:
        needs_s = stage.estimate(dry_run)
        if needs_s > budget_s:
            raise ValueError(f"stage {stage.name} needs ~{needs_s:.0f} s, more than `--budget_min {budget_min:g}` "
                             f"gives a call; give it at least {needs_s / 60:.1f} minutes (default 9)")
    calls, left = [], list(stages)
    while left:
        remaining, call = budget_s, []
        for stage in list(left):
            if stage.estimate(dry_run) <= remaining:
                remaining -= stage.estimate(dry_run)
                call.append(stage.name)
                left.remove(stage)
        calls.append(call)
    return calls


def _previous_document(out: Path, config: GPUStudyConfig) -> dict[str, Any] | None:
    """The stages.json in ``out`` that ``--resume`` continues (None: none); refused without ``--resume``, and
    always where it is of the other kind (dry run / GPU)."""
    path = out / "stages.json"
    if not path.exists():
        return None
    try:
        previous = json.loads(path.read_text())
        done = [entry["name"] for entry in previous["stages"] if entry["status"] == "ok"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not a GPU study's stages.json ({error}); choose another --out") from None
    if not config.resume:
        raise ValueError(f"{out} already holds a study ({len(done)} stages ok); add `--resume true` to keep them and "
                         "run the rest, or choose another --out")
    if bool(previous.get("cpu_dry_run")) != config.cpu_dry_run:
        kinds = {True: "a CPU dry run", False: "a GPU study"}
        raise ValueError(f"{out} holds {kinds[bool(previous.get('cpu_dry_run'))]}, and this call is "
                         f"{kinds[config.cpu_dry_run]}; choose another --out")
    return previous


def _new_document(config: GPUStudyConfig, stages: Sequence[Stage], ctx: StudyContext,
                  previous: dict[str, Any]) -> dict[str, Any]:
    """stages.json for this call: every stage pending, except those ``previous`` has ``ok`` (kept unchanged)."""
    kept = {e["name"]: e for e in previous.get("stages", []) if e.get("status") == "ok"}
    call = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": [repo_relative(arg) for arg in sys.argv], "budget_min": config.budget_min}
    if config.commit:
        commit = {"git_commit": config.commit, "source": "--commit"}
    else:
        state = git_state()
        commit = {"git_commit": state["git_commit"], "source": state["git_commit_source"]}
    return {
        "created": previous.get("created", call["started"]),
        "command": call["command"], "budget_min": config.budget_min, "cpu_dry_run": config.cpu_dry_run,
        "cuda": ctx.cuda, "device": ctx.device, "root": repo_relative(str(ctx.root)), "elapsed_s": 0.0,
        "commit": commit, "calls": [*previous.get("calls", []), call], "complete": False,
        "stages": [kept.get(s.name) or {"name": s.name, "title": s.title, "status": "pending", "seconds": None,
                                        "estimate_s": s.estimate(config.cpu_dry_run), "error": "", "files": [],
                                        "shows": s.shows} for s in stages],
    }


def _skip_reason(stage: Stage, ctx: StudyContext) -> tuple[str, str] | None:
    """``(status, error)`` when ``stage`` does not run in this call, else None."""
    estimate = stage.estimate(ctx.config.cpu_dry_run)
    if ctx.config.stages is not None and stage.name not in ctx.config.stages:
        return "skipped: not selected", ""
    if stage.needs_cuda and not ctx.cuda:
        return "skipped: no CUDA", ""
    if estimate > ctx.remaining():
        return "skipped: budget", f"needs ~{estimate:.0f} s, {max(0.0, ctx.remaining()):.0f} s of the budget left"
    return None


def _run_stage(stage: Stage, entry: dict[str, Any], ctx: StudyContext, save: Callable[[], None]) -> None:
    """Run one stage and record it in ``entry`` (status, seconds, files, error line, problems)."""
    entry.update(status="running", seconds=None, error="", files=[])
    entry.pop("problems", None)
    save()
    estimate = stage.estimate(ctx.config.cpu_dry_run)
    ctx.log(f"[{stage.name}] {stage.title} (~{estimate:.0f} s) ...")
    ctx.stage_estimate_s, ctx.stage_started = estimate, time.monotonic()
    try:
        result = stage.run(ctx)
    except KeyboardInterrupt:
        entry.update(status="interrupted", seconds=round(time.monotonic() - ctx.stage_started, 1),
                     error="interrupted (SIGINT or SIGTERM)")
        save()
        raise
    except Exception as error:  # noqa: BLE001 - one stage's failure is recorded; the study goes on
        text = str(error).strip().splitlines()
        result = StageResult(problems=[f"{type(error).__name__}: {text[0] if text else ''}"[:300]])
    entry["seconds"] = round(time.monotonic() - ctx.stage_started, 1)
    if result.data:
        write_json_atomically(ctx.out / f"{stage.name}.json", result.data, default=str)
        result.files.insert(0, f"{stage.name}.json")
    entry.update(files=result.files, status="failed" if result.problems else "ok",
                 error=result.problems[0] if result.problems else "", problems=result.problems)


def run_study(config: GPUStudyConfig, stages: Sequence[Stage] = STAGES, cuda: bool | None = None,
              log: Callable[[str], None] | None = None, started: float | None = None) -> dict[str, Any]:
    """Run the study of ``config``; returns the final ``stages.json`` document. ``cuda`` default: ask a child
    process; ``log``: where progress lines go (default: print); ``started``: ``time.monotonic()`` when the call
    began (the budget counts from it; default: now)."""
    from lightning_ddp.bench.gpu_study.report import build_report

    started = time.monotonic() if started is None else started
    say = log or (lambda line: print(line, flush=True))
    out = Path(config.out)
    root = repository_root(config.root)
    previous = _previous_document(out, config)
    if cuda is None:
        cuda = cuda_available(config.extra_env)
    if not cuda and not config.cpu_dry_run:
        raise ValueError("no CUDA device is visible (torch.cuda.is_available() is False in a fresh process); the GPU "
                         "study needs one. To rehearse every stage on CPU, add `--cpu_dry_run true`.")
    ctx = StudyContext(config=config, scale=scale_of(config), out=out, root=root, cuda=cuda,
                       deadline=started + config.budget_min * 60, log=say)
    document = _new_document(config, stages, ctx, previous or {})
    # Refuse a budget in which a stage left to run could never start (it would be skipped call after call).
    selected = config.stages or [stage.name for stage in stages]
    left = [stage for stage, entry in zip(stages, document["stages"])
            if entry["status"] != "ok" and stage.name in selected and (cuda or not stage.needs_cuda)]
    plan_calls(left, config.budget_min, config.cpu_dry_run)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        document["elapsed_s"] = round(time.monotonic() - started, 1)
        document["calls"][-1]["elapsed_s"] = document["elapsed_s"]
        document["complete"] = all(e["status"] in DONE for e in document["stages"])
        write_json_atomically(out / "stages.json", document)
        write_atomically(out / "results.md", build_report(document, out))

    kept = sum(e["status"] == "ok" for e in document["stages"])
    say(f"GPU study{' (CPU dry run)' if config.cpu_dry_run else ''}: {len(stages)} stages"
        f"{f' ({kept} already ok, kept)' if kept else ''}, budget {config.budget_min:g} min, results in {out}")
    try:
        save()
        for stage, entry in zip(stages, document["stages"]):
            if entry["status"] == "ok":
                continue
            skip = _skip_reason(stage, ctx)
            if skip is None:
                _run_stage(stage, entry, ctx, save)
            else:
                entry.update(status=skip[0], error=skip[1], seconds=None)
            save()
            line = f"[{stage.name}] {entry['status']}"
            if entry["seconds"] is not None:
                line += f" in {entry['seconds']:.0f} s"
            say(line + (f": {entry['error']}" if entry["error"] else ""))
    finally:
        if config.archive:
            contents = write_archive(out, Path(config.archive))
            say(f"archive: {config.archive} ({contents.size_bytes / 2**20:.1f} MiB, {len(contents.files)} files"
                + (f"; left out: {', '.join(contents.left_out[:5])}" if contents.left_out else "") + ")")
    left = [e["name"] for e in document["stages"] if e["status"] not in DONE]
    say(f"done in {time.monotonic() - started:.0f} s: {out / 'results.md'}"
        + (f"; not done yet: {', '.join(left)} (run again with --resume true)" if left else "; every stage done"))
    return document
