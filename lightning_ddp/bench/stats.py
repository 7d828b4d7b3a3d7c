"""The study's statistics (numpy only): pooled medians, hierarchical-bootstrap intervals, ratios, geometric means
and verdicts; docs/benchmarks.md defines each, with examples."""

from __future__ import annotations

import hashlib
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

LEVEL = 0.95
"""Coverage of every interval: the 2.5th to the 97.5th percentile of the draws."""

_TOLERANCE = 1e-12  # a ratio computed as exactly the target (1/3 from 0.1 / 0.3) counts as on the target

Repeats = Sequence[Any]
"""One array per repeat: shape ``(n_r,)`` for one metric, ``(n_r, k)`` for ``k`` metrics of the same steps."""


def _as_arrays(repeats: Repeats) -> list[np.ndarray]:
    """The repeats as float arrays, empty ones left out; at least one must remain."""
    arrays = [np.asarray(r, dtype=float) for r in repeats]
    arrays = [a for a in arrays if a.shape[0] > 0]
    if not arrays:
        raise ValueError("no measurements: every repeat is empty; pass at least one repeat with one step")
    return arrays


def _median(values: np.ndarray, axis: int) -> np.ndarray:
    """``np.median``, or ``np.nanmedian`` when a value is missing (an all-NaN slice gives NaN, silently)."""
    if not np.isnan(values).any():
        return np.median(values, axis=axis)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "All-NaN slice encountered": NaN is the right answer
        return np.nanmedian(values, axis=axis)


def _scalar(value: np.ndarray) -> float | np.ndarray:
    """A 0-d result as a ``float``; an array (one value per metric) as it is."""
    return float(value) if np.ndim(value) == 0 else value


def pooled_median(repeats: Repeats) -> float | np.ndarray:
    """The median of every step of every repeat, pooled (per metric for 2-D repeats); NaNs are left out."""
    return _scalar(_median(np.concatenate(_as_arrays(repeats)), axis=0))


