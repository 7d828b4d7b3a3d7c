"""Every gradient-sync engine on CUDA tensors trains exactly like one process on the full batch.

Two layouts of one GPU (``tests.support.device_matrix``): NCCL at world size 1 (NCCL refuses two ranks on one GPU) and
2 ranks over gloo with CUDA tensors. Each runs every registered algorithm on every case of the matrix (fp32,
then ``bf16`` under CUDA autocast at bf16 tolerances, tied, frozen, unused, data-dependent, accumulation, mixed
dtypes, gradients kept), the two bucket-count variants of ``bucketed``, ZeRO-1 under both schedules with
both implementations of its collectives (``per_owner`` and ``native``), and ZeRO-2 on every case with both (``native``
at NCCL world size 1 is one ``reduce_scatter_tensor`` per bucket). Checks: ``tests.support.equivalence``. The same
functions run on CPU layouts in ``tests/dist/test_device_matrix.py``.
"""

from __future__ import annotations

import pytest

from tests.support.device_matrix import CUDA_LAYOUTS, Layout, all_jobs, check_job, run_layout

pytestmark = [pytest.mark.cuda, pytest.mark.multiprocess, pytest.mark.xdist_group("cuda_engines")]

JOBS = all_jobs()
PARAMS = [(layout, engine, case) for layout in CUDA_LAYOUTS for engine, case in JOBS]


@pytest.fixture(scope="module")
def results():
    """``results(layout)``: that layout's ranks, spawned once for the module (every job in one run).

    A run that fails (a hang past its time limit, a crashed rank) fails every test of its layout with the same
    error, without spawning again: 55 more time-outs would eat the GPU session.
    """
    cache: dict[str, list[dict] | BaseException] = {}

    def get(layout: Layout) -> list[dict]:
        if layout.name not in cache:
            try:
                cache[layout.name] = run_layout(layout, JOBS)
            except Exception as error:  # noqa: BLE001 - kept, and raised for each test of the layout
                cache[layout.name] = error
        value = cache[layout.name]
        if isinstance(value, BaseException):
            raise value
        return value

    return get


@pytest.mark.parametrize("layout, engine, case", PARAMS, ids=[f"{l.name}-{e}-{c}" for l, e, c in PARAMS])
def test_engine_on_cuda_matches_single_process(results, layout: Layout, engine: str, case: str) -> None:
    check_job(results(layout), engine, case)


@pytest.mark.parametrize("layout", CUDA_LAYOUTS, ids=lambda l: l.name)
def test_the_runs_were_on_the_gpu_at_the_layouts_world_size(results, layout: Layout) -> None:
    ranks = results(layout)
    assert [r["world_size"] for r in ranks] == [layout.world_size] * layout.world_size
    assert all(r["device"].startswith("cuda") for r in ranks), [r["device"] for r in ranks]
