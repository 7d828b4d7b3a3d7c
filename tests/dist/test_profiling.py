"""TraceRecorder through the CLI on 2 CPU processes: one trace per rank, our ranges and communication track in
it, and the overlap it proves (naive ~0, overlap clearly > 0). Two CLI runs shared by every multi-process test.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.profilers import PyTorchProfiler

from lightning_ddp.callbacks import TraceRecorder
from lightning_ddp.cli import main
from lightning_ddp.sync import ranges
from lightning_ddp.trace import load_run, render_timeline
from tests.support.cli_utils import REPO, run_cli

# A small, fast cell: tiny model, short sequences. Steps 0 is left alone, 1 is the profiler's warm-up, 2 and 3
# are recorded. The test-only strategy sleeps 5 ms in every gradient hook after launching that gradient's
# all-reduce: backward then lasts 39 x 5 ms longer, long enough to hide each all-reduce (tens of KB over gloo).
FAST = ("--model.context_length", "32", "--data.seq_len", "32", "--data.batch_size", "2", "--trainer.max_steps", "4",
        "--timer.warmup_steps", "2", "--trace.enabled", "true", "--trace.wait_steps", "1", "--trace.warmup_steps", "1",
        "--trace.active_steps", "2")
RUNS = {
    "naive": ("--trainer.strategy", "naive_ddp"),
    "overlap": ("--trainer.strategy", "tests.support.timing_helpers.SlowBackwardOverlapDDPStrategy",
                "--trainer.strategy.init_args.delay_ms", "5"),
}
RECORDED_STEPS = [2, 3]
# 39 parameter tensors of the tiny model: naive adds the gradient-presence flags every step; overlap (a bucketed
# engine) only when a gradient is missing, which never happens here
CALLS_PER_STEP = {"naive": 40, "overlap": 39}


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, Path]:
    """Run both cells once; return each run's trace directory (<log_dir>/traces)."""
    out = {}
    for name, args in RUNS.items():
        cwd = tmp_path_factory.mktemp(name)
        run_cli("fit", "--config", str(REPO / "configs" / "quickstart.yaml"), *FAST,
                "--trainer.logger.init_args.save_dir", str(cwd / "logs"), *args, cwd=cwd)
        (out[name],) = {p.parent for p in (cwd / "logs").rglob("*.pt.trace.json")}
    return out


