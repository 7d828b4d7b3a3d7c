"""The Python packages the GPU study's processes import, checked before anything imports them.

``missing_packages`` asks the import system without importing (milliseconds); ``missing_message`` is the one line
that names what is missing and how to bring it (docs/gpu.md, "Packages").
"""

from __future__ import annotations

import importlib.util

__all__ = ["REQUIRED", "missing_message", "missing_packages"]

REQUIRED: dict[str, str] = {
    "torch": "torch", "lightning": "lightning", "jsonargparse": "jsonargparse", "docstring_parser": "docstring-parser",
    "typeshed_client": "typeshed-client", "yaml": "PyYAML", "einops": "einops", "tensorboard": "tensorboard",
    "matplotlib": "matplotlib", "numpy": "numpy",
}
"""Import name -> the distribution pip installs it from (jsonargparse's ``signatures`` extra included)."""


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
