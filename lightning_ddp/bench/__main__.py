"""``python -m lightning_ddp.bench --config configs/bench/cpu.yaml``: run (or resume) a benchmark sweep; every config
field is a flag too (``--run.steps 20``), ``--help`` documents them, ``--print_config`` shows the merged result."""

from __future__ import annotations

import signal
import sys

from lightning_ddp.command_line import parse_dataclass
from lightning_ddp.bench.config import SweepConfig


def main(args: list[str] | None = None) -> int:
    """Run or resume the sweep of ``args`` (default: the command line); returns the exit status: 0 once a cell is ok
    (or the grid is empty), 1 if none is, 2 for a config the sweep refuses, 130 when interrupted (SIGINT or SIGTERM)."""
    config = parse_dataclass(SweepConfig, args, prog="python -m lightning_ddp.bench")
    from lightning_ddp.bench.sweep import run_sweep  # after parsing: --help stays fast

    # SIGTERM raises KeyboardInterrupt: it unwinds through the runner, which kills the running cell's processes
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        result = run_sweep(config)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: finished cell repeats are in repeats.csv and steps.csv; rerun the same command to resume",
              file=sys.stderr)
        return 130
    return 0 if result.ok or not result.cells else 1


if __name__ == "__main__":
    sys.exit(main())
