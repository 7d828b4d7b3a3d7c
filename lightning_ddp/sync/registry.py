"""The one list of gradient-sync algorithms: name -> engine and capabilities. Everything else reads it.

Readers: the Lightning strategies (``lightning_ddp.strategies`` registers ``<name>_ddp`` for every entry),
ZeRO-1's ``grad_sync`` choice, the benchmark sweep (its grid, report and plots), the memory benchmark, the
projection (``python -m lightning_ddp.projection`` simulates every entry with a ``projection`` model), and the tests
(the equivalence matrix runs every entry against single-process training).

Adding an algorithm takes one engine file, one ``register_algorithm`` entry and one YAML:

1. ``lightning_ddp/sync/<name>.py``: the engine, a ``GradSyncEngine`` subclass (see ``lightning_ddp.sync.base``).
2. An entry below (or, from your own code, a ``register_algorithm(Algorithm(...))`` call before the strategy is
   built): ``Algorithm("<name>", "lightning_ddp.sync.<name>:<Engine>", "what it does", ...)``.
3. ``configs/strategy/<name>.yaml``: ``trainer: {strategy: <name>_ddp}``.

The strategy ``<name>_ddp`` then exists (``lightning_ddp.strategies.GradSyncStrategy(algorithm="<name>")``), the
sweep accepts ``<name>`` in ``grid.strategies`` (with a bucket-size axis if ``has_bucket_size``), and the
equivalence tests cover it (at bf16 tolerances if it is not ``exact``). An algorithm of the package itself also
gets a row in the algorithm tables of ``lightning_ddp.sync`` and ``lightning_ddp.strategies`` (their docstrings;
``tests/dist/test_registry.py`` fails until it has them), and the projection a timeline model (the entry's
``projection``, in ``lightning_ddp/projection/strategies.py``).

An engine's own settings are the keyword arguments of its factory beyond ``module``, ``process_group``,
``bucket_size_mb`` and ``reduce`` (``Algorithm.settings()``: name -> default), e.g. PowerSGD's ``rank``. They reach
it through ``make_engine(module, **settings)`` and, from YAML, the strategy's ``engine_settings``. An unknown name is
refused with the valid ones listed; if the factory has a ``check_settings(**settings)`` static or class method, it
is called with every setting (defaults filled in) when the settings are checked, so a bad value fails when the
config is read, before any process starts.

This module imports nothing but the standard library: engines are named by import path and imported on first use,
so an entry costs nothing until its engine is built, and an engine file never has to import the registry.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Union

if TYPE_CHECKING:
    from torch import nn

    from lightning_ddp.sync.base import GradSyncEngine

BucketSize = Union[float, Literal["auto"], None]

NOT_SETTINGS = ("module", "process_group", "bucket_size_mb", "reduce")
"""Factory arguments that are not an engine's own settings: the model, the group, the bucket cap (``bucket_size_mb``
has its own option) and a bucketed engine's reduce step (an object; an algorithm fixes it)."""

REQUIRED = inspect.Parameter.empty
"""The default ``Algorithm.settings()`` gives a setting that has none: it must be given."""

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "BucketSize",
    "NOT_SETTINGS",
    "REQUIRED",
    "algorithm_names",
    "get_algorithm",
    "register_algorithm",
]


