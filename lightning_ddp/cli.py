"""``python -m lightning_ddp fit|validate|test --config configs/quickstart.yaml``: a thin LightningCLI with the
``CommTimer`` (``timer:``) and ``TraceRecorder`` (``trace:``) always added; before ``fit`` starts anything, the memory
pre-flight refuses a run that cannot fit, with the fixes (``--preflight false`` skips it; ``docs/memory.md``).
"""

from __future__ import annotations

import difflib
import logging
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import torch

from jsonargparse import Namespace, lazy_instance, set_parsing_settings
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from typing_extensions import override

from lightning_ddp import catalogue, compat
from lightning_ddp.callbacks.comm_timer import CommTimer
from lightning_ddp.callbacks import FinalStepCheckpoint
from lightning_ddp.metrics.recording import strategy_label
from lightning_ddp.callbacks.trace_recorder import TraceRecorder
from lightning_ddp.command_line import SUBCOMMANDS, check_command_line, checkpoint_file, final_checkpoint, refuse
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
        """Exit 2 with one ``error:`` line (the parser's own retries, with ``exit_on_error`` off, still raise)."""
        if not self.exit_on_error:
            super().error(message, ex)  # a caller parsing on purpose without exiting (jsonargparse's own retries)
        refuse(f"{user_error_message(message)}\n(--help lists the options)")


