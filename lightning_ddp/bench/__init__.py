"""The study: benchmarks as configs of one pipeline (``python -m lightning_ddp.bench --config configs/bench/cpu.yaml``
runs the step-time sweep). ``launch`` starts every fit, ``study`` holds the pipeline's shared parts;
docs/benchmarks.md describes each benchmark and its files. Importing this package imports none of its modules.
"""
