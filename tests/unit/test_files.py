"""lightning_ddp.files: a file is written whole or not at all, and a failed write leaves nothing behind."""

from __future__ import annotations

import json
import os
import stat

import pytest

from lightning_ddp import files
from lightning_ddp.files import write_atomically, write_json_atomically


def test_text_and_bytes_replace_the_file_and_create_its_folder(tmp_path):
    path = tmp_path / "a" / "b" / "results.md"  # neither folder exists yet
    assert write_atomically(path, "first\n") == path
    write_atomically(path, "zweite Fassung: ü\n")
    assert path.read_bytes() == "zweite Fassung: ü\n".encode("utf-8")  # text is UTF-8, newlines untranslated
    write_atomically(str(path), b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    assert os.listdir(path.parent) == ["results.md"]


@pytest.mark.parametrize("failure", [OSError("disk full"), KeyboardInterrupt()], ids=["OSError", "KeyboardInterrupt"])
def test_a_write_that_fails_midway_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch, failure):
    path = tmp_path / "timing.json"
    write_json_atomically(path, {"step_ms": 1.0})
    written = []

    def fsync_fails(fd: int) -> None:
        # By now the new content is in the temporary file: the failure comes after the write, before the rename.
        written.append(sorted(os.listdir(tmp_path)))
        raise failure

    monkeypatch.setattr(files.os, "fsync", fsync_fails)
    with pytest.raises(type(failure)):
        write_json_atomically(path, {"step_ms": 2.0})
    assert len(written) == 1 and len(written[0]) == 2  # the temporary file did exist beside timing.json
    assert json.loads(path.read_text()) == {"step_ms": 1.0}
    assert os.listdir(tmp_path) == ["timing.json"]


def test_a_failed_rename_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "results.csv"
    path.write_text("old\n")

    def replace_fails(src, dst):
        raise PermissionError(f"cannot replace {dst}")

    monkeypatch.setattr(files.os, "replace", replace_fails)
    with pytest.raises(PermissionError):
        write_atomically(path, "new\n")
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["results.csv"]


def test_json_keeps_its_arguments_and_ends_with_a_newline(tmp_path):
    path = write_json_atomically(tmp_path / "x.json", {"b": 1, "a": [1, 2]}, indent=1, sort_keys=True)
    assert path.read_text() == '{\n "a": [\n  1,\n  2\n ],\n "b": 1\n}\n'
    with pytest.raises(ValueError):  # allow_nan=False refuses NaN before anything is written
        write_json_atomically(path, {"a": float("nan")}, allow_nan=False)
    assert json.loads(path.read_text()) == {"a": [1, 2], "b": 1}


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
def test_permissions_follow_the_umask_like_a_plain_open(tmp_path):
    # mkstemp would create the file 0600, so results written by one user could not be read by the group.
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    atomic = write_atomically(tmp_path / "atomic.txt", "x")
    assert stat.S_IMODE(atomic.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode)
