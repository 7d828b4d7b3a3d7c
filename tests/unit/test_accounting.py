"""Tests for lightning_ddp.metrics.accounting: hand-made timelines with the expected numbers worked out."""

from __future__ import annotations

import csv
import doctest
import inspect
import json
import math
from pathlib import Path

import pytest

from lightning_ddp.metrics import accounting
from lightning_ddp.metrics.accounting import METRIC_KEYS, StepTiming, TimingSummary, step_metrics
from lightning_ddp.metrics.straggler import attribute_wait
from lightning_ddp.intervals import intersect, total
from lightning_ddp.sync.record import Collective, Recorder, SyncRecord

approx = pytest.approx


def _c(launched: float, completed: float, nbytes: int = 0) -> Collective:
    return Collective("all_reduce", "test", nbytes, launched, completed)


def test_doctests():
    assert doctest.testmod(accounting).failed == 0


# ---- intervals ---------------------------------------------------------------------------------------


def test_total_counts_overlap_once():
    # [0, 4] ∪ [2, 6] = [0, 6] (6); [6, 7] touches it (7 in all); [10, 10.5] apart: 7.5. Order must not matter.
    assert total([(10.0, 10.5), (2.0, 6.0), (0.0, 4.0), (6.0, 7.0)]) == approx(7.5)
    # A nested interval adds nothing.
    assert total([(0.0, 10.0), (3.0, 4.0)]) == approx(10.0)


def test_the_overlap_intersects_the_two_unions():
    # a = [0, 5] ∪ [8, 12] (a's own overlap is merged first); b = [4, 9] ∪ [11, 20]
    # intersection: [4, 5] (1) + [8, 9] (1) + [11, 12] (1) = 3
    a = [(0.0, 5.0), (1.0, 3.0), (8.0, 12.0)]
    b = [(4.0, 9.0), (11.0, 20.0)]
    assert total(intersect(a, b)) == approx(3.0)
    assert total(intersect(b, a)) == approx(3.0)
    assert total(intersect(a, [])) == 0.0


def test_backwards_interval_is_clamped_and_counted_not_an_error():
    # Measuring never ends a run: end = start, one anomaly each (tests/unit/test_cuda_accounting.py: metrics, warning)
    timing = StepTiming(step_ms=10.0, exposed=[(2.0, 1.0)], collectives=[_c(5.0, 4.0)])
    assert timing.exposed == [(2.0, 2.0)]
    assert (timing.collectives[0].launched, timing.collectives[0].completed) == (5.0, 5.0)
    assert len(timing.anomalies) == 2


# ---- step metrics ------------------------------------------------------------------------------------


def _naive_like() -> StepTiming:
    # 100 ms step; finish_gradient_synchronization runs from 80 to 95 ms and does nothing but three blocking
    # all-reduces back to back: [80, 85] 1.5 MB, [85, 90] 1.0 MB, [90, 95] 0.5 MB.
    return StepTiming(
        step_ms=100.0,
        exposed=[(80.0, 95.0)],
        collectives=[_c(80.0, 85.0, 1_500_000), _c(85.0, 90.0, 1_000_000), _c(90.0, 95.0, 500_000)],
        tokens=512,
    )


def test_step_metrics_keys_match_the_documented_table():
    # Every input given, the straggler split too (two ranks that launched the step's 3 collectives together).
    vector = [100.0, 80.0, 0.0, 3.0, 80.0, 85.0, 90.0]
    metrics = step_metrics(_naive_like(), world_size=2, flops_per_step=1.0, peak_flops=1.0, peak_memory_mib=1.0,
                           peak_reserved_mib=2.0, straggler=attribute_wait([vector, vector], rank=0))
    assert tuple(metrics) == METRIC_KEYS
    page = (Path(__file__).parents[2] / "docs" / "comm_timer.md").read_text()
    source = inspect.getsource(step_metrics)
    for key in METRIC_KEYS:  # each key computed by name in step_metrics, and one row per key in the docs page
        assert f'metrics["{key}"] = ' in source or f'"{key}": ' in source, key
        assert f"| `{key}` |" in page, key
    assert all(isinstance(value, float) for value in metrics.values())


