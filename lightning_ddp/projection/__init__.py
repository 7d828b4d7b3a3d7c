"""Project step time and communication share to world sizes nobody has run: one simulated timeline per cell.

``python -m lightning_ddp.projection --config configs/projection/xl_h100.yaml`` simulates every strategy of the
catalogue with a ``projection`` model, from a compute profile (measured by the CommTimer, or modelled from FLOPs:
``flops``) and a fabric (``comm``). Pure Python; only modelling a preset imports ``lightning_ddp.model`` (torch).
The modules, the model, its sources and where it is known to be wrong: docs/projection.md.
"""

from lightning_ddp.profile import SCHEMA, ComputeProfile, ParamTiming, read_profile, write_profile
from lightning_ddp.projection.comm import FABRICS, Fabric, Link, MeasuredFit, get_fabric, read_fit
from lightning_ddp.projection.flops import GPUS, ModelShape, modelled_profile
from lightning_ddp.projection.simulators import StepModel, StepResult, simulate, simulated_names
from lightning_ddp.projection.sweep import best_by_world_size, predict_cells, project

__all__ = [
    "FABRICS",
    "GPUS",
    "SCHEMA",
    "ComputeProfile",
    "Fabric",
    "Link",
    "MeasuredFit",
    "ModelShape",
    "ParamTiming",
    "StepModel",
    "StepResult",
    "best_by_world_size",
    "get_fabric",
    "modelled_profile",
    "predict_cells",
    "project",
    "read_fit",
    "read_profile",
    "simulate",
    "simulated_names",
    "write_profile",
]
