"""lightning_ddp: data-parallel gradient synchronisation, one swappable Lightning strategy per algorithm.

``import lightning_ddp`` is cheap (no torch, no Lightning) and registers our strategy names with Lightning's
``StrategyRegistry`` whether Lightning is imported before or after it (``_registration``), so
``Trainer(strategy="bucketed_ddp")`` works. The product (``sync``, ``strategies``, ``callbacks``, ``metrics``,
``model``, ``module``, ``data``, ``cli``, ...) never imports the study (``bench``, ``projection``):
``tests/unit/test_layers.py`` checks every import. Import names from their sub-packages, e.g.
``from lightning_ddp.callbacks import CommTimer``.
"""

from __future__ import annotations

from lightning_ddp._registration import register_with_lightning

__all__: list[str] = []

register_with_lightning()
