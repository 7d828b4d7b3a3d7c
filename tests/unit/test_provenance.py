"""git_state: the commit and the changed code: files outside the committed results and the run's own output."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from lightning_ddp.reporting import provenance


@pytest.fixture
def checkout(tmp_path, monkeypatch) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    repo.mkdir()
    for args in (["init", "-q"], ["config", "user.email", "t@t"], ["config", "user.name", "t"]):
        subprocess.run(["git", *args], cwd=repo, check=True)
    (repo / "code.py").write_text("x = 1\n")
    subprocess.run(["git", "add", "code.py"], cwd=repo, check=True)
    subprocess.run(["git", "commit", "-qm", "init"], cwd=repo, check=True)
    monkeypatch.setattr(provenance, "_REPO", repo.resolve())
    return repo


def test_clean_tree_then_results_and_own_output_ignored_then_code_change_counted(checkout: Path) -> None:
    state = provenance.git_state()
    assert state["git_dirty"] is False and len(state["git_commit"]) == 40 and state["git_changed"] == []

    results = checkout / "benchmarks" / "results" / "cpu"
    results.mkdir(parents=True)
    (results / "repeats.csv").write_text("a\n")
    assert provenance.git_state()["git_dirty"] is False  # a remade result is data, not code

    output = checkout / "study"
    output.mkdir()
    (output / "stages.json").write_text("{}\n")
    assert provenance.git_state()["git_dirty"] is True  # untracked files count
    assert provenance.git_state(ignore=[output])["git_dirty"] is False  # unless they are the run's own output

    (checkout / "code.py").write_text("x = 2\n")
    state = provenance.git_state(ignore=[output])
    assert state["git_dirty"] is True and state["git_changed"] == ["code.py"]
    assert provenance.git_state(ignore=["/somewhere/else"])["git_changed"] == ["code.py", "study/stages.json"]


def test_outside_a_checkout_everything_is_unknown(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(provenance, "_REPO", tmp_path)
    monkeypatch.delenv(provenance.COMMIT_VARIABLE, raising=False)
    if subprocess.run(["git", "rev-parse"], cwd=tmp_path, capture_output=True).returncode == 0:
        pytest.skip("the temporary directory is inside a git checkout")
    assert provenance.git_state() == {"git_commit": None, "git_commit_source": None, "git_dirty": None,
                                      "git_changed": None}


def test_a_copy_without_git_takes_the_commit_from_the_environment(tmp_path, monkeypatch) -> None:
    # A GPU machine receives the working tree without .git: the study passes --commit on as LIGHTNING_DDP_COMMIT,
    # and the result says where the commit came from; whether the tree was dirty stays unknown.
    monkeypatch.setattr(provenance, "_REPO", tmp_path)
    monkeypatch.setenv(provenance.COMMIT_VARIABLE, "5809175")
    if subprocess.run(["git", "rev-parse"], cwd=tmp_path, capture_output=True).returncode == 0:
        pytest.skip("the temporary directory is inside a git checkout")
    assert provenance.git_state() == {"git_commit": "5809175", "git_commit_source": "LIGHTNING_DDP_COMMIT",
                                      "git_dirty": None, "git_changed": None}


def test_paths_are_written_relative_to_the_repository() -> None:
    root = provenance._REPO
    assert provenance.repo_relative(str(root / "benchmarks" / "results")) == "benchmarks/results"
    assert (provenance.repo_relative(str(root)), provenance.repo_relative("--lr=0.1")) == (".", "--lr=0.1")
    assert provenance.repo_relative(f"--out={root / 'logs'}") == "--out=logs"


def test_a_report_names_the_commit_and_says_when_the_code_had_changed() -> None:
    clean = {"git_commit": "2685a5d1b2c3d4e5", "git_dirty": False}
    assert provenance.code_version(clean) == "commit 2685a5d1b2c3"
    assert provenance.code_version({**clean, "git_dirty": True}) == "commit 2685a5d1b2c3 with uncommitted changes"
    assert provenance.code_version({"git_commit": None, "git_dirty": None}) == "an unknown commit"


def test_a_resumed_sweep_names_each_commit_its_sessions_ran() -> None:
    from lightning_ddp.bench.report import _environment_line

    first = {"git_commit": "2685a5d1b2c3d4e5", "git_dirty": False}
    second = {"git_commit": "9f00aa11bb22cc33", "git_dirty": True}
    one_commit = _environment_line({**second, "sessions": [second, second]})
    assert "commit 9f00aa11bb22 with uncommitted changes;" in one_commit and "resumed" not in one_commit
    two_commits = _environment_line({**second, "sessions": [first, second]})
    assert ("resumed across 2 sessions running different code**: commit 2685a5d1b2c3, commit 9f00aa11bb22 with "
            "uncommitted changes;") in two_commits
    assert provenance.code_version({}) == "an unknown commit"  # results recorded without their git state
