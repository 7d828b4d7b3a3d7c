"""The stages in order within this call's budget, ``stages.json`` and ``results.md`` rewritten after each, so that
a call cut short is finished by another (``--resume true``); ``--archive``: docs/gpu.md, "How a call is budgeted"."""

from __future__ import annotations

import io
import json
import math
import os
import re
import string
import subprocess
import sys
import tarfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from lightning_ddp.bench.gpu_study.config import GPUStudyConfig, repository_root
from lightning_ddp.bench.gpu_study.scales import DRY_RUN_SCALE, GPU_SCALE
from lightning_ddp.bench.gpu_study.stages import STAGES, Column, Stage, StageResult, StudyContext, Table
from lightning_ddp.bench.study import print_flushed, read_json, write_outputs
from lightning_ddp.files import write_atomically, write_json_atomically
from lightning_ddp.reporting.provenance import git_state, repo_relative
from lightning_ddp.reporting.tables import markdown_table

DONE = ("ok", "skipped: no CUDA", "skipped: not selected")
"""The statuses that leave nothing to do (``complete`` in stages.json); ``--resume true`` runs every other again."""


def cuda_available() -> bool:
    """Whether a child process sees a CUDA device, without touching CUDA here."""
    code = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300).returncode == 0
    except subprocess.TimeoutExpired:  # a driver that hangs on the device query: no usable GPU
        return False


def check_budget(stages: Sequence[Stage], budget_min: float, dry_run: bool = False) -> None:
    """Refuse a budget in which one of ``stages`` could never start (it would be skipped call after call)."""
    for stage in stages:
        seconds = stage.estimate.seconds(dry_run)
        if seconds > budget_min * 60:
            raise ValueError(f"stage {stage.name} needs ~{seconds:.0f} s, more than `--budget_min {budget_min:g}` "
                             f"gives a call; give it at least {seconds / 60:.1f} minutes (default 9)")


def _new_document(config: GPUStudyConfig, stages: Sequence[Stage], ctx: StudyContext) -> dict[str, Any]:
    """stages.json for this call: every stage pending, except those the stages.json in ``--out`` has ``ok`` (kept
    unchanged), which ``--resume true`` must continue, and never one of the other kind (dry run or GPU)."""
    path = ctx.out / "stages.json"
    previous: dict[str, Any] = {}
    kept: dict[str, dict[str, Any]] = {}  # the entries of the stages already ok, by name
    if path.exists():
        try:
            previous = json.loads(path.read_text())
            kept = {entry["name"]: entry for entry in previous["stages"] if entry["status"] == "ok"}
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path} is not a GPU study's stages.json ({error}); choose another --out") from None
        if not config.resume:
            raise ValueError(f"{ctx.out} already holds a study ({len(kept)} stages ok); add `--resume true` to keep "
                             "them and run the rest, or choose another --out")
        if bool(previous.get("cpu_dry_run")) != config.cpu_dry_run:
            kinds = {True: "a CPU dry run", False: "a GPU study"}
            raise ValueError(f"{ctx.out} holds {kinds[bool(previous.get('cpu_dry_run'))]}, and this call is "
                             f"{kinds[config.cpu_dry_run]}; choose another --out")
    call = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": [repo_relative(arg) for arg in sys.argv], "budget_min": config.budget_min}
    if config.commit:
        state = {"git_commit": config.commit, "git_commit_source": "--commit"}
    else:
        state = git_state()
    return {
        "created": previous.get("created", call["started"]),
        "command": call["command"], "budget_min": config.budget_min, "cpu_dry_run": config.cpu_dry_run,
        "cuda": ctx.cuda, "device": ctx.scale.device, "root": repo_relative(str(ctx.root)), "elapsed_s": 0.0,
        "commit": {"git_commit": state["git_commit"], "source": state["git_commit_source"]},
        "calls": [*previous.get("calls", []), call], "complete": False,
        "stages": [kept.get(stage.name) or _pending(stage, config.cpu_dry_run) for stage in stages],
    }


def _pending(stage: Stage, dry_run: bool) -> dict[str, Any]:
    """The stages.json entry of ``stage`` before it runs."""
    return {"name": stage.name, "title": stage.title, "status": "pending", "seconds": None,
            "estimate_s": stage.estimate.seconds(dry_run), "error": "", "estimate_basis": stage.estimate.basis(dry_run),
            "files": []}


