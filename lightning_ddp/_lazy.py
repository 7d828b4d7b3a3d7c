"""Package ``__init__`` files that import their names on first use (PEP 562), so importing a package is cheap.

    __getattr__, __dir__ = lazy_exports(__name__, {"BucketedDDP": "lightning_ddp.sync.bucketed", ...})
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, homes: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose name ``n`` lives in module ``homes[n]``."""

    def __getattr__(name: str) -> Any:
        if name in homes:
            return getattr(importlib.import_module(homes[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(homes)

    return __getattr__, __dir__
