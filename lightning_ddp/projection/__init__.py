"""Project step time and communication share to world sizes nobody has run: one simulated timeline per cell.

``python -m lightning_ddp.projection --config configs/projection/xl_h100.yaml`` answers "we measured 2 GPUs; what
happens on 8, 64 or 1024?" for every strategy of this project, from two inputs:

1. **Compute** (``lightning_ddp.profile``, ``flops``): forward, backward and optimizer times per rank, and when each gradient
   becomes ready during backward. Measured (a compute profile JSON the ``CommTimer`` writes) or modelled from
   FLOPs for a model preset on a named GPU at a stated MFU.
2. **Communication** (``comm``): ``alpha + bytes / bandwidth`` per collective and algorithm (ring, tree) with the
   nccl-tests bus-bandwidth factors, on a fabric preset (NVLink 4, InfiniBand NDR in 8-GPU nodes, PCIe Gen4/5)
   or this project's measured 2-rank all-reduce fit, extrapolated to ``n`` ranks.

Each strategy (``strategies.STRATEGIES``: every registered algorithm whose registry entry names a ``projection``
model, naive, flat, overlap, bucketed, bucketed_bf16, bucketed_powersgd, then zero1, ddp, zero2 and fsdp2) issues
its collectives as its engine does; they run in order on one communication stream while the compute stream
runs forward, backward (gradients becoming ready), copies and the optimizer. Per strategy, world size and
bucket size (and engine setting, e.g. PowerSGD's ``rank``) the output is the step time, the exposed communication (step minus the compute-only step) and
its share of the step, and the busy communication time.

=================  ==========================================================================================
module             what it holds
=================  ==========================================================================================
``profile``        (``lightning_ddp.profile``, re-exported) the compute-profile JSON (schema
                   ``lightning_ddp.compute_profile/1``): reader and writer; the ``CommTimer`` writes it
``flops``          a modelled profile: parameters of a preset, FLOPs, per-parameter ready times, GPU table
``comm``           the cost formulas, link and fabric presets (with sources), the measured fit
``buckets``        our engines' bucket rule, torch DDP's, ZeRO-1's owners (pure restatements, tested to agree)
``strategies``     the timeline and one simulation per strategy; ``STRATEGIES``, read from the registry
``memory``         model-state bytes per rank of each strategy (the report's memory column and verdict)
``contention``     compute slowed beside collectives: ``s`` per backend, fitted on the CPU sweep (gloo) and
                   the published runs (NCCL); ``contention_fit`` fits it: ``python -m lightning_ddp.projection.contention_fit``
``sweep``          the grid, best bucket sizes, ``predict_cells`` (model vs this project's measured sweep)
``config``         the CLI's dataclasses (compute, network, study, output)
``run``            config -> profile, fabric, results and files; ``report``: CSV, markdown, PNGs
``published``      the model against the published 2-GPU xl runs (naive, overlap, flat, bucketed):
                   ``python -m lightning_ddp.projection.published``
``validate``       the model against this project's own CPU sweep: ``python -m lightning_ddp.projection.validate``
=================  ==========================================================================================

Assumptions, and where the model is known to be wrong
-----------------------------------------------------

- **One communication stream, FIFO.** Collectives never overlap each other, and run in issue order (NCCL on one
  communicator does this). Strategies that use several streams or communicators are not modelled.
- **Contention: compute slowed beside communication, one constant per backend.** Compute placed while a collective
  is in flight runs ``1 + s`` times slower (``contention``): gloo's threads take CPU cores, NCCL's kernels take SMs
  and memory bandwidth. ``s`` is fitted (gloo: 1.0, the bound, on the CPU sweep's step times; NCCL: 0.36, on the
  published 2-GPU PCIe runs' wait shares), not derived, and communication itself is never slowed by compute, so
  overlapped strategies stay optimistic where the link is the bottleneck (the published overlapped steps are still
  ~20 % longer than the model's; ``validate`` and ``published`` report the errors before and after).
- **One protocol per message.** NCCL switches protocol (LL, LL128, Simple) and algorithm by message size, has a
  latency plateau for large multi-node rings, NVLink SHARP (NVLS) and CollNet/SHARP in-network reduction; we use
  one per-step latency and one bandwidth per link, and ``auto`` picks ring or tree per message. Small messages
  (norm scales, presence flags) are priced roughly; large ones follow the bus bandwidth.
- **Idealised topology.** Every rank has its own full-bandwidth path: an NVSwitch inside a node, a non-blocking
  rail-optimised fat tree between nodes, 8 NICs per node. PCIe root-complex sharing, NUMA hops, oversubscribed
  switches and congestion from other jobs are not modelled; a real PCIe box with 8 GPUs behind one switch will do
  worse than ``pcie_gen4`` at 8 ranks.
- **No stragglers.** All ranks compute the same time; in practice the slowest rank sets every collective's start,
  and jitter grows with the world size.
- **Weak scaling; model-state memory only.** The per-rank batch is fixed, so compute per rank does not change with
  ``n``. ``memory`` counts parameters, gradients, optimizer state and engine buffers per rank (not activations, the
  same for every strategy), and the report calls a sharded strategy's saving free where its step is within 5 % of
  ``ddp``'s (``report.NO_COST_TOLERANCE``); nothing checks that a strategy fits in a device.
- **FSDP2 on one stream.** Its all-gathers and reduce-scatters run FIFO on the one communication stream (torch
  uses two, sharing the link), at the parameters' training width (no ``MixedPrecisionPolicy``).
- **The project's engines, not ideal algorithms.** Each strategy issues what its engine issues: the presence-flag
  all-reduce, one-tensor buckets in place, packing on the compute stream; ``zero1`` owns whole tensors and pads
  every rank's segment to the most loaded owner's, so beyond a few hundred ranks (more ranks than large tensors)
  its buffers grow to several times the gradients, where an element-wise ZeRO would not.
- **Copies at memory bandwidth**, on the compute stream; the division by the world size and framework overheads
  (Python hooks, ``torch.distributed`` dispatch beyond the per-call constant) are not modelled.
- **Measured fits extrapolate** from 2 ranks by the ring formulas (``comm``); a fit on one host says nothing
  about a network.

Everything here is pure Python (the standard library; matplotlib for the plots). Only modelling a preset from
FLOPs imports ``lightning_ddp.model`` (hence torch), to read the preset's shape from its one source of truth.

This package was called ``lightning_ddp.project``; that name still works (``lightning_ddp/project/__init__.py``
maps it here), for imports and for ``python -m``.
"""

from lightning_ddp.profile import SCHEMA, ComputeProfile, ParamTiming, read_profile, write_profile
from lightning_ddp.projection.comm import FABRICS, Fabric, Link, MeasuredFit, get_fabric, read_fit
from lightning_ddp.projection.flops import GPUS, ModelShape, modelled_profile
from lightning_ddp.projection.strategies import STRATEGIES, StepModel, StepResult, simulate
from lightning_ddp.projection.sweep import best_by_world_size, predict_cells, project

__all__ = [
    "FABRICS",
    "GPUS",
    "SCHEMA",
    "STRATEGIES",
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
    "write_profile",
]
