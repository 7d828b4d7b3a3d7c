"""The Python packages the GPU study's processes import, checked before anything imports them.

A GPU machine's Python often lacks a few (jsonargparse and the two packages of its ``signatures`` extra, which
Lightning's CLI needs); without this check the first stage would end in a traceback. ``missing_packages`` asks the
import system without importing, so the check costs milliseconds; docs/gpu.md says how to bring the missing ones
as wheels.
"""

from __future__ import annotations

import importlib.util

__all__ = ["REQUIRED", "missing_message", "missing_packages"]

REQUIRED: dict[str, str] = {
    "torch": "torch", "lightning": "lightning", "jsonargparse": "jsonargparse", "docstring_parser": "docstring-parser",
    "typeshed_client": "typeshed-client", "yaml": "PyYAML", "einops": "einops", "tensorboard": "tensorboard",
    "matplotlib": "matplotlib", "numpy": "numpy",
}
"""Import name -> the distribution pip installs it from: the project's dependencies with jsonargparse's
``signatures`` extra (docstring-parser, typeshed-client) and its own need (PyYAML). Stage cuda_tests also needs
pytest; without it that stage alone fails, with the reason."""


def missing_packages(required: dict[str, str] = REQUIRED) -> list[str]:
    """The distributions of ``required`` whose module this Python cannot import (not found, or blocked).

    >>> missing_packages({"json": "json", "no_such_module_here": "no-such-dist"})
    ['no-such-dist']
    """
    missing = []
    for module, distribution in required.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package missing, or a module blocked in sys.modules
            found = False
        if not found:
            missing.append(distribution)
    return missing


def missing_message(missing: list[str]) -> str:
    """The one line that names what is missing and the fix."""
    return (f"missing Python packages: {' '.join(missing)}; install them, e.g. offline from wheels: `pip install "
            f"--no-index --no-deps --target /tmp/site wheels/*.whl && export PYTHONPATH=/tmp/site` (docs/gpu.md)")
