"""The old name of ``lightning_ddp.projection``, kept so that code and commands written for it still work.

Nothing lives here. ``import lightning_ddp.project.X`` gives the module ``lightning_ddp.projection.X`` itself (the
same object, so its classes are the same classes), ``python -m lightning_ddp.project[.X]`` runs
``python -m lightning_ddp.projection[.X]``, and ``lightning_ddp.projection``'s names are attributes here. Modules
that moved under another name are in ``RENAMED``. Importing it warns (``DeprecationWarning``); new code uses
``lightning_ddp.projection``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import CodeType, ModuleType

from lightning_ddp.projection import *  # noqa: F403 - the old package's names
from lightning_ddp.projection import __all__  # noqa: F401

NEW_NAME = "lightning_ddp.projection"

RENAMED = {
    "profile": "lightning_ddp.profile",
    "seeds": "lightning_ddp.projection.published",
}
"""Old submodule -> the module it is now, where that is not ``lightning_ddp.projection.<same name>``."""


def new_name(old: str) -> str:
    """The module an old name ``lightning_ddp.project.X`` stands for."""
    submodule = old.removeprefix(__name__ + ".")
    return RENAMED.get(submodule, f"{NEW_NAME}.{submodule}")


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``lightning_ddp.project.X`` and loads it as the already imported (or now imported) new module."""

    def find_spec(self, fullname: str, path=None, target=None):
        if not fullname.startswith(__name__ + "."):
            return None
        spec = importlib.util.find_spec(new_name(fullname))
        return None if spec is None else importlib.util.spec_from_loader(fullname, self, origin=spec.origin)

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def create_module(self, spec) -> ModuleType:
        module = importlib.import_module(new_name(spec.name))
        self._specs[spec.name] = module.__spec__  # the import system now overwrites it with the old name's spec
        return module

    def exec_module(self, module: ModuleType) -> None:
        # Nothing to run (the module is the new one); it gets its own spec back.
        module.__spec__ = self._specs.pop(module.__spec__.name)

    def get_code(self, fullname: str) -> CodeType | None:
        """For ``python -m lightning_ddp.project.X``: the code of the new module, run as ``__main__``."""
        name = new_name(fullname)
        return importlib.util.find_spec(name).loader.get_code(name)


if not any(isinstance(finder, _OldNames) for finder in sys.meta_path):
    sys.meta_path.append(_OldNames())

warnings.warn(
    "lightning_ddp.project is the old name of lightning_ddp.projection; import lightning_ddp.projection instead "
    "(and run `python -m lightning_ddp.projection`)",
    DeprecationWarning,
    stacklevel=2,
)