def test_naive_like_step_exposed_equals_busy_and_overlap_is_zero():
    m = step_metrics(_naive_like(), world_size=2)
    # Everything the collectives did was waited for: exposed = busy = 95 - 80 = 15 ms.
    assert m["step/time_ms"] == approx(100.0)
    assert m["comm/exposed_ms"] == approx(15.0)
    assert m["comm/busy_ms"] == approx(15.0)
    assert m["comm/overlap"] == 0.0  # all 15 ms of busy lie inside the exposed [80, 95]
    assert m["comm/share"] == approx(0.15)  # 15 / 100
    assert m["comm/pack_ms"] == 0.0
    assert m["comm/calls"] == 3.0
    assert m["comm/bytes"] == 3_000_000.0


@pytest.mark.parametrize(
    ("world_size", "busbw"),
    [
        (1, 0.0),  # 2 (1 - 1) / 1 = 0: nothing crosses a link
        (2, 0.2),  # 0.2 * 2 * 1 / 2 = 0.2
        (4, 0.3),  # 0.2 * 2 * 3 / 4 = 0.3
    ],
)
def test_algbw_and_busbw_of_all_reduces(world_size, busbw):
    m = step_metrics(_naive_like(), world_size=world_size)
    # 3,000,000 bytes over 15 ms busy: 3e6 / 0.015 s = 2e8 B/s = 0.2 GB/s, whatever the world size.
    assert m["comm/algbw_GBps"] == approx(0.2)
    assert m["comm/busbw_GBps"] == approx(busbw)


def test_bus_bandwidth_uses_each_collectives_own_factor():
    # ZeRO-1 on 4 ranks: a reduce-scatter of a 4 MB buffer [0, 10], an all-gather into a 4 MB buffer [10, 20],
    # then 2 broadcasts of 1 MB [20, 25], [25, 30]. nccl-tests: rs and ag move (n-1)/n = 3/4 of the buffer per
    # rank, a broadcast 1x: bus bytes = 0.75 * 4e6 * 2 + 1e6 * 2 = 8e6 over 30 ms busy = 0.2667 GB/s. With the
    # all-reduce factor 2(n-1)/n = 1.5 for all, it would have been 1.5 * 10e6 / 0.03 s = 0.5 GB/s.
    timing = StepTiming(step_ms=40.0, exposed=[(0.0, 30.0)], collectives=[
        Collective("reduce_scatter", "g", 4_000_000, 0.0, 10.0), Collective("all_gather", "p", 4_000_000, 10.0, 20.0),
        Collective("broadcast", "a", 1_000_000, 20.0, 25.0), Collective("broadcast", "b", 1_000_000, 25.0, 30.0)])
    m = step_metrics(timing, world_size=4)
    assert m["comm/busbw_GBps"] == approx(8e6 / 0.030 / 1e9)
    assert m["comm/algbw_GBps"] == approx(10e6 / 0.030 / 1e9)
    # every op the recording group records has a factor (a barrier moves nothing); an unknown op is refused
    assert accounting.bus_factor("barrier", 4) == 0.0 and accounting.bus_factor("all_to_all", 4) == 0.75
    with pytest.raises(ValueError, match="bus-bandwidth factor"):
        accounting.bus_factor("gather", 4)


def test_bucketed_like_step_overlaps_communication_with_backward():
    # Backward runs 20..80 ms and launches three buckets, each packed and pre-scaled just before its launch (2 ms
    # *outside* finish): b0 [30, 45], b1 [50, 65], b2 [70, 84] (still in flight when backward ends).
    # finish runs 80..86: waits for b2 until 84, the flags all-reduce [84, 85], then unpacks [85, 86].
    timing = StepTiming(
        step_ms=100.0,
        exposed=[(80.0, 86.0)],
        pack=[(28.0, 30.0), (48.0, 50.0), (68.0, 70.0), (85.0, 86.0)],
        collectives=[_c(30.0, 45.0, 100), _c(50.0, 65.0, 100), _c(70.0, 84.0, 100), _c(84.0, 85.0, 4)],
        tokens=1000,
    )
    m = step_metrics(timing, world_size=2)
    # exposed = all 6 ms of finish (its 1 ms unpack included: the critical path paid for it)
    assert m["comm/exposed_ms"] == approx(6.0)
    # pack = 2 + 2 + 2 + 1 = 7 ms, wherever it ran
    assert m["comm/pack_ms"] == approx(7.0)
    # busy = [30, 45] + [50, 65] + [70, 84] + [84, 85] = 15 + 15 + 14 + 1 = 45 ms
    assert m["comm/busy_ms"] == approx(45.0)
    # of which inside exposed [80, 86]: [80, 84] + [84, 85] = 5 ms; hidden = 40 of 45
    assert m["comm/overlap"] == approx(40 / 45)
    assert m["comm/share"] == approx(0.06)  # 6 / 100
    assert m["comm/calls"] == 4.0


