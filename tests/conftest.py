"""Shared pytest setup for the test suite: the repository root on ``sys.path``, and the fixtures every tier uses."""

import sys
from pathlib import Path

import pytest

# Tests import helpers as `tests.support.<module>`, and multi-process tests spawn children that re-import test modules
# by name with the parent's sys.path; putting the repository root on sys.path makes both work whether pytest
# runs as `pytest` or `python -m pytest`, from any directory, under any --import-mode.
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)


@pytest.fixture
def world_of_one():
    """A gloo process group of one rank (this process) for the test, torn down after it: engines and optimizers
    built without spawning anything."""
    import torch.distributed as dist

    from lightning_ddp.teardown import tear_down_process_group

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        tear_down_process_group()  # freed now where it can be: no gloo thread of it left to outlive the session


@pytest.fixture(scope="session")
def lightning_fits(tmp_path_factory):
    """``ddp``, ``zero1_ddp``, ``zero2_ddp`` and ``fsdp2`` fitted through the CLI in one configuration, each once per
    session when a test first asks for it (``tests.support.lightning_fits``)."""
    from tests.support.lightning_fits import LightningFits

    return LightningFits(tmp_path_factory.mktemp("lightning_fits"))
