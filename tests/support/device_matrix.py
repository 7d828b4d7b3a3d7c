"""The equivalence matrix on a device layout: which jobs, how to spawn them, which checks apply.

A *layout* is how the ranks sit: world size, process-group backend, device. The GPU tier (``tests/gpu``) runs
every registered engine, the two bucket-count variants and the ZeRO-1 variants on two CUDA layouts:

==========================  ===========  =======  =======  ==================================================
layout                      world size   backend  device   what it exercises
==========================  ===========  =======  =======  ==================================================
``nccl_1rank``              1            nccl     cuda     NCCL's kernels, streams and event completions
``gloo_2ranks_one_gpu``     2            gloo     cuda     CUDA tensors through gloo (via the host), 2 ranks
==========================  ===========  =======  =======  ==================================================

NCCL refuses two ranks on one GPU, hence world size 1 there; at world size 1 the reference is the same data on
the same device, so any difference is the engine's doing (a scale, a stale buffer, a lost gradient). The CPU
suite runs the same functions on ``CPU_LAYOUTS`` (``tests/dist/test_device_matrix.py``), so this logic is tested even
where no GPU ever comes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from lightning_ddp import catalogue
from tests.support.dist_utils import run_on_ranks
from tests.support.equivalence import (
    JOB_TIMEOUT_S,
    VARIANTS,
    ZERO1_VARIANTS,
    ZERO2_VARIANTS,
    check_grad_none_and_record,
    check_matches_single_process,
    check_ranks_agree_and_start_from_rank0,
    check_zero1_matches_single_process,
    check_zero2_matches_single_process,
    jobs_for,
    run_jobs,
)


@dataclass(frozen=True)
class Layout:
    """Where the ranks of an equivalence run sit."""

    name: str
    world_size: int
    backend: str
    device: str


CUDA_LAYOUTS = (Layout("nccl_1rank", 1, "nccl", "cuda"), Layout("gloo_2ranks_one_gpu", 2, "gloo", "cuda"))
CPU_LAYOUTS = (Layout("gloo_1rank_cpu", 1, "gloo", "cpu"), Layout("gloo_2ranks_cpu", 2, "gloo", "cpu"))


def all_jobs() -> list[tuple[str, str]]:
    """Every registered engine on every case, the bucket-count variants on ``plain``, ZeRO-1 on its cases, ZeRO-2 on
    every case."""
    return (jobs_for(catalogue.names(engines_only=True)) + [(name, "plain") for name in VARIANTS]
            + jobs_for(list(ZERO1_VARIANTS)) + jobs_for(list(ZERO2_VARIANTS)))


def run_layout(layout: Layout, jobs: list[tuple[str, str]], timeout: float = 2 * JOB_TIMEOUT_S) -> list[dict]:
    """Both (or the one) ranks' results of ``jobs`` on ``layout``; a failing job is kept as its traceback."""
    return run_on_ranks(run_jobs, layout.world_size, jobs, layout.device, True, timeout=timeout, backend=layout.backend)


def check_job(ranks: list[dict], engine: str, case: str) -> None:
    """Every check of the matrix that applies to ``engine`` at this world size."""
    for run in (r["runs"][engine, case] for r in ranks):
        if "error" in run:
            pytest.fail(f"{engine} on {case} raised:\n{run['error']}")
    if engine in ZERO1_VARIANTS:
        check_zero1_matches_single_process(ranks, engine, case)
        return
    if engine in ZERO2_VARIANTS:
        check_zero2_matches_single_process(ranks, engine, case)
        return
    check_matches_single_process(ranks, engine, case)
    check_grad_none_and_record(ranks, engine, case)
    if len(ranks) > 1:
        check_ranks_agree_and_start_from_rank0(ranks, engine, case)


def completion_clocks(rank: int, world_size: int, device: str = "cuda") -> dict:
    """Spawned: one recorded step of ``bucketed`` on TinyLM; which clock timed each collective's completion.

    ``"device"``: a CUDA event recorded on the completion callback's stream (NCCL: it fires when the kernel has
    finished); ``"host"``: the host clock in the callback (gloo, which completes on its own thread); ``None``:
    no completion was recorded (the end of the wait stands in). Read after one synchronize, before
    ``finish_step`` turns every mark into milliseconds.
    """
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_ddp.sync import BucketedDDP, Recorder
    from lightning_ddp.sync.comm import backend_for
    from lightning_ddp.sync.memory_model import MiB
    from tests.support.equivalence import SEVERAL_BUCKETS_CAP, TinyLM, VOCAB

    where = torch.device(device)
    if where.type == "cuda" and where.index is None:
        where = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    ddp = BucketedDDP(TinyLM().to(where), SEVERAL_BUCKETS_CAP / MiB)
    recorder = Recorder(where)
    ddp.recorder = recorder
    recorder.open_step(0)
    tokens = torch.randint(0, VOCAB, (4, 4), device=where)
    F.cross_entropy(ddp(tokens).flatten(0, 1), tokens.flatten()).backward()
    ddp.finish_gradient_synchronization()
    recorder.clock.synchronize()
    cuda_event = torch.cuda.Event if where.type == "cuda" else ()
    clocks = [None if c.completed is None else "device" if isinstance(c.completed, cuda_event) else "host"
              for c in recorder.record.collectives]
    record = recorder.finish_step()
    return {
        "group_backend": str(dist.get_backend()),
        "backend_for_device": backend_for(where),
        "clocks": clocks,
        "ordered": all(c.launched <= c.completed for c in record.collectives),
    }
