"""The GPU study (``python -m lightning_ddp.bench.gpu_study``): its orchestration with fake stages, its parts, and its
CPU dry run (a few stages, and every stage in one call, in the ``slow`` tier).

The orchestration is checked with fake stages (instant): order, budget skips, failures that do not stop the study,
stages.json rewritten after every stage, interruption. The real stages run in the dry run on CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from lightning_ddp import catalogue
from lightning_ddp.bench.gpu_study.config import GPUStudyConfig
from lightning_ddp.bench.gpu_study.__main__ import main, missing_packages
from lightning_ddp.bench.gpu_study import processes
from lightning_ddp.bench.gpu_study.processes import FitSpec, batch_candidates, first_that_fits, run_fits
from lightning_ddp.bench.launch import ProcessResult
from lightning_ddp.bench.gpu_study.scales import DRY_RUN_SCALE
from lightning_ddp.bench.gpu_study.stages import (
    EXACT_TOLERANCE,
    Estimate,
    Stage,
    StageResult,
    StudyContext,
    cuda_tests,
    read_pytest_log,
    weight_differences,
)
from lightning_ddp.bench.gpu_study.study import build_report, run_study, select_files
from lightning_ddp.projection.simulators import simulated_names
from tests.support.cli_utils import REPO
from tests.unit.test_gpu_study_plan import STAGE_NAMES

# ---- the orchestration, with fake stages ---------------------------------------------------------------------------


def _stage(name: str, run, estimate: float = 1.0, needs_cuda: bool = False) -> Stage:
    return Stage(name=name, title=name.title(), run=run, needs_cuda=needs_cuda,
                 estimate=Estimate(process_starts=0, fit_starts=0, work_s=estimate, dry_run_s=estimate))


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
        (ctx.out / "pair").mkdir(parents=True)
        (ctx.out / "pair" / "results.csv").write_text("strategy,step_ms\nddp,1.0\n")
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
    assert names == ["archive_contents.json", "pair/results.csv", "results.md", "stages.json", "writes.json"]
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


# ---- the parts ----------------------------------------------------------------------------------------------------


def test_a_pytest_log_gives_the_counts_and_the_failures_with_their_messages(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_passes(): pass\n"
        "def test_fails(): assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='no GPU')\n"
        "def test_skipped(): pass\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError('fixture broke')\n"
        "def test_errors(broken): pass\n")
    log = subprocess.run([sys.executable, "-m", "pytest", str(tmp_path / "test_sample.py"), "-v", "-rfE", "-p",
                          "no:cacheprovider"], cwd=tmp_path, capture_output=True, text=True).stdout
    data = read_pytest_log(log)
    assert {k: data[k] for k in ("tests", "passed", "failed", "errors", "skipped")} == dict(
        tests=4, passed=1, failed=1, errors=1, skipped=1)
    messages = {f["test"].split("::")[-1]: f["message"] for f in data["failures"]}
    assert "one is not two" in messages["test_fails"] and "fixture broke" in messages["test_errors"]


def test_a_tier_cut_off_is_counted_as_far_as_it_got() -> None:
    # No summary yet: the -v lines say what ran, a failure's message is its outcome until the summary comes.
    log = ("tests/gpu/test_a.py::test_one[nccl_1rank] PASSED                [ 33%]\n"
           "tests/gpu/test_a.py::test_two FAILED                            [ 66%]\n"
           "tests/gpu/test_b.py::test_three SKIPPED (needs a CUDA GPU)      [100%]\n")
    data = read_pytest_log(log)
    assert {k: data[k] for k in ("tests", "passed", "failed", "errors", "skipped")} == dict(
        tests=3, passed=1, failed=1, errors=0, skipped=1)
    assert data["failures"] == [{"test": "tests/gpu/test_a.py::test_two", "message": "failed"}]
    xdist = read_pytest_log("[gw0] [ 50%] PASSED tests/a.py::test_x \n[gw1] [100%] ERROR tests/a.py::test_y \n")
    assert (xdist["passed"], xdist["errors"], xdist["failures"]) == (1, 1, [{"test": "tests/a.py::test_y",
                                                                             "message": "errors"}])


@pytest.mark.multiprocess  # one pytest subprocess collecting the tier (~10 s)
@pytest.mark.slow  # the GPU study's stages: the study, not the product's correctness
def test_the_cuda_tests_stage_runs_the_tier_and_says_when_nothing_ran(tmp_path: Path) -> None:
    # Here every test of the tier is skipped (no CUDA): the stage runs it anyway and reports that nothing ran.
    config = _config(tmp_path)
    ctx = StudyContext(config=config, scale=DRY_RUN_SCALE, out=tmp_path, root=REPO, cuda=False,
                       deadline=time.monotonic() + 600, stage_estimate_s=300, stage_started=time.monotonic())
    result = cuda_tests(ctx)
    assert result.data["tests"] >= 12 and result.data["skipped"] == result.data["tests"]
    assert result.problems == ["every test of the tier was skipped: pytest saw no CUDA device"]
    assert result.files == ["cuda_tests.log"]


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
@pytest.mark.slow  # the GPU study's stages: the study, not the product's correctness
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


def test_each_fit_in_a_set_of_processes_meets_on_a_rendezvous_port_of_its_own(tmp_path: Path, monkeypatch) -> None:
    plans = []

    def no_processes(command, envs, logs, timeout_s, cwd=None) -> ProcessResult:
        plans.append(json.loads(Path(command[-1]).read_text()))
        return ProcessResult(returncodes=[0, 0], timed_out=False)

    monkeypatch.setattr(processes, "run_processes", no_processes)
    run_fits([FitSpec("a", ()), FitSpec("b", ())], tmp_path, ranks=2, timeout_s=60)
    ports = [fit["port"] for plan in plans for fit in plan["fits"]]
    assert len(set(ports)) == len(ports) == 3  # a, b; then b again, in the set started after a was lost
    # In the processes, each fit's rendezvous (Lightning's env://) reads its port.
    seen = []
    monkeypatch.setattr("lightning_ddp.cli.main", lambda args: seen.append(os.environ["MASTER_PORT"]))
    monkeypatch.setenv("MASTER_PORT", "1")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({**plans[0], "out_dir": str(tmp_path / "fits")}))
    assert processes.fits(str(plan)) == 0
    assert seen == [str(fit["port"]) for fit in plans[0]["fits"]]


@pytest.mark.slow  # 2 ranks, four sharded fits in one launch (~1 min)
def test_sharded_fits_one_after_another_on_two_ranks_do_not_hang(tmp_path: Path) -> None:
    # torch keeps a finished fsdp2 fit's store alive in the process: on one shared port the next fit hung in 4 of 7
    # tries (docs/gpu.md, the stage notes).
    common = ("--config", str(REPO / "configs" / "quickstart.yaml"), "--data.source", "synthetic",
              "--model.context_length", "32", "--data.seq_len", "32", "--data.batch_size", "2", "--trainer.max_steps",
              "2", "--timer.enabled", "false", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
              "--trainer.num_nodes", "2", "--trainer.limit_val_batches", "0")
    names = ["fsdp2", "hsdp", "fsdp2_again", "hsdp_again"]
    specs = [FitSpec(n, (*common, "--trainer.strategy", n.removesuffix("_again"))) for n in names]
    results = run_fits(specs, tmp_path, ranks=2, timeout_s=240, cwd=str(tmp_path), threads=1)
    assert [(r.name, r.status) for r in results] == [(n, "ok") for n in names], [r.error for r in results]
    assert [p.name for p in (tmp_path / "_processes").iterdir()] == ["launch0"]


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
    (tmp_path / "compute.json").write_text(json.dumps({"rows": {"32-true": {
        "status": "ok", "batch": 6, "preflight_batch": 8, "peak_reserved_bytes": 2 * 2**30, "estimate_bytes": 2**30,
        "attempts": [{"batch": 8, "status": "oom"}, {"batch": 6, "status": "ok"}]}}}))
    document = {"stages": [{"name": name, "title": name, "status": "ok", "seconds": 1.0, "estimate_s": 1}
                           for name in ("compute", "timer_overhead")]}
    report = build_report(document, tmp_path)
    assert "small preset, – off/on pairs of – steps" in report and "overhead +1.23% [95 %: –, –]" in report
    assert "| 32-true | ok | – | 6 | 8: 8 OOM → 6 | – | – | – | – | 2.0 | 1.0 | 0.50 |" in report
    # A stage's row links its section: GitHub's anchor of "## timer_overhead" keeps the underscore.
    assert "| [timer_overhead](#timer_overhead) | ok |" in report


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
        run = compute["rows"][precision]
        # The pre-flight allows the scale's whole cap on a CPU with gigabytes free, and it fits at once.
        assert run["batch"] == run["preflight_batch"] == DRY_RUN_SCALE.compute.batch
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


@pytest.mark.slow  # every stage on CPU in one call, as on a GPU: ~5 minutes on 2 cores
def test_dry_run_of_every_stage_in_one_call(tmp_path: Path, capsys) -> None:
    out, archive = tmp_path / "study", tmp_path / "study.tar.gz"
    # README's GPU recipe, on CPU: one call of the default budget runs every stage.
    assert main(["--out", str(out), "--cpu_dry_run", "true", "--resume", "true", "--archive", str(archive)]) == 0
    document = json.loads((out / "stages.json").read_text())
    assert [(s["name"], s["status"]) for s in document["stages"]] == [
        (name, "skipped: no CUDA" if name == "cuda_tests" else "ok") for name in STAGE_NAMES] and document["complete"]
    # Each stage's measured seconds beside its estimate: in the log, in stages.json and in results.md's table.
    log, report = capsys.readouterr().out, (out / "results.md").read_text()
    for entry in document["stages"]:
        if entry["status"] == "ok":
            assert f"[{entry['name']}] ok in {entry['seconds']:.0f} s (estimate {entry['estimate_s']:.0f} s)" in log
            assert f"| ok | {entry['seconds']:,.0f} | {entry['estimate_s']:,.0f} |" in report
            assert entry["estimate_basis"] == "measured in the dry run on 2 idle CPU cores"
    _check_files(out, document)
    assert not list(out.rglob("weights.pt"))  # compared, then removed
    assert archive.stat().st_size <= 16 * 2**20
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        assert json.loads(tar.extractfile("stages.json").read()) == document
    assert {"stages.json", "results.md", "strategies.json", "traces/timeline.png"} <= names
    assert not [n for n in names if n.endswith((".pt", ".ckpt"))]
    strategies = json.loads((out / "strategies.json").read_text())["rows"]
    assert set(strategies) == set(catalogue.names())  # every strategy a user can pick, the baseline ddp included
    assert all(row["status"] == "ok" and row["step/time_ms"] > 0 for row in strategies.values())
    pair = json.loads((out / "one_gpu_pair.json").read_text())
    assert set(pair["rows"]) == set(catalogue.names()) and all(row["equal"] for row in pair["rows"].values())
    traces = json.loads((out / "traces.json").read_text())
    assert set(traces["rows"]) == {"naive_ddp", "overlap_ddp"} and traces["rows"]["naive_ddp"]["overlap"] < 0.05
    assert (out / "traces" / "timeline.png").stat().st_size > 10_000
    for name in STAGE_NAMES:
        assert f"## {name}" in report
    assert "tiny preset on cpu" in report and "xl" not in "".join(s["title"] for s in document["stages"])
    # The same command again, as after a call cut short: every stage is kept, none runs.
    assert main(["--out", str(out), "--cpu_dry_run", "true", "--resume", "true"]) == 0
    again = json.loads((out / "stages.json").read_text())
    assert again["stages"] == document["stages"] and len(again["calls"]) == 2
