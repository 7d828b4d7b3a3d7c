"""Project step time and communication share to world sizes nobody has run: one simulated timeline per cell.

``python -m lightning_ddp.projection --config configs/projection/xl_h100.yaml`` simulates every strategy of the
catalogue with a ``projection`` model, from a compute profile (measured by the CommTimer, or modelled from FLOPs:
``flops``) and a fabric (``comm``). Pure Python; only modelling a preset imports ``lightning_ddp.model`` (torch).
The modules, the model, its sources and where it is known to be wrong: docs/projection.md.
"""
