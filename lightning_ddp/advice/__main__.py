"""``python -m lightning_ddp advise RUN_DIR [--world_sizes 8 64] [--network nvlink4] [--device_memory_gib 80]``."""

from __future__ import annotations

import argparse
import sys

from lightning_ddp.advice.calibrate import RunError, read_run
from lightning_ddp.advice.recommend import advise
from lightning_ddp.advice.report import render_markdown, write_advice


def main(argv: list[str] | None = None) -> int:
    """Advise on RUN_DIR: print advice.md, write it and advice.json there; a bad folder is one line, exit 2."""
    parser = argparse.ArgumentParser(prog="python -m lightning_ddp advise", description=__doc__)
    parser.add_argument("run_dir", help="the folder where the CommTimer wrote timing_summary.json")
    parser.add_argument("--world_sizes", type=int, nargs="*", default=[], help="also project to these world sizes")
    parser.add_argument("--network", default=None, help="a fabric preset for --world_sizes (default: the run's fit)")
    parser.add_argument("--device_memory_gib", type=float, default=None, help="device memory (CPU runs: not known)")
    args = parser.parse_args(argv)
    try:
        document = advise(read_run(args.run_dir), args.world_sizes, args.network, args.device_memory_gib)
    except RunError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    write_advice(args.run_dir, document)
    print(render_markdown(document))
    return 0


if __name__ == "__main__":
    sys.exit(main())
