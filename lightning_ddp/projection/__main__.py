"""``python -m lightning_ddp.projection --config configs/projection/xl_h100.yaml``: every config field is a flag."""

from __future__ import annotations

import functools
import sys

from lightning_ddp.command_line import parse_dataclass
from lightning_ddp.projection.config import ProjectionConfig
from lightning_ddp.projection.run import run_projection


parse_config = functools.partial(parse_dataclass, ProjectionConfig, prog="python -m lightning_ddp.projection")
"""The ``ProjectionConfig`` of a command line; a validation error exits 2 with the message (no traceback)."""


def main(args: list[str] | None = None) -> int:
    """Project the config of ``args`` (default: the command line); returns the exit status: 0, or 2 with the error
    printed for inputs the projection refuses."""
    config = parse_config(args)
    try:
        outcome = run_projection(config)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out = config.output.out_dir
    print(f"{len(outcome.rows)} cells -> {out}/results.csv, {out}/results.md"
          + (f", {len(outcome.files) - 4} plots" if config.output.plots else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
