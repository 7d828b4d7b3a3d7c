"""Command lines from config dataclasses, for every study entry point: every field a flag, ``--config FILE`` a
YAML of them, and a config its ``__post_init__`` refuses one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import typing
from typing import Any, TypeVar

T = TypeVar("T")


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
