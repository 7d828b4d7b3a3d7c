"""The sizes of the GPU study's work: on one GPU (``GPU_SCALE``) and in the CPU rehearsal (``DRY_RUN_SCALE``)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_ddp.model import get_config


@dataclass(frozen=True)
class FitSize:
    """The size of a stage's fits: ``warmup`` of the ``steps`` are left out of the medians."""

    preset: str
    """A model preset by name (``lightning_ddp.model.PRESETS``); checked against ``seq_len``."""
    batch: int  # per rank
    seq_len: int
    """Tokens per sequence: the model's context length and the data's."""
    steps: int
    """Optimizer steps of the fit, warm-up included."""
    warmup: int
    """The first steps, left out of the medians; fewer than ``steps``."""

    def __post_init__(self) -> None:
        """Refuses a batch, context or step count below 1, a warm-up outside [0, steps), and a preset that
        refuses ``seq_len`` (in the model's own words)."""
        for name in ("batch", "seq_len", "steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`FitSize.{name}` must be an integer >= 1, got {value!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or not 0 <= self.warmup < self.steps:
            raise ValueError(f"`FitSize.warmup` must be in [0, steps={self.steps}), got {self.warmup!r}")
        get_config(self.preset, context_length=self.seq_len)  # what the fit's --model.preset refuses, in its words


@dataclass(frozen=True)
class Scale:
    """The sizes of every stage's work, on a GPU or in the CPU dry run."""

    device: str  # cuda, or cpu for the dry run
    backend: str  # of one rank on the device: nccl on a GPU, gloo on CPU (2 ranks always share it over gloo)
    precision: str  # of the stages' fits (stage compute measures both bf16-mixed and 32-true)
    compute: FitSize  # its batch: the largest the memory pre-flight may propose
    strategies: FitSize
    """Stage strategies: every strategy on one rank."""
    traces: FitSize  # 2 ranks; the steps and warm-up of configs/trace/record.yaml, whose last 3 steps are traced
    profile: FitSize  # stage ready_times
    overhead: FitSize  # stage timer_overhead

    def __post_init__(self) -> None:
        """Refuses any pairing but cuda with nccl, or cpu with gloo."""
        if (self.device, self.backend) not in (("cuda", "nccl"), ("cpu", "gloo")):
            raise ValueError(f"`Scale.device` and `Scale.backend` must be cuda and nccl, or cpu and gloo; got "
                             f"{self.device!r} and {self.backend!r}")


GPU_SCALE = Scale(
    device="cuda",
    backend="nccl",
    precision="bf16-mixed",
    compute=FitSize(preset="xl", batch=16, seq_len=512, steps=4, warmup=2),
    strategies=FitSize(preset="small", batch=16, seq_len=512, steps=10, warmup=3),
    traces=FitSize(preset="small", batch=4, seq_len=256, steps=9, warmup=6),
    profile=FitSize(preset="xl", batch=4, seq_len=512, steps=8, warmup=3),  # the published 2-GPU xl runs' batch
    overhead=FitSize(preset="small", batch=8, seq_len=512, steps=30, warmup=5),
)
"""One H100 (80 GB) or H200 (141 GB): every stage in one call of ``--budget_min 9`` (``stages.STAGES``)."""

DRY_RUN_SCALE = Scale(
    device="cpu",
    backend="gloo",
    precision="32-true",  # bf16 autocast on CPU is several times slower than fp32
    compute=FitSize(preset="tiny", batch=2, seq_len=32, steps=2, warmup=1),
    strategies=FitSize(preset="tiny", batch=2, seq_len=32, steps=4, warmup=1),
    traces=FitSize(preset="tiny", batch=4, seq_len=32, steps=9, warmup=6),
    profile=FitSize(preset="tiny", batch=2, seq_len=32, steps=5, warmup=3),
    overhead=FitSize(preset="tiny", batch=2, seq_len=32, steps=6, warmup=2),
)
"""The same stages on CPU with the tiny preset: every code path but the CUDA lines, in minutes on 2 cores."""