def _skip_reason(stage: Stage, ctx: StudyContext, remaining: float) -> tuple[str, str] | None:
    """``(status, error)`` when ``stage`` does not run with ``remaining`` seconds of the budget left, else None."""
    estimate = stage.estimate.seconds(ctx.config.cpu_dry_run)
    if ctx.config.stages is not None and stage.name not in ctx.config.stages:
        return "skipped: not selected", ""
    if stage.needs_cuda and not ctx.cuda:
        return "skipped: no CUDA", ""
    if estimate > remaining:
        return "skipped: budget", f"needs ~{estimate:.0f} s, {max(0.0, remaining):.0f} s of the budget left"
    return None


def _run_stage(stage: Stage, entry: dict[str, Any], ctx: StudyContext, save: Callable[[], None]) -> None:
    """Run one stage and record it in ``entry`` (status, seconds, files, error line, problems)."""
    entry.update(status="running", seconds=None, error="", files=[])
    entry.pop("problems", None)
    save()
    ctx.stage_estimate_s, ctx.stage_started = stage.estimate.seconds(ctx.config.cpu_dry_run), time.monotonic()
    ctx.log(f"[{stage.name}] {stage.title} (~{ctx.stage_estimate_s:.0f} s) ...")
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
    entry.update(files=result.files, status="ok", error="", problems=result.problems)
    if result.problems:
        entry.update(status="failed", error=result.problems[0])


def run_study(config: GPUStudyConfig, stages: Sequence[Stage] = STAGES, cuda: bool | None = None,
              log: Callable[[str], None] | None = None, started: float | None = None) -> dict[str, Any]:
    """Run the study of ``config``; returns the final ``stages.json`` document. ``cuda`` default: ask a child
    process; ``started``: ``time.monotonic()`` when the call began (the budget counts from it; default: now)."""
    started = time.monotonic() if started is None else started
    say = log or print_flushed
    out = Path(config.out)
    root = repository_root(config.root)
    cuda = cuda_available() if cuda is None else cuda
    if not cuda and not config.cpu_dry_run:
        raise ValueError("no CUDA device is visible (torch.cuda.is_available() is False in a fresh process); the GPU "
                         "study needs one. To rehearse every stage on CPU, add `--cpu_dry_run true`.")
    scale = DRY_RUN_SCALE if config.cpu_dry_run else GPU_SCALE
    ctx = StudyContext(config=config, scale=scale, out=out, root=root, cuda=cuda,
                       deadline=started + config.budget_min * 60, log=say)
    document = _new_document(config, stages, ctx)
    check_budget([stage for stage, entry in zip(stages, document["stages"])
                  if entry["status"] != "ok" and _skip_reason(stage, ctx, math.inf) is None],
                 config.budget_min, config.cpu_dry_run)

    def save() -> None:
        document["elapsed_s"] = document["calls"][-1]["elapsed_s"] = round(time.monotonic() - started, 1)
        document["complete"] = all(e["status"] in DONE for e in document["stages"])
        write_outputs(out, {"stages.json": document, "results.md": build_report(document, out, stages, root)})

    kept = sum(e["status"] == "ok" for e in document["stages"])
    kind = "GPU study (CPU dry run)" if config.cpu_dry_run else "GPU study"
    kept_note = f" ({kept} already ok, kept)" if kept else ""
    say(f"{kind}: {len(stages)} stages{kept_note}, budget {config.budget_min:g} min, results in {out}")
    try:
        save()
        for stage, entry in zip(stages, document["stages"]):
            if entry["status"] == "ok":
                continue
            skip = _skip_reason(stage, ctx, ctx.remaining())
            if skip is None:
                _run_stage(stage, entry, ctx, save)
            else:
                entry.update(status=skip[0], error=skip[1], seconds=None)
            save()
            say(_stage_line(stage, entry))
    finally:
        if config.archive:
            contents = write_archive(out, Path(config.archive))
            left_out = f"; left out: {', '.join(contents['left_out'][:5])}" if contents["left_out"] else ""
            say(f"archive: {config.archive} ({contents['size_bytes'] / 2**20:.1f} MiB, {len(contents['files'])} "
                f"files{left_out})")
    left = [e["name"] for e in document["stages"] if e["status"] not in DONE]
    if left:
        ending = f"not done yet: {', '.join(left)} (run again with --resume true)"
    else:
        ending = "every stage done"
    say(f"done in {time.monotonic() - started:.0f} s: {out / 'results.md'}; {ending}")
    return document


