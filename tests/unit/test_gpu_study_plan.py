"""The GPU study's plan: its stages in order, what they cost on a GPU (one call of 9 minutes), the sizes they run at,
the config's checks (the same in Python as on the command line), and how results.md names what ran and links the
docs. The orchestration and the dry run are tests/dist/test_gpu_study.py's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from lightning_ddp.bench.gpu_study.config import GPUStudyConfig
from lightning_ddp.bench.gpu_study.__main__ import main
from lightning_ddp.bench.gpu_study.scales import DRY_RUN_SCALE, GPU_SCALE, FitSize, Scale
from lightning_ddp.bench.gpu_study.stages import FIT_START_S, PROCESS_START_S, STAGES, Estimate
from lightning_ddp.bench.gpu_study.study import build_report, check_budget
from lightning_ddp.model import PRESETS
from tests.support.cli_utils import REPO

STAGE_NAMES = ["environment", "cuda_tests", "compute", "strategies", "ready_times", "timer_overhead", "traces",
               "one_gpu_pair"]

# ---- the plan: one call of at most 9 minutes on one H100 or H200 --------------------------------------------------

CALL_S = 9 * 60
# A GPU session has ~15 minutes of device time, the machine's start (a minute or more) and the idle wait after the
# call included: one call of 9 minutes leaves ~3 for a rerun with --resume on the still-warm machine.
CALL_OVERHEAD_S = 30
# The call's seconds outside its stages: installing 3 pure-Python wheels (~3 s), the CUDA check in a fresh process
# (one PROCESS_START_S, 12 s), writing the archive (~2 s), and Python's own start, rounded up.


def test_the_stages_run_in_this_order() -> None:
    # What only a GPU can show first: CUDA correctness of every engine and the timer's CUDA paths (the cuda tier),
    # xl compute and MFU, each strategy's cost at world size 1; then the rest.
    assert [s.name for s in STAGES] == STAGE_NAMES


def test_the_whole_gpu_study_is_one_call_of_9_minutes() -> None:
    assert GPUStudyConfig(out="x").budget_min == CALL_S / 60
    gpu_s = {s.name: s.estimate.gpu_s for s in STAGES}
    # 12 + 82 + 47 + 70 + 52 + 54 + 37 + 77 = 431 s, with the overhead 461 s: 79 s (15 %) to spare for estimates
    # that no GPU has checked yet.
    assert sum(gpu_s.values()) + CALL_OVERHEAD_S <= CALL_S, gpu_s
    check_budget(STAGES, CALL_S / 60)  # and none refused
    # The dry run on CPU: every stage in 5 minutes on 2 idle cores, within the default budget.
    assert sum(s.estimate.dry_run_s for s in STAGES if not s.needs_cuda) <= 5 * 60


def test_a_gpu_estimate_is_its_starts_and_its_work() -> None:
    # 2 process starts, 3 fits and 7 s of work: 2 x 12 + 3 x 4 + 7 = 43 s on a GPU; the dry run's is measured.
    estimate = Estimate(process_starts=2, fit_starts=3, work_s=7, dry_run_s=20)
    assert (PROCESS_START_S, FIT_START_S) == (12, 4)
    assert (estimate.seconds(dry_run=False), estimate.seconds(dry_run=True)) == (43, 20)
    assert estimate.basis(dry_run=False) == "2 process starts x 12 s + 3 fits x 4 s + 7 s of work"


def test_the_docs_state_each_stage_s_estimates() -> None:
    # docs/gpu.md's table of stages: each stage's row gives its GPU estimate (as counted) and its dry run's.
    rows = {line.split("|")[1].strip(" `"): line for line in (REPO / "docs" / "gpu.md").read_text().splitlines()
            if line.startswith("| `")}
    for stage in STAGES:
        assert stage.name in rows, stage.name
        cells = [cell.strip() for cell in rows[stage.name].split("|")]
        assert f"{stage.estimate.gpu_s:.0f} s" in cells, (stage.name, cells)
        assert (f"{stage.estimate.dry_run_s:.0f} s" if not stage.needs_cuda else "skipped: no CUDA") in cells


def test_a_plan_refuses_a_budget_in_which_a_stage_could_never_start() -> None:
    with pytest.raises(ValueError, match=r"stage cuda_tests needs ~82 s, more than `--budget_min 1` gives a call; "
                                         r"give it at least 1.4 minutes"):
        check_budget(STAGES, 1)


def test_only_the_test_tier_cannot_rehearse_on_cpu() -> None:
    # Every other stage runs its own code in the dry run; only the cuda tier is nothing but CUDA.
    assert [s.name for s in STAGES if s.needs_cuda] == ["cuda_tests"]


def test_stage_titles_hold_for_the_gpu_study_and_the_dry_run() -> None:
    # A title says what a stage measures; the preset and the device it ran on are the caption's to say.
    presets = re.compile(r"\b(" + "|".join(map(re.escape, PRESETS)) + r")\b")
    assert [s.title for s in STAGES if presets.search(s.title)] == []
    assert all("{preset} preset on {device}" in s.caption for s in STAGES if s.name in ("compute", "ready_times"))


# ---- the scales -----------------------------------------------------------------------------------------------------


def test_the_scales_differ_in_size_not_in_shape() -> None:
    assert (GPU_SCALE.device, GPU_SCALE.compute.preset, GPU_SCALE.compute.seq_len) == ("cuda", "xl", 512)
    assert (GPU_SCALE.profile.preset, GPU_SCALE.profile.batch, GPU_SCALE.profile.seq_len) == ("xl", 4, 512)
    assert DRY_RUN_SCALE.device == "cpu"
    assert {DRY_RUN_SCALE.compute.preset, DRY_RUN_SCALE.strategies.preset} == {"tiny"}
    # The traced steps are configs/trace/record.yaml's (it comes after the fit's arguments): the scales say so.
    record = yaml.safe_load((REPO / "configs" / "trace" / "record.yaml").read_text())
    for scale in (GPU_SCALE, DRY_RUN_SCALE):
        assert (scale.traces.steps, scale.traces.warmup) == (record["trainer"]["max_steps"],
                                                              record["timer"]["warmup_steps"])


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch=0), "`FitSize.batch` must be an integer >= 1, got 0"),
    (dict(seq_len=32.0), "`FitSize.seq_len` must be an integer >= 1, got 32.0"),
    (dict(steps=True), "`FitSize.steps` must be an integer >= 1, got True"),
    (dict(warmup=4), r"`FitSize.warmup` must be in \[0, steps=4\), got 4"),
    (dict(warmup=-1), r"`FitSize.warmup` must be in \[0, steps=4\), got -1"),
    (dict(preset="huge"), "'huge' is not a supported preset; choose one of: tiny, small,"),  # the fit CLI's words
])
def test_a_fit_size_refuses_a_bad_value_where_it_is_built(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FitSize(**{**dict(preset="tiny", batch=2, seq_len=32, steps=4, warmup=1), **kwargs})


def test_a_scale_refuses_a_device_its_backend_does_not_drive() -> None:
    with pytest.raises(ValueError, match="must be cuda and nccl, or cpu and gloo; got 'cuda' and 'gloo'"):
        Scale(**{**DRY_RUN_SCALE.__dict__, "device": "cuda"})


# ---- the command line: a config built in Python is held to what the command line holds it to ----------------------


@pytest.mark.parametrize("kwargs, args, message", [
    (dict(), [], "`--out` is missing"),
    (dict(budget_min=0), ["--budget_min", "0"], "`--budget_min` must be > 0 minutes, got 0"),
    (dict(stages=["compute", "nonsense"]), ["--stages", "[compute,nonsense]"],
     "unknown stage 'nonsense' in `--stages`; choose from environment, cuda_tests, compute,"),
    (dict(stages=[]), ["--stages", "[]"], "`--stages` is empty; choose from environment,"),
    (dict(root="/"), ["--root", "/"], "no configs/bench under /: the study reads the repository's configs"),
    (dict(archive="study.zip"), ["--archive", "study.zip"], "`--archive` must name a .tar.gz file"),
    (dict(commit="HEAD"), ["--commit", "HEAD"], "`--commit` must be a git commit hash"),
])
def test_a_bad_value_is_refused_alike_in_python_and_on_the_command_line(
        capsys, tmp_path: Path, kwargs: dict, args: list[str], message: str) -> None:
    out = {} if message.startswith("`--out`") else {"out": str(tmp_path / "study")}
    with pytest.raises(ValueError) as refused:
        GPUStudyConfig(**out, **kwargs)
    assert str(refused.value).startswith(message)
    with pytest.raises(SystemExit) as exit_info:
        main([*(["--out", out["out"]] if out else []), "--cpu_dry_run", "true", *args])
    # the same words (the command line's 0 is parsed as 0.0 first)
    assert exit_info.value.code == 2 and capsys.readouterr().err.startswith(f"error: {message}")
    assert not (tmp_path / "study").exists()  # refused before anything was written


@pytest.mark.parametrize("kwargs, message", [
    (dict(budget_min="9"), "`--budget_min` must be > 0 minutes, got '9'"),
    (dict(resume="yes"), "`--resume` must be true or false, got 'yes'"),
    (dict(cpu_dry_run=1), "`--cpu_dry_run` must be true or false, got 1"),
])
def test_a_config_built_in_python_is_held_to_the_command_line_s_types(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        GPUStudyConfig(out="study", **kwargs)


# ---- results.md: its stages' titles and its links to docs/gpu.md -------------------------------------------------


def _report(out: Path, root: Path | None) -> str:
    out.mkdir(parents=True)
    (out / "compute.json").write_text(json.dumps({"preset": "tiny", "device": "cpu", "seq_len": 32, "rows": {}}))
    document = {"cpu_dry_run": True, "stages": [
        {"name": "compute", "title": "Compute", "status": "ok", "seconds": 1.0, "estimate_s": 20}]}
    return build_report(document, out, STAGES, root)


def test_results_md_links_the_docs_where_the_link_holds(tmp_path: Path) -> None:
    root = tmp_path / "checkout"
    (root / "docs").mkdir(parents=True)
    # Inside the checkout, wherever --out is: a relative link, right as long as the two stay in one checkout.
    for out, link in [(root / "benchmarks" / "results" / "gpu-h100", "../../../docs/gpu.md"),
                      (root / "study", "../docs/gpu.md")]:
        report = _report(out, root)
        assert f"[docs/gpu.md, Stages]({link}#stages)" in report
        assert f"step times ([docs/gpu.md, Reading the 2-rank numbers]({link}#reading-the-2-rank-numbers))" in report
        assert (out / link).resolve() == root / "docs" / "gpu.md"
    # Outside it: no link that could break, the page and section by name.
    report = _report(tmp_path / "elsewhere", root)
    assert "](" not in report.replace("](#", "") and 'docs/gpu.md, "Stages"' in report
    # The dry run's compute says what ran: the tiny preset on the CPU.
    assert "tiny preset on cpu, context 32" in report
