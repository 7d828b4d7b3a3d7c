"""Every bad input the CLI can tell before starting anything: one ``error:`` line naming the fix (at most one more
line), exit code 2, no traceback. In-process: these fail while parsing or building the classes, before Lightning
launches a rank, so a subprocess per row would only add its start-up time. (``tests/dist/test_bad_inputs.py`` runs
the table through real CLI processes, including the inputs that fail after the ranks start.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_ddp.cli import UsageError, main, user_error_message

REPO = Path(__file__).parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch) -> None:
    # LightningCLI warns when it gets both `args` and pytest's own sys.argv.
    monkeypatch.setattr("sys.argv", ["lightning_ddp"])


def _not_a_checkpoint(tmp_path: Path) -> str:
    path = tmp_path / "notes.ckpt"
    path.write_text("not a checkpoint")
    return str(path)


CASES = {
    # a typo of ours gets the close name, not only the list
    "strategy typo": (lambda tmp: ["--trainer.strategy", "bucketd_ddp"],
                      "did you mean bucketed_ddp? Set --trainer.strategy bucketed_ddp."),
    # the strategy's own ValueError, which jsonargparse reports under its union-type retries
    "bucket size -1": (lambda tmp: ["--trainer.strategy.init_args.bucket_size_mb", "-1"],
                       "bucket_size_mb must be > 0, 'auto' or null (a single bucket), got -1.0; set e.g."),
    "batch of 0": (lambda tmp: ["--data.batch_size", "0"],
                   "--data.batch_size is 0; set --data.batch_size to at least 1"),
    "not an int": (lambda tmp: ["--data.batch_size", "abc"], 'Parser key "data.batch_size": Expected a'),
    "unknown preset": (lambda tmp: ["--model.preset", "huge"], "'huge' is not a supported preset; choose one of"),
    "missing checkpoint": (lambda tmp: ["--ckpt_path", str(tmp / "none.ckpt")], "does not exist; point it at a .ckpt"),
    "not a checkpoint": (lambda tmp: ["--ckpt_path", _not_a_checkpoint(tmp)], "is not a readable checkpoint"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_error_line_and_exit_2(tmp_path: Path, capsys, case: str) -> None:
    make_args, phrase = CASES[case]
    with pytest.raises(UsageError) as refused:
        main(["validate", "--config", QUICKSTART, *make_args(tmp_path),
              "--trainer.logger.init_args.save_dir", str(tmp_path / "logs")])
    assert refused.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert 1 <= len(lines) <= 2 and lines[0].startswith("error: ") and phrase in lines[0], lines
    assert not (tmp_path / "logs").exists()  # nothing written


def test_a_missing_config_file_is_one_line_not_the_usage(tmp_path: Path, capsys) -> None:
    with pytest.raises(UsageError) as refused:
        main(["fit", "--config", str(tmp_path / "nope.yaml")])
    assert refused.value.code == 2
    # jsonargparse alone prints the usage of every option first: ~90 lines
    assert capsys.readouterr().err.splitlines() == [
        f"error: Parser key \"config\": File does not exist: '{tmp_path / 'nope.yaml'}' (check the path; the "
        "configs are under configs/, e.g. configs/quickstart.yaml)",
        "(--help lists the options)",
    ]


def test_the_reason_is_found_in_a_union_report() -> None:
    # jsonargparse's report for a class-typed argument whose constructor raised: the constructor's reason is the
    # second "- " line, between the type it tried first and a dump of the value.
    report = ("Does not validate against any of the Union subtypes\nSubtypes: [<class 'str'>, <class 'Strategy'>]\n"
              "Errors:\n  - Expected a <class 'str'>\n  - bucket_size_mb must be > 0; set e.g. `bucket_size_mb: 25`.\n"
              "Given value type: <class 'Namespace'>\nGiven value: Namespace(bucket_size_mb=-1.0)")
    assert user_error_message(report) == "bucket_size_mb must be > 0; set e.g. `bucket_size_mb: 25`."


def test_a_class_path_problem_is_reported_under_its_key() -> None:
    report = ('Parser key "s":\n  Errors:\n    - Expected a <class \'str\'>\n'
              '    - Problem with given class_path \'A\':\n        Option \'x\' is not accepted')
    assert user_error_message(report) == 'Parser key "s": Option \'x\' is not accepted'
