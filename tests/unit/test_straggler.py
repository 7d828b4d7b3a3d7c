"""Straggler attribution, clock offsets and SlowRank on one process: hand-worked timelines with expected numbers."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import torch

from lightning_ddp.metrics.accounting import StepTiming, TimingSummary, step_metrics
from lightning_ddp.callbacks import SlowRank
from lightning_ddp.metrics.straggler import (ClockOffset, RoundTrip, StragglerExchange, attribute_wait, clock_note,
                                             estimate_offset, rank_vector)
from lightning_ddp.sync.record import Collective, SyncRecord

approx = pytest.approx


def _record(launches: list[float], last_ready: float, usable: float, origin_s: float = 50.0) -> SyncRecord:
    collectives = [Collective("all_reduce", f"bucket {i}", 1000, t, t + 3.0) for i, t in enumerate(launches)]
    return SyncRecord(collectives=collectives, started=0.0, ended=100.0, last_ready=last_ready, usable=usable,
                      origin_s=origin_s)


def _metrics(record: SyncRecord, vectors: list[list[float]], rank: int) -> dict[str, float]:
    stats = attribute_wait(vectors, rank)
    timing = StepTiming.from_record(record, stats.step_ms, tokens=0)
    return step_metrics(timing, world_size=len(vectors), straggler=stats)


# ---- waiting versus transfer ---------------------------------------------------------------------------


def test_a_rank_that_launches_20_ms_late_makes_the_other_wait_inside_its_exposed_interval():
    # Rank 0 launches its two buckets at 40 and 55 ms during backward, computes its last gradient at 58 and has the
    # gradients usable at 80: exposed [58, 80], 22 ms. Rank 1 (same host, same 0 ms) launches both 20 ms later, at
    # 60 and 75 ms, and is done at 78 (its buckets were in flight already: exposed [78, 80]).
    r0, r1 = _record([40.0, 55.0], 58.0, 80.0), _record([60.0, 75.0], 78.0, 80.0)
    vectors = [rank_vector(r0, 8), rank_vector(r1, 8)]
    m0, m1 = _metrics(r0, vectors, 0), _metrics(r1, vectors, 1)
    # Rank 0 waited [40, 60] and [55, 75]: union [40, 75], of which [58, 75] lies in its exposed interval: 17 ms
    # (the first 18 ms of waiting were hidden behind its own backward). The other 80 - 75 = 5 ms are transfer.
    assert m0["comm/exposed_ms"] == approx(22.0)
    assert m0["comm/wait_ms"] == approx(17.0) and m0["comm/transfer_ms"] == approx(5.0)
    # Rank 1 was last every time: it waited for nobody; all of its 2 ms exposed are transfer.
    assert m1["comm/wait_ms"] == 0.0 and m1["comm/transfer_ms"] == approx(2.0)
    for m in (m0, m1):  # both ranks agree on who straggled and by how much; compute 58 vs 78 ms
        assert (m["straggler/rank"], m["straggler/lag_ms"], m["step/rank_spread_ms"]) == (1.0, 20.0, 20.0)


def test_clock_offsets_put_launches_of_two_hosts_on_one_axis():
    # The same step as above, but rank 1's host clock reads 1000 s more than rank 0's at the same instant. Corrected
    # by its offset (+1e6 ms), the vectors are exactly those of the one-host case.
    r0, r1 = _record([40.0, 55.0], 58.0, 80.0), _record([60.0, 75.0], 78.0, 80.0, origin_s=1050.0)
    shifted = [rank_vector(r0, 8), rank_vector(r1, 8, clock_offset_ms=1e6)]
    assert shifted == [rank_vector(r0, 8), rank_vector(_record([60.0, 75.0], 78.0, 80.0), 8)]
    assert _metrics(r0, shifted, 0)["comm/wait_ms"] == approx(17.0)
    # Uncorrected, rank 1 looks 1e6 ms late: rank 0's wait would swallow its whole exposed interval.
    raw = [rank_vector(r0, 8), rank_vector(r1, 8)]
    assert _metrics(r0, raw, 0)["comm/wait_ms"] == approx(22.0)


def test_only_the_collectives_every_rank_holds_are_compared():
    # K = 2 slots. Rank 0 launched 3 collectives (keeps indices 1, 2), rank 1 only 2 (keeps 0, 1): only index 1 is
    # held by both. Its launches: rank 0 at 20, rank 1 at 27: rank 0 waited [20, 27].
    r0, r1 = _record([10.0, 20.0, 30.0], 31.0, 40.0), _record([12.0, 27.0], 28.0, 40.0)
    vectors = [rank_vector(r0, 2), rank_vector(r1, 2)]
    assert vectors[0][3:] == [3.0, 20.0, 30.0] and vectors[1][3:] == [2.0, 12.0, 27.0]
    stats = attribute_wait(vectors, 0)
    assert stats.wait == [(20.0, 27.0)] and stats.straggler_rank == 1


def test_the_straggler_is_the_rank_last_most_often_and_ties_go_to_the_lowest_rank():
    # 3 ranks, 3 collectives. Launch times (same origin):   c0  c1  c2
    #   rank 0                                               0   0  10
    #   rank 1                                               5   5   0
    #   rank 2                                               5   0   0
    # c0: ranks 1 and 2 tie at 5 -> rank 1 (lowest); c1: rank 1; c2: rank 0. Rank 1 was last twice.
    # Its lag behind the earliest launch: c0 5 - 0, c1 5 - 0, c2 0 - 0 -> median 5.
    def vector(launches: list[float], compute: float) -> list[float]:
        return [100.0, compute, 0.0, 3.0, *launches, math.nan]

    vectors = [vector([0, 0, 10], 50.0), vector([5, 5, 0], math.nan), vector([5, 0, 0], 42.0)]
    stats = attribute_wait(vectors, 2)
    assert stats.straggler_rank == 1 and stats.lag_ms == 5.0
    assert stats.rank_spread_ms == 8.0  # 50 - 42: the rank without a compute mark is left out
    assert stats.wait == [(5.0, 5.0), (0.0, 5.0), (0.0, 10.0)]  # rank 2's own launch to the latest


def test_without_collectives_there_is_no_straggler_and_no_wait():
    record = _record([], 58.0, 80.0)
    vectors = [rank_vector(record, 4), rank_vector(record, 4)]
    metrics = _metrics(record, vectors, 0)
    assert metrics["comm/wait_ms"] == 0.0 and metrics["comm/transfer_ms"] == approx(22.0)
    assert "straggler/rank" not in metrics and "straggler/lag_ms" not in metrics
    assert metrics["step/rank_spread_ms"] == 0.0


def test_the_step_time_is_the_slowest_ranks():
    fast, slow = _record([40.0], 58.0, 80.0), _record([40.0], 58.0, 80.0)
    slow.ended = 130.0
    assert attribute_wait([rank_vector(fast, 1), rank_vector(slow, 1)], 0).step_ms == 130.0


def test_vectors_of_different_lengths_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="same CommTimer\\(straggler_collectives"):
        attribute_wait([[1.0] * 6, [1.0] * 7], 0)
    with pytest.raises(ValueError, match="straggler_collectives"):
        rank_vector(_record([1.0], 2.0, 3.0), 0)


def test_the_summary_table_shows_the_split_only_when_there_is_one():
    r0, r1 = _record([40.0, 55.0], 58.0, 80.0), _record([60.0, 75.0], 78.0, 80.0)
    vectors = [rank_vector(r0, 8), rank_vector(r1, 8)]
    with_split, without = TimingSummary(), TimingSummary()
    for step in range(3):
        with_split.add(step, _metrics(r0, vectors, 0))
        without.add(step, step_metrics(StepTiming.from_record(r0, 100.0, 0), world_size=2))
    header = with_split.format_table(0).splitlines()[1]
    assert "wait ms" in header and "transfer ms" in header
    assert with_split.summarize(0)["comm/wait_ms"]["median"] == approx(17.0)
    assert "wait ms" not in without.format_table(0)


def test_the_clock_note_speaks_only_when_offsets_blur_the_lags():
    assert clock_note(0.0, 0.01) is None  # one host: one clock
    assert clock_note(0.05, 20.0) is None  # +-0.05 ms cannot blur a 20 ms lag
    assert "+-0.5 ms" in clock_note(0.5, 0.2)
    assert "not estimated" in clock_note(None, 20.0)


# ---- clock offsets -----------------------------------------------------------------------------------------


def _trip(start: float, theta: float, out: float, back: float, turnaround: float = 0.05) -> RoundTrip:
    """A ping-pong with true offset ``theta`` (the other clock minus rank 0's) and one-way delays ``out``/``back``."""
    t1 = start + out + theta
    t2 = t1 + turnaround
    return RoundTrip(t0=start, t1=t1, t2=t2, t3=t2 - theta + back)


@pytest.mark.parametrize("theta", [0.0, 1234.5, -3.6e6])
def test_the_estimate_keeps_the_shortest_round_trip_and_bounds_the_true_offset(theta: float):
    # Symmetric delays give theta exactly; an asymmetric one is off by (out - back) / 2, within the bound.
    trips = [_trip(0.0, theta, out=2.0, back=0.1), _trip(10.0, theta, out=0.3, back=0.1), _trip(20.0, theta, 1.0, 1.0)]
    estimate = estimate_offset(trips)
    # kept: the second, round trip 0.4 ms: offset theta + (0.3 - 0.1) / 2 = theta + 0.1, uncertainty 0.2
    assert estimate.offset_ms == approx(theta + 0.1, abs=1e-6) and estimate.uncertainty_ms == approx(0.2)
    assert abs(estimate.offset_ms - theta) <= estimate.uncertainty_ms + 1e-9
    assert estimate.samples == 3
    assert estimate_offset([_trip(0.0, theta, 0.5, 0.5)]).offset_ms == approx(theta, abs=1e-6)


def test_an_estimate_needs_a_round_trip():
    with pytest.raises(ValueError, match="clock_sync_rounds"):
        estimate_offset([])


def test_one_process_needs_no_offset_and_compares_with_itself():
    exchange = StragglerExchange(max_collectives=4, clock_sync="always")
    exchange.start("cpu")  # no process group: one rank, one clock
    assert exchange.offsets == [ClockOffset(0.0, 0.0, 0)]
    stats = exchange.exchange(_record([40.0, 55.0], 58.0, 80.0), step=3)
    assert stats.straggler_rank == 0 and stats.lag_ms == 0.0 and stats.wait == [(40.0, 40.0), (55.0, 55.0)]
    assert exchange.describe()["estimated_at_steps"] == [3]  # the train-start estimate, counted as step 3's


def test_offsets_are_re_estimated_every_n_measured_steps_on_every_rank_alike():
    # Decided from the step number alone, which every rank shares: at train start (counted as the first measured
    # step, 1), then once 3 steps have passed since the last estimate: 4 and 7. Steps 5 and 6 were not measured
    # (a sampled timer): the count is by step number, not by exchanges.
    exchange = StragglerExchange(max_collectives=4, clock_sync="always", clock_sync_every_n_steps=3)
    exchange.start("cpu")
    for step in (1, 2, 3, 4, 7, 8):
        exchange.exchange(_record([40.0], 58.0, 80.0), step=step)
    assert exchange.estimated_at == [1, 4, 7]
    never = StragglerExchange(max_collectives=4, clock_sync="auto")  # one host: nothing to estimate
    never.start("cpu")
    never.exchange(_record([40.0], 58.0, 80.0), step=1)
    assert never.estimated_at == [] and never.describe()["max_uncertainty_ms"] == 0.0


def test_small_messages_travel_on_the_cpu_unless_the_group_has_no_cpu_backend(monkeypatch: pytest.MonkeyPatch):
    from lightning_ddp.metrics import straggler

    monkeypatch.setattr("torch.distributed.get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    assert straggler._message_device(torch.device("cuda", 0)) == torch.device("cpu")
    monkeypatch.setattr("torch.distributed.get_backend_config", lambda group=None: "cuda:nccl")
    assert straggler._message_device(torch.device("cuda", 0)) == torch.device("cuda", 0)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"clock_sync": "sometimes"}, "auto, always, off"),
    ({"clock_sync_every_n_steps": 0}, "clock_sync_every_n_steps 1000"),
    ({"clock_sync_rounds": 0}, "clock_sync_rounds 8"),
    ({"max_collectives": 0}, "straggler_collectives"),
])
def test_bad_exchange_settings_name_the_fix(kwargs: dict, match: str):
    with pytest.raises(ValueError, match=match):
        StragglerExchange(**{"max_collectives": 4, **kwargs})


