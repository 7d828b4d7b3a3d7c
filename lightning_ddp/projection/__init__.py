"""Project step time and communication share to world sizes nobody has run, one simulated timeline per cell; pure
Python (only modelling a preset imports ``lightning_ddp.model``, hence torch). The model: docs/projection.md.
``advise``: the projection calibrated to one run, every strategy predicted (``python -m lightning_ddp advise``)."""