def test_flat_like_step_counts_its_copies_as_exposed_and_reports_them():
    # finish runs 70..90: flags all-reduce [70, 71], pack + pre-scale [71, 74], flat all-reduce [74, 86],
    # unpack [86, 90]. The copies are on the critical path, so they are exposed: the study timed the same.
    timing = StepTiming(
        step_ms=200.0,
        exposed=[(70.0, 90.0)],
        pack=[(71.0, 74.0), (86.0, 90.0)],
        collectives=[_c(70.0, 71.0, 4), _c(74.0, 86.0, 1_000)],
    )
    m = step_metrics(timing, world_size=2)
    assert m["comm/pack_ms"] == approx(7.0)  # 3 + 4
    assert m["comm/exposed_ms"] == approx(20.0)
    assert m["comm/busy_ms"] == approx(13.0)  # 1 + 12
    assert m["comm/overlap"] == 0.0  # blocking: every busy moment lies inside exposed
    assert m["comm/share"] == approx(20.0 / 200.0)


def test_collectives_that_back_up_are_counted_from_when_the_previous_one_ends():
    # Three collectives issued at 10, 11 and 12 ms on one group; they complete at 20, 30 and 40 ms. The group
    # runs them one after another, so they are in flight [10, 20], [20, 30], [30, 40]: busy 30 ms. The union of
    # [launched, completed] would say the same here, but their sum (10 + 19 + 28 = 57) would not; and a
    # collective completing before its predecessor adds nothing beyond it.
    timing = StepTiming(step_ms=50.0, exposed=[(35.0, 40.0)],
                        collectives=[_c(10.0, 20.0, 1), _c(11.0, 30.0, 1), _c(12.0, 40.0, 1), _c(13.0, 39.0, 1)])
    assert accounting.busy_intervals(timing.collectives) == [(10.0, 20.0), (20.0, 30.0), (30.0, 40.0), (40.0, 40.0)]
    m = step_metrics(timing, world_size=2)
    assert m["comm/busy_ms"] == approx(30.0)
    # 25 of the 30 ms in flight ran before the exposed [35, 40]
    assert m["comm/overlap"] == approx(25 / 30)


def test_a_late_launch_starts_at_its_launch_not_at_the_previous_end():
    # [10, 20] then a collective launched at 50 (the stream idle since 20): in flight [50, 55], not [20, 55].
    timing = StepTiming(step_ms=60.0, collectives=[_c(10.0, 20.0), _c(50.0, 55.0)])
    assert step_metrics(timing, world_size=2)["comm/busy_ms"] == approx(15.0)


def test_no_collectives_means_zero_busy_overlap_and_bandwidth():
    m = step_metrics(StepTiming(step_ms=10.0, tokens=10), world_size=2)
    assert m["comm/busy_ms"] == 0.0
    assert m["comm/overlap"] == 0.0
    assert m["comm/algbw_GBps"] == 0.0
    assert m["comm/busbw_GBps"] == 0.0
    assert m["comm/calls"] == 0.0


def test_tokens_per_s_is_global_throughput():
    # 2048 tokens per rank, 4 ranks, 250 ms per step: 8192 tokens / 0.25 s = 32768 tokens/s
    m = step_metrics(StepTiming(step_ms=250.0, tokens=2048), world_size=4)
    assert m["step/tokens_per_s"] == approx(32768.0)


def test_mfu_only_with_flops_per_step_and_peak_flops():
    timing = StepTiming(step_ms=250.0, tokens=2048)
    assert "step/mfu" not in step_metrics(timing, world_size=4)
    assert "step/mfu" not in step_metrics(timing, world_size=4, flops_per_step=2048 * 6e9)
    assert "step/mfu" not in step_metrics(timing, world_size=4, peak_flops=1e15)
    # peak_flops is the whole job's: 4 GPUs of 1e15 each
    m = step_metrics(timing, world_size=4, flops_per_step=2048 * 6e9, peak_flops=4e15)
    # 2048 tokens * 6e9 flops/token per rank, 4 ranks, in 0.25 s = 1.96608e14 flop/s, over 4e15 = 4.9152 %
    assert m["step/mfu"] == approx(0.049152)
    # FLOPs without tokens (a module with flops_per_batch but no token count): MFU, no tokens_per_s
    m = step_metrics(StepTiming(step_ms=250.0), world_size=4, flops_per_step=2048 * 6e9, peak_flops=4e15)
    assert m["step/mfu"] == approx(0.049152) and "step/tokens_per_s" not in m


