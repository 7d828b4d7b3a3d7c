"""``python -m lightning_ddp advise RUN_DIR``, optionally ``--world_sizes '[8, 64]' --network nvlink4`` and
``--device_memory_gib 80``: docs/advice.md."""

from __future__ import annotations

import sys
from typing import Optional

from jsonargparse import ArgumentParser

from lightning_ddp.advice.calibrate import read_run
from lightning_ddp.advice.recommend import advise
from lightning_ddp.advice.report import render_markdown, write_advice


def main(argv: list[str] | None = None) -> int:
    """Advise on RUN_DIR: print advice.md, write it and advice.json there; a bad folder is one line, exit 2."""
    parser = ArgumentParser(prog="python -m lightning_ddp advise", description=__doc__)
    parser.add_argument("run_dir", help="the folder where the CommTimer wrote timing_summary.json")
    parser.add_argument("--world_sizes", type=list[int], default=[], help="also project to these world sizes")
    parser.add_argument("--network", type=Optional[str], default=None,
                        help="a fabric preset for --world_sizes (default: the run's all-reduce fit)")
    parser.add_argument("--device_memory_gib", type=Optional[float], default=None,
                        help="the device's memory (a CPU run's is not known)")
    args = parser.parse_args(argv)
    try:
        document = advise(read_run(args.run_dir), args.world_sizes, args.network, args.device_memory_gib)
    except ValueError as error:  # RunError: RUN_DIR; else an option (an unknown --network)
        print(f"error: {error}", file=sys.stderr)
        return 2
    write_advice(args.run_dir, document)
    print(render_markdown(document))
    return 0


if __name__ == "__main__":
    sys.exit(main())
