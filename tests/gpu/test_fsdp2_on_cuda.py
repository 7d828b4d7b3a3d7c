"""``fsdp2`` on CUDA tensors: gradients after the first step and weights after three equal one process's.

Both layouts of one GPU (``tests.support.device_matrix``): NCCL at world size 1, and 2 ranks over gloo with CUDA
tensors, where gloo has been reported to sum what FSDP2 asks it to average (pytorch/pytorch#162338); the gradients,
not only the weights, show it (``tests.support.fsdp2_on_device``). The same job runs on CPU layouts in
``tests/dist/test_device_matrix.py``.
"""

from __future__ import annotations

import pytest

from tests.support.device_matrix import CUDA_LAYOUTS, Layout
from tests.support.dist_utils import run_on_ranks
from tests.support.fsdp2_on_device import check_fsdp2_matches_one_process, fsdp2_job

pytestmark = [pytest.mark.cuda, pytest.mark.multiprocess]


@pytest.mark.parametrize("layout", CUDA_LAYOUTS, ids=lambda l: l.name)
def test_fsdp2_on_cuda_matches_one_process(layout: Layout) -> None:
    ranks = run_on_ranks(fsdp2_job, layout.world_size, layout.device, backend=layout.backend, timeout=180)
    assert all(r["device"].startswith("cuda") for r in ranks), [r["device"] for r in ranks]
    check_fsdp2_matches_one_process(ranks)
