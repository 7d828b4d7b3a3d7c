"""Markdown tables and CSV text: the one helper the projection's and the GPU study's reports write with."""

from __future__ import annotations

import csv
import io
from typing import Any, Iterable, Mapping, Sequence


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> list[str]:
    """The lines of a markdown table; ``align`` has one letter per column, ``r`` right-aligned (``---:``), anything
    else (or a missing letter) left (``---``). A ``|`` or a line break inside a cell stays in it (escaped).

    >>> print("\\n".join(markdown_table(["a", "b"], [[1, "x|y"]], align="r")))
    | a | b |
    |---:|---|
    | 1 | x\\|y |
    """
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    rule = "".join("---:|" if letter == "r" else "---|" for letter in align.ljust(len(header)))
    lines = ["| " + " | ".join(header) + " |", "|" + rule]
    return lines + ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]


def csv_text(rows: Iterable[Mapping[str, Any]], columns: Sequence[str], **options: Any) -> str:
    """``rows`` as CSV with a header of ``columns`` and ``\\n`` line ends; ``options`` go to ``csv.DictWriter``."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n", **options)
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()
