"""The CommTimer's sampling on CUDA: a step it does not measure has no ``torch.cuda.synchronize()``, no CUDA event
and no recorded collective; a measured one has its synchronize (``tests/dist/test_sampling.py`` on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli_utils import REPO, repo_first_on_path

pytestmark = [pytest.mark.cuda, pytest.mark.multiprocess]


def test_unsampled_steps_never_synchronize_the_gpu(tmp_path: Path) -> None:
    # bucketed_ddp on one GPU (NCCL, world size 1), CommTimer(every_n_steps=3) over 7 steps
    env = {**repo_first_on_path(), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "support" / "sampling_probe.py"), str(tmp_path),
                           "cuda", "1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-8000:]
    probe = json.loads((tmp_path / "rank0.json").read_text())
    steps = {int(step): counts for step, counts in probe["steps"].items()}
    for step, counts in steps.items():
        if step % 3 == 0:
            # the step's synchronize before its events are read (step 0 also anchors the clocks: one more)
            assert counts.get("torch.cuda.synchronize", 0) >= 1 and counts["Recorder.launch"] == 1, (step, counts)
        else:
            measuring = {k: v for k, v in counts.items() if k != "dist.all_reduce"}  # the engine's own, unrecorded
            assert measuring == {}, (step, counts)
    assert [step for step, _ in probe["logged"]] == [0, 3, 6]
