"""The GPU tier: every test under ``tests/gpu`` needs a CUDA GPU and carries the ``cuda`` marker.

Without a GPU each one is skipped, with the reason, so CI stays green and ``pytest -m cuda --collect-only`` still
lists the tier. On a GPU machine: ``pytest tests/gpu`` (or ``pytest -m cuda``), or the whole GPU study,
``python -m lightning_ddp.bench.gpu_study --out DIR``, whose stage ``cuda_tests`` runs this tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

_TIER = Path(__file__).resolve().parent
NO_CUDA = ("needs a CUDA GPU and torch.cuda.is_available() is False here; on a GPU machine run `pytest -m cuda` "
           "or the GPU study (python -m lightning_ddp.bench.gpu_study --out DIR)")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: a test of the tier is a `cuda` test even if it forgot to say so
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = torch.cuda.is_available()  # no GPU context is created: only the device count is read
    for item in items:
        if _TIER not in Path(str(item.fspath)).resolve().parents:
            continue
        if item.get_closest_marker("cuda") is None:
            item.add_marker(pytest.mark.cuda)
        if not cuda:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))