def _stage_line(stage: Stage, entry: dict[str, Any]) -> str:
    """The log line of a stage that has ended: its status, seconds against the estimate, and error."""
    line = f"[{stage.name}] {entry['status']}"
    if entry["seconds"] is not None:
        line += f" in {entry['seconds']:.0f} s (estimate {entry['estimate_s']:.0f} s)"
    if entry["error"]:
        line += f": {entry['error']}"
    return line


# ---- results.md: each stage's caption and tables over its <name>.json -------------------------------------------


class _Cells(string.Formatter):
    """How results.md shows a value: ``–`` for none, ``GiB`` for bytes in GiB, else ``format(value, spec)``; as a
    ``str.format`` over a stage's data (its caption), a missing field shows as ``–``."""

    def get_field(self, field_name: str, args: Sequence[Any], kwargs: Any) -> Any:
        """The field's value, or ``None`` (shown as ``–``) for a field the data lacks."""
        try:
            return super().get_field(field_name, args, kwargs)
        except (KeyError, IndexError, TypeError):
            return None, field_name

    def format_field(self, value: Any, format_spec: str) -> str:
        """``value`` in ``format_spec``: ``–`` for none, empty or not finite; ``GiB``: bytes in GiB to
        1 decimal; a value the spec does not fit, as text."""
        if value is None or value == "" or (isinstance(value, float) and not math.isfinite(value)):
            return "–"
        if format_spec == "GiB" and isinstance(value, (int, float)):
            return f"{value / 2**30:.1f}"
        try:
            return format(value, format_spec)
        except (TypeError, ValueError):  # a text where a number was expected
            return str(value)


cell = _Cells().format_field
"""One value as results.md shows it (``_Cells.format_field``)."""


def _table(table: Table, data: dict[str, Any]) -> list[str]:
    """The lines of one of a stage's tables."""
    rows = table.rows(data)
    if not rows:
        return ["", "No rows."]
    align = "".join("l" if column.format == "" else "r" for column in table.columns)
    values = [[cell(_value(column, row), column.format) for column in table.columns] for row in rows]
    return [""] + markdown_table([column.header for column in table.columns], values, align)


def _value(column: Column, row: dict[str, Any]) -> Any:
    """The row's value in ``column``: its function of the row, or the row's field of that name."""
    if callable(column.value):
        return column.value(row)
    return row.get(column.value)


def docs_reference(out: Path, root: Path | None, section: str) -> str:
    """A reference from results.md in ``out`` to a section of docs/gpu.md: a relative link where ``out`` is inside
    the checkout ``root`` (it holds wherever the checkout goes), else the page and section by name."""
    if root is None or not out.resolve().is_relative_to(root.resolve()):
        return f'docs/gpu.md, "{section}"'
    link = Path(os.path.relpath(root.resolve() / "docs" / "gpu.md", out.resolve())).as_posix()
    return f"[docs/gpu.md, {section}]({link}#{re.sub(r'[^a-z0-9 -]', '', section.lower()).replace(' ', '-')})"


