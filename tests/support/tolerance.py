"""Tolerances worked out from the arithmetic, for floating-point results that differ only in the order of their sums
(the batch split over ranks, buckets, shards, another GEMM blocking): one function per kind of comparison.

The rounding model (fp32 and fp64 alike; ``u`` is the dtype's unit roundoff, 2^-24 for fp32):

- Summing n terms t_i in two orders gives results at most ``2 γ(n) Σ|t_i|`` apart, ``γ(n) = λ sqrt(n) u``: the
  probabilistic bound of Higham and Mary (SIAM J. Sci. Comput. 41(5), 2019, Theorem 3.1) with λ = 6, which holds
  for an element with probability at least 1 - 2n exp(-λ²/2) ≈ 1 - 3e-8 n (the deterministic bound n u is reached
  only if every rounding errs the same way).
- A gradient element is the mean over the step's ``tokens`` of their contributions, each a product formed through
  the layers' inner sums (forward and backward): ``chain`` counts the terms along that path.
- Its terms add up in absolute value to at most ``sqrt(tokens)`` times the largest gradient of its tensor: the
  tokens' contributions have random signs and cancel like a random walk, no further.

So two such gradients differ by at most ``reordered_gradient_bound`` per element. ``adam_weight_bounds`` carries
that through AdamW's steps to a bound per weight, from the reference run's own gradients (exact equality where a
parameter never had one). Exactness itself is what the fp64 tests prove.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

LAMBDA = 6.0
"""The probabilistic bound's confidence: the chance it fails for one element is below 2 n exp(-18) = 3e-8 n."""


def unit_roundoff(dtype: torch.dtype) -> float:
    """2^-24 for fp32, 2^-53 for fp64: half the distance from 1 to the next number."""
    return torch.finfo(dtype).eps / 2


def reordered_sum_bound(terms: int, abs_sum: float, dtype: torch.dtype = torch.float32) -> float:
    """How far two orders of summing ``terms`` terms whose absolute values add to ``abs_sum`` can end apart."""
    return 2 * LAMBDA * math.sqrt(terms) * unit_roundoff(dtype) * abs_sum


def reordered_gradient_bound(reference: torch.Tensor, chain: int, tokens: int,
                             dtype: torch.dtype | None = None) -> float:
    """Per element of a gradient tensor computed in another order than ``reference``: the terms of any element add
    up to at most ``sqrt(tokens) max|reference|`` (module docstring). ``dtype``: the precision the chain is computed
    in, if coarser than the gradient's own (an fp64 layer between fp32 ones gets fp32-rounded gradients)."""
    terms = math.sqrt(tokens) * reference.abs().max().item()
    return reordered_sum_bound(chain, terms, dtype or reference.dtype)


def adam_step_ratio_bound(step: int, betas: tuple[float, float]) -> float:
    """The most ``|m̂ / sqrt(v̂)|`` can be at ``step`` (1-based), whatever the gradients: with m̂ = Σ a_s g_s and
    v̂ = Σ b_s g_s² (bias-corrected EMA weights), Cauchy-Schwarz gives ``sqrt(Σ a_s² / b_s)``; 1 at step 1."""
    beta1, beta2 = betas
    a = [(1 - beta1) * beta1 ** (step - s) / (1 - beta1**step) for s in range(1, step + 1)]
    b = [(1 - beta2) * beta2 ** (step - s) / (1 - beta2**step) for s in range(1, step + 1)]
    return math.sqrt(sum(x * x / y for x, y in zip(a, b)))