def test_tokens_per_s_only_when_the_tokens_were_counted():
    # A module that does not say how to count tokens (an MLP classifier): the key is absent, not 0.
    assert "step/tokens_per_s" not in step_metrics(StepTiming(step_ms=250.0), world_size=4)
    assert step_metrics(StepTiming(step_ms=250.0, tokens=0), world_size=4)["step/tokens_per_s"] == 0.0


def test_a_run_without_communication_has_no_comm_keys():
    full = step_metrics(_naive_like(), world_size=2)
    unseen = step_metrics(_naive_like(), world_size=2, comm=None)  # one device: nothing communicated
    assert full["comm/exposed_ms"] == 15.0 and full["comm/calls"] == 3.0
    assert not any(k.startswith("comm/") for k in unseen)
    # what is not about communication stays: step time and tokens (512 * 2 ranks / 0.1 s)
    assert unseen["step/time_ms"] == 100.0 and unseen["step/tokens_per_s"] == approx(10240.0)
    with pytest.raises(ValueError, match="comm must be"):
        step_metrics(_naive_like(), world_size=2, comm="landmarks")  # a level of the past: every collective is seen


def test_peak_memory_only_when_given():
    timing = StepTiming(step_ms=1.0)
    assert "memory/peak_MiB" not in step_metrics(timing, world_size=1)
    assert "memory/peak_reserved_MiB" not in step_metrics(timing, world_size=1, peak_memory_mib=1.0)
    m = step_metrics(timing, world_size=1, peak_memory_mib=123.5, peak_reserved_mib=256.0)
    assert m["memory/peak_MiB"] == 123.5 and m["memory/peak_reserved_MiB"] == 256.0


def test_input_errors_say_what_is_wrong():
    # A step time of 0 is a measurement (clamped and counted, see test_cuda_accounting.py); these are not.
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        StepTiming(step_ms=1.0, tokens=-1)
    with pytest.raises(ValueError, match="world_size"):
        step_metrics(StepTiming(step_ms=1.0), world_size=0)
    with pytest.raises(ValueError, match="peak_flops"):
        step_metrics(StepTiming(step_ms=1.0), world_size=1, flops_per_step=1.0, peak_flops=0.0)


# ---- from a record ------------------------------------------------------------------------------------


def test_a_wait_outside_the_engines_spans_is_exposed_too():
    # FSDP2's forward all-gather: nobody's span, but forward waited 4 ms for it; its wait is exposed time.
    record = SyncRecord(collectives=[Collective("all_gather", "all_gather", 64, launched=10.0, completed=16.0,
                                                wait=(12.0, 16.0))], started=0.0, ended=50.0)
    m = step_metrics(StepTiming.from_record(record, step_ms=50.0, tokens=None), world_size=2)
    assert m["comm/exposed_ms"] == approx(4.0) and m["comm/busy_ms"] == approx(6.0)
    assert m["comm/overlap"] == approx(2.0 / 6.0)  # [10, 12] was hidden behind forward's compute


def test_a_record_converts_to_ms_and_fills_in_missing_completions():
    # Host-clock marks in seconds with the anchor at 1000 s, as on CPU.
    record = SyncRecord(
        collectives=[
            # completed via the gloo future: 1000.010 s -> 10 ms, 1000.015 s -> 15 ms
            Collective("all_reduce", "bucket 0", 400, launched=1000.010, completed=1000.015),
            # no completion mark: the end of its wait (30 ms) stands in for it
            Collective("all_reduce", "bucket 1", 800, launched=1000.020, wait=(1000.025, 1000.030)),
            # neither completed nor waited for: completed at launch (40 ms)
            Collective("broadcast", "lonely", 8, launched=1000.040),
        ],
        exposed=[(1000.025, 1000.035)],
        pack=[(1000.031, 1000.033)],
        started=1000.0,
        ended=1000.070,
    )
    finished = record.converted(lambda mark: (mark - 1000.0) * 1e3, origin_s=1000.0)
    assert finished.step_ms == approx(70.0) and finished.origin_s == 1000.0
    assert [c.label for c in finished.collectives] == ["bucket 0", "bucket 1", "lonely"]
    assert [c.launched for c in finished.collectives] == approx([10.0, 20.0, 40.0])
    assert [c.completed for c in finished.collectives] == approx([15.0, 30.0, 40.0])
    assert finished.collectives[1].wait == (approx(25.0), approx(30.0))
    # Back on the host clock (what the trace recorder uses): the same instants in seconds.
    assert [c.launched for c in finished.in_host_seconds().collectives] == approx([1000.010, 1000.020, 1000.040])

    timing = StepTiming.from_record(finished, step_ms=70.0, tokens=64)
    assert timing.step_ms == 70.0 and timing.tokens == 64
    # the engine's span, then every recorded wait (whoever waited): bucket 1's, inside the span here
    assert timing.exposed == [(approx(25.0), approx(35.0)), (approx(25.0), approx(30.0))]
    assert timing.pack == [(approx(31.0), approx(33.0))]
    m = step_metrics(timing, world_size=2)
    # busy = [10, 15] + [20, 30] + [40, 40] = 5 + 10 + 0 = 15 ms
    assert m["comm/busy_ms"] == approx(15.0)
    # exposed = union([25, 35], [25, 30]) = [25, 35], its 2 ms of pack included
    assert m["comm/exposed_ms"] == approx(10.0)
    assert m["comm/bytes"] == 1208.0


