"""``python -m lightning_ddp.bench.gpu_study --out DIR``: its command line (``config.GPUStudyConfig``); the sizes
of its work are ``scales``, its stages ``stages.STAGES``; docs/gpu.md. Importing this package imports none of its
modules."""
