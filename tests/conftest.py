"""Shared pytest setup for the test suite."""

import sys
from pathlib import Path

# Tests import helpers as `tests.<module>`, and multi-process tests spawn children that re-import test modules
# by name with the parent's sys.path; putting the repository root on sys.path makes both work whether pytest
# runs as `pytest` or `python -m pytest`, from any directory, under any --import-mode.
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)
