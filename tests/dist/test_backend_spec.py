"""A device-qualified process-group spec on two real gloo ranks: ZeRO-1's ``collectives: auto`` follows the device
of its tensors (``lightning_ddp.sync.comm.backend_for``), not the spec's text. The fakes of the same logic are in
``tests/unit/test_cuda_accounting.py``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_ddp.sync import Recorder
from tests.support.dist_utils import run_on_ranks
from tests.unit.test_cuda_accounting import _Small


def _zero1_step_on_a_device_qualified_group(rank: int, world_size: int) -> dict:
    from lightning_ddp.sync import DeferredGradSync, ShardedOptimizer

    group = dist.new_group(backend="cpu:gloo")  # torch's device-qualified form, on CPU
    torch.manual_seed(0)
    model = _Small(unused=False)
    engine = DeferredGradSync(model, process_group=group)
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.SGD, schedule="reduce_scatter", process_group=group,
                                 lr=0.1)
    engine.recorder = optimizer.recorder = recorder = Recorder()
    recorder.open_step(0)
    engine.on_train_batch_start()
    engine(torch.randn(4, 5) + rank).sum().backward()
    engine.finish_gradient_synchronization()
    optimizer.step()
    record = recorder.finish_step()
    return {
        "backend": dist.get_backend(group),
        "collectives": optimizer.collectives,
        "ops": sorted({c.op for c in record.collectives}),
        "intervals": [(c.launched, c.completed) for c in record.collectives],
        "weights": [p.detach().clone() for p in model.parameters()],
    }


def test_one_zero1_step_on_two_ranks_of_a_cpu_gloo_group() -> None:
    ranks = run_on_ranks(_zero1_step_on_a_device_qualified_group, 2)
    for result in ranks:
        assert result["backend"] == "cpu:gloo"  # the spec as given: the old `== "gloo"` test said "not gloo"
        assert result["collectives"] == "per_owner"  # auto, resolved for the CPU parameters: gloo moves them
        assert {"reduce", "broadcast"} <= set(result["ops"])  # what per_owner issues (native: reduce_scatter)
        assert all(end >= start for start, end in result["intervals"])  # host times on one clock
    for mine, theirs in zip(ranks[0]["weights"], ranks[1]["weights"]):
        assert torch.equal(mine, theirs)  # the owners shared their updated shards: copies, bit for bit