# ---- SlowRank --------------------------------------------------------------------------------------------------


def _trainer(rank: int, step: int, accumulating: bool = False) -> SimpleNamespace:
    return SimpleNamespace(global_rank=rank, global_step=step, world_size=2,
                           strategy=SimpleNamespace(root_device=SimpleNamespace(type="cpu")),
                           fit_loop=SimpleNamespace(_should_accumulate=lambda: accumulating))


def test_slow_rank_sleeps_on_its_rank_every_n_steps_before_the_last_backward():
    callback = SlowRank(rank=1, delay_ms=30, every_n_steps=2)
    start = time.perf_counter()
    for step in range(4):
        callback.on_before_backward(_trainer(0, step), None, None)  # another rank: never
        callback.on_before_backward(_trainer(1, step, accumulating=True), None, None)  # not the last micro-batch
        callback.on_before_backward(_trainer(1, step), None, None)
    assert callback.delayed_steps == [0, 2]  # steps 0 and 2 are multiples of 2
    assert time.perf_counter() - start >= 0.060  # two sleeps of 30 ms


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"rank": -1}, "callbacks.rank 1"), ({"delay_ms": -5}, "delay_ms 20"), ({"every_n_steps": 0}, "every_n_steps 1"),
])
def test_slow_rank_refuses_bad_settings_with_the_fix(kwargs: dict, match: str):
    with pytest.raises(ValueError, match=match):
        SlowRank(**kwargs)


def test_slow_rank_refuses_a_rank_the_run_does_not_have():
    with pytest.raises(ValueError, match="below 2"):
        SlowRank(rank=2).setup(_trainer(0, 0), None, "fit")
