"""The layers hold: the pure-PyTorch core imports and trains where Lightning is not installed, and the pure
modules import no torch at all.

Each check runs in a fresh interpreter whose import system refuses Lightning (a meta-path finder that raises
``ModuleNotFoundError`` for ``lightning``, ``lightning_fabric`` and ``pytorch_lightning``, exactly what a
machine without them gives), so nothing this test process already imported can hide a violation.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.cli_utils import REPO

_BLOCK = textwrap.dedent(
    """
    import importlib.abc, sys

    class NotInstalled(importlib.abc.MetaPathFinder):
        BLOCKED = {BLOCKED}

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.BLOCKED:
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by test_layers)", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
    """
)


def _run_without(blocked: set[str], body: str) -> subprocess.CompletedProcess:
    code = _BLOCK.format(BLOCKED=repr(blocked)) + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def test_the_core_imports_and_trains_without_lightning() -> None:
    proc = _run_without({"lightning", "lightning_fabric", "pytorch_lightning"}, """
        import lightning_ddp, lightning_ddp.compat, lightning_ddp.model, lightning_ddp.intervals
        import lightning_ddp.callbacks.accounting, lightning_ddp.trace
        from lightning_ddp.sync import (ALGORITHMS, BucketedDDP, DeferredGradSync, FlatDDP, NaiveDDP, OverlapDDP,
                                        Recorder, ShardedOptimizer, get_algorithm)
        from lightning_ddp.sync.zero1 import checkpoint, collectives, partition

        import torch, torch.distributed as dist
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        for name in ALGORITHMS:  # every registered engine takes a step, recorded
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
            engine = get_algorithm(name).make_engine(model)
            engine.recorder = recorder = Recorder()
            optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
            optimizer.recorder = recorder
            recorder.open_step(0)
            engine.on_train_batch_start()
            engine(torch.randn(3, 4)).sum().backward()
            engine.finish_gradient_synchronization()
            optimizer.step()
            record = recorder.finish_step()
            assert record.collectives and all(c.launched <= c.completed for c in record.collectives), name
        dist.destroy_process_group()
        assert not any(m.split(".")[0] in ("lightning", "lightning_fabric") for m in sys.modules)
        print("trained", len(ALGORITHMS), "algorithms")
    """)
    assert "trained" in proc.stdout


def test_pure_modules_import_without_torch() -> None:
    # The accounting, the interval arithmetic, the registry and the range names are plain Python: the sweep and
    # the analysis read them without paying for torch. So are the shared helpers: the atomic file write, the
    # GPT's shapes (the projection and the memory pre-flight) and the free port (the sweep's parent process).
    _run_without({"torch", "lightning", "lightning_fabric"}, """
        import lightning_ddp, lightning_ddp.intervals, lightning_ddp.callbacks.accounting, lightning_ddp.sync.assignment
        import lightning_ddp.files, lightning_ddp.local_group, lightning_ddp.memory, lightning_ddp.model_shapes
        from lightning_ddp.sync import ranges, registry
        assert "bucketed" in registry.ALGORITHMS and ranges.GRAD_SYNC
        assert "torch" not in sys.modules
    """)


def test_the_lightning_layer_registers_every_algorithm() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_ddp.strategies import strategy_names
    from lightning_ddp.sync.registry import ALGORITHMS

    names = strategy_names()
    assert names[: len(ALGORITHMS)] == [f"{name}_ddp" for name in ALGORITHMS] and names[-1] == "zero1_ddp"
    assert all(name in StrategyRegistry for name in names)
