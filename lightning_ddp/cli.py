"""``python -m lightning_ddp fit --config configs/quickstart.yaml``: a thin LightningCLI.

The CLI only wires things together; each knob is documented where it is defined (``LitGPT``,
``LMDataModule``, the strategies and callbacks), and jsonargparse turns those docstrings into ``--help``.
The ``CommTimer`` callback is always added (section ``timer:``), and so is the ``TraceRecorder`` (section ``trace:``,
off until ``--trace.enabled true``). Two arguments are linked rather than set twice:

- ``data.vocab_size -> model.vocab_size``: the data decides the vocabulary (raw text bytes are always 256).
- ``model.context_length -> data.context_length``: the data module rejects ``seq_len`` longer than the model's context.
"""

from __future__ import annotations

import warnings

from jsonargparse import lazy_instance, set_parsing_settings
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger

import lightning_ddp  # noqa: F401  (registers our strategies with Lightning's StrategyRegistry)
from lightning_ddp.callbacks import CommTimer
from lightning_ddp.data import LMDataModule
from lightning_ddp.module import LitGPT
from lightning_ddp.profiling import TraceRecorder


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


def main(args: list[str] | None = None) -> LightningDDPCLI:
    return LightningDDPCLI(
        LitGPT,
        LMDataModule,
        trainer_defaults={"logger": lazy_instance(TensorBoardLogger, save_dir="logs", name="lightning_ddp")},
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        args=args,
    )
