"""The whole GPU study in one command: ``python -m lightning_ddp.bench.gpu_study --out DIR --budget_min 9``.

Ordered stages (``stages.STAGES``) under a time budget per call (``study.run_study``); ``--resume true`` finishes the
study in several calls, ``--cpu_dry_run true`` rehearses every stage on CPU (docs/gpu.md).
"""
