"""``python -m lightning_ddp fit --config configs/quickstart.yaml``: a thin LightningCLI.

The CLI only wires things together; each knob is documented where it is defined (``LitGPT``,
``LMDataModule``, the strategies and callbacks), and jsonargparse turns those docstrings into ``--help``.
The ``CommTimer`` callback is always added (section ``timer:``), and so is the ``TraceRecorder`` (section ``trace:``,
off until ``--trace.enabled true``). Two arguments are linked rather than set twice:

- ``data.vocab_size -> model.vocab_size``: the data decides the vocabulary (raw text bytes are always 256).
- ``model.context_length -> data.context_length``: the data module rejects ``seq_len`` longer than the model's context.
"""

from __future__ import annotations

import os
import warnings
import zipfile

import torch

from jsonargparse import lazy_instance, set_parsing_settings
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import StrategyRegistry

from lightning_ddp.callbacks.comm_timer import CommTimer
from lightning_ddp.callbacks.trace_recorder import TraceRecorder
from lightning_ddp.data import LMDataModule
from lightning_ddp.module import LitGPT
from lightning_ddp.strategies import register_strategies, strategy_names


# LMDataModule resumes mid-epoch exactly through its own state_dict and sampler (see data.py); Lightning only
# recognises resumable *dataloaders* and would warn on every resume that ours is not.
warnings.filterwarnings("ignore", message=".*your dataloader is not resumable.*")
# An empty val_dataloader() is how LMDataModule says "no validation"; Lightning warns that its length is zero.
warnings.filterwarnings("ignore", message="Total length of `list` across ranks is zero.*")

# Attribute docstrings (a string under a dataclass field) become --help text and YAML comments.
set_parsing_settings(docstring_parse_attribute_docstrings=True)


class LightningDDPCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Always on: every run reports its communication share. Configure under `timer:` (enabled, warmup_steps).
        parser.add_lightning_class_args(CommTimer, "timer")
        # Off by default: `--trace.enabled true` writes a profiler trace per rank to <log_dir>/traces.
        parser.add_lightning_class_args(TraceRecorder, "trace")
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.link_arguments("model.context_length", "data.context_length")

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        super().parse_arguments(parser, args)
        # Checked right after parsing: before LightningCLI reads the checkpoint's hyperparameters, any process is
        # launched or any file is written.
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        check_strategy_name(config.trainer.strategy)
        check_cpu_devices(config.trainer.accelerator, config.trainer.devices)
        if config.get("ckpt_path"):
            check_checkpoint_file(config.ckpt_path)


def check_strategy_name(strategy: object) -> None:
    """An unknown strategy name lists every registered one, ours first."""
    if not isinstance(strategy, str) or strategy in StrategyRegistry or strategy == "auto":
        return
    ours = strategy_names()
    others = sorted(name for name in StrategyRegistry if name not in ours and name != "ddp")
    raise ValueError(
        f"Unknown strategy {strategy!r}. Ours: {', '.join(ours)}; Lightning's baseline: ddp; also registered: "
        f"{', '.join(others)}. Set --trainer.strategy to one of them."
    )


def check_cpu_devices(accelerator: object, devices: object) -> None:
    """On CPU each device is a process: more processes than cores only thrash (or hang waiting for a core)."""
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    cores = os.cpu_count() or 1
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    if on_cpu and isinstance(devices, int) and devices > cores:
        raise ValueError(
            f"--trainer.devices {devices} asks for {devices} CPU processes, but this machine has {cores} CPU cores; "
            f"set --trainer.devices to at most {cores}."
        )


def check_checkpoint_file(path: str) -> None:
    """A missing, truncated or foreign checkpoint fails here, with its name, instead of deep inside torch.load."""
    if "://" in str(path) or path in ("last", "best", "hpc", "registry"):
        return  # remote paths and Lightning's special names are resolved by Lightning itself
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--ckpt_path {path!r} does not exist; point it at a .ckpt file written by a run.")
    # torch.save writes a zip archive whose directory sits at the end: a truncated file has none.
    if not zipfile.is_zipfile(path):
        raise ValueError(
            f"--ckpt_path {path!r} is not a readable checkpoint (truncated or not written by torch.save); "
            "resume from an earlier checkpoint of the run (e.g. the previous `step=...ckpt`)."
        )


def main(args: list[str] | None = None) -> LightningDDPCLI:
    register_strategies()  # `trainer.strategy: <name>_ddp` for every registered algorithm
    return LightningDDPCLI(
        LitGPT,
        LMDataModule,
        trainer_defaults={"logger": lazy_instance(TensorBoardLogger, save_dir="logs", name="lightning_ddp")},
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        args=args,
    )
