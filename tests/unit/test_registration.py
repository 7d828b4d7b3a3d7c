"""``import lightning_ddp`` registers our strategy names with Lightning, in either import order, without importing
Lightning (or torch) itself: ``Trainer(strategy="bucketed_ddp")`` works from a user's script (issue 23, item 5)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.support.cli_utils import REPO

_CHECK = """
    from lightning.pytorch.strategies import StrategyRegistry
    from lightning_ddp import catalogue
    missing = [name for name in catalogue.names() if name not in StrategyRegistry]
    assert not missing, missing
    print("registered", len(catalogue.names()))
"""


def _run(body: str) -> str:
    code = textwrap.dedent(body) + textwrap.dedent(_CHECK)
    # -W error: a registration that fails only warns (never breaking `import lightning`), so make that fail here
    proc = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def test_import_registers_when_lightning_is_imported_later_and_loads_neither_lightning_nor_torch() -> None:
    out = _run("""
        import sys
        import lightning_ddp
        assert "lightning" not in sys.modules and "torch" not in sys.modules, "import lightning_ddp must stay cheap"
        import lightning  # the user's `import lightning as L` after ours
    """)
    assert "registered" in out


def test_import_registers_at_once_when_lightning_was_imported_first() -> None:
    out = _run("""
        import lightning.pytorch
        import lightning_ddp
    """)
    assert "registered" in out


def test_importing_our_strategies_first_registers_them_once_without_a_warning() -> None:
    # lightning_ddp.strategies imports Lightning itself: the hook fires while it is half-imported and leaves the
    # registration to it (importing it from the hook would be a circular import)
    out = _run("""
        import lightning_ddp.strategies
    """)
    assert "registered" in out
