"""``python -m lightning_ddp.trace RUN_DIR_OR_TRACES... -o timeline.png``: draw runs as stacked timelines.
Each directory is one run (a logger's folder: its latest run with traces); files are grouped by directory.
The overlap printed is HTA's, not the CommTimer's ``comm/overlap`` (docs/tensorboard.md, "Two overlaps").
"""

from __future__ import annotations

import sys
from pathlib import Path

from jsonargparse import ArgumentParser

from lightning_ddp.trace import COMM_SOURCES, OVERLAP_DEFINITION, load_run, render_timeline


def main(argv: list[str] | None = None) -> None:
    """Draw the runs of ``argv`` (default: the command line) into ``--output``; print each run's folder, the overlaps
    and the picture's path. A folder or file without a usable trace exits with status 2 and the error."""
    parser = ArgumentParser(prog="python -m lightning_ddp.trace", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="run log directories or *.pt.trace.json files (one run per directory)")
    parser.add_argument("-o", "--output", default="timeline.png", help="picture to write (default: timeline.png)")
    parser.add_argument("--label", action="append", default=None,
                        help="name of a run, once per run in order (default: the strategy recorded in the trace)")
    parser.add_argument("--steps", type=int, default=None, help="draw only each rank's first N recorded steps")
    parser.add_argument("--comm-source", choices=COMM_SOURCES, default="auto",
                        help="collectives from the SyncRecord track (record), from gloo threads / NCCL kernels "
                             "(profiler), or the track where there is one (auto)")
    parser.add_argument("--title", default=None, help="figure title")
    args = parser.parse_args(argv)

    groups: dict[Path, list[Path]] = {}  # in the order given
    for p in map(Path, args.paths):
        groups.setdefault(p if p.is_dir() else p.parent, []).append(p)
    if args.label is not None and len(args.label) != len(groups):
        parser.error(f"got {len(args.label)} --label for {len(groups)} runs; give one per run, in order")
    labels = args.label or [None] * len(groups)
    try:
        runs = [load_run(paths, label) for paths, label in zip(groups.values(), labels)]
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    for run in runs:
        print(f"{run.label}: {Path(run.ranks[0].path).parent}")  # which run a logger's folder stood for
    timeline = render_timeline(runs, args.output, steps=args.steps, comm_source=args.comm_source, title=args.title)
    print(timeline.summary())
    print(f"({OVERLAP_DEFINITION})")
    print(f"wrote {timeline.path}")


if __name__ == "__main__":
    main()
