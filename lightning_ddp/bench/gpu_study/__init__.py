"""The whole GPU study in one command: ``python -m lightning_ddp.bench.gpu_study --out DIR --budget_min 20``.

A GPU reaches this project rarely and briefly (one H100 or H200 for ~30 minutes), so everything the study needs
from one runs in ordered stages, each writing its files into ``DIR`` as soon as it ends, under a time budget:

=================  =====================================================================  ======  =======
stage              what it shows                                                           GPU s   dry s
=================  =====================================================================  ======  =======
``environment``    GPU, memory, SMs, driver, torch / CUDA / NCCL, the hardware table row   20      5
``cuda_tests``     the ``cuda`` test tier (``tests/gpu``, pytest in a subprocess)          240     -
``compute``        xl at world size 1, bf16-mixed and 32-true, context 512, the largest    90      20
                   batch the pre-flight allows and that fits: step, tokens/s, MFU, memory
``strategies``     every strategy at NCCL world size 1 (medium): it runs; its hooks' cost  60      55
``one_gpu_pair``   2 gloo ranks on the GPU: every strategy equals one process; a short     240     100
                   sweep of the strategies (``configs/bench/gpu_study.yaml``)
``traces``         naive vs overlap profiler traces with GPU kernel rows, drawn            60      30
``ready_times``    when each xl gradient is ready in backward; the projection from it      90      20
                   for 2 x H100/H200 over NVLink and PCIe
``timer_overhead`` the CommTimer on/off, alternated, with its interval                    120     40
=================  =====================================================================  ======  =======

Recipe (``study.run_study``): check for CUDA in a child process (the study's own process never holds a GPU
context); then per stage, in order: skip it if not selected, if it needs CUDA and there is none (``skipped: no
CUDA``) or if its estimate exceeds what is left of the budget (``skipped: budget``); else run it, record
``ok`` or ``failed`` with one error line, and go on. After every stage ``stages.json`` (each stage's name, status,
seconds, estimate, error line and files) is rewritten atomically and ``results.md`` re-rendered from the files.

``--cpu_dry_run true`` runs every stage on CPU with the tiny preset (``config.DRY_RUN_SCALE``) and writes the same
files, so a GPU session starts from a rehearsed command. Two ranks on one GPU time-slice it: those step times are
not 2-GPU step times; what transfers is correctness, the CUDA code paths and the compute figures (``results.md``
says so at the top).

=============  ==================================================================================
module         what it holds
=============  ==================================================================================
``config``     the command line (``GPUStudyConfig``) and the sizes of the work (``Scale``)
``stages``     ``STAGES``: name, estimate, needs-CUDA, function; one small function per stage
``study``      ``run_study``: the budget, the order, stages.json
``report``     results.md from stages.json and the stages' JSON files (rendering apart from running)
``fits``       several CLI fits in one set of processes (1 rank, or 2 sharing the device)
``compute``    the compute measurement, stepping the batch down on out-of-memory errors
``environment`` the device and software description (in its own process)
``callbacks``  ``SaveFinalWeights``, for the equivalence of 2 ranks and one process
=============  ==================================================================================
"""

from __future__ import annotations

from lightning_ddp.bench.gpu_study.config import DRY_RUN_SCALE, GPU_SCALE, GPUStudyConfig, Scale

__all__ = ["DRY_RUN_SCALE", "GPU_SCALE", "GPUStudyConfig", "Scale", "run_study"]


def __getattr__(name: str):
    if name == "run_study":  # imported on use: parsing the command line stays fast
        from lightning_ddp.bench.gpu_study.study import run_study

        return run_study
    raise AttributeError(f"module 'lightning_ddp.bench.gpu_study' has no attribute {name!r}")
