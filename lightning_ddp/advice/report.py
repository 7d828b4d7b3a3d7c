"""advice.md from advice.json's document, and both written into the run's folder atomically."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_ddp import catalogue
from lightning_ddp.files import write_atomically, write_json_atomically

SHOWN = 12
"""Rows of advice.md's table, each strategy at its best setting and the current one (advice.json has all)."""


def _row(r: dict[str, Any]) -> list[str]:
    lo, hi = r["predicted_step_interval"]
    glo, ghi = r["gain_interval"]
    flags = " ".join(flag for flag, on in (("current", r["current"]), ("lossy", not r["exact"]),
                                            ("sharded", r["sharded"])) if on)
    return [catalogue.variant_label(r["strategy"], r["settings"].get("bucket_size_mb")), flags or "-",
            f"{r['predicted_step_ms']:.1f} [{lo:.1f}, {hi:.1f}]", f"{r['predicted_share']:.1%}",
            f"{r['gain']:+.0%} [{glo:+.0%}, {ghi:+.0%}]", f"{r['memory_GiB']:.3f}"]


def render_markdown(document: dict[str, Any]) -> str:
    """The verdict, how to apply it, and the best predictions first."""
    run, calibration, verdict = document["run"], document["calibration"], document["verdict"]
    lines = [f"# Advice for {run['path']}", "",
             f"Current: {run['strategy']} on {run['world_size']} ranks ({run['backend']}), step {run['step_ms']:.1f} "
             f"ms, exposed communication {run['exposed_ms'] or 0:.1f} ms.", "", f"**Verdict: {verdict['text']}.**", ""]
    top = verdict.get("top")
    if top is not None and verdict["action"] == "change":
        applied = " ".join(top["fit_args"][:1] + [f"'{a}'" for a in top["fit_args"][1:]])
        lines += [f"Apply: `{applied}`" if applied else f"Apply: `{top['python']}`", "",
                  "```yaml", top["yaml"].rstrip(), "```", ""]
    for name, saved in verdict.get("memory", {}).get("sharding_saves_GiB", {}).items():
        lines.append(f"- memory: {name} saves {saved:.2f} GiB per rank")
    header = "| strategy | | predicted step ms [interval] | exposed share | gain [interval] | state GiB/rank |"
    lines += [header, "|---|---|---:|---:|---:|---:|"]
    seen: set[str] = set()
    shown = [r for r in document["recommendations"]
             if r["current"] or (r["strategy"] not in seen and not seen.add(r["strategy"]))]
    lines += ["| " + " | ".join(_row(r)) + " |" for r in shown[:SHOWN]]
    lines += ["", f"Intervals: +-{calibration['projection_error']:.1%} (docs/advice.md). Communication scaled "
              f"x{calibration['comm_factor']:.3g} to the measured busy time, the step x{calibration['scale']:.3g} "
              "to the measured step.", *[f"- {note}" for note in calibration["notes"]]]
    for n, best in document.get("scales", {}).items():
        lines.append(f"- {n} ranks: " + "; ".join(
            f"{b['strategy']} {b['predicted_step_ms']:.1f} ms" for b in best[:3]))
    return "\n".join(lines) + "\n"


def write_advice(run_dir: str | Path, document: dict[str, Any]) -> tuple[Path, Path]:
    """advice.json and advice.md into ``run_dir``, each whole or not at all."""
    return (write_json_atomically(Path(run_dir) / "advice.json", document, allow_nan=False),
            write_atomically(Path(run_dir) / "advice.md", render_markdown(document)))
