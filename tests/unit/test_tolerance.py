"""The derived tolerances bound what they claim to: AdamW, and SGD with momentum, run on gradients moved within their
bounds stay within the weight bounds (``tests.support.tolerance``), and the bounds are far tighter than a wrong step
where gradients are healthy."""

from __future__ import annotations

import torch

from tests.support.tolerance import (
    adam_moment_bounds, adam_step_ratio_bound, adam_weight_bounds, assert_within, sgd_momentum_weight_bounds,
)

LRS = [1e-2, 2e-2, 3e-2, 3e-2]
BETAS = (0.9, 0.95)


def _adamw(history: list[torch.Tensor], start: torch.Tensor) -> tuple[torch.Tensor, dict]:
    w = torch.nn.Parameter(start.clone())
    optimizer = torch.optim.AdamW([w], lr=LRS[0], betas=BETAS, weight_decay=0.1)
    for lr, g in zip(LRS, history):
        optimizer.param_groups[0]["lr"] = lr
        w.grad = g.clone()
        optimizer.step()
    return w.detach(), optimizer.state[w]


def test_adam_step_ratio_is_1_at_the_first_step_and_bounded_after() -> None:
    assert adam_step_ratio_bound(1, BETAS) == 1.0
    assert all(1.0 <= adam_step_ratio_bound(t, BETAS) < 1.5 for t in range(2, 10))


def test_adamw_on_gradients_moved_within_their_bounds_stays_within_the_weight_bounds() -> None:
    g = torch.Generator().manual_seed(0)
    # Healthy gradients, and a tenth of them within 1e-6 of zero: where Adam's step may flip.
    history = [torch.randn(2000, dtype=torch.float64, generator=g) for _ in LRS]
    for step in history:
        step[:200] *= 1e-6
    bound = 1e-3  # per element, every step
    start = torch.randn(2000, dtype=torch.float64, generator=g)
    reference, reference_state = _adamw(history, start)
    named = [{"w": step} for step in history]
    weights = adam_weight_bounds(named, [{"w": bound}] * len(LRS), LRS, BETAS, weights={"w": reference})
    moments = adam_moment_bounds(named, [{"w": bound}] * len(LRS), BETAS)["w"]
    for trial in range(20):  # random moves, and the extremes: every gradient pushed up, or down, by its bound
        if trial < 18:
            moved = [step + bound * (2 * torch.rand(step.shape, dtype=step.dtype, generator=g) - 1) for step in history]
        else:
            moved = [step + bound * (1 if trial == 18 else -1) for step in history]
        ours, state = _adamw(moved, start)
        assert_within({"w": ours}, {"w": reference}, weights, f"trial {trial}")
        assert_within({k: state[k] for k in ("exp_avg", "exp_avg_sq")},
                      {k: reference_state[k] for k in ("exp_avg", "exp_avg_sq")}, moments, f"trial {trial}")
    # Where the gradients are healthy the bound is a small part of a step; where they may flip, two whole steps.
    assert weights["w"][200:].median() < 0.01 * sum(LRS)
    assert weights["w"][:200].min() > sum(LRS)


def test_sgd_with_momentum_on_gradients_moved_within_their_bounds_stays_within_the_weight_bounds() -> None:
    g = torch.Generator().manual_seed(0)
    history = [torch.randn(2000, dtype=torch.float64, generator=g) for _ in range(4)]
    bound, lr, momentum = 1e-3, 0.1, 0.9
    start = torch.randn(2000, dtype=torch.float64, generator=g)

    def sgd(steps: list[torch.Tensor]) -> torch.Tensor:
        w = torch.nn.Parameter(start.clone())
        optimizer = torch.optim.SGD([w], lr=lr, momentum=momentum)
        for step in steps:
            w.grad = step.clone()
            optimizer.step()
        return w.detach()

    reference = sgd(history)
    weights = sgd_momentum_weight_bounds([{"w": step} for step in history], [{"w": bound}] * len(history), lr,
                                         momentum, weights={"w": reference})
    # The extremes (every gradient pushed up, or down, by its bound) reach it: buffer errors 1, 1.9, 2.71, 3.439
    # times the bound, each a step of lr: lr x 9.049 x 1e-3 = 9.049e-4, plus the runs' own rounding.
    for sign in (1, -1):
        ours = sgd([step + sign * bound for step in history])
        assert_within({"w": ours}, {"w": reference}, weights, f"every gradient moved by {sign:+d} bound")
        assert (ours - reference).abs().min() > 0.999 * lr * 9.049 * bound
    assert weights["w"].max() < 1.001 * lr * 9.049 * bound  # and no more: the rounding is fp64's, 1e-16 relative
    for trial in range(10):
        moved = [step + bound * (2 * torch.rand(step.shape, dtype=step.dtype, generator=g) - 1) for step in history]
        assert_within({"w": sgd(moved)}, {"w": reference}, weights, f"trial {trial}")
