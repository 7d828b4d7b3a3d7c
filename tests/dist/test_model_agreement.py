"""Every engine checks, before its first broadcast, that the ranks wrap the same model (``verify_same_parameters``).

A rank whose model differs (a shape, an extra parameter, a dtype, a frozen parameter) would otherwise broadcast into
mismatched tensors, or issue one broadcast more than its peers and hang. The check must fail on *every* rank with
the same message naming the parameter, what differs, and the rank. All cases share one 2-rank spawn.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_ddp.sync.base import _first_difference, describe_parameters
from tests.support.dist_utils import run_on_ranks


class Net(nn.Module):
    def __init__(self, hidden: int = 4, extra: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, hidden)
        self.fc2 = nn.Linear(hidden, 2, dtype=dtype)
        if extra:
            self.extra = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


# What rank 1 builds differently in each case (rank 0 always builds Net()), and the message every rank must raise.
CASES = {
    "shape": ({"hidden": 5}, "parameter 'fc1.weight' has shape (4, 3) on rank 0 but (5, 3) on rank 1"),
    "extra parameter": ({"extra": True},
                        "rank 1 has a parameter 'extra.weight' that rank 0 lacks (6 parameters against 4)"),
    "dtype": ({"dtype": torch.float64}, "parameter 'fc2.weight' has dtype float32 on rank 0 but float64 on rank 1"),
    "frozen": ("freeze fc2.bias", "parameter 'fc2.bias' has requires_grad True on rank 0 but False on rank 1"),
}


def _wrap_mismatched_models(rank: int, world_size: int) -> dict[str, str]:
    from lightning_ddp.sync import BucketedDDP, NaiveDDP

    errors = {}
    for case, (change, _) in CASES.items():
        model = Net()
        if rank == 1:
            if change == "freeze fc2.bias":
                model.fc2.bias.requires_grad_(False)
            else:
                model = Net(**change)
        try:
            BucketedDDP(model)
            errors[case] = "no error"
        except ValueError as error:
            errors[case] = str(error)
    # After four refused models the group is still in step: the same model on both ranks wraps, and trains.
    torch.manual_seed(rank)
    model = Net()
    engine = NaiveDDP(model)
    engine(torch.ones(1, 3)).sum().backward()
    engine.finish_gradient_synchronization()
    errors["same model"] = "wrapped" if torch.equal(model.fc1.weight, _rank0_weight(model)) else "not broadcast"
    return errors


def _rank0_weight(model: nn.Module) -> torch.Tensor:
    import torch.distributed as dist

    weight = model.fc1.weight.detach().clone()
    dist.broadcast(weight, src=0)
    return weight


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, str]]:
    return run_on_ranks(_wrap_mismatched_models, 2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_a_mismatched_model_fails_on_every_rank_naming_the_difference(ranks, case) -> None:
    expected = CASES[case][1]
    for rank, errors in enumerate(ranks):
        assert errors[case].startswith(f"The ranks wrap different models: {expected}. "), (rank, errors[case])
        assert "Every rank must build the same model" in errors[case]  # the fix


@pytest.mark.multiprocess
def test_the_same_model_still_wraps_after_refusals(ranks) -> None:
    # The refusals left no collective unmatched: a matching model then broadcasts rank 0's weights as usual.
    assert [errors["same model"] for errors in ranks] == ["wrapped", "wrapped"]


def test_first_difference_reads_names_order_and_missing_parameters() -> None:
    reference = describe_parameters(Net())
    assert reference[0] == ("fc1.weight", (4, 3), "float32", True)
    assert _first_difference(reference, reference, 0, 1) is None
    swapped = [reference[1], reference[0], *reference[2:]]
    assert _first_difference(reference, swapped, 0, 3) == (
        "parameter #0 is 'fc1.weight' on rank 0 but 'fc1.bias' on rank 3 (the parameters differ in name or order)")
    assert _first_difference(reference, reference[:3], 0, 1) == (
        "rank 1 lacks the parameter 'fc2.bias' that rank 0 has (3 parameters against 4)")
