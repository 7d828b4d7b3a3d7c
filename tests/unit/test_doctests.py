"""Every example in the package's docstrings runs and gives what it shows (``doctest`` over every module)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import lightning_ddp

MODULES = sorted(info.name for info in pkgutil.walk_packages(lightning_ddp.__path__, prefix="lightning_ddp."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples in {name} failed"


def test_the_examples_are_found() -> None:
    # A guard against the walk above silently finding nothing: these modules are known to hold examples.
    for name in ("lightning_ddp.intervals", "lightning_ddp.sync.assignment", "lightning_ddp.sync.sharding",
                 "lightning_ddp.metrics.accounting", "lightning_ddp.sync.bucket_model"):
        assert name in MODULES
        assert doctest.testmod(importlib.import_module(name)).attempted > 0, name