def pooled_percentile(repeats: Repeats, q: float) -> float | np.ndarray:
    """The ``q``-th percentile (0..100, linear interpolation, numpy's default) of the pooled steps."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return _scalar(np.nanpercentile(np.concatenate(_as_arrays(repeats)), q, axis=0))


def rng_for(seed: int, *keys: str) -> np.random.Generator:
    """A generator determined by ``seed`` and the names of what is drawn (not by what was drawn before it)."""
    digest = hashlib.sha256("\0".join(keys).encode()).digest()
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, *np.frombuffer(digest[:16], dtype=np.uint32).tolist()])


def hierarchical_bootstrap(
    repeats: Repeats,
    samples: int,
    rng: np.random.Generator,
    statistic: Callable[[np.ndarray, int], np.ndarray] = _median,
) -> np.ndarray:
    """``samples`` draws (``(B,)``, or ``(B, k)`` for 2-D repeats: a step's metrics stay together) of ``statistic``
    (default: the NaN-aware median) over the pooled steps, resampling the repeats, then the steps within each."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    arrays = _as_arrays(repeats)
    one_metric = arrays[0].ndim == 1
    arrays = [a[:, None] if one_metric else a for a in arrays]
    n_repeats, width = len(arrays), arrays[0].shape[1]
    lengths = np.array([a.shape[0] for a in arrays])
    longest = int(lengths.max())
    padded = np.full((n_repeats, longest, width), np.nan)  # (R, n_max, k)
    for r, a in enumerate(arrays):
        padded[r, : a.shape[0]] = a
    picked = rng.integers(0, n_repeats, size=(samples, n_repeats))  # (B, R): level 1, repeats
    sizes = lengths[picked]  # (B, R): steps of each picked repeat
    steps = np.floor(rng.random((samples, n_repeats, longest)) * sizes[..., None]).astype(np.int64)  # level 2
    values = padded[picked[..., None], steps]  # (B, R, n_max, k)
    if (lengths != longest).any():
        # a picked repeat with fewer steps than the longest contributes only its own count of draws
        values[np.arange(longest)[None, None, :] >= sizes[..., None]] = np.nan
    draws = statistic(values.reshape(samples, n_repeats * longest, width), 1)  # (B, k)
    return draws[:, 0] if one_metric else draws


def percentile_interval(draws: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """``(lo, hi)``: the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the ``(B,)`` draws."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        lo, hi = np.nanpercentile(draws, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


@dataclass(frozen=True)
class Estimate:
    """A point estimate and its 95 % interval."""

    point: float
    """The pooled median (or ratio of pooled medians)."""
    lo: float
    """Lower end of the 95 % interval: the draws' 2.5th percentile."""
    hi: float
    """Upper end of the 95 % interval: the draws' 97.5th percentile."""

    @classmethod
    def of(cls, point: Any, draws: np.ndarray) -> Estimate:
        """``point`` with the 95 % percentile interval of its bootstrap ``draws``."""
        return cls(float(point), *percentile_interval(draws))


def interval_text(point: Any, lo: Any = math.nan, hi: Any = math.nan, spec: str = ",.1f", scale: float = 1.0,
                  unit: str = "") -> str:
    """The study's one way to write an estimate (``point`` a number or an ``Estimate``): ``"12.3 ms [11.0, 14.2]"``,
    the interval left out unless both ends are finite numbers; ``"-"`` without a finite point.

    >>> interval_text(12.34, 11.0, 14.2, ".1f", unit=" ms"), interval_text(0.5, spec=".0%"), interval_text(None)
    ('12.3 ms [11.0, 14.2]', '50%', '-')
    """
    if isinstance(point, Estimate):
        point, lo, hi = point.point, point.lo, point.hi
    if not (isinstance(point, (int, float)) and math.isfinite(point)):
        return "-"
    text = f"{format(point * scale, spec)}{unit}"
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (lo, hi)):
        return text
    return f"{text} [{format(lo * scale, spec)}, {format(hi * scale, spec)}]"


def verdict(interval: tuple[float, float] | Estimate, target: float) -> str:
    """``met`` if the interval is at or below ``target``, ``missed`` if above it, else (or NaN) ``inconclusive``."""
    lo, hi = (interval.lo, interval.hi) if isinstance(interval, Estimate) else interval
    if hi <= target + _TOLERANCE:
        return "met"
    if lo > target + _TOLERANCE:
        return "missed"
    return "inconclusive"


def estimate(repeats: Repeats, samples: int, seed: int, key: str = "") -> Estimate:
    """The pooled median of one metric and its hierarchical-bootstrap interval."""
    return Estimate.of(pooled_median(repeats), hierarchical_bootstrap(repeats, samples, rng_for(seed, key)))


def ratio_estimate(numerator: Repeats, denominator: Repeats, samples: int, seed: int,
                   keys: tuple[str, str] = ("numerator", "denominator")) -> Estimate:
    """``median(numerator) / median(denominator)``; interval from independent bootstraps of both, ratio per draw."""
    top = hierarchical_bootstrap(numerator, samples, rng_for(seed, keys[0]))
    bottom = hierarchical_bootstrap(denominator, samples, rng_for(seed, keys[1]))
    with np.errstate(divide="ignore", invalid="ignore"):
        return Estimate.of(pooled_median(numerator) / pooled_median(denominator), top / bottom)


def geometric_mean_draws(ratio_draws: Sequence[np.ndarray]) -> np.ndarray:
    """Per draw, ``exp(mean over groups of log(ratio))``: draws ``(B,)`` of each group's ratio in, ``(B,)`` out (or
    each group's point in, their geometric mean out)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.exp(np.mean(np.log(np.stack(ratio_draws)), axis=0))


class Bootstrapper:
    """``draws(key, repeats)``: ``hierarchical_bootstrap`` seeded by ``rng_for(seed, key)``, cached on the key and
    the values (a cell's own interval and its ratios share the draws)."""

    def __init__(self, samples: int, seed: int) -> None:
        """``samples`` draws per key, each key's generator seeded from ``seed`` and the key."""
        self.samples = samples
        self.seed = seed
        self._cache: dict[tuple[str, bytes], np.ndarray] = {}

    def draws(self, key: str, repeats: Repeats) -> np.ndarray:
        """``hierarchical_bootstrap`` of ``repeats`` seeded by ``key``, computed once per (key, values)."""
        arrays = _as_arrays(repeats)
        digest = hashlib.sha1(b"".join(np.ascontiguousarray(a).tobytes() + repr(a.shape).encode() for a in arrays))
        cache_key = (key, digest.digest())
        if cache_key not in self._cache:
            self._cache[cache_key] = hierarchical_bootstrap(arrays, self.samples, rng_for(self.seed, key))
        return self._cache[cache_key]
