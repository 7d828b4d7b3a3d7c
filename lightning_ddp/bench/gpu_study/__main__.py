"""``python -m lightning_ddp.bench.gpu_study --out DIR``: every field of ``GPUStudyConfig`` is a flag. Exit status: 0
when every stage that ran is ok, 1 when one failed, 2 for a missing package, a bad command line or no CUDA without
``--cpu_dry_run``, 130 when interrupted.
"""

from __future__ import annotations

import importlib.util
import signal
import sys
import time

from lightning_ddp.bench.gpu_study.config import GPUStudyConfig
from lightning_ddp.command_line import parse_dataclass

REQUIRED: dict[str, str] = {
    "torch": "torch", "lightning": "lightning", "jsonargparse": "jsonargparse", "docstring_parser": "docstring-parser",
    "typeshed_client": "typeshed-client", "yaml": "PyYAML", "einops": "einops", "tensorboard": "tensorboard",
    "matplotlib": "matplotlib", "numpy": "numpy",
}
"""The modules the study's processes import -> the distribution pip installs each from (docs/gpu.md, "Packages")."""


def missing_packages(required: dict[str, str] = REQUIRED) -> list[str]:
    """The distributions of ``required`` whose module this Python cannot import, asked without importing it."""
    missing = []
    for module, distribution in required.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package missing, or a module blocked in sys.modules
            found = False
        if not found:
            missing.append(distribution)
    return missing


def main(args: list[str] | None = None) -> int:
    """Run the GPU study of ``args`` (default: the command line) within ``--budget_min``; returns the exit status:
    0, 1 if a stage failed, 2 for missing packages or a config it refuses, 130 when interrupted."""
    started = time.monotonic()  # this call's budget counts from here
    missing = missing_packages()
    if missing:  # before anything imports them: one line, not a traceback
        print(f"error: missing Python packages: {' '.join(missing)}; install them, e.g. offline from wheels: `pip "
              "install --no-index --no-deps --target /tmp/site wheels/*.whl && export PYTHONPATH=/tmp/site` "
              "(docs/gpu.md)", file=sys.stderr)
        return 2
    config = parse_dataclass(GPUStudyConfig, args, prog="python -m lightning_ddp.bench.gpu_study")
    from lightning_ddp.bench.gpu_study.study import run_study  # after parsing: --help stays fast

    # SIGTERM raises KeyboardInterrupt as SIGINT does: it unwinds through the stage, whose runner kills its processes.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
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
