"""lightning_ddp: data-parallel gradient synchronisation, one swappable Lightning strategy per algorithm.

``import lightning_ddp`` is cheap (no torch, no Lightning) and registers our strategy names with Lightning's
``StrategyRegistry`` when Lightning is imported, before or after it, so ``Trainer(strategy="bucketed_ddp")`` works
(a failure is a warning). Import names from their sub-packages, e.g. ``from lightning_ddp.callbacks import CommTimer``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any, Sequence

__all__: list[str] = []

_TARGET = "lightning.pytorch"  # whose import triggers the registration (StrategyRegistry is complete once it has run)


def _register() -> None:
    ours = sys.modules.get("lightning_ddp.strategies")
    if ours is not None and getattr(getattr(ours, "__spec__", None), "_initializing", False):
        return  # its own import brought Lightning in: it registers the names itself when it finishes
    try:
        from lightning_ddp.strategies import register_strategies

        register_strategies()
    except Exception as error:  # never break the user's `import lightning` because of ours
        warnings.warn(
            f"lightning_ddp could not register its strategies with Lightning ({type(error).__name__}: {error}); "
            "`import lightning_ddp.strategies` shows the full error.",
            RuntimeWarning,
            stacklevel=2,
        )


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds ``lightning.pytorch`` with the other finders and registers our strategies once its module has run."""

    def find_spec(self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None) -> Any:
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # one shot; the other finders find the real module
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            exec_module(module)
            _register()

        spec.loader.exec_module = exec_then_register  # this module's own loader object: no other module runs it
        return spec


def register_with_lightning() -> None:
    """Register our strategy names with Lightning now if it is imported, else as soon as it is (idempotent)."""
    module = sys.modules.get(_TARGET)
    if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
        _register()
        return
    if not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


register_with_lightning()