@dataclass(frozen=True)
class Algorithm:
    """One gradient-sync algorithm: how to build its engine, and what it can do."""

    name: str
    """Short name: the sweep's strategy name; the Lightning strategy is ``<name>_ddp``."""
    engine: str | Callable[..., GradSyncEngine]
    """The engine: ``"package.module:Class"`` (imported on first use) or a callable
    ``(module, *, process_group=None[, bucket_size_mb=...][, <its own settings>=...]) -> GradSyncEngine``."""
    summary: str
    """What it does, in one line (strategy registry description, docs)."""
    has_bucket_size: bool = False
    """Takes ``bucket_size_mb`` (the sweep gives it a bucket-size axis)."""
    default_bucket_size_mb: BucketSize = 25.0
    """The cap used when none is given (only with ``has_bucket_size``)."""
    overlaps_backward: bool = False
    """Communicates during backward (from gradient hooks) rather than after it."""
    exact: bool = True
    """Reproduces single-process training up to float rounding; ``False`` for lossy ones (e.g. compression),
    which the equivalence tests compare at bf16 tolerances."""
    projection: str | None = None
    """Its step-time model for ``python -m lightning_ddp.projection``: the import path ``"package.module:function"`` of
    a ``simulate(model, bucket_size_mb, **settings) -> StepResult`` (``lightning_ddp.projection.strategies`` has the
    contract and the built-ins' models). A string, so the product never imports the study code; ``None``: the
    projection lists the algorithm as not projected."""

    def __post_init__(self) -> None:
        if not self.name or not self.name.isidentifier():
            raise ValueError(f"an algorithm name must be a Python identifier (it names a strategy), got {self.name!r}")

    @property
    def strategy_name(self) -> str:
        """Its Lightning strategy name, e.g. ``bucketed_ddp``."""
        return f"{self.name}_ddp"

    def engine_factory(self) -> Callable[..., GradSyncEngine]:
        """The engine class (or callable), imported if given by path."""
        if callable(self.engine):
            return self.engine
        module, _, attribute = self.engine.partition(":")
        return getattr(importlib.import_module(module), attribute)

    def settings(self) -> dict[str, Any]:
        """The engine's own settings, name -> default (``REQUIRED`` if it has none), in signature order.

        Read from the factory's signature: its keyword arguments beyond ``module``, ``process_group``,
        ``bucket_size_mb`` and ``reduce`` (``NOT_SETTINGS``); e.g. ``{"rank": 4, "start_iter": 10, ...}`` for
        ``bucketed_powersgd``, ``{}`` for ``bucketed``.
        """
        return {
            name: parameter.default
            for name, parameter in _factory_parameters(self.engine_factory()).items()
            if name not in NOT_SETTINGS
            and parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        }

    def check_settings(self, settings: Mapping[str, Any] | None) -> dict[str, Any]:
        """Check ``settings`` against the engine's own (``settings()``); returns them with the defaults filled in.

        Not a collective and builds nothing: the strategy calls it when the config is read.

        Raises:
            TypeError: ``settings`` is not a mapping of names, or the engine's ``check_settings`` refuses a value's
                type.
            ValueError: A name the engine does not take (the valid ones are listed with their defaults), a required
                one missing, or a value the engine's ``check_settings`` refuses.
        """
        if settings is None:
            settings = {}
        if not isinstance(settings, Mapping) or not all(isinstance(name, str) for name in settings):
            raise TypeError(
                f"the engine settings of {self.name!r} must be a mapping of setting names to values, got {settings!r}; "
                f"e.g. {{{', '.join(f'{k}: {_show(v)}' for k, v in self.settings().items()) or 'name: value'}}}."
            )
        factory = self.engine_factory()
        known = self.settings()
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in _factory_parameters(factory).values())
        unknown = [name for name in settings if name not in known]
        if unknown and not takes_any:
            reserved = [name for name in unknown if name in NOT_SETTINGS]
            hint = (
                f" ({', '.join(reserved)} {'is' if len(reserved) == 1 else 'are'} not an engine setting: "
                "bucket_size_mb has an option of its own; the model, process group and reduce step are the engine's)"
                if reserved else ""
            )
            raise ValueError(
                f"{', '.join(map(repr, unknown))} {'is not a setting' if len(unknown) == 1 else 'are not settings'} of "
                f"the {self.name!r} algorithm{hint}; {self.describe_settings()}."
            )
        complete = {**known, **settings}
        missing = [name for name, value in complete.items() if value is REQUIRED]
        if missing:
            raise ValueError(
                f"the {self.name!r} algorithm needs {', '.join(missing)} in its engine settings; "
                f"{self.describe_settings()}."
            )
        check = getattr(factory, "check_settings", None)
        if callable(check):
            check(**complete)
        return complete

    def describe_settings(self) -> str:
        """The engine's settings with their defaults, for error messages and docs."""
        known = self.settings()
        if not known:
            return f"{self.name!r} has no engine settings: drop them"
        return f"{self.name!r} takes: " + ", ".join(
            f"{name} (required)" if default is REQUIRED else f"{name}={default!r}" for name, default in known.items()
        )

    def make_engine(
        self, module: nn.Module, *, bucket_size_mb: Any = "default", process_group: Any = None, **settings: Any
    ) -> GradSyncEngine:
        """Wrap ``module`` in this algorithm's engine (a collective: it broadcasts rank 0's weights).

        Args:
            module: The model to wrap.
            bucket_size_mb: ``"default"`` for ``default_bucket_size_mb``; anything else only with ``has_bucket_size``.
            process_group: The group to average over (default: the world).
            **settings: The engine's own settings (``settings()``), checked by ``check_settings`` first.
        """
        factory = self.engine_factory()
        if not self.has_bucket_size:
            if bucket_size_mb != "default":
                raise ValueError(
                    f"the {self.name!r} algorithm has no bucket size, got bucket_size_mb={bucket_size_mb!r}; drop "
                    f"it, or choose an algorithm with buckets ({', '.join(a.name for a in ALGORITHMS.values() if a.has_bucket_size)})."
                )
            self.check_settings(settings)
            return factory(module, process_group=process_group, **settings)
        self.check_settings(settings)
        size = self.default_bucket_size_mb if bucket_size_mb == "default" else bucket_size_mb
        return factory(module, bucket_size_mb=size, process_group=process_group, **settings)


