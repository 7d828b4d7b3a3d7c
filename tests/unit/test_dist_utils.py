"""The rank launcher's device choice (``tests.support.dist_utils.select_device``), with a fake ``torch.cuda``: the
GPU tier's NCCL layouts go through it, and no GPU ever reaches CI."""

from __future__ import annotations

import torch

from tests.support.dist_utils import select_device


def test_nccl_ranks_take_the_gpu_of_their_rank_modulo_the_count_and_gloo_ranks_take_none(monkeypatch) -> None:
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for rank, backend in [(0, "nccl"), (3, "nccl"), (1, "cpu:gloo,cuda:nccl"), (0, "gloo")]:
        select_device(rank, backend)
    assert chosen == [0, 1, 1]  # rank 3 of 2 GPUs -> GPU 1; gloo alone binds no device
