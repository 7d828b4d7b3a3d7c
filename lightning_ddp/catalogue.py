"""The strategy catalogue: one entry per name a user can put in ``trainer.strategy``.

Nothing else spells a strategy's name. Adding an algorithm is one engine file, one ``register(Entry(...))`` and
one YAML (``docs/algorithms.md``). Standard library only: engines are imported on first use.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Union

BucketSize = Union[float, Literal["auto"], None]

DEFAULT_BUCKET_SIZE_MB = 25.0  # the cap of every entry with buckets unless it says otherwise; torch DDP's default too
NOT_SETTINGS = ("module", "process_group", "bucket_size_mb", "reduce")  # engine arguments that are not its settings
REQUIRED = inspect.Parameter.empty  # what `Entry.settings()` gives for a setting without a default

# The memory models of ``lightning_ddp.memory``: which communication buffers a strategy keeps.
MEMORY_MODELS = ("none", "per_tensor", "packed", "bucketed", "full_buckets", "zero1", "zero2", "fully_sharded",
                 "hybrid_sharded")

GRAD_SYNC_STRATEGY = "lightning_ddp.strategies.GradSyncStrategy"

SCHEDULE = "schedule"  # `Entry.projection` of a strategy the projection simulates from its facts

NOT_APPLICABLE = "n/a"  # a setting a strategy does not have (the HPARAMS table's bucket size without buckets)
ONE_BUCKET = "one bucket"  # a bucket size of ``null``

DEFAULT_ENGINE = "bucketed_ddp"  # the engine `GradSyncStrategy` and ZeRO-1's `grad_sync` run when none is named


def load(path: str) -> Any:
    """The object a ``"module:attribute"`` path names (an entry's ``engine`` or ``projection``), imported now."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class Entry:
    """One strategy: its name, how Lightning builds it, its engine and what it can do."""

    name: str
    """What ``trainer.strategy`` takes, and the strategy's name in every table, CSV column and plot."""
    summary: str  # what it does, in one line
    engine: str | Callable[..., Any] | None = None
    """``"package.module:Class"`` or a factory ``(module, *, process_group, ...)``; ``None`` for torch's own."""
    lightning_class: str = GRAD_SYNC_STRATEGY  # the Lightning strategy class that builds it
    init_args: Mapping[str, Any] = field(default_factory=dict)
    """Fixed ``init_args`` of ``lightning_class`` (``GradSyncStrategy`` gets ``algorithm: <name>`` added)."""
    has_bucket_size: bool = False
    default_bucket_size_mb: BucketSize = DEFAULT_BUCKET_SIZE_MB
    overlaps_backward: bool = False  # communicates during backward, from gradient hooks
    exact: bool = True  # reproduces single-process training up to rounding; False for lossy compression
    sharded: bool = False  # the optimizer state is split over the ranks
    memory: str = "packed"  # its memory model in lightning_ddp.memory (MEMORY_MODELS)
    projection: str | None = None
    """Its step-time simulation: ``SCHEDULE`` (the projection's shared schedule, from the facts above), a hook
    ``"package.module:function"`` for a schedule they do not describe, or ``None`` (not projected)."""

    def __post_init__(self) -> None:
        """Refuses a name that is not an identifier and an unknown memory model; an engine entry's ``init_args``
        gain ``algorithm: <name>``."""
        if not self.name.isidentifier():
            raise ValueError(f"a strategy name must be a Python identifier, got {self.name!r}")
        if self.memory not in MEMORY_MODELS:
            raise ValueError(f"{self.name}: memory model {self.memory!r} is not one of {', '.join(MEMORY_MODELS)}")
        if self.lightning_class == GRAD_SYNC_STRATEGY and "algorithm" not in self.init_args:
            object.__setattr__(self, "init_args", {"algorithm": self.name, **self.init_args})

    @property
    def is_engine(self) -> bool:
        """Built by ``GradSyncStrategy`` over its engine alone (the entries ZeRO-1's ``grad_sync`` may name)."""
        return self.lightning_class == GRAD_SYNC_STRATEGY

    def engine_factory(self) -> Callable[..., Any]:
        """What builds this entry's engine (``engine(module, **settings)``); ``ValueError`` where torch builds it."""
        if self.engine is None:
            raise ValueError(f"{self.name!r} has no engine of ours (torch builds it)")
        return self.engine if callable(self.engine) else load(self.engine)

    def _parameters(self) -> Mapping[str, inspect.Parameter]:
        """The engine factory's parameters by name; none where torch builds the strategy."""
        return {} if self.engine is None else inspect.signature(self.engine_factory()).parameters

    def settings(self) -> dict[str, Any]:
        """The engine's own settings, name -> default (``REQUIRED`` if none), in signature order."""
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return {name: parameter.default for name, parameter in self._parameters().items()
                if name not in NOT_SETTINGS and parameter.kind in named}

    def check_settings(self, settings: Mapping[str, Any] | None) -> dict[str, Any]:
        """``settings`` with the defaults filled in; raises on unknown or missing names and refused values."""
        settings = {} if settings is None else settings
        if not isinstance(settings, Mapping) or not all(isinstance(name, str) for name in settings):
            example = ", ".join(f"{k}: {'<required>' if v is REQUIRED else repr(v)}"
                                for k, v in self.settings().items()) or "name: value"
            raise TypeError(f"the engine settings of {self.name!r} must be a mapping of setting names to values, "
                            f"got {settings!r}; e.g. {{{example}}}.")
        known = self.settings()
        unknown = [name for name in settings if name not in known]
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in self._parameters().values())  # **kwargs
        if unknown and not takes_any:
            reserved = [name for name in unknown if name in NOT_SETTINGS]
            hint = (f" ({', '.join(reserved)}: not an engine setting; bucket_size_mb has an option of its own, the "
                    "model, process group and reduce step are the engine's)" if reserved else "")
            noun = "is not a setting" if len(unknown) == 1 else "are not settings"
            raise ValueError(f"{', '.join(map(repr, unknown))} {noun} of {self.name!r}{hint}; "
                             f"{self.describe_settings()}.")
        complete = {**known, **settings}
        missing = [name for name, value in complete.items() if value is REQUIRED]
        if missing:
            raise ValueError(f"{self.name!r} needs {', '.join(missing)} in its engine settings; "
                             f"{self.describe_settings()}.")
        check = getattr(self.engine_factory(), "check_settings", None) if self.engine is not None else None
        if callable(check):
            check(**complete)
        return complete

    def describe_settings(self) -> str:
        """The engine settings this entry takes, with their defaults, as a sentence for an error."""
        known = self.settings()
        if not known:
            return f"{self.name!r} has no engine settings: drop them"
        return f"{self.name!r} takes: " + ", ".join(
            f"{name} (required)" if default is REQUIRED else f"{name}={default!r}" for name, default in known.items())

    def refuse_bucket_size(self, bucket_size_mb: Any) -> None:
        """Refuse a bucket size other than ``"default"`` where the engine has no buckets."""
        if bucket_size_mb != "default" and not self.has_bucket_size:
            with_buckets = ", ".join(entry.name for entry in STRATEGIES.values()
                                     if entry.has_bucket_size and entry.is_engine)
            raise ValueError(f"{self.name!r} has no bucket size, got bucket_size_mb={bucket_size_mb!r}; drop it, "
                             f"or choose a strategy with buckets ({with_buckets}).")

    def make_engine(self, module: Any, *, bucket_size_mb: Any = "default", process_group: Any = None,
                    **settings: Any) -> Any:
        """Wrap ``module`` in this entry's engine (a collective: it broadcasts rank 0's weights)."""
        factory = self.engine_factory()
        self.check_settings(settings)
        self.refuse_bucket_size(bucket_size_mb)
        if not self.has_bucket_size:
            return factory(module, process_group=process_group, **settings)
        size = self.default_bucket_size_mb if bucket_size_mb == "default" else bucket_size_mb
        return factory(module, bucket_size_mb=size, process_group=process_group, **settings)

    def strategy_argument(self, backend: str | None = None, bucket_size_mb: BucketSize | str = None,
                          settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The value of ``--trainer.strategy`` (``json.dumps`` it): ``{"class_path": ..., "init_args": ...}``;
        ``bucket_size_mb`` None: the entry's default."""
        init_args: dict[str, Any] = dict(self.init_args)
        if backend is not None:
            init_args["process_group_backend"] = backend
        if self.has_bucket_size:
            default = "default" if self.is_engine else self.default_bucket_size_mb
            init_args["bucket_size_mb"] = default if bucket_size_mb is None else bucket_size_mb
        elif self.is_engine:
            # "default" always: a bucket size in a base config's strategy would otherwise carry over to this class.
            init_args["bucket_size_mb"] = "default"
        if settings:
            if self.is_engine:
                init_args["engine_settings"] = dict(settings)
            else:
                init_args.update(settings)
        return {"class_path": self.lightning_class, "init_args": init_args}


STRATEGIES: dict[str, Entry] = {}  # every strategy by name, in the order tables and plots use


def register(entry: Entry, replace: bool = False) -> Entry:
    """Add ``entry`` to ``STRATEGIES`` (``replace=True`` to redefine a name)."""
    if entry.name in STRATEGIES and not replace and STRATEGIES[entry.name] != entry:
        raise ValueError(f"a strategy named {entry.name!r} is already in the catalogue; "
                         "pass replace=True to redefine it")
    STRATEGIES[entry.name] = entry
    return entry


def get(name: str) -> Entry:
    """The entry ``name``; an unknown name lists the valid ones."""
    if name not in STRATEGIES:
        raise ValueError(f"{name!r} is not a strategy of the catalogue; choose one of: {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def names(engines_only: bool = False) -> list[str]:
    """Every strategy's name, or only those ``GradSyncStrategy`` builds from an engine alone."""
    return [entry.name for entry in STRATEGIES.values() if entry.is_engine or not engines_only]


def format_bucket(value: Any) -> str:
    """A bucket size or a setting's value as tables, CSV columns and file names write it: ``25.0`` -> ``"25"``,
    ``0.5`` -> ``"0.5"``, ``"auto"`` -> ``"auto"``, ``True`` -> ``"true"``."""
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def format_settings(settings: Mapping[str, Any]) -> str:
    """``{"rank": 4, "start_iter": 10}`` -> ``"rank=4 start_iter=10"``; ``{}`` -> ``""``."""
    return " ".join(f"{name}={format_bucket(value)}" for name, value in settings.items())


_SIMULATORS = "lightning_ddp.projection.simulators"

register(Entry(
    "naive_ddp", "After backward, all-reduce every gradient tensor, one blocking call each.",
    engine="lightning_ddp.sync.naive:NaiveDDP", memory="none", projection=SCHEDULE,
))
register(Entry(
    "flat_ddp", "After backward, all-reduce all gradients flattened into one buffer.",
    engine="lightning_ddp.sync.flat:FlatDDP", memory="packed", projection=SCHEDULE,
))
register(Entry(
    "overlap_ddp", "During backward, an async all-reduce of each gradient as soon as it is ready.",
    engine="lightning_ddp.sync.overlap:OverlapDDP", overlaps_backward=True, memory="per_tensor",
    projection=SCHEDULE,
))
register(Entry(
    "bucketed_ddp", "During backward, an async all-reduce per size-capped bucket of gradients as it fills.",
    engine="lightning_ddp.sync.bucketed:BucketedDDP", has_bucket_size=True, overlaps_backward=True,
    memory="bucketed", projection=SCHEDULE,
))
register(Entry(
    "bucketed_bf16_ddp", "Bucketed, with the gradients communicated in bf16: half the bytes, lossy.",
    engine="lightning_ddp.sync.bucketed_bf16:BucketedBF16DDP", has_bucket_size=True, overlaps_backward=True,
    exact=False, memory="bucketed", projection=f"{_SIMULATORS}:simulate_bucketed_bf16",
))
register(Entry(
    "bucketed_powersgd_ddp", "Bucketed, each large gradient matrix sent as low-rank PowerSGD factors with error "
    "feedback: far fewer bytes, lossy.",
    engine="lightning_ddp.sync.bucketed_powersgd:BucketedPowerSGDDDP", has_bucket_size=True, overlaps_backward=True,
    exact=False, memory="bucketed", projection=f"{_SIMULATORS}:simulate_bucketed_powersgd",
))
register(Entry(
    "zero1_ddp", "ZeRO-1: gradients reduce-scattered in step(), optimizer state sharded, parameters all-gathered.",
    engine="lightning_ddp.sync.zero1:DeferredGradSync", lightning_class="lightning_ddp.strategies.ZeRO1DDPStrategy",
    init_args={"schedule": "reduce_scatter"}, sharded=True, memory="zero1", projection=SCHEDULE,
))
register(Entry(
    "zero2_ddp", "ZeRO-2: each bucket reduce-scattered to its owners during backward, gradients and optimizer state "
    "sharded, parameters all-gathered after the step.",
    engine="lightning_ddp.sync.zero2:ZeRO2DDP", lightning_class="lightning_ddp.strategies.ZeRO2DDPStrategy",
    has_bucket_size=True, overlaps_backward=True, sharded=True, memory="zero2",
    projection=SCHEDULE,
))
register(Entry(
    "fsdp2", "torch's FSDP2 (fully_shard per block): parameters, gradients and optimizer state sharded.",
    lightning_class="lightning_ddp.strategies.FSDP2Strategy", overlaps_backward=True, sharded=True,
    memory="fully_sharded", projection=SCHEDULE,
))
register(Entry(
    "hsdp", "Hybrid sharding, torch's FSDP2 over a (replicate, shard) mesh: fsdp2 within each group of shard_size "
    "ranks (a node), each gradient shard all-reduced across the groups.",
    lightning_class="lightning_ddp.strategies.HSDPStrategy", overlaps_backward=True, sharded=True,
    memory="hybrid_sharded", projection=f"{_SIMULATORS}:simulate_hsdp",
))
register(Entry(
    "ddp", "Lightning's DDP (torch DistributedDataParallel): 25 MiB buckets during backward; the baseline.",
    lightning_class="lightning.pytorch.strategies.DDPStrategy", overlaps_backward=True,
    memory="full_buckets", projection=SCHEDULE,
))
