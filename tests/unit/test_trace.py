"""The trace toolkit on hand-made data: overlap arithmetic, the communication track, the renderer, the ranges.

One process throughout; the real 2-process traces are checked in ``test_profiling.py``.
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_ddp.intervals import intersect, merge, subtract, total
from lightning_ddp.sync import ranges
from lightning_ddp.sync.record import Collective
from lightning_ddp.trace.__main__ import main as trace_main
from lightning_ddp.metrics.comm_track import COMM_TID_BASE, RecordedStep, add_communication_track, assign_lanes
from lightning_ddp.trace import (Overlap, comm_compute_overlap, find_traces, load_rank_trace, load_run,
                                 render_timeline)

# -- interval arithmetic and HTA's overlap -------------------------------------------------------------------


def test_merge_joins_touching_and_drops_empty() -> None:
    assert merge([(3, 5), (0, 1), (1, 2), (4, 6), (7, 7)]) == [(0, 2), (3, 6)]
    assert total([(0, 4), (2, 6), (10, 11)]) == 7  # (0, 6) and (10, 11): the overlap 2..4 counts once


def test_intersect_and_subtract() -> None:
    assert intersect([(0, 4), (6, 10)], [(3, 7)]) == [(3, 4), (6, 7)]
    assert intersect([(0, 1)], [(1, 2)]) == []  # touching is not overlapping
    assert subtract([(0, 10)], [(2, 3), (5, 6)]) == [(0, 2), (3, 5), (6, 10)]
    assert subtract([(0, 10)], [(-5, 20)]) == []


def test_naive_pattern_overlaps_nothing() -> None:
    # compute 0..10, then all communication 10..20 while the thread waits, then the optimizer 20..30
    o = comm_compute_overlap(comm=[(10, 14), (14, 20)], compute=[(0, 10), (20, 30)])
    assert (o.comm, o.overlapped, o.fraction) == (10, 0, 0.0)


def test_overlap_pattern_counts_concurrent_collectives_once() -> None:
    # comm union = (0, 6) + (8, 10) = 8; compute (1, 9) covers (1, 6) = 5 and (8, 9) = 1 -> 6 / 8 = 0.75
    o = comm_compute_overlap(comm=[(0, 4), (2, 6), (8, 10)], compute=[(1, 9)])
    assert (o.comm, o.overlapped) == (8, 6)
    assert o.fraction == 0.75


def test_no_communication_is_zero_not_nan() -> None:
    assert comm_compute_overlap([], [(0, 5)]).fraction == 0.0


def test_overlap_over_ranks_is_a_ratio_of_sums() -> None:
    # rank A: 10 ms comm, all hidden; rank B: 30 ms, none hidden -> 10 / 40 = 0.25 (not the mean of ratios, 0.5)
    assert (Overlap(10, 10) + Overlap(30, 0)).fraction == 0.25


def test_lanes_never_hold_overlapping_intervals() -> None:
    intervals = [(0, 4), (1, 2), (3, 5), (4, 6)]
    assert assign_lanes(intervals) == [0, 1, 1, 0]


# -- the communication track: clock alignment ----------------------------------------------------------------

PID, TID = 100, 100


def _x(name: str, ts: float, dur: float, tid: int = TID, **extra) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": PID, "tid": tid, "ts": ts, "dur": dur, **extra}


def test_communication_track_is_aligned_by_the_step_anchor(tmp_path: Path) -> None:
    trace = {"traceEvents": [_x(ranges.step_range_name(7), ts=1_000_000.0, dur=300_000.0)]}
    # perf_counter read 10.0 s before and 10.00002 s after opening ddp/step#7: anchor at 10.00001 s, +-10 us
    step = RecordedStep(7, (10.0, 10.00002), [
        Collective("all_reduce", "lm_head.weight", 4096, launched=10.1, completed=10.105, wait=(10.103, 10.105)),
        Collective("all_reduce", "flags", 16, launched=10.102, completed=10.104),  # concurrent: a second lane
    ])
    skipped = RecordedStep(6, (9.0, 9.00001), [Collective("all_reduce", "x", 4, 9.1, 9.2)])  # no anchor in trace
    add_communication_track(trace, [skipped, step], PID, TID, metadata={"rank": 3, "strategy": "overlap_ddp"})

    comm = [e for e in trace["traceEvents"] if e.get("cat") == ranges.COMM_CATEGORY]
    # offset = 1_000_000 us - 10.00001 s * 1e6 = -9_000_010 us; launch 10.1 s -> 10_100_000 - 9_000_010 = 1_099_990 us
    assert [(e["ts"], e["dur"], e["tid"]) for e in comm] == [
        (1_099_990.0, 5_000.0, COMM_TID_BASE), (1_101_990.0, 2_000.0, COMM_TID_BASE + 1)
    ]
    assert comm[0]["args"] == {"label": "lm_head.weight", "bytes": 4096, "step": 7, "wait_us": 2_000.0}
    meta = trace[ranges.METADATA_KEY]
    assert meta["rank"] == 3 and [s["step"] for s in meta["steps"]] == [7]
    assert meta["steps"][0]["uncertainty_us"] == pytest.approx(10.0)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert names == {ranges.COMM_THREAD_NAME, ranges.COMM_THREAD_NAME + " #1"}

    path = tmp_path / "rank3.pt.trace.json"
    path.write_text(json.dumps(trace))
    loaded = load_rank_trace(path)
    assert loaded.rank == 3 and loaded.label == "overlap_ddp"
    assert [(c.start, c.end, c.label) for c in loaded.record_comm] == [
        (1_099_990.0, 1_104_990.0, "lm_head.weight"), (1_101_990.0, 1_103_990.0, "flags")
    ]


def test_a_step_whose_anchor_reads_were_far_apart_borrows_its_neighbours() -> None:
    trace = {"traceEvents": [_x(ranges.step_range_name(7), ts=1_000_000.0, dur=900_000.0),
                             _x(ranges.step_range_name(8), ts=2_000_000.0, dur=900_000.0)]}
    steps = [
        RecordedStep(7, (10.0, 10.00002)),  # tight: offset = 1_000_000 - 10_000_010 = -9_000_010 us, +-10 us
        # the thread was descheduled for 8 ms between the two reads: +-4000 us, and its midpoint 11.004 s is off
        RecordedStep(8, (11.0, 11.008), [Collective("all_reduce", "w", 4, launched=11.5, completed=11.501)]),
    ]
    add_communication_track(trace, steps, PID, TID, metadata={})
    meta = {m["step"]: m for m in trace[ranges.METADATA_KEY]["steps"]}
    # step 8 via step 7's anchor: 10 us + 500 us/s drift bound x 1.004 s apart = 512 us < its own 4000 us
    assert meta[8]["anchor_step"] == 7 and meta[8]["uncertainty_us"] == pytest.approx(512.0, abs=0.1)
    assert meta[8]["offset_us"] == pytest.approx(-9_000_010.0)
    (event,) = [e for e in trace["traceEvents"] if e.get("cat") == ranges.COMM_CATEGORY]
    assert event["ts"] == pytest.approx(11_500_000 - 9_000_010)  # = 2_499_990 us, not its own anchor's 2_496_000


# -- reading ranges, and the renderer ------------------------------------------------------------------------


def _rank_trace(rank: int, overlapped: bool) -> dict:
    """Two 100 ms steps (times in us): forward 0-30, backward 30-80, then (naive) sync 80-90, optimizer 90-100.

    Communication: naive: 4 ms collectives back to back inside the sync window 80-88 -> overlap 0.
    overlapped: collectives 40-44 and 60-68 launched inside backward (launch calls 1 ms each, not compute) and
    a 1 ms sync 80-81 -> comm 12 ms per step; hidden = comm minus the launch ms: (41-44) + (61-68) = 10 ms.
    """
    events, steps = [], []
    for step, t in ((5, 0.0), (6, 100_000.0)):
        ms = lambda v: t + v * 1000  # noqa: E731
        events += [_x(ranges.step_range_name(step), ms(0), 100_000), _x(ranges.FORWARD, ms(0), 30_000),
                   _x(ranges.BACKWARD, ms(30), 50_000), _x(ranges.OPTIMIZER, ms(90), 10_000)]
        if overlapped:
            events += [_x(ranges.COMM_LAUNCH, ms(40), 1000), _x(ranges.COMM_LAUNCH, ms(60), 1000),
                       _x(ranges.GRAD_SYNC, ms(80), 1000)]
            comm = [(40, 44), (60, 68)]
        else:
            events += [_x(ranges.GRAD_SYNC, ms(80), 10_000)]
            comm = [(80, 84), (84, 88)]
        events += [_x("all_reduce", ms(a), (b - a) * 1000, tid=COMM_TID_BASE, cat=ranges.COMM_CATEGORY) for a, b in comm]
        events += [_x("gloo:all_reduce", ms(a), (b - a) * 1000, tid=TID + 1) for a, b in comm]  # gloo's thread
        steps.append({"step": step})
    name = "overlap_ddp" if overlapped else "naive_ddp"
    return {"traceEvents": events, ranges.METADATA_KEY: {"rank": rank, "strategy": name, "pid": PID, "tid": TID}}


def _write_run(root: Path, overlapped: bool) -> Path:
    root.mkdir(parents=True)
    for rank in (0, 1):
        (root / f"rank{rank}.pt.trace.json").write_text(json.dumps(_rank_trace(rank, overlapped)))
    return root


def test_compute_excludes_time_inside_collective_calls(tmp_path: Path) -> None:
    run = load_run([_write_run(tmp_path / "overlap", overlapped=True)])
    rank = run.ranks[0]
    assert [s for s, _ in rank.steps] == [5, 6]
    # per step: forward 30 + backward 50 - 2 launches of 1 ms + optimizer 10 = 88 ms (the sync is outside backward)
    assert total(rank.compute()) == 2 * 88_000
    # per step 12 ms of comm, 10 ms of it hidden (see _rank_trace): 20 of 24 ms over both steps
    assert rank.overlap() == Overlap(24_000, 20_000)
    # gloo's own thread events give the same answer here, since they were made identical
    assert rank.overlap("profiler") == Overlap(24_000, 20_000)
    # the first step only: 12 ms of which 10 hidden
    assert rank.overlap(window=rank.window(steps=1)) == Overlap(12_000, 10_000)


def test_renderer_draws_a_compute_and_a_comm_row_per_rank(tmp_path: Path) -> None:
    naive = load_run([_write_run(tmp_path / "naive", overlapped=False)])
    overlap = load_run([_write_run(tmp_path / "overlap", overlapped=True)], label="overlap")
    timeline = render_timeline([naive, overlap], tmp_path / "out" / "timeline.png")
    png = timeline.path.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert [(r.run, r.rank, r.kind) for r in timeline.rows] == [
        (run, rank, kind) for run in ("naive_ddp", "overlap") for rank in (0, 1) for kind in ("compute", "comm")
    ]
    # compute rows: per step forward, backward, optimizer, sync = 4 bars x 2 steps; comm rows: 2 collectives x 2 steps
    assert [r.bars for r in timeline.rows] == [8, 4] * 4
    assert timeline.overlaps["naive_ddp"].fraction == 0.0
    assert timeline.overlaps["overlap"].fraction == pytest.approx(20 / 24)  # both ranks alike: 40 of 48 ms
    assert "overlap 83.3%" in timeline.summary().splitlines()[1]


def test_the_figure_is_titled_with_the_caption_or_the_title_given(tmp_path: Path, monkeypatch) -> None:
    from matplotlib.figure import Figure

    titles: list[str] = []
    original = Figure.suptitle

    def suptitle(figure: Figure, text: str, **kwargs):
        titles.append(text)
        return original(figure, text, **kwargs)

    monkeypatch.setattr(Figure, "suptitle", suptitle)
    run = load_run([_write_run(tmp_path / "naive", overlapped=False)])
    render_timeline([run], tmp_path / "default.png")
    render_timeline([run], tmp_path / "titled.png", title="mine")
    assert titles[0].startswith("Compute vs gradient communication (overlap = ") and titles[1] == "mine"


def test_cli_draws_runs_and_prints_their_overlap(tmp_path: Path, capsys) -> None:
    naive = _write_run(tmp_path / "naive", overlapped=False)
    overlap = _write_run(tmp_path / "overlap", overlapped=True)
    # a run given as its two files and a run given as a directory
    trace_main([str(naive / "rank0.pt.trace.json"), str(naive / "rank1.pt.trace.json"), str(overlap),
                "-o", str(tmp_path / "t.png"), "--steps", "1", "--label", "naive", "--label", "overlap"])
    out = capsys.readouterr().out
    assert "naive: overlap 0.0%" in out and "overlap: overlap 83.3%" in out
    assert (tmp_path / "t.png").stat().st_size > 10_000
    with pytest.raises(SystemExit):  # one --label for two runs
        trace_main([str(naive), str(overlap), "-o", str(tmp_path / "u.png"), "--label", "x"])


def test_a_folder_that_is_no_run_is_refused(tmp_path: Path) -> None:
    # logs/ holds two runs in folders that are no logger's version_N: which one it stands for is not guessed
    naive = _write_run(tmp_path / "logs" / "a", overlapped=False)
    _write_run(tmp_path / "logs" / "b", overlapped=True)
    with pytest.raises(ValueError, match=r"logs holds no \*.pt.trace.json \(in it or its traces/\); record some"):
        load_run([tmp_path / "logs"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="trace.enabled true"):  # the error says how to record one
        load_run([tmp_path / "empty"])
    with pytest.raises(ValueError, match="two traces for rank 0"):  # two runs' files given as one run
        load_run([naive / "rank0.pt.trace.json", tmp_path / "logs" / "b" / "rank0.pt.trace.json"])


# -- the engines' ranges, in one process over a world-size-1 gloo group --------------------------------------


@pytest.fixture
def gloo_world_of_one(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("engine", ["NaiveDDP", "OverlapDDP"])
def test_engines_record_their_collective_ranges(gloo_world_of_one, tmp_path: Path, engine: str) -> None:
    import lightning_ddp.sync as sync

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))  # 4 parameter tensors
    ddp = getattr(sync, engine)(model)  # no recorder attached: the ranges do not depend on measuring
    x = torch.randn(4, 8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ddp.on_train_batch_start()
        ddp(x).sum().backward()
        ddp.finish_gradient_synchronization()
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    events = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    main_tid = threading.get_native_id()
    count = lambda name: sum(e["name"] == name and e["tid"] == main_tid for e in events)  # noqa: E731
    # 4 gradients, each launched once and waited for once, in one grad_sync; naive adds the presence-flags
    # all-reduce, overlap (a bucketed engine) needs none when no gradient is missing
    calls = {"NaiveDDP": 5, "OverlapDDP": 4}[engine]
    assert (count(ranges.COMM_LAUNCH), count(ranges.COMM_WAIT), count(ranges.GRAD_SYNC)) == (calls, calls, 1)
    # gloo runs each collective on its own worker threads, and the profiler sees it there
    gloo = [e for e in events if e["name"] == "gloo:all_reduce"]
    assert len(gloo) == calls and all(e["tid"] != main_tid for e in gloo)
    if engine == "OverlapDDP":  # launched from the gradient hooks: inside autograd's backward, on the caller thread
        sync_start = next(e["ts"] for e in events if e["name"] == ranges.GRAD_SYNC)
        assert sum(e["name"] == ranges.COMM_LAUNCH and e["ts"] < sync_start for e in events) == 4


def test_collective_ranges_cost_nothing_without_a_profiler() -> None:
    from contextlib import nullcontext

    from lightning_ddp.sync.comm import profiler_range

    assert isinstance(profiler_range(ranges.COMM_LAUNCH), nullcontext)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert isinstance(profiler_range(ranges.COMM_LAUNCH), torch.profiler.record_function)


def test_a_loggers_folder_gives_its_latest_run_with_traces(tmp_path: Path, capsys) -> None:
    # logs/overlap_ddp holds version_0 and version_2 with traces and version_3 without (a run with tracing off):
    # the README's `python -m lightning_ddp.trace logs/overlap_ddp` draws version_2, the latest that has them.
    logger_dir = tmp_path / "logs" / "overlap_ddp"
    _write_run(logger_dir / "version_0" / "traces", overlapped=False)
    _write_run(logger_dir / "version_2" / "traces", overlapped=True)
    (logger_dir / "version_3").mkdir()
    assert find_traces(logger_dir) == sorted((logger_dir / "version_2" / "traces").glob("*.pt.trace.json"))
    trace_main([str(logger_dir), "-o", str(tmp_path / "t.png")])
    out = capsys.readouterr().out
    assert f"{logger_dir / 'version_2' / 'traces'}" in out
    # the overlap printed names its definition and the CommTimer's other one
    assert "overlap here is HTA's" in out and "comm/overlap" in out and "docs/comm_timer.md" in out


def test_a_missing_run_is_one_error_line(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as refused:
        trace_main([str(tmp_path / "logs" / "quickstart" / "version_0"), "-o", str(tmp_path / "t.png")])
    assert refused.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and "version_0 does not exist; pass a run's folder" in line


def test_kinetos_usdt_lines_are_dropped_and_the_rest_kept(capfd: pytest.CaptureFixture[str]) -> None:
    import os

    from lightning_ddp.callbacks.trace_recorder import without_kineto_usdt_lines

    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with without_kineto_usdt_lines():
        profiler.start()  # kineto prints "USDT: ... profiler_start" on fd 2 here, in C++
        os.write(2, b"an error kineto printed\n")
    torch.ones(3).sum()
    with without_kineto_usdt_lines():
        profiler.stop()
    assert capfd.readouterr().err == "an error kineto printed\n"
