"""Run the stages in order against the budget; keep ``stages.json`` and ``results.md`` current after every stage.

Recipe (``run_study``):

1. Resolve the checkout (configs/, tests/) and whether CUDA is visible (asked in a child process, so the study's own
   process never holds a CUDA context). Without CUDA only a dry run may go on.
2. Write ``stages.json`` with every stage ``pending`` and its estimate.
3. For each stage in order: ``skipped: not selected`` (``--stages``), ``skipped: no CUDA`` (it needs a GPU and
   none is visible), ``skipped: budget`` (its estimate exceeds what is left), else run it. An exception or a
   problem it reports makes it ``failed`` with one error line; the study goes on. Its data goes to
   ``<name>.json``; then ``stages.json`` (atomically: a temporary file renamed over it) and ``results.md`` are
   rewritten, so a run cut off at any minute leaves everything before it, described.
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

from lightning_ddp.bench.gpu_study.config import GPUStudyConfig, scale_of
from lightning_ddp.bench.gpu_study.stages import STAGES, Stage, StageResult, StudyContext
from lightning_ddp.files import write_atomically

__all__ = ["RESULTS_MD", "STAGES_JSON", "STATUSES", "cuda_available", "repository_root", "run_study"]

STAGES_JSON = "stages.json"
RESULTS_MD = "results.md"
STATUSES = ("pending", "running", "ok", "failed", "skipped: budget", "skipped: no CUDA", "skipped: not selected",
            "interrupted")
"""What a stage's ``status`` in stages.json can be."""


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
    """Whether a child process sees a CUDA device (``torch.cuda.is_available()``), without touching CUDA here."""
    try:
        proc = subprocess.run([sys.executable, "-c", "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"],
                              capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300)
    except subprocess.TimeoutExpired:  # a driver that hangs on the device query: no usable GPU
        return False
    return proc.returncode == 0


def _error_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def run_study(config: GPUStudyConfig, stages: Sequence[Stage] = STAGES, cuda: bool | None = None,
              log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the study of ``config`` (module recipe); returns the final ``stages.json`` document.

    Args:
        config: The command line.
        stages: The stages to run, in order (tests pass their own).
        cuda: Whether CUDA is visible; default: ask a child process.
        log: Where progress lines go (default: print, flushed).
    """
    from lightning_ddp.bench.gpu_study.report import build_report

    say = log or (lambda line: print(line, flush=True))
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    root = repository_root(config.root)
    if cuda is None:
        cuda = cuda_available(config.extra_env)
    if not cuda and not config.cpu_dry_run:
        raise ValueError("no CUDA device is visible (torch.cuda.is_available() is False in a fresh process); the GPU "
                         "study needs one. To rehearse every stage on CPU, add `--cpu_dry_run true`.")
    dry_run = config.cpu_dry_run
    started = time.monotonic()
    ctx = StudyContext(config=config, scale=scale_of(config), out=out, root=root, cuda=cuda,
                       deadline=started + config.budget_min * 60, log=say)
    document: dict[str, Any] = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": sys.argv, "budget_min": config.budget_min, "cpu_dry_run": dry_run, "cuda": cuda,
        "device": ctx.device, "root": str(root), "elapsed_s": 0.0,
        "stages": [{"name": s.name, "title": s.title, "status": "pending", "seconds": None,
                    "estimate_s": s.estimate(dry_run), "error": "", "files": [], "shows": s.shows} for s in stages],
    }

    def save() -> None:
        document["elapsed_s"] = round(time.monotonic() - started, 1)
        write_atomically(out / STAGES_JSON, json.dumps(document, indent=2) + "\n")
        write_atomically(out / RESULTS_MD, build_report(document, out))

    save()
    say(f"GPU study{' (CPU dry run)' if dry_run else ''}: {len(stages)} stages, budget {config.budget_min:g} min, "
        f"results in {out}")
    for stage, entry in zip(stages, document["stages"]):
        estimate = stage.estimate(dry_run)
        if config.stages is not None and stage.name not in config.stages:
            entry["status"] = "skipped: not selected"
        elif stage.needs_cuda and not cuda:
            entry["status"] = "skipped: no CUDA"
        elif estimate > ctx.remaining():
            entry["status"] = "skipped: budget"
            entry["error"] = f"needs ~{estimate:.0f} s, {max(0.0, ctx.remaining()):.0f} s of the budget left"
        else:
            entry["status"] = "running"
            save()
            say(f"[{stage.name}] {stage.title} (~{estimate:.0f} s) ...")
            ctx.stage_estimate_s, ctx.stage_started = estimate, time.monotonic()
            try:
                result = stage.run(ctx)
            except KeyboardInterrupt:
                entry.update(status="interrupted", seconds=round(time.monotonic() - ctx.stage_started, 1),
                             error="interrupted (SIGINT or SIGTERM)")
                save()
                raise
            except Exception as error:  # noqa: BLE001 - one stage's failure is recorded; the study goes on
                result = StageResult(problems=[_error_line(error)])
            entry["seconds"] = round(time.monotonic() - ctx.stage_started, 1)
            if result.data:
                write_atomically(out / f"{stage.name}.json", json.dumps(result.data, indent=2, default=str) + "\n")
                result.files.insert(0, f"{stage.name}.json")
            entry["files"] = result.files
            entry["status"] = "failed" if result.problems else "ok"
            entry["error"] = result.problems[0] if result.problems else ""
            entry["problems"] = result.problems
        save()
        line = f"[{stage.name}] {entry['status']}"
        if entry["seconds"] is not None:
            line += f" in {entry['seconds']:.0f} s"
        say(line + (f": {entry['error']}" if entry["error"] else ""))
    say(f"done in {time.monotonic() - started:.0f} s: {out / RESULTS_MD}")
    return document
