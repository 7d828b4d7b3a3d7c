"""Command lines from config dataclasses, for every study entry point (sweep, projection, GPU study, memory).

Every field is a flag (``--grid.batch_sizes [2,4]``), ``--config FILE`` reads a YAML of them, a field's docstring is
its ``--help`` text, and a config that fails validation (the dataclasses raise ``ValueError`` in
``__post_init__``) ends in one line, ``error: ...``, and exit code 2, without a traceback.
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