def adam_weight_bounds(history: Sequence[Mapping[str, torch.Tensor]],
                       grad_bounds: Sequence[Mapping[str, float | torch.Tensor]],
                       lrs: Sequence[float] | Mapping[str, Sequence[float]], betas: tuple[float, float] = (0.9, 0.999),
                       eps: float = 1e-8, weights: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Per weight, how far AdamW (or Adam) runs from the same start can end apart when step t's gradient of each
    parameter differs from ``history[t]`` (the reference run's) by at most ``grad_bounds[t][name]`` per element.

    Step t moves a weight by ``lr_t (m̂/(sqrt(v̂) + eps) + wd w)``. With every gradient within E_s of the
    reference's: m̂ moves by at most ``Σ a_s E_s``, sqrt(v̂) by at most ``V = sqrt(Σ b_s E_s²)`` (Minkowski), so the
    step ratio by at most ``(Σ a_s E_s + R V) / (max(sqrt(v̂) - V, 0) + eps)``, R its bound above, and never by more
    than 2R (two opposite steps of the largest size): a gradient within its rounding of zero can flip its step.
    Decay multiplies an existing difference by 1 - lr wd < 1, so the bound adds ``lr_t`` times each step's. The
    weights' own difference feeds back into later gradients by the curvature times it, second order next to E. A
    step without a gradient leaves a parameter alone (AdamW skips it; its own step count sets the bias correction).
    ``lrs``: every step's learning rate, or per parameter (groups, schedulers). ``weights`` (the reference's final
    ones) adds each run's own rounding of its steps: per step the decay, the ratio (a few operations), its product
    with lr and the subtraction, at most ``u (2 |w| + 8 lr R)`` on each side (``|w|`` the final weight, which a step
    moves by at most lr R).
    """
    beta1, beta2 = betas
    bounds: dict[str, torch.Tensor] = {}
    for name in dict.fromkeys(name for step in history for name in step):
        present = [i for i, step in enumerate(history) if name in step]
        g = [history[i][name].double() for i in present]
        e = [torch.as_tensor(grad_bounds[i][name], dtype=torch.float64) for i in present]
        total = torch.zeros_like(g[0])
        for t in range(1, len(g) + 1):  # the parameter's own step count
            a = [(1 - beta1) * beta1 ** (t - s) / (1 - beta1**t) for s in range(1, t + 1)]
            b = [(1 - beta2) * beta2 ** (t - s) / (1 - beta2**t) for s in range(1, t + 1)]
            root_v = torch.sqrt(sum(b_s * g_s * g_s for b_s, g_s in zip(b, g)))
            moved_m = sum(a_s * e_s for a_s, e_s in zip(a, e))
            moved_root_v = torch.sqrt(sum(b_s * e_s * e_s for b_s, e_s in zip(b, e)))
            ratio = adam_step_ratio_bound(t, betas)
            moved = (moved_m + ratio * moved_root_v) / ((root_v - moved_root_v).clamp(min=0) + eps)
            lr = (lrs[name] if isinstance(lrs, Mapping) else lrs)[present[t - 1]]
            total += lr * moved.clamp(max=2 * ratio)
            if weights is not None and name in weights:
                u = unit_roundoff(history[present[0]][name].dtype)
                total += 2 * u * (2 * weights[name].double().abs() + 8 * lr * ratio)
        bounds[name] = total
    return bounds


def sgd_momentum_weight_bounds(history: Sequence[Mapping[str, torch.Tensor]],
                               grad_bounds: Sequence[Mapping[str, float | torch.Tensor]], lr: float, momentum: float,
                               weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per weight, how far SGD with momentum (torch's: no dampening, Nesterov or weight decay) runs from the same start
    can end apart when step t's gradient differs from ``history[t]`` by at most ``grad_bounds[t][name]``.

    The buffer b_t = μ b_(t-1) + g_t carries the gradients' differences on, e_t = μ e_(t-1) + E_t, and step t moves
    the weight by lr b_t: the weights end at most ``Σ lr e_t`` apart. Each run's own rounding of a step (the buffer's
    product and sum, the weight's product and subtraction) is at most ``u (|w| + 3 lr |b_t|)`` in the weight, and a
    rounding left in the buffer moves each later step by lr times it: ``steps x`` that, on each side (``|w|`` the
    final weight of ``weights``, ``|b_t| <= μ |b_(t-1)| + |g_t| + E_t``)."""
    bounds: dict[str, torch.Tensor] = {}
    for name in dict.fromkeys(name for step in history for name in step):
        present = [i for i, step in enumerate(history) if name in step]
        u = unit_roundoff(history[present[0]][name].dtype)
        carried = size = total = torch.zeros_like(history[present[0]][name], dtype=torch.float64)
        for i in present:
            e = torch.as_tensor(grad_bounds[i][name], dtype=torch.float64)
            carried = momentum * carried + e
            size = momentum * size + history[i][name].double().abs() + e
            total = total + lr * carried + 2 * u * (weights[name].double().abs() + 3 * lr * size * len(present))
        bounds[name] = total
    return bounds


def adam_moment_bounds(history: Sequence[Mapping[str, torch.Tensor]],
                       grad_bounds: Sequence[Mapping[str, float | torch.Tensor]],
                       betas: tuple[float, float] = (0.9, 0.999)) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter, how far AdamW's saved moments (``exp_avg``, ``exp_avg_sq``, before bias correction) can be from
    the reference's after ``history``'s steps, every gradient within its bound E: m = Σ (1-β1) β1^(t-s) g_s moves by
    at most Σ (1-β1) β1^(t-s) E_s, v = Σ (1-β2) β2^(t-s) g_s² by at most Σ (1-β2) β2^(t-s) (2 |g_s| E_s + E_s²)."""
    beta1, beta2 = betas
    bounds: dict[str, dict[str, torch.Tensor]] = {}
    for name in dict.fromkeys(name for step in history for name in step):
        present = [i for i, step in enumerate(history) if name in step]
        t, u = len(present), unit_roundoff(history[present[0]][name].dtype)
        m = v = size_m = size_v = torch.zeros_like(history[present[0]][name], dtype=torch.float64)
        for s, i in enumerate(present, 1):
            g, e = history[i][name].double().abs(), torch.as_tensor(grad_bounds[i][name], dtype=torch.float64)
            m = m + (1 - beta1) * beta1 ** (t - s) * e
            v = v + (1 - beta2) * beta2 ** (t - s) * (2 * g * e + e * e)
            size_m = size_m + (1 - beta1) * beta1 ** (t - s) * (g + e)
            size_v = size_v + (1 - beta2) * beta2 ** (t - s) * (g + e) ** 2
        # each run's own rounding: per step two products and a sum, on values no larger than the moment's size
        bounds[name] = {"exp_avg": m + 2 * 3 * t * u * size_m, "exp_avg_sq": v + 2 * 3 * t * u * size_v}
    return bounds


def gpt_gradient_chain(config, tokens: int) -> int:
    """``chain`` for a ``lightning_ddp.model.GPT`` step over ``tokens`` tokens: the token sum, then forward and back
    every inner sum a gradient passes through: per block two norms, the q/k/v and output projections (``d_model``
    each), the scores (head size), softmax and weighted sum over the positions, the FFN (``d_model``, ``d_ff``); the
    final norm, the head (``d_model``) and the softmax over the vocabulary."""
    head = config.d_model // config.n_heads
    block = 6 * config.d_model + config.d_ff + head + 2 * config.context_length
    return tokens + 2 * (config.n_layers * block + 2 * config.d_model + config.vocab_size)


def clipped_history_bounds(history: Sequence[Mapping[str, torch.Tensor]], chain: int, tokens: int,
                           clip: float | None) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """The gradients AdamW saw and their bounds, from the gradients a run had before clipping by the global norm
    (``clip``: ``max_norm``; None: no clipping). Clipping scales step t by c = min(1, clip / (norm + 1e-6))
    (torch's ``clip_grad_norm_``); another run's norm is off by at most the norm of the gradients' bounds plus its
    own rounding (a sum of n squares), which moves c by at most c times that over the norm, and so every clipped
    element by ``c E + |g| Δc``."""
    seen, bounds = [], []
    for step in history:
        e = {name: reordered_gradient_bound(g, chain, tokens) for name, g in step.items()}
        if clip is None:
            seen.append(dict(step))
            bounds.append({name: torch.tensor(value) for name, value in e.items()})
            continue
        squares = sum(float(g.double().square().sum()) for g in step.values())
        norm, terms = math.sqrt(squares), sum(g.numel() for g in step.values())
        scale = min(1.0, clip / (norm + 1e-6))
        e_norm = math.sqrt(sum(step[name].numel() * value**2 for name, value in e.items()))
        moved = e_norm / norm + reordered_sum_bound(terms, 1.0)  # the other run's norm, relatively
        moved_scale = 0.0 if norm * (1 + moved) + 1e-6 < clip else scale * moved  # no run clips, or both may
        seen.append({name: g * scale for name, g in step.items()})
        bounds.append({name: scale * e[name] + g.abs().double() * moved_scale for name, g in step.items()})
    return seen, bounds


def history_weight_bounds(path, chain: int, tokens: int, clip: float | None,
                          state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per entry of ``state`` (the reference run's final weights): how far another run's can be, from the gradients
    ``tests.support.callbacks_for_tests.GradientHistory`` saved to ``path`` during the reference run."""
    saved = torch.load(path, weights_only=True)
    seen, bounds = clipped_history_bounds(saved["steps"], chain, tokens, clip)
    bounds = adam_weight_bounds(seen, bounds, saved["lrs"], tuple(saved["betas"]), saved["eps"], weights=state)
    return with_tied(bounds, state)


def history_moment_bounds(path, chain: int, tokens: int, clip: float | None) -> dict[int, dict[str, torch.Tensor]]:
    """``adam_moment_bounds`` from a ``GradientHistory`` file, by the optimizer's state index (checkpoints' keys)."""
    saved = torch.load(path, weights_only=True)
    seen, bounds = clipped_history_bounds(saved["steps"], chain, tokens, clip)
    moments = adam_moment_bounds(seen, bounds, tuple(saved["betas"]))
    return {index: moments[name] for index, name in enumerate(saved["order"]) if name in moments}


def with_tied(bounds: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``bounds`` for every entry of ``state`` that equals a bounded one: a tied weight appears in a state dict under
    each of its names, among the parameters (and so the gradients) once."""
    out = dict(bounds)
    for name, value in state.items():
        twin = next((other for other in bounds if other != name and state[other].shape == value.shape
                     and torch.equal(state[other], value)), None)
        if name not in out and twin is not None:
            out[name] = bounds[twin]
    return out


def assert_within(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
                  bounds: Mapping[str, torch.Tensor | float], what: str) -> None:
    """``|actual - expected| <= bound`` for every element of every tensor (a name without a bound: exactly equal)."""
    assert actual.keys() == expected.keys(), (what, sorted(actual.keys() ^ expected.keys()))
    for name, value in expected.items():
        apart = (actual[name].double() - value.double()).abs()
        bound = torch.as_tensor(bounds.get(name, 0.0), dtype=torch.float64)
        over = apart > bound
        if over.any():
            worst = int(torch.argmax(torch.where(over, apart - bound, torch.zeros_like(apart))))
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), apart.shape)) if apart.dim() else ()
            raise AssertionError(
                f"{what}: {name}{list(index)} differs by {apart.flatten()[worst].item():.3g}, over its bound "
                f"{bound.expand_as(apart).flatten()[worst].item():.3g} ({int(over.sum())} of {apart.numel()} elements)"
            )
