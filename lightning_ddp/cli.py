"""``python -m lightning_ddp fit|validate|test --config configs/quickstart.yaml``: a thin LightningCLI with the
``CommTimer`` (``timer:``) and ``TraceRecorder`` (``trace:``) always added; before ``fit`` starts anything, the memory
pre-flight refuses a run that cannot fit, with the fixes (``--preflight false`` skips it; ``docs/memory.md``).
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
import warnings
import zipfile
from typing import Any, NoReturn

import torch

from jsonargparse import Namespace, lazy_instance, set_parsing_settings
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.strategies import StrategyRegistry
from typing_extensions import override

from lightning_ddp import catalogue
from lightning_ddp.callbacks.comm_timer import CommTimer
from lightning_ddp.callbacks import FinalStepCheckpoint
from lightning_ddp.metrics.recording import strategy_label
from lightning_ddp.callbacks.trace_recorder import TraceRecorder
from lightning_ddp.data import BYTE_VOCAB_SIZE, DEFAULT_VOCAB_SIZE, LMDataModule
from lightning_ddp.memory import GiB, MemoryPreflightError, memory_budget_bytes, preflight
from lightning_ddp.model import get_config
from lightning_ddp.module import LitGPT
from lightning_ddp.strategies import register_strategies
from lightning_ddp.teardown import tear_down_process_group


# LMDataModule resumes mid-epoch through its own state_dict (lightning_ddp.data): Lightning would warn on every resume.
warnings.filterwarnings("ignore", message=".*your dataloader is not resumable.*")
# An empty val_dataloader() is how LMDataModule says "no validation"; Lightning warns that its length is zero.
warnings.filterwarnings("ignore", message="Total length of `list` across ranks is zero.*")

# Known and harmless, on every run (silenced so that a real warning stands out): Lightning's pytree helper calls a
# torch API deprecated in torch 2.13 (a FutureWarning, once per rank), and Lightning advertises its cloud services.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)


logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
    lambda record: not str(record.msg).startswith("\N{ELECTRIC LIGHT BULB} Tip:"))

# Attribute docstrings (a string under a dataclass field) become --help text and YAML comments.
set_parsing_settings(docstring_parse_attribute_docstrings=True)

SUBCOMMANDS = ("fit", "validate", "test")  # LightningCLI's without predict


class UsageError(SystemExit):
    """A refused input: exit code 2 and no traceback, the message already printed as one ``error:`` line."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def refuse(message: str) -> NoReturn:
    """Print ``error: <message>`` on stderr and exit 2 (``UsageError``)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise UsageError(message)


# jsonargparse's reasons that only restate a type it tried, beside the one that says what is wrong
_TYPE_NOISE = ("Expected a ", "Not a valid subclass", "Type <", "Does not validate against", "Problem with given")


def user_error_message(message: str) -> str:
    """The line of a jsonargparse error message that says what is wrong: of a union's reasons, the one that is not a
    type mismatch, preferring one that names a fix, after the key's label."""
    raw = [line.rstrip() for line in message.splitlines() if line.strip()]
    if not raw:
        return message
    label = raw[0].strip() + " " if raw[0].strip().endswith(":") else ""
    reasons = []
    for i, line in enumerate(raw):
        if not line.lstrip().startswith("- "):
            continue
        indent = len(line) - len(line.lstrip())
        body = [line.lstrip()[2:]]
        for follow in raw[i + 1:]:
            if len(follow) - len(follow.lstrip()) <= indent:
                break
            body.append(follow.strip())
        if not body[0].startswith(_TYPE_NOISE):
            reasons.append(" ".join(body))
        elif body[0].endswith(":") and len(body) > 1:  # "Problem with given class_path 'X':" and why, below it
            reasons.append(" ".join(body[1:]))
    if reasons:
        fixes = [line for line in reasons if any(word in line for word in ("; set", "; use", "set --", "use --"))]
        return label + (fixes or reasons)[0]
    if label and len(raw) > 1:
        return label + raw[1].strip()
    return raw[0].strip()


class OneLineErrorParser(LightningArgumentParser):
    """jsonargparse's parser, refusing with one ``error:`` line instead of the whole usage text."""

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)  # a caller parsing on purpose without exiting (jsonargparse's own retries)
        line = user_error_message(message)
        if "File does not exist" in line:
            line += " (check the path; the configs are under configs/, e.g. configs/quickstart.yaml)"
        refuse(f"{line}\n(--help lists the options)")


