"""README's "Measure your own training" example is ``examples/measure_your_training.py``, verbatim.

``tests/dist/test_sampling.py`` runs the file on 2 CPU processes; this test keeps the README's copy from drifting
away from what is run.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_readme_example_is_the_example_file() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Measure your own training"):]
    start = section.index("```python\n") + len("```python\n")
    snippet = section[start:section.index("\n```", start)]
    assert snippet.strip() == (REPO / "examples" / "measure_your_training.py").read_text(encoding="utf-8").strip()


def test_the_example_is_about_fifteen_lines() -> None:
    # The issue asked for a ~15-line example: count the lines that hold code (no blank lines).
    lines = [line for line in (REPO / "examples" / "measure_your_training.py").read_text().splitlines() if line.strip()]
    assert len(lines) <= 20, len(lines)
