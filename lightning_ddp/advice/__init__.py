"""``python -m lightning_ddp advise RUN_DIR``: what to change, predicted from the run's own timer files.

Reads a CommTimer folder (``timing_summary.json`` version 2, ``compute_profile.json``), calibrates the projection
to it, simulates every catalogue alternative at the run's world size and writes ``advice.json`` and ``advice.md``
into the folder. A study package: the product never imports it. How each step works: docs/advice.md.
"""

from lightning_ddp.advice.calibrate import Run, RunError, read_run
from lightning_ddp.advice.recommend import PROJECTION_ERROR, advise

__all__ = ["PROJECTION_ERROR", "Run", "RunError", "advise", "read_run"]