def _factory_parameters(factory: Callable[..., Any]) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature: no settings we can know
        return {}


def _show(value: Any) -> str:
    return "<required>" if value is REQUIRED else repr(value)


ALGORITHMS: dict[str, Algorithm] = {}
"""Every registered algorithm by name, in registration order (the order tables and plots use)."""


def register_algorithm(algorithm: Algorithm, replace: bool = False) -> Algorithm:
    """Add ``algorithm`` to ``ALGORITHMS`` (``replace=True`` to redefine a name); returns it."""
    if algorithm.name in ALGORITHMS and not replace and ALGORITHMS[algorithm.name] != algorithm:
        raise ValueError(f"an algorithm named {algorithm.name!r} is already registered; pass replace=True to redefine it")
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def get_algorithm(name: str) -> Algorithm:
    """The registered algorithm ``name``; an unknown name lists the valid ones."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"{name!r} is not a registered algorithm; choose one of: {', '.join(ALGORITHMS)}") from None


def algorithm_names() -> list[str]:
    return list(ALGORITHMS)


# ---- the built-in algorithms ------------------------------------------------------------------------------

register_algorithm(Algorithm(
    "naive", "lightning_ddp.sync.naive:NaiveDDP",
    "After backward, all-reduce every gradient tensor, one blocking call each.",
    projection="lightning_ddp.projection.strategies:simulate_naive",
))
register_algorithm(Algorithm(
    "flat", "lightning_ddp.sync.flat:FlatDDP",
    "After backward, all-reduce all gradients flattened into one buffer.",
    projection="lightning_ddp.projection.strategies:simulate_flat",
))
register_algorithm(Algorithm(
    "overlap", "lightning_ddp.sync.overlap:OverlapDDP",
    "During backward, an async all-reduce of each gradient as soon as it is ready.",
    overlaps_backward=True, projection="lightning_ddp.projection.strategies:simulate_overlap",
))
register_algorithm(Algorithm(
    "bucketed", "lightning_ddp.sync.bucketed:BucketedDDP",
    "During backward, an async all-reduce per size-capped bucket of gradients as it fills.",
    has_bucket_size=True, overlaps_backward=True, projection="lightning_ddp.projection.strategies:simulate_bucketed",
))
register_algorithm(Algorithm(
    "bucketed_bf16", "lightning_ddp.sync.bucketed_bf16:BucketedBF16DDP",
    "Bucketed, with the gradients communicated in bf16: half the bytes, lossy.",
    has_bucket_size=True, overlaps_backward=True, exact=False,
    projection="lightning_ddp.projection.strategies:simulate_bucketed_bf16",
))
register_algorithm(Algorithm(
    "bucketed_powersgd", "lightning_ddp.sync.bucketed_powersgd:BucketedPowerSGDDDP",
    "Bucketed, each large gradient matrix sent as low-rank PowerSGD factors with error feedback: far fewer "
    "bytes, lossy.",
    has_bucket_size=True, overlaps_backward=True, exact=False,
    projection="lightning_ddp.projection.strategies:simulate_bucketed_powersgd",
))