def build_report(document: dict[str, Any], out: Path, stages: Sequence[Stage] = STAGES, root: Path | None = None,
                 ) -> str:
    """results.md for ``document`` (the stages.json dict), reading each stage's ``<name>.json`` from ``out``; links to
    docs/gpu.md where ``out`` is inside the checkout ``root``."""
    gpus = (read_json(out / "environment.json", missing_ok=True) or {}).get("gpus") or []
    device = gpus[0]["name"] if gpus else document.get("device", "?")
    title = "GPU study" + (" (CPU dry run: tiny preset, no CUDA)" if document.get("cpu_dry_run") else f" on {device}")
    calls = document.get("calls") or [document]
    plural = "s" if len(calls) != 1 else ""
    budgets = " + ".join(f"{c.get('budget_min', 0):g}" for c in calls)
    commit = (document.get("commit") or {}).get("git_commit")
    lines = [f"# {title}", "",
             f"{len(calls)} call{plural} (budget{plural} {budgets} min, "
             f"{sum(c.get('elapsed_s') or 0 for c in calls) / 60:.1f} min in all); started {document.get('created')}"
             + (f", commit {str(commit)[:12]}" if commit else "") + ". `stages.json` has each stage's status, seconds "
             "and error line.", "",
             "**Two ranks on one GPU time-slice it.** The step times of `traces` are not 2-GPU step times "
             f"({docs_reference(out, root, 'Reading the 2-rank numbers')}).", ""]
    if document.get("cpu_dry_run"):
        lines += ["A rehearsal on CPU with the tiny preset: no number below says anything about a GPU.", ""]
    lines += markdown_table(["stage", "status", "seconds", "estimate s", "error"], align="llrrl", rows=[
                             [f"[{e['name']}](#{e['name']})", e["status"],
                              cell(e.get("seconds"), ",.0f"), cell(e.get("estimate_s"), ",.0f"), e.get("error") or ""]
                             for e in document.get("stages", [])])
    specs = {stage.name: stage for stage in stages}
    for entry in document.get("stages", []):
        lines += ["", f"## {entry['name']}", "", f"*{entry['title']}* ({docs_reference(out, root, 'Stages')}).", ""]
        data = read_json(out / f"{entry['name']}.json", missing_ok=True)
        if entry["status"] in ("pending", "running") or data is None:
            lines.append(f"Status: {entry['status']}" + (f" ({entry['error']})" if entry.get("error") else "") + ".")
            continue
        stage = specs[entry["name"]]
        if stage.caption:
            lines.append(_Cells().format(stage.caption, **data))
        for table in stage.tables:
            lines += _table(table, data)
        if entry.get("problems"):
            lines += ["", "Problems:", *[f"- {p}" for p in entry["problems"][:20]]]
    return "\n".join(lines).rstrip() + "\n"


# ---- the archive: what is worth committing, small enough to come back from a GPU machine -----------------------

ARCHIVE_LIMIT = 16 * 2**20  # bytes before compression: a file the GPU machine sends back may have 16 MiB
FILE_LIMIT = 2 * 2**20  # bytes one file may have: a raw profiler trace is larger, its picture is not
KEPT_SUFFIXES = (".json", ".csv", ".md", ".png", ".svg", ".xml", ".log", ".txt")
"""The only suffixes an archive keeps: results, logs and pictures (no weights, no checkpoints)."""
ALWAYS = ("stages.json", "results.md")
"""Files every archive holds first, whatever their size."""
CONTENTS = "archive_contents.json"
"""The archive's own listing: what it holds and what the limits left out."""


def select_files(out: Path, limit: int = ARCHIVE_LIMIT, file_limit: int = FILE_LIMIT) -> dict[str, Any]:
    """``{"files", "left_out", "size_bytes"}``: the files of ``out`` to archive (``ALWAYS``, then the smallest first
    while they fit), and ``"PATH (why)"`` of each file a suffix would keep but the limits leave out."""
    candidates = []
    for path in sorted(out.rglob("*")):
        relative = path.relative_to(out)
        if path.is_file() and relative.name != CONTENTS and path.suffix in KEPT_SUFFIXES:
            candidates.append((relative.as_posix(), path.stat().st_size))
    contents: dict[str, Any] = {"files": [], "left_out": [], "size_bytes": 0}
    for name, size in sorted(candidates, key=lambda c: (c[0] not in ALWAYS, c[1], c[0])):
        if name not in ALWAYS and size > file_limit:
            contents["left_out"].append(f"{name} ({size:,} B: over {file_limit:,} B a file)")
        elif name not in ALWAYS and contents["size_bytes"] + size > limit:
            contents["left_out"].append(f"{name} ({size:,} B: the archive would pass {limit:,} B)")
        else:
            contents["files"].append(name)
            contents["size_bytes"] += size
    contents["files"].sort()
    return contents


def write_archive(out: Path, archive: Path) -> dict[str, Any]:
    """Write ``archive`` (whole or not at all) of the files ``select_files`` keeps, ``CONTENTS`` listing them."""
    contents = select_files(out)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in contents["files"]:
            tar.add(out / name, arcname=name, recursive=False)
        listing = json.dumps(contents, indent=2).encode()
        info = tarfile.TarInfo(CONTENTS)
        info.size = len(listing)
        tar.addfile(info, io.BytesIO(listing))
    write_atomically(archive, buffer.getvalue())
    return contents