@pytest.mark.multiprocess
@pytest.mark.slow  # a traced fit per strategy: the traces' end-to-end run, in the slow tier (`pytest -m slow`)
def test_one_parseable_trace_per_rank_with_ranges_and_communication(traces: dict[str, Path]) -> None:
    for name, trace_dir in traces.items():
        files = sorted(trace_dir.glob("*.pt.trace.json"))
        # tensorboard_trace_handler's layout <worker>.pt.trace.json, one worker per rank, next to the run's logs
        assert [f.name for f in files] == ["rank0.pt.trace.json", "rank1.pt.trace.json"], name
        assert trace_dir.name == "traces" and (trace_dir.parent / "timing_summary.json").exists()
        for rank, path in enumerate(files):
            trace = json.loads(path.read_text())
            assert trace["distributedInfo"]["rank"] == rank and trace["distributedInfo"]["backend"] == "gloo"
            meta = trace[ranges.METADATA_KEY]
            # the communication track holds every collective of the run, recorded at the process groups
            assert meta["rank"] == rank and meta["world_size"] == 2 and meta["comm_track"] == "process groups"
            assert [s["step"] for s in meta["steps"]] == RECORDED_STEPS
            # the two perf_counter reads around opening ddp/step#N are tens of microseconds apart; a thread
            # descheduled between them widens one step's, which then borrows the other step's anchor (+ 500 us/s)
            assert all(s["uncertainty_us"] < 2000 for s in meta["steps"]), meta["steps"]
            calls = CALLS_PER_STEP[name]
            assert all(s["collectives"] == calls for s in meta["steps"])

            rank_trace = load_run([path]).ranks[0]
            assert [s for s, _ in rank_trace.steps] == RECORDED_STEPS
            n = len(RECORDED_STEPS)
            for range_name in (ranges.FORWARD, ranges.BACKWARD, ranges.OPTIMIZER, ranges.GRAD_SYNC):
                assert len(rank_trace.ranges[range_name]) == n, (name, range_name)
            assert len(rank_trace.ranges[ranges.COMM_LAUNCH]) == len(rank_trace.ranges[ranges.COMM_WAIT]) == n * calls
            # the communication track: every collective, inside its step
            assert len(rank_trace.record_comm) == n * calls
            for step, (start, end) in rank_trace.steps:
                inside = [c for c in rank_trace.record_comm if start <= c.start and c.end <= end]
                assert len(inside) == calls, (name, rank, step)
            # Clock alignment: the recording process group marks a launch as the engine's call reaches it, inside
            # the engine's ddp/comm_launch range, so on the trace's axis each mark must fall inside its range (the
            # k-th collective <-> the k-th range). A misaligned track would put marks before their ranges open or
            # after they close. Typical distance from either end: 30-200 us; a descheduled thread on a loaded
            # machine can make a single range milliseconds long, hence the median for the close.
            pairs = list(zip(rank_trace.record_comm, rank_trace.ranges[ranges.COMM_LAUNCH]))
            after_open = sorted(c.start - opened for c, (opened, _) in pairs)
            before_close = sorted(closed - c.start for c, (_, closed) in pairs)
            assert after_open[0] > -100 and before_close[len(pairs) // 2] > 0, (name, rank, after_open, before_close)
            # what the profiler recorded itself: gloo's worker threads ran every all-reduce (plus Lightning's and
            # the CommTimer's own small collectives)
            gloo = [c for c in rank_trace.profiler_comm if c.name == "gloo:all_reduce"]
            assert len(gloo) >= n * calls


@pytest.mark.multiprocess
@pytest.mark.slow  # a timing threshold: noisy on a shared machine, so in the slow tier (`pytest -m slow`)
def test_naive_overlaps_nothing_and_overlap_hides_communication(traces: dict[str, Path], tmp_path: Path) -> None:
    naive, overlap = load_run([traces["naive"]]), load_run([traces["overlap"]], label="overlap (slow backward)")
    # naive: every collective runs inside finish_gradient_synchronization, after backward: nothing to hide behind
    assert naive.overlap().fraction < 0.02, naive.overlap()
    assert naive.overlap("profiler").fraction < 0.02, naive.overlap("profiler")  # gloo's own threads agree
    # overlap: each all-reduce is in flight while backward goes on computing (here: sleeping 5 ms per gradient)
    assert overlap.overlap().fraction > 0.5, overlap.overlap()
    assert overlap.overlap("profiler").fraction > 0.5, overlap.overlap("profiler")

    timeline = render_timeline([naive, overlap], tmp_path / "timeline.png")
    assert timeline.path.stat().st_size > 30_000
    assert [(r.run, r.rank, r.kind) for r in timeline.rows] == [
        (run, rank, kind) for run in ("naive_ddp", "overlap (slow backward)") for rank in (0, 1)
        for kind in ("compute", "comm")
    ]
    for row in timeline.rows:  # both rows drawn for every rank
        # compute: forward, backward, grad_sync and optimizer once per step; comm: every collective of every step
        name = "naive" if row.run == "naive_ddp" else "overlap"
        per_step = 4 if row.kind == "compute" else CALLS_PER_STEP[name]
        assert row.bars == len(RECORDED_STEPS) * per_step, row


# -- one process: configuration and validation ---------------------------------------------------------------


def test_trace_config_fragment_parses_on_top_of_quickstart(monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.argv", ["lightning_ddp"])
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--config",
              str(REPO / "configs" / "trace" / "record.yaml"), "--print_config"])
    assert exit_info.value.code in (0, None)
    assert "enabled: true" in capsys.readouterr().out.split("trace:")[1]


def test_recorder_is_off_by_default_and_validates_its_steps() -> None:
    assert TraceRecorder().enabled is False
    assert TraceRecorder(wait_steps=5, warmup_steps=1, active_steps=3).total_steps == 9
    with pytest.raises(ValueError, match="--trace.active_steps"):
        TraceRecorder(active_steps=0)
    with pytest.raises(ValueError, match="--trace.wait_steps"):
        TraceRecorder(wait_steps=-1)


def test_recorder_refuses_a_second_torch_profiler() -> None:
    trainer = SimpleNamespace(profiler=PyTorchProfiler())
    with pytest.raises(ValueError, match="--trainer.profiler"):
        TraceRecorder(enabled=True).setup(trainer, None, "fit")
