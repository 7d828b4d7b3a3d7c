"""Every bad input the CLI can tell before starting anything: one ``error:`` line naming the fix (at most one more
line), exit code 2, no traceback. In-process: these fail while parsing or building the classes, before Lightning
launches a rank, so a subprocess per row would only add its start-up time. (``tests/dist/test_bad_inputs.py`` runs
the table through real CLI processes, including the inputs that fail after the ranks start.) The inputs that need no
Lightning to tell are refused before it is imported: those run as ``python -m lightning_ddp`` with it unimportable.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_ddp import cli
from lightning_ddp.cli import HeldBack, check_precision, main, run_folder_report, user_error_message
from lightning_ddp.command_line import UsageError, check_command_line, checkpoint_file
from tests.support.cli_utils import repo_first_on_path

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
    "a folder without checkpoints": (lambda tmp: ["--ckpt_path", str(tmp)], "holds no checkpoint (*.ckpt); fit with "
                                     "--trainer.enable_checkpointing true"),
    # CPUs have no fp16 autocast: Lightning would run bf16-mixed instead and only warn
    "fp16 on CPU": (lambda tmp: ["--trainer.precision", "16-mixed"],
                    "--trainer.precision 16-mixed cannot run on CPU (no fp16 autocast there: Lightning would run "
                    "bf16-mixed instead); set --trainer.precision 32-true, or bf16-mixed to run that."),
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


def _yaml_with_a_syntax_error(tmp: Path) -> str:
    path = tmp / "broken.yaml"
    path.write_text("trainer:\n  max_steps: 3\n  devices: [2\n")  # the list is never closed
    return str(path)


BEFORE_LIGHTNING = {
    "a typo of a command": (lambda tmp: ["fitt"], "`fitt` is not a command of python -m lightning_ddp; did you mean "
                            "fit? Commands: fit, validate, test, advise; e.g. python -m lightning_ddp validate"),
    "the study's command misspelt": (lambda tmp: ["advice", "logs"], "did you mean advise?"),
    "predict": (lambda tmp: ["predict"], "(a language model's predictions need a sampling loop"),
    "a missing config": (lambda tmp: ["fit", "--config", str(tmp / "nope.yaml")],
                         "nope.yaml does not exist; the configs are under configs/, e.g. configs/quickstart.yaml"),
    "a folder as config": (lambda tmp: ["fit", "-c", str(tmp)], "is a folder, not a file"),
    # PyYAML's mark: line 4 (the end of the file), column 1; the file named as an editor jumps to it
    "a YAML syntax error": (lambda tmp: ["validate", f"--config={_yaml_with_a_syntax_error(tmp)}"],
                            "broken.yaml:4:1: not valid YAML: expected ',' or ']', but got '<stream end>' (while "
                            "parsing a flow sequence)"),
    "a missing checkpoint": (lambda tmp: ["validate", "--ckpt_path", str(tmp / "no.ckpt")], "does not exist"),
    "not a checkpoint": (lambda tmp: ["fit", "--ckpt_path", _not_a_checkpoint(tmp)], "is not a readable checkpoint"),
    "a folder without checkpoints": (lambda tmp: ["fit", "--ckpt_path", str(tmp)], "holds no checkpoint (*.ckpt)"),
}


@pytest.mark.parametrize("case", list(BEFORE_LIGHTNING))
def test_what_needs_no_lightning_is_refused_before_importing_it(tmp_path: Path, case: str) -> None:
    # torch and Lightning unimportable (None in sys.modules: ImportError): a check that came after their import
    # would fail with a traceback and exit 1, not with its one line and exit 2.
    make_args, phrase = BEFORE_LIGHTNING[case]
    code = ("import runpy, sys; sys.modules.update(dict.fromkeys(['torch', 'lightning', 'lightning.pytorch'])); "
            "runpy.run_module('lightning_ddp', run_name='__main__', alter_sys=True)")
    proc = subprocess.run([sys.executable, "-c", code, *make_args(tmp_path)], cwd=tmp_path, env=repo_first_on_path(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: ") and phrase in line, line


def test_yaml_given_in_place_of_a_config_file_is_checked_as_yaml() -> None:
    check_command_line(["fit", "--config", "{trainer: {max_steps: 3}}"])  # jsonargparse reads it as a config
    with pytest.raises(UsageError, match=r"--config '\{trainer: \[':1:12: not valid YAML: expected the node content"):
        check_command_line(["fit", "--config", "{trainer: ["])


def _checkpoint(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as archive:  # what torch.save writes: a zip archive
        archive.writestr("data.pkl", b"")
    return path


def test_ckpt_path_takes_a_run_or_its_loggers_folder(tmp_path: Path) -> None:
    # logs/bucketed_ddp: version_0 kept steps 20 and 40, version_1 (a validate run) none, version_2 a last.ckpt
    logger = tmp_path / "logs" / "bucketed_ddp"
    step_20 = _checkpoint(logger / "version_0" / "checkpoints" / "epoch=0-step=20.ckpt")
    step_40 = _checkpoint(logger / "version_0" / "checkpoints" / "epoch=1-step=40.ckpt")
    (logger / "version_1").mkdir()
    assert checkpoint_file(str(logger)) == str(step_40)  # the latest run that kept one, its last step
    assert checkpoint_file(str(logger / "version_0")) == checkpoint_file(str(step_40.parent)) == str(step_40)
    assert checkpoint_file(str(step_20)) == str(step_20)
    _checkpoint(logger / "version_2" / "checkpoints" / "epoch=0-step=60.ckpt")
    last = _checkpoint(logger / "version_2" / "checkpoints" / "last.ckpt")
    assert checkpoint_file(str(logger)) == str(last)
    assert checkpoint_file("last") == "last" and checkpoint_file("s3://bucket/x.ckpt") == "s3://bucket/x.ckpt"


def test_help_names_the_command_a_user_types(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m lightning_ddp [options] fit")


def test_a_slow_precision_on_cpu_is_said_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    # the measurement itself: a positive ratio (its value is the machine's)
    assert cli.cpu_matmul_slowdown(torch.bfloat16, size=32, repeats=1) > 0
    monkeypatch.setattr(cli, "cpu_matmul_slowdown", lambda dtype: 7.0)
    with pytest.warns(UserWarning, match=r"--trainer.precision bf16-mixed will be slow on this CPU: its bfloat16 "
                                         r"matrix products took 7.0x as long as fp32's"):
        check_precision("cpu", "bf16-mixed")
    monkeypatch.setattr(cli, "cpu_matmul_slowdown", lambda dtype: 1.1)  # a CPU with bf16 instructions: no note
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_precision("cpu", "bf16-mixed")
        check_precision("cpu", "32-true")


def test_lightnings_seed_line_waits_for_the_classes(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test_lightnings_seed_line")
    held = HeldBack(logger)
    with caplog.at_level(logging.INFO):
        logger.info("Seed set to 0")
        assert caplog.messages == []  # held while the classes are built
        held.release()
        assert caplog.messages == ["Seed set to 0"]
        logger.info("after")
        assert caplog.messages == ["Seed set to 0", "after"]


def test_an_input_refused_while_building_prints_no_seed_line(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    with caplog.at_level(logging.INFO), pytest.raises(UsageError):
        main(["fit", "--config", QUICKSTART, "--data.batch_size", "0",
              "--trainer.logger.init_args.save_dir", str(tmp_path)])
    assert not any("Seed set" in message for message in caplog.messages), caplog.messages


def test_the_end_of_fit_names_the_run_folder_and_its_commands(tmp_path: Path) -> None:
    folder = tmp_path / "logs" / "bucketed_ddp" / "version_0"
    for name in ("timing_summary.json", "config.yaml", "events.out.tfevents.1.host.1.0"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("")
    checkpoint = _checkpoint(folder / "checkpoints" / "epoch=0-step=40.ckpt")
    logger = TensorBoardLogger(tmp_path / "logs", name="bucketed_ddp", version=0)
    trainer = SimpleNamespace(loggers=[logger], checkpoint_callback=SimpleNamespace(dirpath=str(checkpoint.parent)))
    assert run_folder_report(trainer).splitlines() == [
        f"Run folder: {folder} (timing_summary.json, config.yaml, TensorBoard logs, checkpoints: {checkpoint})",
        f"  what to change: python -m lightning_ddp advise {folder}",
        f"  TensorBoard:    tensorboard --logdir {folder}",
        f"  evaluate:       python -m lightning_ddp validate --config {folder / 'config.yaml'} --ckpt_path {folder}",
    ]
    bare = SimpleNamespace(loggers=[], default_root_dir=str(tmp_path / "empty"), checkpoint_callback=None)
    assert run_folder_report(bare) == f"Run folder: {tmp_path / 'empty'} (nothing written)"


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
