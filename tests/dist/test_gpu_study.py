"""The GPU study (``python -m lightning_ddp.bench.gpu_study``): its orchestration with fake stages, its parts, and its
CPU dry run (a few stages quickly, and every stage in the ``slow`` tier).

The orchestration is checked with fake stages (instant): order, budget skips, failures that do not stop the study,
stages.json rewritten after every stage, interruption. The real stages run in the dry run on CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from lightning_ddp import catalogue
from lightning_ddp.bench.gpu_study import DRY_RUN_SCALE, GPU_SCALE, GPUStudyConfig
from lightning_ddp.bench.gpu_study.__main__ import main, missing_packages
from lightning_ddp.bench.gpu_study.processes import FitSpec, batch_candidates, first_that_fits, run_fits
from lightning_ddp.bench.gpu_study.stages import (
    EXACT_TOLERANCE,
    STAGES,
    Stage,
    StageResult,
    StudyContext,
    cuda_tests,
    outcomes_from_log,
    read_junit,
    weight_differences,
)
from lightning_ddp.bench.gpu_study.study import build_report, plan_calls, run_study, select_files
from lightning_ddp.projection.simulators import simulated_names
from tests.support.cli_utils import REPO

# ---- the stage table ---------------------------------------------------------------------------------------------


STAGE_NAMES = ["environment", "cuda_tests", "compute", "strategies", "one_gpu_pair", "traces", "ready_times",
               "timer_overhead"]


def test_the_stages_run_in_this_order() -> None:
    assert [s.name for s in STAGES] == STAGE_NAMES


def test_the_estimates_fit_two_calls_of_the_default_budget() -> None:
    # A GPU machine gives ~30 minutes in commands of at most 10: README's recipe is two calls of 9 minutes (the
    # default budget), each with a minute to spare for installing wheels and writing the archive.
    assert GPUStudyConfig(out="x").budget_min == 9
    calls = plan_calls(STAGES, 9)
    assert calls == [["environment", "cuda_tests", "compute", "strategies"],
                     ["one_gpu_pair", "traces", "ready_times", "timer_overhead"]]
    estimates = {s.name: s.estimate_s for s in STAGES}
    assert all(sum(estimates[name] for name in call) <= 0.95 * 9 * 60 for call in calls)
    # The CPU dry run: under 5 minutes on 2 cores.
    assert sum(s.dry_run_estimate_s for s in STAGES if not s.needs_cuda) <= 5 * 60


def test_a_plan_refuses_a_budget_that_no_call_could_finish_a_stage_in() -> None:
    message = r"stage cuda_tests needs ~240 s, more than `--budget_min 3` gives a call; give it at least 4.0 min"
    with pytest.raises(ValueError, match=message):
        plan_calls(STAGES, 3)


def test_only_the_test_tier_cannot_rehearse_on_cpu() -> None:
    # Every other stage runs its own code in the dry run; only the cuda tier is nothing but CUDA.
    assert [s.name for s in STAGES if s.needs_cuda] == ["cuda_tests"]


def test_the_scales_differ_in_size_not_in_shape() -> None:
    assert (GPU_SCALE.device, GPU_SCALE.compute["preset"], GPU_SCALE.compute["seq_len"]) == ("cuda", "xl", 512)
    assert (GPU_SCALE.profile["preset"], GPU_SCALE.profile["batch"], GPU_SCALE.profile["seq_len"]) == ("xl", 4, 512)
    assert DRY_RUN_SCALE.device == "cpu"
    assert {DRY_RUN_SCALE.compute["preset"], DRY_RUN_SCALE.strategies["preset"]} == {"tiny"}
    # Every stage's fits take the same keyword arguments at both scales.
    for stage in ("compute", "strategies", "traces", "profile", "overhead"):
        assert getattr(GPU_SCALE, stage).keys() == getattr(DRY_RUN_SCALE, stage).keys(), stage


# ---- the orchestration, with fake stages ---------------------------------------------------------------------------


def _stage(name: str, run, estimate: float = 1.0, needs_cuda: bool = False) -> Stage:
    return Stage(name, name.title(), estimate, estimate, needs_cuda, run)


def _config(tmp_path: Path, **kwargs) -> GPUStudyConfig:
    return GPUStudyConfig(out=str(tmp_path / "study"), cpu_dry_run=True, root=str(REPO), **kwargs)


def test_a_failing_stage_is_recorded_and_the_study_goes_on(tmp_path: Path) -> None:
    seen: dict[str, list] = {}

    def writes(ctx: StudyContext) -> StageResult:
        (ctx.out / "a.txt").write_text("a")
        return StageResult(data={"value": 1}, files=["a.txt"])

    def raises(ctx: StudyContext) -> StageResult:
        raise RuntimeError("injected failure\nwith a second line")

    def reports(ctx: StudyContext) -> StageResult:
        return StageResult(data={"value": 2}, problems=["first problem", "second problem"])

    def reads_the_record(ctx: StudyContext) -> StageResult:
        # stages.json is rewritten after every stage: the three before this one are already final.
        document = json.loads((ctx.out / "stages.json").read_text())
        seen["statuses"] = [s["status"] for s in document["stages"]]
        return StageResult()

    stages = [_stage("one", writes), _stage("two", raises), _stage("three", reports), _stage("four", reads_the_record)]
    document = run_study(_config(tmp_path), stages=stages, cuda=False, log=lambda line: None)
    out = tmp_path / "study"
    entries = {s["name"]: s for s in document["stages"]}
    assert [s["status"] for s in document["stages"]] == ["ok", "failed", "failed", "ok"]
    assert seen["statuses"] == ["ok", "failed", "failed", "running"]
    assert entries["one"]["files"] == ["one.json", "a.txt"]
    assert json.loads((out / "one.json").read_text()) == {"value": 1}
    assert entries["two"]["error"] == "RuntimeError: injected failure"  # one line, named by its type
    assert entries["three"]["error"] == "first problem"
    assert entries["three"]["problems"] == ["first problem", "second problem"]
    assert all(isinstance(s["seconds"], float) and s["estimate_s"] == 1.0 for s in document["stages"])
    assert json.loads((out / "stages.json").read_text()) == document
    assert not list(out.glob("*.tmp"))  # written to a temporary name and renamed over the file
    report = (out / "results.md").read_text()
    assert "RuntimeError: injected failure" in report and "- second problem" in report


def test_stages_that_cannot_finish_in_the_budget_are_skipped(tmp_path: Path) -> None:
    ran = []

    def runs(ctx: StudyContext) -> StageResult:
        left, deadline = ctx.remaining(), ctx.stage_deadline()
        ran.append((ctx.stage_estimate_s, left, deadline))
        return StageResult()

    # A 1-minute budget of which 30 s are gone (the call started earlier): the 50-second stage no longer fits what
    # is left and waits for a later call; the 5-second stages before and after it run.
    stages = [_stage("short", runs, 5), _stage("long", runs, 50), _stage("after", runs, 5)]
    document = run_study(_config(tmp_path, budget_min=1), stages=stages, cuda=False, log=lambda line: None,
                         started=time.monotonic() - 30)
    statuses = {s["name"]: s["status"] for s in document["stages"]}
    assert statuses == {"short": "ok", "long": "skipped: budget", "after": "ok"}
    assert [estimate for estimate, _, _ in ran] == [5, 5]
    # A stage's processes may run to the smaller of the budget left and 1.5 x its estimate, at least its estimate
    # + 60 s: here, with 5-second stages in a 60-second budget, the budget left (read first, hence the slack).
    for estimate, left, deadline in ran:
        assert deadline <= min(left, max(1.5 * estimate, estimate + 60)) + 1e-3 and deadline > left - 1
    skipped = document["stages"][1]
    assert skipped["seconds"] is None and skipped["error"].startswith("needs ~50 s, ")


def test_cuda_only_stages_are_skipped_without_cuda_and_selection_is_honoured(tmp_path: Path) -> None:
    stages = [_stage("environment", lambda ctx: StageResult()),
              _stage("cuda_tests", lambda ctx: StageResult(), needs_cuda=True),
              _stage("compute", lambda ctx: StageResult())]
    document = run_study(_config(tmp_path, stages=["environment", "cuda_tests"]), stages=stages, cuda=False,
                         log=lambda line: None)
    assert [s["status"] for s in document["stages"]] == ["ok", "skipped: no CUDA", "skipped: not selected"]
    # With a GPU visible, the same stage runs.
    document = run_study(_config(tmp_path / "gpu"), stages=stages[1:2], cuda=True, log=lambda line: None)
    assert document["stages"][0]["status"] == "ok"


def test_an_interrupted_stage_is_recorded_before_the_study_stops(tmp_path: Path) -> None:
    def interrupted(ctx: StudyContext) -> StageResult:
        raise KeyboardInterrupt

    stages = [_stage("first", lambda ctx: StageResult()), _stage("second", interrupted),
              _stage("third", lambda ctx: StageResult())]
    with pytest.raises(KeyboardInterrupt):
        run_study(_config(tmp_path), stages=stages, cuda=False, log=lambda line: None)
    document = json.loads((tmp_path / "study" / "stages.json").read_text())
    assert [s["status"] for s in document["stages"]] == ["ok", "interrupted", "pending"]


def test_resume_keeps_the_ok_stages_and_runs_the_rest(tmp_path: Path) -> None:
    runs: list[str] = []
    fail = {"flaky": True}

    def stage_run(name: str):
        def run(ctx: StudyContext) -> StageResult:
            runs.append(name)
            (ctx.out / f"{name}.txt").write_text(name)
            return StageResult(data={"name": name}, files=[f"{name}.txt"],
                               problems=["flaky failed"] if fail.get(name) else [])
        return run

    stages = [_stage("first", stage_run("first"), 5), _stage("flaky", stage_run("flaky"), 5),
              _stage("long", stage_run("long"), 50), _stage("last", stage_run("last"), 5)]
    # Call 1, one minute of which 30 s are gone: the 50-second stage is left for later; flaky fails.
    one = run_study(_config(tmp_path, budget_min=1), stages=stages, cuda=False, log=lambda line: None,
                    started=time.monotonic() - 30)
    assert [s["status"] for s in one["stages"]] == ["ok", "failed", "skipped: budget", "ok"]
    assert not one["complete"]
    kept = {s["name"]: dict(s) for s in one["stages"] if s["status"] == "ok"}
    # Call 2 resumes with 3 minutes: first and last are kept as they were (not run again), flaky and long run.
    fail["flaky"] = False
    two = run_study(_config(tmp_path, budget_min=3, resume=True), stages=stages, cuda=False, log=lambda line: None)
    assert runs == ["first", "flaky", "last", "flaky", "long"]
    assert [s["status"] for s in two["stages"]] == ["ok"] * 4 and two["complete"]
    assert {s["name"]: s for s in two["stages"] if s["name"] in kept} == kept  # rows unchanged, seconds included
    assert [call["budget_min"] for call in two["calls"]] == [1, 3] and two["created"] == one["created"]
    report = (tmp_path / "study" / "results.md").read_text()
    assert (tmp_path / "study" / "first.json").exists() and "flaky failed" not in report


def test_a_budget_too_small_for_a_stage_left_to_run_is_refused(tmp_path: Path) -> None:
    stages = [_stage("environment", lambda ctx: StageResult(), 5), _stage("compute", lambda ctx: StageResult(), 120)]
    message = r"stage compute needs ~120 s, more than `--budget_min 1` .* at least 2.0 min"
    with pytest.raises(ValueError, match=message):
        run_study(_config(tmp_path, budget_min=1), stages=stages, cuda=False, log=lambda line: None)
    assert not (tmp_path / "study").exists()  # refused before anything was written
    # Not selected, or needing CUDA where there is none: it would not run, so the budget is enough.
    document = run_study(_config(tmp_path, budget_min=1, stages=["environment"]), stages=stages, cuda=False,
                         log=lambda line: None)
    assert [s["status"] for s in document["stages"]] == ["ok", "skipped: not selected"]


def test_a_folder_that_holds_a_study_needs_resume_and_the_same_kind(tmp_path: Path) -> None:
    stages = [_stage("only", lambda ctx: StageResult())]
    run_study(_config(tmp_path), stages=stages, cuda=False, log=lambda line: None)
    with pytest.raises(ValueError, match="already holds a study .1 stages ok.; add `--resume true`"):
        run_study(_config(tmp_path), stages=stages, cuda=False, log=lambda line: None)
    gpu = GPUStudyConfig(out=str(tmp_path / "study"), root=str(REPO), resume=True)
    with pytest.raises(ValueError, match="holds a CPU dry run, and this call is a GPU study"):
        run_study(gpu, stages=stages, cuda=True, log=lambda line: None)
    # Resuming where nothing was run yet starts the study: README's command is the same for every call.
    document = run_study(_config(tmp_path / "fresh", resume=True), stages=stages, cuda=False, log=lambda line: None)
    assert document["complete"] and len(document["calls"]) == 1


def test_the_archive_holds_what_is_worth_committing_and_is_written_even_when_interrupted(tmp_path: Path) -> None:
    def writes(ctx: StudyContext) -> StageResult:
        (ctx.out / "sweep" / "runs" / "cell").mkdir(parents=True)
        (ctx.out / "sweep" / "results.csv").write_text("strategy,step_ms\nddp,1.0\n")
        (ctx.out / "sweep" / "runs" / "cell" / "command.txt").write_text("MASTER_PORT=1234 python -m ...")
        (ctx.out / "weights.pt").write_bytes(b"\0" * 1000)
        (ctx.out / "trace.json").write_bytes(b"{}" + b" " * (3 * 2**20))  # a raw trace over the 2 MiB a file
        return StageResult(data={"rows": 1})

    def interrupted(ctx: StudyContext) -> StageResult:
        raise KeyboardInterrupt

    archive = tmp_path / "out" / "study.tar.gz"
    stages = [_stage("writes", writes), _stage("stops", interrupted)]
    with pytest.raises(KeyboardInterrupt):
        run_study(_config(tmp_path, archive=str(archive)), stages=stages, cuda=False, log=lambda line: None)
    with tarfile.open(archive) as tar:
        names = sorted(tar.getnames())
        contents = json.loads(tar.extractfile("archive_contents.json").read())
        stages_json = json.loads(tar.extractfile("stages.json").read())
    assert names == ["archive_contents.json", "results.md", "stages.json", "sweep/results.csv", "writes.json"]
    assert contents["left_out"] == ["trace.json (3,145,730 B: over 2,097,152 B a file)"]
    assert [s["status"] for s in stages_json["stages"]] == ["ok", "interrupted"]  # the state at the interruption
    assert not list(archive.parent.glob("*.tmp"))


def test_the_commit_of_a_copy_without_git_comes_from_the_command_line(tmp_path: Path) -> None:
    seen = {}

    def reads_env(ctx: StudyContext) -> StageResult:
        seen.update(ctx.env())
        return StageResult()

    document = run_study(_config(tmp_path, commit="5809175"), stages=[_stage("env", reads_env)], cuda=False,
                         log=lambda line: None)
    assert document["commit"] == {"git_commit": "5809175", "source": "--commit"}
    assert seen["LIGHTNING_DDP_COMMIT"] == "5809175"  # the environment stage's process records it
    with pytest.raises(ValueError, match="`--commit` must be a git commit hash"):
        _config(tmp_path, commit="HEAD")


def test_a_missing_package_is_one_line_before_anything_imports_it(tmp_path: Path) -> None:
    # jsonargparse made unimportable (None in sys.modules), as on a GPU machine whose Python lacks it.
    code = ("import runpy, sys; sys.modules['jsonargparse'] = None; "
            f"sys.argv = ['gpu_study', '--out', {str(tmp_path / 'study')!r}, '--cpu_dry_run', 'true']; "
            "runpy.run_module('lightning_ddp.bench.gpu_study', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: missing Python packages: jsonargparse;"), lines
    assert "--no-index" in lines[0] and "docs/gpu.md" in lines[0]
    assert not (tmp_path / "study").exists()  # nothing started


def test_missing_packages_are_found_without_importing_them() -> None:
    assert missing_packages({"json": "json", "no_such_module_here": "no-such-dist"}) == ["no-such-dist"]


def test_without_cuda_only_a_dry_run_may_start(tmp_path: Path) -> None:
    config = GPUStudyConfig(out=str(tmp_path / "study"), root=str(REPO))
    with pytest.raises(ValueError, match="--cpu_dry_run true"):
        run_study(config, stages=[], cuda=False, log=lambda line: None)


@pytest.mark.parametrize("args, message", [
    (["--budget_min", "20"], "`--out` is missing"),
    (["--out", "x", "--budget_min", "0"], "`--budget_min` must be > 0"),
])
def test_bad_command_lines_exit_2_naming_the_fix(capsys, args: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("stages, message", [("[compute,nonsense]", "unknown stage 'nonsense' in `--stages`"),
                                             ("[]", "`--stages` is empty")])
def test_a_bad_stage_list_exits_2_naming_the_stages(tmp_path: Path, capsys, stages: str, message: str) -> None:
    # Checked against the study's stages before anything starts: nothing written.
    assert main(["--out", str(tmp_path / "study"), "--cpu_dry_run", "true", "--stages", stages]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and "; choose from environment, cuda_tests, compute," in err
    assert not (tmp_path / "study").exists()


# ---- the parts ----------------------------------------------------------------------------------------------------


def test_read_junit_counts_and_names_the_failures(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_passes(): pass\n"
        "def test_fails(): assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='no GPU')\n"
        "def test_skipped(): pass\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError('fixture broke')\n"
        "def test_errors(broken): pass\n")
    report = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", str(tmp_path / "test_sample.py"), "-q", "-p", "no:cacheprovider",
                    f"--junitxml={report}"], cwd=tmp_path, capture_output=True)
    data = read_junit(report)
    assert {k: data[k] for k in ("tests", "passed", "failed", "errors", "skipped")} == dict(
        tests=4, passed=1, failed=1, errors=1, skipped=1)
    messages = {f["test"].split("::")[-1]: f["message"] for f in data["failures"]}
    assert "one is not two" in messages["test_fails"] and "fixture broke" in messages["test_errors"]


def test_a_tier_cut_off_before_its_report_is_counted_from_the_verbose_log() -> None:
    log = ("tests/gpu/test_a.py::test_one[nccl_1rank] PASSED                [ 33%]\n"
           "tests/gpu/test_a.py::test_two FAILED                            [ 66%]\n"
           "tests/gpu/test_b.py::test_three SKIPPED (needs a CUDA GPU)      [100%]\n")
    data = outcomes_from_log(log)
    assert {k: data[k] for k in ("tests", "passed", "failed", "errors", "skipped")} == dict(
        tests=3, passed=1, failed=1, errors=0, skipped=1)
    assert data["failures"] == [{"test": "tests/gpu/test_a.py::test_two", "message": "failed"}]
    assert outcomes_from_log("tests/a.py::test_x PASSED [ 50%]\ntests/a.py::test_y FAILED [100%]\n")["failed"] == 1
    xdist = outcomes_from_log("[gw0] [ 50%] PASSED tests/a.py::test_x \n[gw1] [100%] ERROR tests/a.py::test_y \n")
    assert (xdist["passed"], xdist["errors"], xdist["failures"]) == (1, 1, [{"test": "tests/a.py::test_y",
                                                                             "message": "error"}])


@pytest.mark.multiprocess  # one pytest subprocess collecting the tier (~10 s)
def test_the_cuda_tests_stage_runs_the_tier_and_says_when_nothing_ran(tmp_path: Path) -> None:
    # Here every test of the tier is skipped (no CUDA): the stage runs it anyway and reports that nothing ran.
    config = _config(tmp_path)
    ctx = StudyContext(config=config, scale=DRY_RUN_SCALE, out=tmp_path, root=REPO, cuda=False,
                       deadline=time.monotonic() + 600, stage_estimate_s=300, stage_started=time.monotonic())
    result = cuda_tests(ctx)
    assert result.data["tests"] >= 12 and result.data["skipped"] == result.data["tests"]
    assert result.problems == ["every test of the tier was skipped: pytest saw no CUDA device"]
    assert set(result.files) == {"cuda_tests.xml", "cuda_tests.log"}


def test_the_archive_keeps_the_smallest_files_that_fit(tmp_path: Path) -> None:
    for name, size in [("stages.json", 10), ("a/weights.pt", 50), ("b/big.json", 40), ("b/c.csv", 30)]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * size)
    contents = select_files(tmp_path, limit=45, file_limit=100)
    assert (contents["files"], contents["left_out"], contents["size_bytes"]) == (
        ["b/c.csv", "stages.json"], ["b/big.json (40 B: the archive would pass 45 B)"], 40)


def test_compute_steps_down_from_the_preflight_batch_on_out_of_memory_errors() -> None:
    assert batch_candidates(10) == [10, 8, 6, 4, 3, 2, 1] and batch_candidates(1) == [1]
    freed = []

    def attempt(batch: int) -> dict:
        if batch > 6:
            raise MemoryError("out of memory")
        return {"batch": batch}

    assert first_that_fits([10, 8, 6, 4], attempt, lambda: freed.append(1)) == (
        {"batch": 6}, [{"batch": 10, "status": "oom"}, {"batch": 8, "status": "oom"}, {"batch": 6, "status": "ok"}])
    assert len(freed) == 2

    def fails(batch: int) -> dict:
        raise ValueError("not a matter of size")

    with pytest.raises(ValueError, match="not a matter of size"):
        first_that_fits([4, 2], fails, lambda: None)


def test_weight_differences_tell_rounding_from_a_missing_rank() -> None:
    d = weight_differences({"w": torch.tensor([1.0, 1.0, 1.5])}, {"w": torch.tensor([1.0, 1.0, 1.0])}, 1.0)
    assert (round(d["off_fraction"], 3), d["median_updates"], d["max_updates"], d["worst_tensor"]) == (
        0.333, 0.0, 0.5, "w")
    torch.manual_seed(0)
    reference = {"w": torch.randn(10_000), "b": torch.randn(100)}
    update = 1e-3 * 3  # lr x steps
    # Rounding: every weight within 1e-6 updates; a missing rank: half the weights a whole update away.
    rounded = {k: v + 1e-6 * update * torch.randn_like(v) for k, v in reference.items()}
    broken = {k: v + update * (torch.rand_like(v) < 0.5) for k, v in reference.items()}
    assert weight_differences(rounded, reference, update)["off_fraction"] <= EXACT_TOLERANCE
    assert weight_differences(broken, reference, update)["off_fraction"] == pytest.approx(0.5, abs=0.02)
    with pytest.raises(ValueError, match="different tensors"):
        weight_differences({"w": reference["w"]}, reference, update)


@pytest.mark.multiprocess
def test_fits_in_one_process_record_a_failure_and_go_on(tmp_path: Path) -> None:
    common = ("--config", str(REPO / "configs" / "quickstart.yaml"), "--data.source", "synthetic",
              "--model.context_length", "32", "--data.seq_len", "32", "--data.batch_size", "2", "--trainer.max_steps",
              "3", "--timer.warmup_steps", "1", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
              "--trainer.limit_val_batches", "0")
    specs = [FitSpec("naive", (*common, "--trainer.strategy", "naive_ddp")),
             FitSpec("broken", (*common, "--trainer.strategy", "no_such_ddp")),
             FitSpec("ddp", (*common, "--trainer.strategy", "ddp"))]
    results = run_fits(specs, tmp_path, timeout_s=300, cwd=str(tmp_path), threads=1)
    assert [r.status for r in results] == ["ok", "failed", "ok"]
    assert "Unknown strategy 'no_such_ddp'" in results[1].error
    # One launch for the three: a failing fit at world size 1 does not end the process.
    assert [p.name for p in (tmp_path / "_processes").iterdir()] == ["launch0"]
    assert results[0].summary["run"]["strategy"] == "naive_ddp"
    assert results[2].summary["run"]["strategy_class"] == "DDPStrategy"
    assert results[0].file("timing_summary.json") is not None
    # No time left: nothing starts, and every fit says so.
    assert {r.status for r in run_fits(specs[:1], tmp_path / "late", timeout_s=0.5)} == {"not run"}


@pytest.mark.slow  # 2 ranks, three fits, one relaunch (~1 min)
def test_fits_on_two_ranks_start_again_after_a_failing_fit(tmp_path: Path) -> None:
    common = ("--config", str(REPO / "configs" / "quickstart.yaml"), "--data.source", "synthetic",
              "--model.context_length", "32", "--data.seq_len", "32", "--data.batch_size", "2", "--trainer.max_steps",
              "3", "--timer.warmup_steps", "1", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
              "--trainer.num_nodes", "2", "--trainer.limit_val_batches", "0")
    specs = [FitSpec("naive", (*common, "--trainer.strategy", "naive_ddp")),
             FitSpec("broken", (*common, "--trainer.strategy", "no_such_ddp")),
             FitSpec("ddp", (*common, "--trainer.strategy", "ddp"))]
    results = run_fits(specs, tmp_path, ranks=2, timeout_s=400, cwd=str(tmp_path), threads=1)
    assert [r.status for r in results] == ["ok", "failed", "ok"]
    # The ranks stop after a failing fit (a peer may be waiting in a collective); the rest run in a new launch.
    assert sorted(p.name for p in (tmp_path / "_processes").iterdir()) == ["launch0", "launch1"]
    assert results[2].summary["run"]["world_size"] == 2


def test_the_report_puts_the_published_runs_beside_ours(tmp_path: Path) -> None:
    (tmp_path / "strategies.json").write_text(json.dumps({
        "preset": "medium", "batch": 8, "seq_len": 512, "steps": 20, "warmup": 5, "backend": "nccl",
        "precision": "bf16-mixed", "rows": {
            "overlap_ddp": {"status": "ok", "error": "", "step/time_ms": 110.0, "overhead_vs_ddp": 0.1},
            "zero1_ddp": {"status": "failed", "error": "RuntimeError: boom"},
            "ddp": {"status": "ok", "error": "", "step/time_ms": 100.0, "overhead_vs_ddp": 0.0}}}))
    document = {"budget_min": 20, "elapsed_s": 60, "cpu_dry_run": False, "device": "cuda", "stages": [
        {"name": "strategies", "title": "Every strategy", "status": "failed", "seconds": 50.0, "estimate_s": 60,
         "error": "zero1_ddp: failed: RuntimeError: boom", "problems": ["zero1_ddp: boom"]},
        {"name": "traces", "title": "Traces", "status": "skipped: budget", "seconds": None, "estimate_s": 60,
         "error": "needs ~60 s, 10 s of the budget left"}]}
    report = build_report(document, tmp_path)
    assert "**Two ranks on one GPU time-slice it.**" in report
    # overlap_ddp beside the published 2-GPU xl overlap run at batch 4, context 512: 946.8 ms, 13.59 % comm
    assert "| overlap_ddp | ok | 110.0 | +10.0% |" in report and "947 ms, 14% comm" in report
    assert "failed: RuntimeError: boom" in report
    assert "| [traces](#traces) | skipped: budget | – | 60 | needs ~60 s, 10 s of the budget left |" in report


def test_the_report_renders_what_a_stage_cut_off_wrote(tmp_path: Path) -> None:
    # Every stage's caption and tables come from its data: a missing field or row shows as "–", never an error.
    (tmp_path / "timer_overhead.json").write_text(json.dumps({"preset": "small", "overhead": 0.0123}))
    (tmp_path / "compute.json").write_text(json.dumps({"runs": {"32-true": {
        "status": "ok", "batch": 6, "preflight_batch": 8, "peak_reserved_bytes": 2 * 2**30, "estimate_bytes": 2**30,
        "attempts": [{"batch": 8, "status": "oom"}, {"batch": 6, "status": "ok"}]}}}))
    document = {"stages": [{"name": name, "title": name, "status": "ok", "seconds": 1.0, "estimate_s": 1}
                           for name in ("compute", "timer_overhead")]}
    report = build_report(document, tmp_path)
    assert "small preset, – off/on pairs of – steps" in report and "overhead +1.23% [95 %: –, –]" in report
    assert "| 32-true | ok | – | 6 | 8: 8 OOM → 6 | – | – | – | – | 2.0 | 1.0 | 0.50 |" in report


# ---- the dry run ----------------------------------------------------------------------------------------------------


def _check_files(out: Path, document: dict) -> None:
    for stage in document["stages"]:
        for name in stage["files"]:
            assert (out / name).is_file(), (stage["name"], name)


@pytest.mark.multiprocess
@pytest.mark.slow  # three real stages on CPU (~20 s); the two-call dry run below runs every stage
def test_dry_run_of_three_stages(tmp_path: Path) -> None:
    out = tmp_path / "study"
    assert main(["--out", str(out), "--cpu_dry_run", "true", "--stages", "[environment,compute,ready_times]"]) == 0
    document = json.loads((out / "stages.json").read_text())
    statuses = {s["name"]: s["status"] for s in document["stages"]}
    assert statuses == {"environment": "ok", "cuda_tests": "skipped: not selected", "compute": "ok",
                        "strategies": "skipped: not selected", "one_gpu_pair": "skipped: not selected",
                        "traces": "skipped: not selected", "ready_times": "ok",
                        "timer_overhead": "skipped: not selected"}
    _check_files(out, document)
    compute = json.loads((out / "compute.json").read_text())
    for precision in ("bf16-mixed", "32-true"):
        run = compute["runs"][precision]
        # The pre-flight allows the scale's whole cap on a CPU with gigabytes free, and it fits at once.
        assert run["batch"] == run["preflight_batch"] == DRY_RUN_SCALE.compute["max_batch"]
        assert run["attempts"] == [{"batch": run["batch"], "status": "ok"}] and run["tokens_per_s"] > 0
    ready = json.loads((out / "ready_times.json").read_text())
    assert ready["tensors"] == 39 and 0 <= ready["first_ready_ms"] <= ready["last_ready_ms"] <= ready["backward_ms"]
    # One projected row per strategy the projection models (every registered algorithm with a model, plus its
    # zero1 and ddp baselines), over NVLink and over PCIe.
    projected = len(simulated_names())
    assert {network: len(p["rows"]) for network, p in ready["projections"].items()} == {"nvlink4": projected,
                                                                                       "pcie_gen4": projected}
    report = (out / "results.md").read_text()
    assert "# GPU study (CPU dry run" in report and "## ready_times" in report


@pytest.mark.slow  # every stage on CPU, in two calls: ~5 minutes on 2 cores
def test_dry_run_of_every_stage_in_two_calls(tmp_path: Path) -> None:
    out, archive = tmp_path / "study", tmp_path / "study.tar.gz"
    # Call 1, two minutes (README's GPU recipe in small): some stages run, those that no longer fit are left.
    started = time.monotonic()
    assert main(["--out", str(out), "--cpu_dry_run", "true", "--budget_min", "2", "--resume", "true"]) == 0
    assert time.monotonic() - started < 150  # 107 s on 2 idle cores
    first = json.loads((out / "stages.json").read_text())
    kept = {s["name"]: s for s in first["stages"] if s["status"] == "ok"}
    assert kept and any(s["status"] == "skipped: budget" for s in first["stages"]) and not first["complete"]
    # Call 2 resumes: the ok stages are kept as they were, the rest run, and the archive holds the whole study.
    assert main(["--out", str(out), "--cpu_dry_run", "true", "--budget_min", "10", "--resume", "true",
                 "--archive", str(archive)]) == 0
    document = json.loads((out / "stages.json").read_text())
    assert [(s["name"], s["status"]) for s in document["stages"]] == [
        (name, "skipped: no CUDA" if name == "cuda_tests" else "ok") for name in STAGE_NAMES]
    assert {s["name"]: s for s in document["stages"] if s["name"] in kept} == kept and document["complete"]
    _check_files(out, document)
    assert not list(out.rglob("weights.pt"))  # compared, then removed
    assert archive.stat().st_size <= 16 * 2**20
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        assert json.loads(tar.extractfile("stages.json").read()) == document
    assert {"stages.json", "results.md", "strategies.json", "traces/timeline.png"} <= names
    assert not [n for n in names if n.endswith((".pt", ".ckpt")) or "/runs/" in n]
    strategies = json.loads((out / "strategies.json").read_text())["rows"]
    assert set(strategies) == set(catalogue.names())  # every strategy a user can pick, the baseline ddp included
    assert all(row["status"] == "ok" and row["step/time_ms"] > 0 for row in strategies.values())
    pair = json.loads((out / "one_gpu_pair.json").read_text())
    assert all(row["equal"] for row in pair["equivalence"]["rows"].values())
    # DRY_RUN_SCALE's sweep: ddp, and the reference the sweep adds
    assert {row["strategy"] for row in pair["sweep"]["rows"]} == {"reference", "ddp"}
    traces = json.loads((out / "traces.json").read_text())
    assert set(traces["runs"]) == {"naive_ddp", "overlap_ddp"} and traces["runs"]["naive_ddp"]["overlap"] < 0.05
    assert (out / "traces" / "timeline.png").stat().st_size > 10_000
    report = (out / "results.md").read_text()
    for name in STAGE_NAMES:
        assert f"## {name}" in report
