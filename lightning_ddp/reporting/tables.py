"""Markdown tables and CSV text: the one table and CSV writer (and CSV reader) of every report of the study."""

from __future__ import annotations

import csv
import io
import math
import os
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence


def markdown_table(header: Sequence[Any], rows: Iterable[Sequence[Any]], align: str = "") -> list[str]:
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
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + rule]
    return lines + ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]


class Column(NamedTuple):
    """One column of a table: its header, its cell from a row, its alignment (``l`` or ``r``)."""

    header: str
    cell: Callable[[Any], Any]
    align: str = "r"


def table(columns: Sequence[Column], rows: Iterable[Any]) -> list[str]:
    """The markdown table of ``rows`` under ``columns``, as lines."""
    return markdown_table([c.header for c in columns], [[c.cell(row) for c in columns] for row in rows],
                          "".join(c.align for c in columns))


def text_cell(name: str, spec: str = "") -> Callable[[Mapping[str, Any]], str]:
    """A cell writing ``row[name]`` in ``spec``: booleans as yes/no, ``-`` where it is missing or empty."""
    def cell(row: Mapping[str, Any]) -> str:
        value = row.get(name)
        if value is None or value == "":
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "no"
        return format(value, spec)

    return cell


def csv_value(value: Any, digits: int | None = None) -> Any:
    """A value as a CSV cell holds it: None/NaN as ``""``, booleans as ``true``/``false``."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if not math.isfinite(value):
            return ""
        return round(value, digits) if digits is not None else value
    return value


def csv_text(rows: Iterable[Mapping[str, Any]], columns: Sequence[str], digits: int | None = None) -> str:
    """``rows`` as CSV with a header of ``columns`` (others ignored) and ``\\n`` line ends; cells by ``csv_value``
    (floats rounded to ``digits`` when given)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows({column: csv_value(row.get(column), digits) for column in columns} for row in rows)
    return buffer.getvalue()


def read_csv(path: str | os.PathLike) -> list[dict[str, str]]:
    """The rows of a CSV file as strings (empty cells as ``""``)."""
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))