def test_the_cpu_recorder_finishes_a_step_in_ms_since_its_start():
    recorder = Recorder()
    recorder.open_step(7)
    recorder.open_step(7)  # idempotent for the open step: a second observer opening it changes nothing
    started = recorder.record.started
    collective = Collective("all_reduce", "flat", 4, recorder.mark())
    recorder.record.collectives.append(collective)
    collective.completed = recorder.mark()
    recorder.span("exposed", recorder.mark())
    finished = recorder.finish_step()
    assert recorder.record.started is started
    assert recorder.finish_step() is finished  # idempotent once finished
    assert finished.started == approx(0.0, abs=1.0)  # the anchor is taken when the step opens
    (c,) = finished.collectives
    assert 0.0 <= finished.started <= c.launched <= c.completed <= finished.ended
    assert finished.exposed[0][0] <= finished.exposed[0][1] <= finished.ended
    with pytest.raises(RuntimeError, match="open_step"):
        Recorder().finish_step()


# ---- summary -----------------------------------------------------------------------------------------


def _summary_with_times(times: list[float]) -> TimingSummary:
    summary = TimingSummary()
    for step, ms in enumerate(times):
        summary.add(step, step_metrics(StepTiming(step_ms=ms, tokens=100), world_size=2))
    return summary


def test_summary_drops_warmup_and_gives_median_p10_p90():
    # Two slow warm-up steps, then 8 steps of 10..80 ms in shuffled order.
    summary = _summary_with_times([1000.0, 900.0, 40.0, 10.0, 80.0, 30.0, 70.0, 20.0, 60.0, 50.0])
    stats = summary.summarize(warmup_steps=2)["step/time_ms"]
    # sorted: 10 20 30 40 50 60 70 80 (8 values, ranks 0..7), linear interpolation between closest ranks:
    # median: rank 3.5 -> (40 + 50) / 2 = 45; p10: rank 0.7 -> 10 + 0.7 * 10 = 17; p90: rank 6.3 -> 73
    assert stats == {"median": approx(45.0), "p10": approx(17.0), "p90": approx(73.0), "n": 8.0}
    # Without warm-up the slow steps dominate the top: sorted 10..80, 900, 1000; p90 is rank 0.9 * 9 = 8.1,
    # between 900 (rank 8) and 1000 (rank 9): 900 + 0.1 * 100 = 910
    assert summary.summarize(warmup_steps=0)["step/time_ms"]["p90"] == approx(910.0)


def test_summary_counts_optimizer_steps_not_micro_batches():
    # 3 optimizer steps of 4 micro-batches each (accumulate_grad_batches=4). The callback adds once per
    # optimizer step, after the last micro-batch, with all 4 micro-batches' tokens in one StepTiming.
    accumulate, micro_tokens = 4, 256
    summary = TimingSummary()
    tokens = 0
    for batch_idx in range(12):
        tokens += micro_tokens
        if (batch_idx + 1) % accumulate == 0:  # gradient accumulation is over: one optimizer step
            step = batch_idx // accumulate
            summary.add(step, step_metrics(StepTiming(step_ms=100.0, tokens=tokens), world_size=2))
            tokens = 0
    assert len(summary) == 3
    stats = summary.summarize(warmup_steps=0)
    assert stats["step/time_ms"]["n"] == 3.0
    # 4 * 256 = 1024 tokens per rank per step, 2 ranks, 0.1 s: 20480 tokens/s
    assert stats["step/tokens_per_s"]["median"] == approx(20480.0)


