"""``python -m lightning_ddp.bench.gpu_study --out DIR [--budget_min 9] [--resume true] [--archive FILE]``.

Every field of ``GPUStudyConfig`` is a flag (``--stages [environment,compute]``, ``--cpu_dry_run true``,
``--commit HASH``); ``--help`` documents them. Exit status: 0 when every stage that ran is ok (stages left for a
later ``--resume true`` call are listed on the last line), 1 when one failed, 2 for a missing package, a bad
command line or no CUDA without ``--cpu_dry_run``, 130 when interrupted (what finished is in DIR and the archive).
"""

from __future__ import annotations

import signal
import sys
import time

from lightning_ddp.command_line import parse_dataclass
from lightning_ddp.bench.gpu_study.config import GPUStudyConfig
from lightning_ddp.bench.gpu_study.packages import missing_message, missing_packages


def parse_config(args: list[str] | None = None) -> GPUStudyConfig:
    """The ``GPUStudyConfig`` of a command line; a validation error exits 2 with the message (no traceback)."""
    return parse_dataclass(GPUStudyConfig, args, prog="python -m lightning_ddp.bench.gpu_study")


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds through the stage, whose process runner kills what it started


def main(args: list[str] | None = None) -> int:
    started = time.monotonic()  # this call's budget counts from here
    missing = missing_packages()
    if missing:  # before anything imports them: one line, not a traceback
        print(f"error: {missing_message(missing)}", file=sys.stderr)
        return 2
    config = parse_config(args)
    from lightning_ddp.bench.gpu_study.study import run_study  # after parsing: --help stays fast

    signal.signal(signal.SIGTERM, _terminate)
    try:
        document = run_study(config, started=started)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: the finished stages are in {config.out} (stages.json, results.md)", file=sys.stderr)
        return 130
    return 1 if any(stage["status"] == "failed" for stage in document["stages"]) else 0


if __name__ == "__main__":
    sys.exit(main())
