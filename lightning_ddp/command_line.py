"""Command lines from config dataclasses, for every study entry point: every field a flag, ``--config FILE`` a
YAML of them, and a config its ``__post_init__`` refuses one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import sys
from typing import TypeVar

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