class HeldBack(logging.Filter):
    """Holds a logger's records back (Lightning's ``Seed set to 0``) until ``release``: an input refused while the
    classes are built prints its error alone."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger, self.records = logger, []
        logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        """Keep ``record`` for ``release``; nothing is logged now."""
        self.records.append(record)
        return False

    def release(self) -> None:
        """Stop holding back and log the kept records, in order."""
        self.logger.removeFilter(self)
        for record in self.records:
            self.logger.handle(record)


class LightningDDPCLI(LightningCLI):
    """``python -m lightning_ddp``: LightningCLI with the CommTimer (``timer:``) and the TraceRecorder (``trace:``),
    every input checked before anything is launched or written, a refused one as a one-line error."""

    def __init__(self, *args, parser_class: type[LightningArgumentParser] = OneLineErrorParser, **kwargs) -> None:
        """LightningCLI's, with Lightning's seed message held back until the classes are built."""
        self.seed_message = HeldBack(logging.getLogger("lightning.fabric.utilities.seed"))
        try:
            super().__init__(*args, parser_class=parser_class, **kwargs)
        finally:
            self.seed_message.logger.removeFilter(self.seed_message)

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        """LightningCLI's subcommands that this CLI offers (``SUBCOMMANDS``)."""
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
        self.seed_message.release()

    @override
    def instantiate_trainer(self, **kwargs):
        """Lightning's Trainer plus ``FinalStepCheckpoint``; an unnamed TensorBoard or CSV logger is named
        after the strategy, and ``{strategy}`` in a logger's name replaced by it."""
        trainer = super().instantiate_trainer(**kwargs)
        # With checkpointing on, the last step is saved even when the run does not end on a validation.
        trainer.callbacks.append(FinalStepCheckpoint())
        logger = trainer.logger  # an unnamed TensorBoard/CSV logger is named after the strategy, {strategy} replaced
        if isinstance(logger, (TensorBoardLogger, CSVLogger)):
            label = strategy_label(trainer.strategy)
            if logger.name == "lightning_logs":  # the loggers' default: no name was given
                compat.rename_logger(logger, label)
            elif "{strategy}" in logger.name:
                compat.rename_logger(logger, logger.name.replace("{strategy}", label))
        return trainer

    @override
    def before_validate(self) -> None:
        # Checked before the Trainer launches the other ranks: one message, not a traceback from each of them.
        try:
            self.datamodule.check_has_split(self.subcommand)
        except ValueError as error:
            refuse(str(error))
        # Evaluating a checkpoint needs none of the callbacks that saved it (ModelCheckpoint's state only matters to
        # a resumed fit), yet Lightning warns that they are missing, or that the run's folder is not theirs, on
        # every `validate/test --ckpt_path`.
        warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`, callbacks used to create")
        warnings.filterwarnings("ignore", message="The dirpath has changed from")

    before_test = before_validate

    def after_fit(self) -> None:
        """Rank 0 prints where the run's files are (``run_folder_report``)."""
        if self.trainer.is_global_zero:
            print(run_folder_report(self.trainer), flush=True)

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        """Refuses, as one line, an unknown strategy, more CPU processes than cores, a precision the CPU cannot run, and
        a checkpoint path with no checkpoint; a run folder becomes its checkpoint. Then fit's memory pre-flight."""
        super().parse_arguments(parser, args)
        # Checked before LightningCLI reads the checkpoint, launches a process or writes a file.
        subcommand = self.config.get("subcommand")
        config = self.config[subcommand] if subcommand else self.config
        try:
            check_strategy_name(config.trainer.strategy)
            check_cpu_devices(config.trainer.accelerator, config.trainer.devices)
            check_precision(config.trainer.accelerator, config.trainer.precision)
            if config.get("ckpt_path"):  # a run's folder becomes its checkpoint's path (lightning_ddp.run_folders)
                config.ckpt_path = checkpoint_file(config.ckpt_path)
        except ValueError as error:
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


FP16_MIXED = ("16", "16-mixed")  # Lightning's names of fp16 autocast with a gradient scaler
REDUCED_PRECISION = {"bf16": torch.bfloat16, "bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16,
                     "16-true": torch.float16}  # the matmul dtype of every other reduced precision
SLOW_PRECISION = 1.5  # said at start when a reduced precision's matmul takes this many times fp32's on the CPU


def check_precision(accelerator: object, precision: object) -> None:
    """On CPU, fp16 mixed precision is refused (CPUs have no fp16 autocast: Lightning would run bf16-mixed and only
    warn), and a reduced precision whose matrix products run slower than fp32 here is said at start."""
    if _device_type(accelerator) != "cpu" or str(precision) not in (*FP16_MIXED, *REDUCED_PRECISION):
        return
    if str(precision) in FP16_MIXED:
        raise ValueError(f"--trainer.precision {precision} cannot run on CPU (no fp16 autocast there: Lightning would "
                         "run bf16-mixed instead); set --trainer.precision 32-true, or bf16-mixed to run that.")
    dtype = REDUCED_PRECISION[str(precision)]
    slowdown = cpu_matmul_slowdown(dtype) if rank_zero_only.rank == 0 else 1.0
    if slowdown > SLOW_PRECISION:
        rank_zero_warn(f"--trainer.precision {precision} will be slow on this CPU: its {str(dtype)[6:]} matrix "
                       f"products took {slowdown:.1f}x as long as fp32's in a check just now (no native "
                       f"{str(dtype)[6:]} instructions); 32-true is the fast precision here.")


def cpu_matmul_slowdown(dtype: torch.dtype, size: int = 256, repeats: int = 3) -> float:
    """How many times longer a ``size`` x ``size`` matrix product takes in ``dtype`` than in fp32 on this CPU: the
    ratio of medians of ``repeats`` interleaved timings, each after a warm-up product (about 0.1 s on a CPU
    without native bf16)."""
    times: dict[torch.dtype, list[float]] = {torch.float32: [], dtype: []}
    matrix = torch.randn(size, size)
    for _ in range(repeats):
        for kind, measured in times.items():
            x = matrix.to(kind)
            x @ x
            start = time.perf_counter()
            x @ x
            measured.append(time.perf_counter() - start)
    return statistics.median(times[dtype]) / statistics.median(times[torch.float32])


def run_folder_report(trainer: Any) -> str:
    """Where a fit went and the commands that read it, printed by rank 0 at its end."""
    # trainer.log_dir as rank 0 knows it, without its broadcast (a collective, which rank 0 alone must not call)
    logger = trainer.loggers[0] if trainer.loggers else None
    folder = Path(logger.log_dir if isinstance(logger, (TensorBoardLogger, CSVLogger))
                  else getattr(logger, "save_dir", None) or trainer.default_root_dir)
    kept = [name for name in ("timing_summary.json", "compute_profile.json", "config.yaml", "traces/")
            if (folder / name).exists()]
    events = any(folder.glob("events.out.tfevents.*"))
    checkpoint_dir = getattr(trainer.checkpoint_callback, "dirpath", None)
    final = final_checkpoint(Path(checkpoint_dir)) if checkpoint_dir else None
    if events:
        kept.append("TensorBoard logs")
    if final is not None:
        kept.append(f"checkpoints: {final}")
    lines = [f"Run folder: {folder} ({', '.join(kept) or 'nothing written'})"]
    if "timing_summary.json" in kept:
        lines.append(f"  what to change: python -m lightning_ddp advise {folder}")
    if events:
        lines.append(f"  TensorBoard:    tensorboard --logdir {folder}")
    if final is not None and "config.yaml" in kept:
        weights = folder if final.parent in (folder, folder / "checkpoints") else final
        lines.append(f"  evaluate:       python -m lightning_ddp validate --config {folder / 'config.yaml'} "
                     f"--ckpt_path {weights}")
    return "\n".join(lines)


def _builds(lightning_class: str, class_path: object) -> bool:
    """``class_path`` names ``lightning_class`` (``package.Class`` or ``package.module.Class``)."""
    package, _, name = lightning_class.rpartition(".")
    return isinstance(class_path, str) and class_path.rpartition(".")[2] == name and class_path.startswith(package)


class EstimatedStrategy(NamedTuple):
    """What the memory pre-flight prices of ``trainer.strategy``."""

    strategy: str  # the catalogue name whose memory model prices it
    bucket_size_mb: float | None = None  # None: the strategy's default
    sharded_by: str | None = None  # the entry sharding the state over an all-reducing engine (ZeRO-1's), if any
    shard_size: int | None = None  # hsdp's ranks per shard group; None: the devices of one node


def _strategy_for_estimate(strategy: object) -> EstimatedStrategy | None:
    """What the estimate prices of ``trainer.strategy``, or None if not modelled."""
    if isinstance(strategy, str):
        return EstimatedStrategy(strategy)
    if not isinstance(strategy, (dict, Namespace)):  # a Strategy instance
        return None
    class_path, init_args = strategy.get("class_path"), strategy.get("init_args") or {}
    bucket = init_args.get("bucket_size_mb")
    entry = next((e for e in catalogue.STRATEGIES.values() if _builds(e.lightning_class, class_path)), None)
    if entry is None:
        return None
    if entry.is_engine:
        return EstimatedStrategy(str(init_args.get("algorithm", catalogue.DEFAULT_ENGINE)), bucket)
    schedule = init_args.get("schedule", entry.init_args.get("schedule"))
    if schedule is not None and schedule != entry.init_args.get("schedule"):
        # ZeRO-1's allreduce_broadcast: the grad_sync engine all-reduces (its buffers), the optimizer state is sharded.
        return EstimatedStrategy(str(init_args.get("grad_sync", catalogue.DEFAULT_ENGINE)), bucket,
                                 sharded_by=entry.name)
    return EstimatedStrategy(entry.name, bucket, shard_size=init_args.get("shard_size"))


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
    num_nodes = int(trainer.get("num_nodes", 1) or 1)
    world_size = local * num_nodes
    # Every other strategy a fix names is a sharded one: sharding the state changes nothing there. hsdp's shard
    # group is the devices of one node unless set.
    kwargs = dict(seq_len=data.seq_len, precision=str(trainer.precision), world_size=world_size,
                  device_type=device_type, **resolved._replace(shard_size=resolved.shard_size or local)._asdict())
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
    check_command_line(sys.argv[1:] if args is None else args)
    register_strategies()  # `trainer.strategy: <name>` for every catalogue entry
    try:
        LightningDDPCLI(
            LitGPT,
            LMDataModule,
            trainer_defaults={"logger": lazy_instance(TensorBoardLogger, save_dir="logs")},  # named by strategy
            seed_everything_default=0,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"prog": "python -m lightning_ddp",
                           "epilog": "and: python -m lightning_ddp advise RUN_DIR, what to change (docs/advice.md)"},
            args=args,
        )
    except MemoryPreflightError as error:  # refused by design: one message, no traceback
        refuse(str(error))
    tear_down_process_group()  # the run finished (a failure raised above): docs/troubleshooting.md, "exits -6"