def test_adding_the_same_step_twice_is_an_error_that_mentions_micro_batches():
    summary = TimingSummary()
    summary.add(0, {"step/time_ms": 1.0})
    with pytest.raises(ValueError, match="once per optimizer step.*not once per micro-batch"):
        summary.add(0, {"step/time_ms": 1.0})


def test_warmup_that_swallows_every_step_says_the_fix():
    summary = _summary_with_times([10.0, 11.0, 12.0])
    with pytest.raises(ValueError) as excinfo:
        summary.summarize(warmup_steps=3)
    assert str(excinfo.value) == "ran 3 steps but warmup_steps=3; lower --timer.warmup_steps or run more steps"


def test_keys_missing_from_some_steps_are_summarised_over_the_steps_that_have_them():
    summary = TimingSummary()
    summary.add(0, {"step/time_ms": 1.0, "memory/peak_MiB": 7.0})
    summary.add(1, {"step/time_ms": 3.0})
    stats = summary.summarize(warmup_steps=0)
    assert stats["step/time_ms"]["median"] == approx(2.0) and stats["step/time_ms"]["n"] == 2.0
    assert stats["memory/peak_MiB"] == {"median": 7.0, "p10": 7.0, "p90": 7.0, "n": 1.0}


def test_write_json_is_atomic_and_valid(tmp_path):
    summary = _summary_with_times([100.0, 20.0, 30.0])
    path = tmp_path / "out" / "timing.json"  # the directory is created
    summary.write_json(path, warmup_steps=1, extra={"hardware": "2 CPU cores", "strategy": "bucketed"})
    document = json.loads(path.read_text())
    assert document["hardware"] == "2 CPU cores"
    assert document["warmup_steps"] == 1
    assert document["summary"]["step/time_ms"]["median"] == approx(25.0)  # (20 + 30) / 2
    assert [row["step"] for row in document["steps"]] == [0, 1, 2]  # every step, warm-up included
    assert sorted(p.name for p in path.parent.iterdir()) == ["timing.json"]  # no .tmp left behind


def test_failed_write_leaves_the_old_file_and_no_tmp(tmp_path):
    path = tmp_path / "timing.json"
    _summary_with_times([10.0]).write_json(path, warmup_steps=0)
    before = path.read_text()
    broken = TimingSummary()
    broken.add(0, {"step/time_ms": math.nan})  # NaN is not valid JSON
    with pytest.raises(ValueError):
        broken.write_json(path, warmup_steps=0)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timing.json"]


def test_write_csv_is_atomic_and_valid(tmp_path):
    summary = TimingSummary()
    summary.add(0, {"step/time_ms": 10.0, "memory/peak_MiB": 5.0})
    summary.add(1, {"step/time_ms": 12.5})
    path = tmp_path / "timing.csv"
    path.write_text("old contents\n")  # overwritten in one rename
    summary.write_csv(path)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows == [
        {"step": "0", "step/time_ms": "10.0", "memory/peak_MiB": "5.0"},
        {"step": "1", "step/time_ms": "12.5", "memory/peak_MiB": ""},  # not reported that step: empty cell
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timing.csv"]


def test_format_table_is_aligned_and_shows_the_headline_metrics():
    summary = TimingSummary()
    for step in range(4):
        timing = StepTiming(
            step_ms=100.0, exposed=[(80.0, 86.0)], collectives=[_c(30.0, 84.0, 1_000_000)], tokens=512
        )
        summary.add(step, step_metrics(timing, world_size=2))
    table = summary.format_table(warmup_steps=1, title="bucketed")
    lines = table.splitlines()
    assert lines[0] == "bucketed: 3 steps after 1 warm-up"
    header, *rows = lines[1:]
    for name in ("step ms", "exposed comm ms", "comm share %", "overlap %", "busbw GB/s", "tokens/s"):
        assert name in header
    assert [row.split()[0] for row in rows] == ["median", "p10", "p90"]
    assert len({len(line) for line in lines[1:]}) == 1  # every row as wide as the header
    # share 6 %; busy [30, 84] is 54 ms, of which [80, 84] inside exposed: overlap 50/54 = 92.6 %;
    # tokens/s = 1024 / 0.1 = 10,240
    assert rows[0].split()[1:] == ["100.0", "6.00", "6.0", "92.6", "0.019", "10,240"]