class LightningDDPCLI(LightningCLI):
    def __init__(self, *args, parser_class: type[LightningArgumentParser] = OneLineErrorParser, **kwargs) -> None:
        super().__init__(*args, parser_class=parser_class, **kwargs)

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name in SUBCOMMANDS}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Always on: every run reports its communication share. Configure under `timer:` (enabled, warmup_steps).
        parser.add_lightning_class_args(CommTimer, "timer")
        # Off by default: `--trace.enabled true` writes a profiler trace per rank to <log_dir>/traces.
        parser.add_lightning_class_args(TraceRecorder, "trace")
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.link_arguments("model.context_length", "data.context_length")
        parser.add_argument(
            "--preflight", type=bool, default=True,
            help="Before fit starts, estimate one rank's peak memory (lightning_ddp.memory) and refuse a run that "
            "cannot fit, naming the fixes. false skips the check. validate and test never run it (forward only).",
        )

    @override
    def instantiate_classes(self) -> None:
        # The model's, data's and strategy's own checks raise from their constructors (jsonargparse buries a
        # strategy's under its union-type report); nothing has started yet: one line, exit 2.
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as error:
            refuse(user_error_message(str(error)))

    @override
    def instantiate_trainer(self, **kwargs):
        trainer = super().instantiate_trainer(**kwargs)
        # With checkpointing on, the last step is saved even when the run does not end on a validation.
        trainer.callbacks.append(FinalStepCheckpoint())
        logger = trainer.logger  # an unnamed TensorBoard/CSV logger is named after the strategy, {strategy} replaced
        if isinstance(logger, (TensorBoardLogger, CSVLogger)):
            label = strategy_label(trainer.strategy)
            if logger.name == "lightning_logs":  # the loggers' default: no name was given
                logger._name = label
            elif "{strategy}" in logger.name:
                logger._name = logger.name.replace("{strategy}", label)
        return trainer

    @override
    def before_validate(self) -> None:
        # Checked before the Trainer launches the other ranks: one message, not a traceback from each of them.
        try:
            self.datamodule.check_has_split(self.subcommand)
        except ValueError as error:
            refuse(str(error))
        # Evaluating a checkpoint needs none of the callbacks that saved it (ModelCheckpoint's state only matters to
        # a resumed fit), yet Lightning warns that they are missing on every `validate/test --ckpt_path`.
        warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`, callbacks used to create")

    before_test = before_validate

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        super().parse_arguments(parser, args)
        # Checked before LightningCLI reads the checkpoint, launches a process or writes a file.
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        try:
            check_strategy_name(config.trainer.strategy)
            check_cpu_devices(config.trainer.accelerator, config.trainer.devices)
            if config.get("ckpt_path"):
                check_checkpoint_file(config.ckpt_path)
        except (ValueError, FileNotFoundError) as error:
            refuse(str(error))
        # `fit`, or no subcommand (`run=False`: the caller is about to call `trainer.fit` itself).
        if subcommand in ("fit", None) and config.get("preflight", True):
            check_memory(config)


def check_strategy_name(strategy: object) -> None:
    """An unknown strategy name suggests the closest registered one and lists ours (Lightning's variants counted)."""
    if not isinstance(strategy, str) or strategy in StrategyRegistry or strategy == "auto":
        return
    ours = catalogue.names()
    others = sorted(name for name in StrategyRegistry if name not in ours)
    close = difflib.get_close_matches(strategy, [*ours, *others], n=1, cutoff=0.6)
    fix = f"did you mean {close[0]}? Set --trainer.strategy {close[0]}" if close else "set --trainer.strategy to one"
    raise ValueError(
        f"Unknown strategy {strategy!r}. Ours (ddp is Lightning's, the baseline): {', '.join(ours)} (and "
        f"{len(others)} more of Lightning's: {', '.join(n for n in others if '_' not in n)}, ...); {fix}."
    )


def check_cpu_devices(accelerator: object, devices: object) -> None:
    """On CPU each device is a process: more processes than cores only thrash (or hang waiting for a core)."""
    cores = os.cpu_count() or 1
    count = _device_count(devices, on_cuda=False) if _device_type(accelerator) == "cpu" else None
    if count is not None and count > cores:
        raise ValueError(
            f"--trainer.devices {devices} asks for {count} CPU processes, but this machine has {cores} CPU cores; "
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


def _builds(lightning_class: str, class_path: object) -> bool:
    """``class_path`` names ``lightning_class`` (``package.Class`` or ``package.module.Class``)."""
    package, _, name = lightning_class.rpartition(".")
    return isinstance(class_path, str) and class_path.rpartition(".")[2] == name and class_path.startswith(package)


def _strategy_for_estimate(strategy: object) -> tuple[str, float | None, str | None] | None:
    """(catalogue name, bucket_size_mb, the entry that shards the state over an all-reducing engine, if any), or
    None if not modelled."""
    if isinstance(strategy, str):
        return strategy, None, None
    if not isinstance(strategy, (dict, Namespace)):  # a Strategy instance
        return None
    class_path, init_args = strategy.get("class_path"), strategy.get("init_args") or {}
    bucket = init_args.get("bucket_size_mb")
    entry = next((e for e in catalogue.STRATEGIES.values() if _builds(e.lightning_class, class_path)), None)
    if entry is None:
        return None
    if entry.is_engine:
        return str(init_args.get("algorithm", catalogue.DEFAULT_ENGINE)), bucket, None
    schedule = init_args.get("schedule", entry.init_args.get("schedule"))
    if schedule is not None and schedule != entry.init_args.get("schedule"):
        # ZeRO-1's allreduce_broadcast: the grad_sync engine all-reduces (its buffers), the optimizer state is sharded.
        return str(init_args.get("grad_sync", catalogue.DEFAULT_ENGINE)), bucket, entry.name
    return entry.name, bucket, None


def _device_count(devices: object, on_cuda: bool) -> int | None:
    """Ranks on this host: Lightning's ``devices`` as a count (``auto``: 1 CPU process, or every visible GPU)."""
    if isinstance(devices, str) and devices.lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if devices in ("auto", -1, None):
        return torch.cuda.device_count() if on_cuda else 1
    if isinstance(devices, int) and devices > 0:
        return devices
    return None


def _ranks_per_gpu(world_size: int, num_nodes: int) -> int:
    """How many ranks share this rank's GPU: 1, or with several "nodes" on the loopback (the sweep's layout for
    more ranks than GPUs) the world over the visible GPUs, rounded up (the budget errs small, never large)."""
    if num_nodes == 1 or os.environ.get("MASTER_ADDR") not in ("127.0.0.1", "localhost"):
        return 1
    return max(1, -(-world_size // max(torch.cuda.device_count(), 1)))


def _device_type(accelerator: object) -> str | None:
    """``cuda`` or ``cpu`` for the accelerators the pre-flight has a budget for; None for others or CUDA not visible."""
    device_type = {"cuda": "cuda", "gpu": "cuda", "cpu": "cpu", "auto": "cuda"}.get(str(accelerator))
    if device_type == "cuda" and not torch.cuda.is_available():
        return "cpu" if accelerator == "auto" else None  # Lightning reports a GPU it cannot see itself
    return device_type


def check_memory(config) -> None:
    """Refuse a ``fit`` whose estimated per-rank peak exceeds the rank's memory, with the breakdown and fixes;
    skipped where there is no model or no budget (another accelerator, an unmodelled strategy or precision)."""
    trainer, data, model = config.trainer, config.data, config.model
    device_type = _device_type(trainer.accelerator)
    local = None if device_type is None else _device_count(trainer.devices, device_type == "cuda")
    resolved = _strategy_for_estimate(trainer.strategy)
    if local is None or resolved is None:
        return  # nothing to check against
    strategy, bucket_size_mb, sharded_by = resolved
    num_nodes = int(trainer.get("num_nodes", 1) or 1)
    world_size = local * num_nodes
    # Every other strategy a fix names is a sharded one: sharding the state changes nothing there.
    kwargs = dict(seq_len=data.seq_len, precision=str(trainer.precision), strategy=strategy, world_size=world_size,
                  bucket_size_mb=bucket_size_mb, device_type=device_type, sharded_by=sharded_by)
    vocab = BYTE_VOCAB_SIZE if data.source == "text" else (data.vocab_size or DEFAULT_VOCAB_SIZE)

    def gpt(preset: str) -> Any:
        return get_config(preset, vocab_size=vocab, context_length=model.context_length,
                          tie_embeddings=model.tie_embeddings)

    sharing = local if device_type == "cpu" else _ranks_per_gpu(world_size, num_nodes)
    budget = memory_budget_bytes(device_type, sharing)
    if device_type == "cuda":
        source = f"the GPU's {budget * sharing / GiB:.1f} GiB" + (f" / {sharing} ranks on it" if sharing > 1 else "")
    else:
        source = f"available RAM {budget * local / GiB:.1f} GiB / {local} processes"
    try:
        preflight(gpt, model.preset, budget, source, batch_size=data.batch_size,
                  processes=local if device_type == "cpu" else 1, **kwargs)
    except MemoryPreflightError:
        raise
    except ValueError:
        return  # a value the model, data or strategy will reject with its own message, or one we do not model


def main(args: list[str] | None = None) -> None:
    first = (sys.argv[1:] if args is None else args)[:1]
    if first and not first[0].startswith("-") and first[0] not in SUBCOMMANDS:  # exit 2 naming the supported ones
        predict = first[0] == "predict"
        why = " (a language model's predictions need a sampling loop this toolkit does not have)" if predict else ""
        refuse(f"`{first[0]}` is not a subcommand of python -m lightning_ddp{why}. Supported: "
               f"{', '.join(SUBCOMMANDS)}; e.g. python -m lightning_ddp validate --config configs/quickstart.yaml")
    register_strategies()  # `trainer.strategy: <name>` for every catalogue entry
    try:
        LightningDDPCLI(
            LitGPT,
            LMDataModule,
            trainer_defaults={"logger": lazy_instance(TensorBoardLogger, save_dir="logs")},  # named by strategy
            seed_everything_default=0,
            save_config_kwargs={"overwrite": True},
            args=args,
        )
    except MemoryPreflightError as error:  # refused by design: one message, no traceback
        refuse(str(error))
    tear_down_process_group()  # the run finished (a failure raised above): docs/troubleshooting.md, "exits -6"
