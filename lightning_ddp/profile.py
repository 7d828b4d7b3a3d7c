"""The compute profile: how long forward, backward and the optimizer take, and when each gradient is ready.

One JSON file per measurement (schema ``lightning_ddp.compute_profile/1``, in ``docs/comm_timer.md``), written by
the ``CommTimer`` or ``write_profile`` and read by the projection. Standard library only.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightning_ddp.files import write_atomically

SCHEMA = "lightning_ddp.compute_profile/1"  # the `schema` value of version 1; a reader refuses any other

_TIMES = ("forward_ms", "backward_ms", "optimizer_ms")
_RUN_FIELDS = ("preset", "batch_size", "seq_len", "precision", "world_size")


@dataclass(frozen=True)
class ParamTiming:
    """One trainable parameter (as ``named_parameters()`` names it), its gradient's bytes, and when backward produced
    that gradient: ``ready_ms`` after backward's start (None: no gradient this step); ``shape`` if recorded."""

    name: str
    numel: int
    bytes: int
    ready_ms: Optional[float]
    shape: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if self.numel < 0 or self.bytes < 0:
            raise ValueError(f"parameter {self.name!r}: numel and bytes must be >= 0, "
                             f"got {self.numel} and {self.bytes}")
        if self.shape is not None:
            object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
            if math.prod(self.shape) != self.numel:
                raise ValueError(f"parameter {self.name!r}: shape {list(self.shape)} has {math.prod(self.shape)} "
                                 f"elements, but numel is {self.numel}; record the parameter's own shape, or none")
        if self.ready_ms is not None and not (self.ready_ms >= 0 and math.isfinite(self.ready_ms)):
            raise ValueError(
                f"parameter {self.name!r}: ready_ms must be a finite time >= 0 ms after the start of backward, or "
                f"null if it got no gradient; got {self.ready_ms!r}"
            )


@dataclass(frozen=True)
class ComputeProfile:
    """Per-rank compute of one training step (its JSON form: ``docs/comm_timer.md``)."""

    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    params: tuple[ParamTiming, ...]
    source: str = ""
    device: str = ""
    preset: Optional[str] = None
    batch_size: Optional[int] = None
    seq_len: Optional[int] = None
    precision: Optional[str] = None
    world_size: Optional[int] = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # unknown fields of the file, kept as read

    def __post_init__(self) -> None:
        for name in _TIMES:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"compute profile: {name} must be a finite time >= 0 ms, got {value!r}")
        if not self.params:
            raise ValueError("compute profile: `params` is empty; list every trainable parameter in parameters() order")
        object.__setattr__(self, "params", tuple(self.params))

    @property
    def backward_span_ms(self) -> float:
        """How long backward lasts in the simulation: ``backward_ms``, or the last gradient's ``ready_ms`` if later."""
        ready = [p.ready_ms for p in self.params if p.ready_ms is not None]
        return max([self.backward_ms, *ready])

    @property
    def compute_ms(self) -> float:
        """The compute-only step: forward + backward + optimizer (the 1-GPU reference, no communication)."""
        return self.forward_ms + self.backward_span_ms + self.optimizer_ms

    @property
    def has_shapes(self) -> bool:
        """Whether every parameter's shape is recorded."""
        return all(p.shape is not None for p in self.params)

    @property
    def grad_bytes(self) -> int:
        """Bytes of every gradient that exists this step (what naive and flat communicate)."""
        return sum(p.bytes for p in self.params if p.ready_ms is not None)

    @property
    def label(self) -> str:
        """A short description for tables: preset, batch, sequence length, precision, device."""
        parts = [self.preset or "model", f"b{self.batch_size}" if self.batch_size else "",
                 f"t{self.seq_len}" if self.seq_len else "", self.precision or "", self.device or ""]
        return " ".join(p for p in parts if p)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (schema version 1)."""
        data = {"schema": SCHEMA, **{key: getattr(self, key) for key in ("source", "device", *_RUN_FIELDS, *_TIMES)}}
        data["params"] = [{k: (list(v) if k == "shape" else v) for k, v in asdict(p).items()
                           if not (k == "shape" and v is None)} for p in self.params]
        return {**data, **{key: value for key, value in self.extra.items() if key not in data}}  # ours win

    @classmethod
    def from_dict(cls, data: dict[str, Any], origin: str = "compute profile") -> ComputeProfile:
        """Parse the JSON form; every error names the field and says what a valid file holds."""
        schema = data.get("schema") if isinstance(data, dict) else f"none (a JSON {type(data).__name__})"
        if schema != SCHEMA:
            raise ValueError(
                f"{origin}: schema is {schema!r}, this reader understands {SCHEMA!r}; write the file with "
                "lightning_ddp.profile.write_profile (or the CommTimer), or convert it to that schema"
            )
        missing = [k for k in (*_TIMES, "params") if k not in data]
        if missing or not isinstance(data["params"], list):
            raise ValueError(f"{origin}: a version-1 profile needs forward_ms, backward_ms, optimizer_ms and a list "
                             f"`params` (missing: {missing})")
        params = []
        for i, raw in enumerate(data["params"]):
            try:  # ParamTiming checks the values; JSON gives the types
                params.append(ParamTiming(**raw))
            except TypeError as error:
                raise ValueError(f"{origin}: params[{i}] must be an object with name, numel, bytes and ready_ms "
                                 f"(null if no gradient), and optionally shape; got {raw!r}") from error
        known = {"schema", "source", "device", *_RUN_FIELDS, *_TIMES, "params"}
        return cls(
            **{k: float(data[k]) for k in _TIMES}, **{k: data.get(k) for k in _RUN_FIELDS}, params=tuple(params),
            source=data.get("source") or "", device=data.get("device") or "",
            extra={k: v for k, v in data.items() if k not in known},
        )


def read_profile(path: str | os.PathLike) -> ComputeProfile:
    """Read and validate a compute profile JSON file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"compute profile {str(path)!r} does not exist; record one with the CommTimer or point "
                         "`compute.profile_path` at an existing file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"compute profile {str(path)!r} is not valid JSON ({error}); "
                         "was it written completely?") from None
    return ComputeProfile.from_dict(data, origin=f"compute profile {str(path)!r}")


def write_profile(profile: ComputeProfile, path: str | os.PathLike) -> Path:
    """Write ``profile`` as JSON (schema version 1), atomically; returns the path."""
    return write_atomically(path, json.dumps(profile.to_dict(), indent=1) + "\n")
