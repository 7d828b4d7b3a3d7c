"""The names a strategy variant (a strategy with its bucket size and engine settings) goes by in the study's tables,
CSV columns, file names and grids; the text of a setting's value is the catalogue's ``format_bucket``."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any, Mapping

from lightning_ddp.catalogue import format_bucket, format_settings

__all__ = ["format_bucket", "format_settings", "parse_settings", "setting_combinations", "settings_slug",
           "variant_label", "variant_strategy"]


def parse_settings(text: str) -> dict[str, Any]:
    """The settings ``format_settings`` wrote; values read as JSON where they parse, else kept as text.

    >>> parse_settings("rank=4 mode=fast")
    {'rank': 4, 'mode': 'fast'}
    """
    settings: dict[str, Any] = {}
    for item in (text or "").split():
        name, _, value = item.partition("=")
        try:
            settings[name] = json.loads(value)
        except ValueError:
            settings[name] = value
    return settings


def settings_slug(settings: Mapping[str, Any]) -> str:
    """The settings as a file-name fragment: ``{"rank": 4}`` -> ``"-rank4"``; ``{}`` -> ``""``."""
    return "".join("-" + re.sub(r"[^A-Za-z0-9._]", "_", f"{name}{format_bucket(value)}")
                   for name, value in settings.items())


def setting_combinations(axes: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Every combination of ``{setting: [values]}``, the first setting varying slowest; ``[{}]`` for none."""
    axes = axes or {}
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def variant_label(strategy: str, bucket_size_mb: float | str | None = None, settings: str = "") -> str:
    """A strategy with its bucket size and settings: ``bucketed_powersgd_ddp 4 MiB rank=4``, ``bucketed_ddp auto``."""
    label = strategy
    if bucket_size_mb == "auto":
        label += " auto"
    elif bucket_size_mb not in (None, ""):
        label += f" {format_bucket(bucket_size_mb)} MiB"
    if settings:
        label += f" {settings}"
    return label


def variant_strategy(variant: str) -> str:
    """The strategy of a ``variant_label``: a name is an identifier, so it ends at the first space."""
    return variant.split(" ", 1)[0]
