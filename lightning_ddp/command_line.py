"""Command lines: a refused input is one ``error:`` line and exit code 2. ``check_command_line`` checks what needs no
Lightning of ``python -m lightning_ddp ...`` (the command, ``--config`` files, ``--ckpt_path``) before it is imported;
``parse_dataclass`` builds the study entry points' command lines from their config dataclasses.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import sys
import typing
import zipfile
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from lightning_ddp.run_folders import run_folder

T = TypeVar("T")

SUBCOMMANDS = ("fit", "validate", "test")  # the CLI's: LightningCLI's without predict
COMMANDS = (*SUBCOMMANDS, "advise")  # what `python -m lightning_ddp` takes first; advise is the study's


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


def check_command(word: str) -> None:
    """``word``, the first argument, is an option or one of ``COMMANDS``; else ``ValueError`` with the closest."""
    if word.startswith("-") or word in COMMANDS:
        return
    close = difflib.get_close_matches(word, COMMANDS, n=1, cutoff=0.6)
    why = (" (a language model's predictions need a sampling loop this toolkit does not have)" if word == "predict"
           else f"; did you mean {close[0]}?" if close else "")
    raise ValueError(f"`{word}` is not a command of python -m lightning_ddp{why} Commands: {', '.join(COMMANDS)}; "
                     "e.g. python -m lightning_ddp validate --config configs/quickstart.yaml")


def check_config_file(path: str) -> None:
    """A ``--config`` file exists and is YAML; a syntax error names the file, line and column (PyYAML's mark). YAML
    given in place of a file (``--config '{trainer: {max_steps: 3}}'``, as jsonargparse allows) is checked as such."""
    import yaml

    inline = not Path(path).exists() and (path.lstrip().startswith("{") or "\n" in path)
    if not (Path(path).is_file() or inline):
        what = "is a folder, not a file" if Path(path).is_dir() else "does not exist"
        raise ValueError(f"--config {path} {what}; the configs are under configs/, e.g. configs/quickstart.yaml")
    try:
        yaml.safe_load(path if inline else Path(path).read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        mark = getattr(error, "problem_mark", None)
        name = f"--config {path!r}" if inline else path
        where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else name
        context = f" ({error.context})" if getattr(error, "context", None) else ""
        raise ValueError(f"{where}: not valid YAML: {getattr(error, 'problem', None) or error}{context}") from None


def final_checkpoint(folder: Path) -> Path | None:
    """The checkpoint a run's folder stands for, in it or its ``checkpoints/``: ``last*.ckpt``, else the highest
    ``step=N``, else the newest; None if it holds none."""
    files = sorted(folder.glob("*.ckpt")) or sorted((folder / "checkpoints").glob("*.ckpt"))

    def order(file: Path) -> tuple[bool, int, float]:
        step = re.search(r"step=(\d+)", file.name)
        return file.name.startswith("last"), int(step[1]) if step else -1, file.stat().st_mtime

    return max(files, key=order, default=None)


def checkpoint_file(path: str) -> str:
    """The checkpoint ``--ckpt_path`` names: a file, or a run's folder, or its logger's (``run_folders``: its latest
    run with one); ``ValueError`` if it holds none or is no checkpoint. URLs and Lightning's names pass as given."""
    if "://" in path or path in ("last", "best", "hpc", "registry"):
        return path
    if Path(path).is_dir():
        try:
            found = run_folder(path, lambda folder: final_checkpoint(folder) is not None, "checkpoint (*.ckpt)",
                               "fit with --trainer.enable_checkpointing true to keep one")
        except ValueError as error:
            raise ValueError(f"--ckpt_path {error}") from None
        return checkpoint_file(str(final_checkpoint(found)))
    if not Path(path).exists():
        raise ValueError(f"--ckpt_path {path} does not exist; point it at a .ckpt file or the folder of a run that "
                         "kept checkpoints (e.g. logs/bucketed_ddp/version_0)")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive, its directory at the end: not when truncated
        raise ValueError(f"--ckpt_path {path} is not a readable checkpoint (truncated or not written by torch.save); "
                         "resume from an earlier checkpoint of the run (e.g. the previous `step=...ckpt`).")
    return path


def check_command_line(args: list[str]) -> None:
    """Refuse (``refuse``) what ``args`` of ``python -m lightning_ddp`` get wrong that needs no Lightning to see."""
    checks = {"--config": check_config_file, "-c": check_config_file, "--ckpt_path": checkpoint_file}
    try:
        if args:
            check_command(args[0])
        for index, word in enumerate(args):  # `--flag value` or `--flag=value`
            flag, equals, value = word.partition("=")
            if flag in checks and (equals or index + 1 < len(args)):
                checks[flag](value if equals else args[index + 1])
    except ValueError as error:
        refuse(str(error))


def parse_dataclass(cls: type[T], args: list[str] | None, prog: str) -> T:
    """The ``cls`` instance a command line describes (``args=None``: ``sys.argv[1:]``)."""
    from jsonargparse import auto_cli, set_parsing_settings

    # Attribute docstrings (a string under a dataclass field) become --help text.
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    try:
        return auto_cli(cls, args=args, description=cls.__doc__, prog=prog)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def check_field_types(config: object) -> None:
    """Hold a config built in Python to what its command line holds it to: every field's value checked against the
    field's type by jsonargparse, as the CLI checks it (``NonNegativeFloat``, ``Literal[...]``, ``list[int]`` ...),
    ``ValueError`` with the CLI's message. A dataclass's ``__post_init__`` calls it first; fields that are
    dataclasses check themselves."""
    parser, names = _field_parser(type(config))
    try:
        parser.parse_object({name: getattr(config, name) for name in names})
    except Exception as error:  # jsonargparse's ArgumentError: the message the command line prints after "error:"
        raise ValueError(str(error)) from None


@functools.cache
def _field_parser(cls: type) -> tuple[Any, tuple[str, ...]]:
    """A parser of ``cls``'s fields that are not dataclasses (built once per class), and their names."""
    from jsonargparse import ArgumentParser

    hints = typing.get_type_hints(cls)
    names = tuple(spec.name for spec in dataclasses.fields(cls) if not dataclasses.is_dataclass(hints[spec.name]))
    parser = ArgumentParser(exit_on_error=False)
    for name in names:
        parser.add_argument(f"--{name}", type=hints[name])
    return parser, names
