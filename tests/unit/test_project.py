"""The projection (lightning_ddp.projection): cost formulas, hand-worked timelines of every strategy, monotonicity, the
profile file, config validation, the CLI end to end, the seed comparison, and agreement with the real engines' rules.

One process, no GPU; the timelines use a linear cost model (1 ms per collective + 1 ms per MiB) and a hand-made
3-parameter profile so that every expected number can be worked out on paper.
"""

from __future__ import annotations

import ast
import dataclasses
import csv
import json
import math
import random
from pathlib import Path

import pytest

from lightning_ddp import catalogue
from lightning_ddp.profile import ComputeProfile, ParamTiming, read_profile, write_profile
from lightning_ddp.projection.comm import FABRICS, Fabric, Link, MeasuredFit, read_fit
from lightning_ddp.projection.flops import ModelShape, modelled_profile
from lightning_ddp.projection.simulators import StepModel, simulate, simulated_names
from lightning_ddp.projection.__main__ import main, parse_config
from lightning_ddp.projection.simulators import assign_buckets, assign_owners, ddp_buckets
from lightning_ddp.projection.config import ComputeConfig, NetworkConfig, ProjectionConfig, StudyConfig
from lightning_ddp.projection.run import COLUMNS, project, result_row
from lightning_ddp.projection.simulators import best_by_world_size
from lightning_ddp.sync.memory_model import MiB

REPO = Path(__file__).resolve().parents[2]
FLAGS_MS = 1 + 12 / MiB  # the presence-flags all-reduce: 3 int32 flags = 12 bytes -> 1 ms + 12 B at 1 ms/MiB


class LinearComm:
    """Every collective costs 1 ms + 1 ms per MiB, whatever the kind and the world size."""

    def collective_s(self, kind: str, nbytes: float, n: int) -> float:
        return (1 + nbytes / MiB) * 1e-3


def three_params(ready=(30.0, 20.0, 10.0)) -> ComputeProfile:
    """parameters() order a (1 MiB), b (2 MiB), c (3 MiB) of fp32 matrices 512 x 512, 512 x 1024, 768 x 1024;
    backward makes c, then b, then a (at its end).

    forward 10 ms, backward 30 ms, optimizer 5 ms: the compute-only step is 45 ms.
    """
    sizes, shapes = (1, 2, 3), ((512, 512), (512, 1024), (768, 1024))
    params = [ParamTiming(name, s * MiB // 4, s * MiB, r, shape) for name, s, r, shape in zip("abc", sizes, ready, shapes)]
    return ComputeProfile(10.0, 30.0, 5.0, tuple(params), source="hand-made", world_size=2)


def model(profile: ComputeProfile | None = None, n: int = 2) -> StepModel:
    # copies move 6 MiB per ms (read + write), so copying 3 MiB (3 read + 3 written) takes 1 ms
    return StepModel(profile or three_params(), LinearComm(), n, copy_bandwidth_Bps=6 * MiB * 1e3)


# ---- cost formulas ----------------------------------------------------------------------------------------------


def test_cost_formulas_at_two_and_eight_ranks():
    S, B, a = 1e9, 1e10, 1e-5  # 1 GB at 10 GB/s: S / B = 0.1 s; alpha = 10 us; no per-call cost
    ring = Fabric("one level", Link("link", B, a), call_overhead_s=0.0, algorithm="ring")
    tree = dataclasses.replace(ring, algorithm="tree")
    # ring all-reduce: 2(n-1) alpha + 2(n-1)/n S/B
    assert ring.collective_s("all_reduce", S, 2) == pytest.approx(2 * a + 1.0 * 0.1)  # 0.10002
    assert ring.collective_s("all_reduce", S, 8) == pytest.approx(14 * a + 1.75 * 0.1)  # 0.17514
    # tree: 2 ceil(log2 n) alpha + 2 S/B
    assert tree.collective_s("all_reduce", S, 2) == pytest.approx(2 * a + 0.2)  # 0.20002
    assert tree.collective_s("all_reduce", S, 8) == pytest.approx(6 * a + 0.2)  # 0.20006
    # reduce-scatter and all-gather: (n-1) alpha + (n-1)/n S/B (on the tree fabric too: only all-reduce has a tree)
    for f, kind in ((ring, "reduce_scatter"), (ring, "all_gather"), (tree, "all_gather")):
        assert f.collective_s(kind, S, 2) == pytest.approx(a + 0.05)  # 0.05001
        assert f.collective_s(kind, S, 8) == pytest.approx(7 * a + 0.0875)  # 0.08757
    assert ring.collective_s("broadcast", S, 8) == pytest.approx(7 * a + 0.1)  # pipelined: (n-1) alpha + S/B
    for f, kind in ((ring, "all_reduce"), (tree, "all_reduce"), (ring, "reduce_scatter"), (ring, "broadcast")):
        assert f.collective_s(kind, S, 1) == 0.0  # nothing to talk to


def test_two_level_fabric_follows_nccl_ring_and_tree():
    fabric = Fabric("test", Link("nvl", 100e9, 1e-6), Link("nic", 10e9, 5e-6), gpus_per_node=8, nics_per_node=4,
                    call_overhead_s=0.0, algorithm="auto")
    # 16 ranks = 2 nodes; the ring's bandwidth is min(NVLink 100, 4 NICs x 10) = 40 GB/s
    assert fabric.nodes(16) == 2 and fabric.bus_bandwidth(16) == 40e9
    S = 4e9
    # ring: 2(n-m) intra steps + 2(m-1) inter steps = 28 x 1 us + 2 x 5 us = 38 us; 2 x 15/16 x 4 GB / 40 GB/s
    assert fabric.ring_s("all_reduce", S, 16) == pytest.approx(38e-6 + 0.1875)
    # tree: 2((g-1) alpha_intra + log2(m) alpha_inter) = 2(7 + 5) us = 24 us; 2 x 4 GB / 40 GB/s
    assert fabric.tree_all_reduce_s(S, 16) == pytest.approx(24e-6 + 0.2)
    assert fabric.collective_s("all_reduce", S, 16) == fabric.ring_s("all_reduce", S, 16)  # large: the ring wins
    assert fabric.collective_s("all_reduce", 1e3, 16) == fabric.tree_all_reduce_s(1e3, 16)  # small: the tree's latency
    # inside one node only NVLink counts: 14 steps of 1 us + 1.75 x 4 GB / 100 GB/s
    assert fabric.collective_s("all_reduce", S, 8) == pytest.approx(14e-6 + 0.07)
    # reduce-scatter over 2 nodes: (n-m) intra + (m-1) inter steps = 14 + 5 us; 15/16 x 4 GB / 40 GB/s
    assert fabric.collective_s("reduce_scatter", S, 16) == pytest.approx(19e-6 + 0.09375)
    with pytest.raises(ValueError, match="multiple of 8"):
        fabric.collective_s("all_reduce", S, 12)


def test_measured_fit_is_exact_at_its_world_size_and_extrapolates_as_stated(tmp_path):
    fit = MeasuredFit(overhead_s=1e-3, bandwidth_Bps=1e9, world_size=2)
    per_hop, per_call = fit.fabric("per_hop"), fit.fabric("per_call")
    S = 1e6  # 1 ms at 1 GB/s
    assert per_hop.collective_s("all_reduce", S, 2) == pytest.approx(2e-3)  # t = o + S / w, the fit itself
    assert per_call.collective_s("all_reduce", S, 2) == pytest.approx(2e-3)
    assert per_hop.collective_s("all_reduce", S, 8) == pytest.approx(7e-3 + 1.75e-3)  # (n-1) o + 2(n-1)/n S / w
    assert per_call.collective_s("all_reduce", S, 8) == pytest.approx(1e-3 + 1.75e-3)  # o + 2(n-1)/n S / w
    # the sweep's bucket_prediction.json (its fit, the measured points and the chosen bucket) is read as such
    path = tmp_path / "bucket_prediction.json"
    path.write_text(json.dumps({"overhead_s": 8.4e-4, "bandwidth_Bps": 1.5e9, "sizes": [4096], "times_s": [8.4e-4],
                                "world_size": 2, "backend": "gloo", "device": "cpu", "bucket_bytes": 5120000}))
    cpu = read_fit(path)
    assert (cpu.world_size, cpu.overhead_s, cpu.bandwidth_Bps, cpu.backend) == (2, 8.4e-4, 1.5e9, "gloo")
    with pytest.raises(ValueError, match="predict_bucket_size"):
        read_fit(tmp_path / "missing.json")


# ---- timelines of a hand-made 3-parameter profile ----------------------------------------------------------


def test_naive_is_compute_plus_every_all_reduce_in_parameter_order():
    r = simulate("naive_ddp", model())
    # 40 ms of forward + backward; flags; a (1 + 1 ms), b (1 + 2), c (1 + 3) one after another; optimizer 5 ms
    assert r.step_ms == pytest.approx(40 + FLAGS_MS + 2 + 3 + 4 + 5)
    assert r.compute_only_ms == 45 and r.exposed_comm_ms == pytest.approx(FLAGS_MS + 9)
    assert r.busy_comm_ms == pytest.approx(r.exposed_comm_ms) and r.overlap == pytest.approx(0.0, abs=1e-9)
    assert [i.label for i in r.intervals if i.stream == "comm"] == ["gradient presence flags", "a", "b", "c"]


def test_flat_packs_reduces_once_and_unpacks():
    r = simulate("flat_ddp", model())
    # flags, pack 6 MiB (2 ms), one all-reduce of 6 MiB (7 ms), unpack (2 ms), optimizer
    assert r.step_ms == pytest.approx(40 + FLAGS_MS + 2 + 7 + 2 + 5)
    assert r.copy_ms == pytest.approx(4) and r.calls == 2


def test_overlap_hides_all_but_the_tail():
    r = simulate("overlap_ddp", model())
    comm = {i.label: (i.start_ms, i.end_ms) for i in r.intervals if i.stream == "comm"}
    # c ready at 10 + 10 = 20 ms: [20, 24]; b at 30: [30, 33]; a at the end of backward, 40, but a is the last
    # bucket, copied into its buffer (it carries the missing-gradient sentinel): 1 MiB read + written = 1/3 ms
    third = 1 / 3
    assert comm["c"] == pytest.approx((20, 24)) and comm["b"] == pytest.approx((30, 33))
    assert comm["a"] == pytest.approx((40 + third, 42 + third))
    # only that copy and a's all-reduce stay exposed; no presence flags (nothing is missing)
    assert r.step_ms == pytest.approx(42 + third + 5) and r.exposed_comm_ms == pytest.approx(2 + third)


def test_overlap_launches_strictly_in_reverse_parameter_order():
    # c (last parameter, first to launch) is ready only at 25 ms, b already at 5: b waits for c's launch
    r = simulate("overlap_ddp", model(three_params(ready=(30.0, 5.0, 25.0))))
    comm = {i.label: (i.start_ms, i.end_ms) for i in r.intervals if i.stream == "comm"}
    assert comm["c"] == pytest.approx((35, 39))  # launched at 10 + 25
    assert comm["b"] == pytest.approx((39, 42))  # issued at 35 too, runs after c on the one stream


def test_bucketed_buckets_in_reverse_order_and_packs_multi_tensor_buckets():
    r = simulate("bucketed_ddp", model(), 4.0)
    # 4 MiB cap, walking c, b, a: [c] (3 MiB; + b would be 5), then [b, a] (3 MiB)
    comm = [(i.label, i.start_ms, i.end_ms) for i in r.intervals if i.stream == "comm"]
    assert comm[0] == ("c", pytest.approx(20), pytest.approx(24))  # [c] in place at 20 ms: 1 + 3 ms
    # [b, a] complete at 40 ms; copied into its buffer (3 MiB: 1 ms) on the compute stream, then 1 + 3 ms
    assert comm[1] == ("bucket 1 (2 tensors)", pytest.approx(41), pytest.approx(45))
    # no flags (nothing is missing), no unpack (the gradients are views of the buffer); optimizer 5 ms
    assert r.step_ms == pytest.approx(45 + 5)
    assert r.copy_ms == pytest.approx(1) and r.calls == 2
    # one bucket for everything: copy 6 MiB (2 ms) at 40, all-reduce 7 ms, optimizer: flat without its flags and
    # its unpack (another 2 ms)
    flat = simulate("flat_ddp", model()).step_ms
    assert simulate("bucketed_ddp", model(), 1000.0).step_ms == pytest.approx(40 + 2 + 7 + 5) == pytest.approx(flat - FLAGS_MS - 2)


def test_bucketed_bf16_halves_the_wire_bytes_and_pays_a_cast_per_bucket():
    r = simulate("bucketed_bf16_ddp", model(), 4.0)
    # same buckets; each moves 1.5 MiB (2.5 ms) and casts 3 MiB fp32 -> 1.5 MiB bf16 (4.5 MiB moved: 0.75 ms) each way
    comm = [(i.start_ms, i.end_ms) for i in r.intervals if i.stream == "comm"]
    assert comm[0] == pytest.approx((20.75, 23.25))  # [c], in place: cast [20, 20.75], then 2.5 ms
    # [b, a] ready at 40 + 0.75 (the first cast delayed backward); copied into its buffer (1 ms), cast (0.75 ms)
    assert comm[1] == pytest.approx((42.5, 45))
    # backward ends at 42.5; cast [c] back (0.75); wait for [b, a] until 45, cast it back (0.75); optimizer 5 ms
    assert r.step_ms == pytest.approx(45 + 0.75 + 5)


def test_ddp_uses_torch_buckets_in_ready_order_and_copies_every_bucket():
    r = simulate("ddp", model())
    # ready order c, b, a; the 1 MiB first bucket closes on c (3 MiB >= 1 MiB), then [b, a] under 25 MiB
    # c: copy in [20, 21], all-reduce [21, 25]; its copy delays backward by 1 ms, so [b, a] completes at 41
    # copy in [41, 42], all-reduce [42, 46]; copy out c (42 -> 43), then [b, a] after 46 (-> 47); optimizer -> 52
    assert r.step_ms == pytest.approx(52) and r.calls == 2 and r.copy_ms == pytest.approx(4)


def test_zero1_reduce_scatters_steps_its_shard_and_all_gathers():
    r = simulate("zero1_ddp", model())
    # owners: c (3 MiB) -> rank 0, b -> rank 1, a -> rank 1: loads 3 : 3 MiB, so segments of 3 MiB, a 6 MiB buffer
    # flags; pack (6 read + 6 written: 2 ms); reduce-scatter 7 ms; own segment out (1 ms); optimizer on half (2.5 ms);
    # own parameters in (1 ms); all-gather 7 ms; unpack (2 ms)
    assert r.step_ms == pytest.approx(40 + FLAGS_MS + 2 + 7 + 1 + 2.5 + 1 + 7 + 2)
    assert r.calls == 3 and r.comm_bytes == 12 + 2 * 6 * MiB


def test_a_parameter_without_gradient_is_skipped_by_naive_and_launched_at_the_finish_by_bucketed():
    profile = three_params(ready=(None, 20.0, 10.0))  # a never gets a gradient
    assert simulate("naive_ddp", model(profile)).calls == 3  # flags, b, c
    r = simulate("overlap_ddp", model(profile))
    a = next(i for i in r.intervals if i.label == "a")
    # launched by finish_gradient_synchronization at the end of backward (40 ms), after zeroing its buffer (1/3 ms);
    # then, a gradient being missing, the presence flags
    assert a.start_ms == pytest.approx(40 + 1 / 3)
    assert [i.label for i in r.intervals if i.stream == "comm"][-1] == "gradient presence flags"


def test_powersgd_overlaps_its_first_round_with_backward_and_runs_the_second_after_it():
    r = simulate("bucketed_powersgd_ddp", model(), 4.0, rank=4)
    # Buckets as bucketed at 4 MiB: [c], then [b, a] (+ the sentinel). Every matrix compresses at rank 4, e.g. c:
    # (768 + 1024) x 4 x 2 = 14,336 < 786,432 elements. Wire bytes (fp32): P = rows x 4, Q = cols x 4 elements.
    comm = [(i.label, i.nbytes) for i in r.intervals if i.stream == "comm"]
    assert comm == [
        ("c [PowerSGD P]", 768 * 4 * 4),
        ("bucket 1 (2 tensors) [uncompressed]", 4),  # a and b are compressed: only the sentinel is left
        ("bucket 1 (2 tensors) [PowerSGD P]", (512 + 512) * 4 * 4),
        ("c [PowerSGD Q]", 1024 * 4 * 4),  # the Q rounds only once the engine waits, after backward
        ("bucket 1 (2 tensors) [PowerSGD Q]", (1024 + 512) * 4 * 4),
    ]
    spans = {i.label: (i.start_ms, i.end_ms) for i in r.intervals}
    # [c] is ready at 20 ms. Its P round costs, per element of c (786,432 of them, 3 MiB at 4 B), 24 bytes moved:
    # M = G (read 4, write 4), M += E (read 8, write 4), P = M Q (read 4); plus the small ones: QR of Q (2 x 1024 x 4
    # x 4 B), Q and P read and P written by the product ((1024 + 768) x 4 x 4 B), P /= n (2 x 768 x 4 x 4 B):
    # 18 MiB + 86,016 B at 6 MiB per ms.
    assert spans["PowerSGD P 0"] == pytest.approx((20, 20 + 3 + 86_016 / (6 * MiB)))
    # ... and it delays the rest of backward: [b, a] completes at 40 + 3.0137 ms, then its buffer copy (1 ms).
    assert spans["pack bucket 1"][0] == pytest.approx(spans["PowerSGD P 0"][1] + 20)
    backward_end = spans["pack bucket 1"][0]
    assert spans["c [PowerSGD Q]"][0] > backward_end and spans["PowerSGD Q 0"][0] > backward_end
    # Finish, per bucket in order: Q round (blocking), then P Q^T into the bucket and E = M - P Q^T: 24 bytes per
    # element again (P Q^T written 4, copied in 8, E read 8 written 4) plus P and Q read by the product.
    assert spans["PowerSGD decompress 0"] == pytest.approx(
        (spans["c [PowerSGD Q]"][1], spans["c [PowerSGD Q]"][1] + 3 + 4 * (768 + 1024) * 4 / (6 * MiB)))
    assert r.step_ms == pytest.approx(spans["PowerSGD decompress 1"][1] + 5)  # then the optimizer
    assert r.settings == {"rank": 4} and r.variant == "bucketed_powersgd_ddp rank=4"


def test_powersgd_at_full_rank_never_sends_fewer_bytes_than_bucketed():
    # At rank >= min(rows, cols) a "compressed" matrix sends (rows + cols) x min(rows, cols) >= rows x cols
    # elements, so it is compressed only if min_compression_rate < 1 (and then sends more): never fewer bytes.
    for profile in (three_params(), _small_gpt_profile()):
        for size in (0.25, 1.0, 4.0, 100.0):
            bucketed = simulate("bucketed_ddp", model(profile), size).comm_bytes
            for rate in (2.0, 0.0):
                full = simulate("bucketed_powersgd_ddp", model(profile), size, rank=10**6, min_compression_rate=rate)
                assert full.comm_bytes >= bucketed, (size, rate)
                assert (full.comm_bytes > bucketed + 4) == (rate == 0.0)  # + 4: the sentinel the model counts
            assert simulate("bucketed_powersgd_ddp", model(profile), size, rank=4).comm_bytes < bucketed / 10


def test_arithmetic_is_a_roofline_of_flops_and_bytes():
    m = StepModel(three_params(), LinearComm(), 2, 6 * MiB * 1e3, flops_per_s=1e12)
    assert m.kernel_ms(2e9, 6 * MiB) == pytest.approx(2.0)  # compute-bound: 2e9 / 1e12 s = 2 ms > 1 ms of bytes
    assert m.kernel_ms(1e9, 12 * MiB) == pytest.approx(2.0)  # memory-bound: 12 MiB at 6 MiB per ms
    assert StepModel(three_params(), LinearComm(), 2, 6 * MiB * 1e3).kernel_ms(1e15, 6 * MiB) == pytest.approx(1.0)
    # at rank 512 PowerSGD's products (2 x rows x cols x 512 FLOPs each: 0.27 GFLOP for a, 27 ms at 10 GFLOP/s)
    # outweigh their bytes (about 1 MiB: 1/6 ms); counted as bytes only, they are far cheaper
    slow_arithmetic = StepModel(three_params(), LinearComm(), 2, 6 * MiB * 1e3, flops_per_s=1e10)
    slow = simulate("bucketed_powersgd_ddp", slow_arithmetic, 4.0, rank=512, min_compression_rate=0.0).step_ms
    fast = simulate("bucketed_powersgd_ddp", model(), 4.0, rank=512, min_compression_rate=0.0).step_ms
    assert slow > fast + 10


def test_profile_shapes_round_trip_and_older_files_without_them_still_read(tmp_path):
    path = write_profile(three_params(), tmp_path / "profile.json")
    data = json.loads(path.read_text())
    assert data["params"][2]["shape"] == [768, 1024]
    assert read_profile(path) == three_params() and read_profile(path).has_shapes
    for q in data["params"]:  # a file written before shapes were recorded
        del q["shape"]
    path.write_text(json.dumps(data))
    older = read_profile(path)
    assert not older.has_shapes and simulate("bucketed_ddp", model(older), 4.0).step_ms == simulate("bucketed_ddp", model(), 4.0).step_ms
    with pytest.raises(ValueError, match="PowerSGD's model needs every parameter's shape.*'a'"):
        simulate("bucketed_powersgd_ddp", model(older), 4.0)
    with pytest.raises(ValueError, match=r"shape \[2, 3\] has 6 elements, but numel is 5"):
        ParamTiming("w", 5, 20, 1.0, (2, 3))


def test_engine_settings_are_projected_as_strategies_of_their_own(tmp_path, capsys):
    write_profile(three_params(), tmp_path / "profile.json")
    (tmp_path / "fit.json").write_text(json.dumps({"overhead_s": 1e-3, "bandwidth_Bps": 1e9, "world_size": 2}))
    base = ["--compute.source", "profile", "--compute.profile_path", str(tmp_path / "profile.json"),
            "--compute.memory_bandwidth_GBps", "10", "--network.preset", "measured",
            "--network.fit_path", str(tmp_path / "fit.json"), "--study.world_sizes", "[2, 8]",
            "--study.bucket_sizes_mb", "[1, 4]", "--study.strategies", "[bucketed_ddp, bucketed_powersgd_ddp, ddp]",
            "--output.out_dir", str(tmp_path / "out"), "--output.plots", "false"]
    assert main([*base, "--study.engine_settings", "{bucketed_powersgd_ddp: {rank: [1, 4]}}"]) == 0
    with open(tmp_path / "out" / "results.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["strategy"] == "bucketed_powersgd_ddp"]
    # 2 world sizes x 2 bucket sizes x 2 ranks, one best size per (rank, world size)
    assert sorted({r["engine_settings"] for r in rows}) == ["rank=1", "rank=4"] and len(rows) == 8
    assert sum(r["best_bucket"] == "true" for r in rows) == 4
    bytes_at = {(r["engine_settings"], r["world_size"], r["bucket_size_mb"]): int(r["comm_bytes"]) for r in rows}
    assert bytes_at[("rank=1", "2", "4")] < bytes_at[("rank=4", "2", "4")]  # rank 1 sends a quarter of P and Q
    markdown = (tmp_path / "out" / "results.md").read_text()
    assert "| bucketed_powersgd_ddp rank=1 (best size) |" in markdown and "| bucketed_powersgd_ddp rank=4 (best size) |" in markdown
    assert "## Fastest per world size" in markdown
    with pytest.raises(SystemExit):
        parse_config([*base, "--study.engine_settings", "{bucketed_powersgd_ddp: {seed: [1]}}"])
    assert "models no setting 'seed'; its settings are: rank, min_compression_rate" in capsys.readouterr().err


def _small_gpt_profile():
    """The `tiny` preset's shapes with a 64-token vocabulary, fp32 gradients ready in reverse parameter order."""
    from lightning_ddp.memory import gpt_parameter_shapes

    shape = ModelShape(d_model=128, n_layers=2, n_heads=4, d_ff=512, vocab_size=64)
    shapes = gpt_parameter_shapes(shape)
    names = [name for name, _ in shape.parameters()]
    params = [ParamTiming(name, numel, 4 * numel, float(len(names) - k), shapes[name])
              for k, (name, numel) in enumerate(shape.parameters())]
    return ComputeProfile(5.0, 30.0, 1.0, tuple(params), world_size=2)


@pytest.mark.parametrize("bucket_size_mb", [0.1, 1.0])
def test_powersgd_model_sends_what_the_engine_sends(world_of_one, bucket_size_mb):
    # The real engine on one rank, compressing from the first step, records every collective (label, bytes); the
    # model of the same GPT must issue the same ones in the same order, and each bucket's bytes must be its
    # plan_bucket's sent_numel x 4 (fp32).
    import torch

    from lightning_ddp.model import GPT, get_config
    from lightning_ddp.sync import Recorder
    from lightning_ddp.sync.bucketed_powersgd import BucketedPowerSGDDDP, plan_bucket

    torch.manual_seed(0)
    gpt = GPT(get_config("tiny", n_layers=2, vocab_size=64, context_length=16))
    profile = _small_gpt_profile()
    assert [(q.name, q.shape) for q in profile.params] == [(n, tuple(t.shape)) for n, t in gpt.named_parameters()]
    engine = BucketedPowerSGDDDP(gpt, bucket_size_mb, rank=4, start_iter=0)
    engine.recorder = recorder = Recorder()
    recorder.open_step(0)
    engine.on_train_batch_start()
    tokens = torch.randint(0, 64, (2, 16))
    torch.nn.functional.cross_entropy(engine(tokens).flatten(0, 1), tokens.flatten()).backward()
    engine.finish_gradient_synchronization()
    sent = [(c.label, c.nbytes) for c in recorder.finish_step().collectives]

    r = simulate("bucketed_powersgd_ddp", model(profile), bucket_size_mb, rank=4)
    assert [(i.label, i.nbytes) for i in r.intervals if i.stream == "comm"] == sent
    per_bucket: dict[str, int] = {}
    for label, nbytes in sent:
        per_bucket[label.split(" [")[0]] = per_bucket.get(label.split(" [")[0], 0) + nbytes
    plans = [plan_bucket(b.layout, b.buffer.numel() if b.buffer is not None else b.params[0].numel(), 4, 2.0)
             for b in engine._buckets]
    assert list(per_bucket.values()) == [4 * plan.sent_numel for plan in plans]
    assert sum(len(plan.matrices) for plan in plans) == 2 * 7 + 2  # 7 matrices per block, embedding and lm_head


def test_more_bandwidth_or_less_latency_is_never_slower():
    tiny = ModelShape(d_model=128, n_layers=4, n_heads=4, d_ff=512)  # the `tiny` preset's shape, no torch needed
    profile = modelled_profile(tiny, 4, 64, gpu="h100-sxm", mfu=0.4)  # with every parameter's shape
    base = FABRICS["h100_nvlink_ib"]
    faster = dataclasses.replace(base, intra=Link("nvl", 2 * base.intra.bandwidth_Bps, base.intra.latency_s),
                               inter=Link("ib", 2 * base.inter.bandwidth_Bps, base.inter.latency_s))
    snappier = dataclasses.replace(base, intra=Link("nvl", base.intra.bandwidth_Bps, base.intra.latency_s / 2),
                                 inter=Link("ib", base.inter.bandwidth_Bps, base.inter.latency_s / 2))
    for name in simulated_names():
        for n in (2, 8, 64, 1024):
            for size in ((0.01, 1.0, 25.0) if catalogue.get(name).has_bucket_size else (None,)):
                steps = [simulate(name, StepModel(profile, f, n, 2.7e12), size).step_ms for f in (base, faster, snappier)]
                assert steps[1] <= steps[0] + 1e-9 and steps[2] <= steps[0] + 1e-9, (name, n, size, steps)


def test_best_bucket_is_the_shortest_step_per_world_size():
    results = project(three_params(), LinearComm(), ["bucketed_ddp", "naive_ddp"], [2, 8], [1.0, 4.0, 1000.0], 6 * MiB * 1e3)
    best = best_by_world_size(results)
    assert best[("bucketed_ddp", 2)].step_ms == min(r.step_ms for r in results if r.strategy == "bucketed_ddp" and r.world_size == 2)
    assert best[("naive_ddp", 8)].bucket_size_mb is None


# ---- the compute profile file -------------------------------------------------------------------------------


def test_profile_json_round_trip_and_errors(tmp_path):
    profile = three_params(ready=(None, 20.0, 10.0))
    path = write_profile(profile, tmp_path / "profile.json")
    data = json.loads(path.read_text())
    assert data["schema"] == "lightning_ddp.compute_profile/1" and data["params"][0]["ready_ms"] is None
    assert read_profile(path) == profile
    data["schema"] = "something/2"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="schema"):
        read_profile(path)
    with pytest.raises(ValueError, match="does not exist"):
        read_profile(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="ready_ms"):
        ParamTiming("w", 1, 4, -1.0)


def test_modelled_xl_profile_matches_the_real_model():
    torch = pytest.importorskip("torch")
    from lightning_ddp.model import GPT, get_config

    shape = ModelShape.from_preset("xl")
    with torch.device("meta"):
        gpt = GPT(get_config("xl"))
    assert shape.parameters() == [(name, p.numel()) for name, p in gpt.named_parameters()]
    assert shape.num_params == 1_998_235_200 and len(shape.parameters()) == 435
    assert shape.flops_per_token(512) == gpt.flops_per_token(512)
    profile = modelled_profile(shape, 4, 512, gpu="h100-sxm", mfu=0.4)
    assert profile.backward_ms == pytest.approx(2 * profile.forward_ms)
    # 2048 tokens x 12.36 GFLOP per token / (40 % of 989.4 TFLOP/s) = 64 ms of forward + backward
    assert profile.forward_ms + profile.backward_ms == pytest.approx(1e3 * 2048 * shape.flops_per_token(512) / (0.4 * 989.4e12))
    ready = [p.ready_ms for p in profile.params]
    assert ready[-1] == pytest.approx(1e3 * 2048 * 4 * 10_000 * 1600 / (0.4 * 989.4e12))  # lm_head's backward first
    assert ready[0] == pytest.approx(profile.backward_ms)  # the embedding's gradient at the end
    assert ready[1:] == sorted(ready[1:], reverse=True)  # reverse parameters() order
    # the shapes the projection gives a modelled profile are the module's own
    assert [(q.name, q.shape) for q in profile.params] == [(n, tuple(p.shape)) for n, p in gpt.named_parameters()]


# ---- agreement with the engines' own rules (these import torch) ------------------------------------------------


def test_bucket_and_owner_rules_are_the_engines_and_ddp_buckets_agree_with_torch():
    pytest.importorskip("torch")
    import torch
    import torch.distributed as dist

    from lightning_ddp.sync import assign_buckets as engine_buckets
    from lightning_ddp.sync import assign_owners as engine_owners

    # the projection simulates with the engines' own functions, not a restatement of them
    assert (assign_buckets, assign_owners) == (engine_buckets, engine_owners)
    rng = random.Random(0)
    for _ in range(50):
        sizes = [rng.choice([4, 40, 400, 4000, 40000]) * rng.randint(1, 9) for _ in range(rng.randint(1, 30))]
        order = list(reversed(range(len(sizes))))
        tensors = [torch.empty(s // 4) for s in sizes]
        expected, _ = dist._compute_bucket_assignment_by_size([tensors[i] for i in order], [400, 4000], [False] * len(sizes))
        assert ddp_buckets(sizes, order, 400, 4000) == [[order[i] for i in bucket] for bucket in expected]


def test_the_package_imports_neither_torch_nor_lightning_at_module_level():
    for path in (REPO / "lightning_ddp" / "projection").glob("*.py"):
        for node in ast.parse(path.read_text()).body:  # top-level statements only; function bodies may import lazily
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("torch", "lightning") or n == "lightning_ddp.model" for n in names), (path, names)


# ---- config and CLI -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, match", [
    (lambda: StudyConfig(strategies=["nope"]), "unknown strategy 'nope'; choose one of naive_ddp"),
    (lambda: StudyConfig(strategies=[]), "at least one"),
    (lambda: StudyConfig(world_sizes=[1]), r">= 2"),
    (lambda: StudyConfig(bucket_sizes_mb=[0]), "> 0 MiB"),
    (lambda: StudyConfig(strategies=["bucketed_ddp"], engine_settings={"bucketed_powersgd_ddp": {"seed": [4]}}),
     "models no setting 'seed'"),  # checked even when not listed
    (lambda: StudyConfig(engine_settings={"powersgd": {"rank": [4]}}), "unknown strategy 'powersgd'"),
    (lambda: StudyConfig(engine_settings={"bucketed_powersgd_ddp": {"rank": []}}), "rank must be a non-empty list"),
    (lambda: ComputeConfig(source="profile"), "profile_path"),
    (lambda: ComputeConfig(mfu=1.5), r"compute.mfu: 0.4"),
    (lambda: ComputeConfig(gpu="tpu"), "choose one of h100-sxm"),
    (lambda: NetworkConfig(preset="measured"), "fit_path"),
    (lambda: NetworkConfig(preset="carrier-pigeon"), "choose one of h100_nvlink_ib"),
    (lambda: ProjectionConfig(study=StudyConfig(world_sizes=[2, 12])), "multiple of 8"),
])
def test_config_errors_say_the_fix(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_every_project_config_parses():
    configs = sorted((REPO / "configs" / "projection").glob("*.yaml"))
    assert {p.name for p in configs} >= {"xl_h100.yaml", "published_xl_2gpu.yaml"}
    for path in configs:
        config = parse_config(["--config", str(path)])
        assert config.study.strategies and config.study.world_sizes


def test_cli_end_to_end_on_a_hand_made_profile_and_fit(tmp_path, capsys):
    write_profile(three_params(), tmp_path / "profile.json")
    (tmp_path / "fit.json").write_text(json.dumps({"overhead_s": 1e-3, "bandwidth_Bps": 1e9, "world_size": 2}))
    (tmp_path / "tiny.yaml").write_text(
        "name: tiny test\n"
        f"compute: {{source: profile, profile_path: {tmp_path / 'profile.json'}, memory_bandwidth_GBps: 10}}\n"
        f"network: {{preset: measured, fit_path: {tmp_path / 'fit.json'}}}\n"
        "study: {world_sizes: [2, 4, 8], bucket_sizes_mb: [0.001, 1, 10]}\n"
        f"output: {{out_dir: {tmp_path / 'out'}}}\n"
    )
    assert main(["--config", str(tmp_path / "tiny.yaml")]) == 0
    out = tmp_path / "out"
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == COLUMNS
    # world sizes x (7 strategies without buckets: naive, flat, overlap, zero1, ddp, fsdp2, hsdp + 4 with 3 sizes
    # each: bucketed, bucketed_bf16, bucketed_powersgd, zero2)
    assert len(rows) == 3 * (7 + 4 * 3)
    naive2 = next(r for r in rows if r["strategy"] == "naive_ddp" and r["world_size"] == "2")
    # measured fit at 2 ranks: 1 ms + bytes / (1 GB/s) per call: flags (12 B) + 1, 2, 3 MiB; compute 45 ms
    assert float(naive2["step_ms"]) == pytest.approx(45 + 4 + (12 + 6 * MiB) / 1e6, abs=1e-3)
    assert sum(r["best_bucket"] == "true" for r in rows) == 3 * 4  # one best size per bucketed strategy and world size
    markdown = (out / "results.md").read_text()
    assert "# tiny test" in markdown and "## Best bucket size per world size" in markdown
    for png in ("share_vs_world.png", "step_vs_bucket.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    environment = json.loads((out / "environment.json").read_text())
    assert environment["config"]["network"]["preset"] == "measured" and environment["fabric"]["name"] == "measured"
    assert read_profile(out / "compute_profile.json") == three_params()
    assert not list(out.glob("*.tmp"))  # written atomically
    assert "57 cells" in capsys.readouterr().out


def test_project_a_profile_file_on_a_measured_fit(tmp_path):
    profile = read_profile(write_profile(three_params(), tmp_path / "p.json"))
    rows = [result_row(r) for r in project(profile, MeasuredFit(1e-3, 1e9).fabric(), ["naive_ddp", "bucketed_ddp"], [2],
                                           [1.0, 4.0], 10e9)]
    assert [(r["strategy"], r["bucket_size_mb"]) for r in rows] == [("naive_ddp", ""), ("bucketed_ddp", "1"), ("bucketed_ddp", "4")]
    assert rows[0]["step_ms"] == pytest.approx(45 + 4 + (12 + 6 * MiB) / 1e6, abs=1e-3) and rows[0]["world_size"] == 2


# ---- the published 2-GPU xl runs ------------------------------------------------------------------------------


def test_published_transcription_is_consistent_and_the_model_tracks_naive_and_flat(tmp_path):
    from lightning_ddp.projection.published import PUBLISHED_RUNS, SOURCES, XL_SHAPE, compare_with_published, write_comparison

    for run in PUBLISHED_RUNS:  # a typo in a transcribed number breaks ratio = comm / total (printed to 4 digits)
        assert run.comm_s / run.total_s == pytest.approx(run.ratio, abs=6e-4), run
    assert len(PUBLISHED_RUNS) == 5 + 6 + 6 + 24  # naive (one OOM), overlap, flat, bucketed x 4 sizes
    # each run cites the write-up of its strategy, by topic
    assert all(run.source in SOURCES and run.source.startswith(run.strategy.removesuffix("_ddp")) for run in PUBLISHED_RUNS)
    assert XL_SHAPE.num_params == 1_998_235_200
    comparisons = compare_with_published()
    for c in comparisons:
        if c["strategy"] in ("naive_ddp", "flat_ddp") and not c["compute_extrapolated"]:
            assert abs(c["pcie_gen4_share"] - c["published_share"]) < 0.08, c  # bandwidth-bound: the link decides
        assert c["nvlink4_share"] < c["pcie_gen4_share"]
    md, csv_path = write_comparison(tmp_path)
    assert "| naive_ddp |" in md.read_text() and len(csv_path.read_text().splitlines()) == len(PUBLISHED_RUNS) + 1


def test_published_config_reproduces_the_published_comparison(tmp_path):
    pytest.importorskip("torch")  # the xl preset's shape comes from lightning_ddp.model
    from lightning_ddp.projection.published import compare_with_published
    from lightning_ddp.projection.run import run_projection

    config = parse_config(["--config", str(REPO / "configs" / "projection" / "published_xl_2gpu.yaml"),
                           "--study.world_sizes", "[2]", "--output.out_dir", str(tmp_path), "--output.plots", "false"])
    outcome = run_projection(config)
    cli = {(r.strategy, r.bucket_size_mb): r.step_ms for r in outcome.results}
    for c in compare_with_published():
        if (c["batch_size"], c["seq_len"]) == (2, 128):
            assert cli[(c["strategy"], c["bucket_size_mb"])] == pytest.approx(c["pcie_gen4_step_ms"], rel=1e-3)
    assert math.isclose(outcome.profile.compute_ms, 365.1, rel_tol=1e-9)


def test_the_projection_reads_its_models_from_the_catalogue():
    # Modelling a new strategy for the projection is optional (adding one stays one engine file, one catalogue
    # entry, one YAML); every strategy this project ships names a model in its entry, and the projection simulates
    # exactly those, in catalogue order.
    assert simulated_names() == list(catalogue.STRATEGIES)
    assert simulated_names(modelled=False) == []
    for name in simulated_names():  # each model loads, runs, and its result carries the strategy's name
        size = 4.0 if catalogue.get(name).has_bucket_size else None
        assert simulate(name, model(), size).strategy == name
    with pytest.raises(ValueError, match="models no setting 'seed'; its settings are: rank, min_compression_rate"):
        simulate("bucketed_powersgd_ddp", model(), 4.0, seed=1)  # an engine setting that changes no step time


# ---- the validation against a sweep ---------------------------------------------------------------------------


def _cell(strategy: str, measured: float, lo: float, hi: float, predicted: float, batch: int = 2) -> dict:
    return {"cell_id": strategy, "strategy": strategy, "bucket_size_mb": "", "batch_size": batch, "context_length": 32,
            "precision": "32-true", "measured_step_ms": measured, "measured_step_lo": lo, "measured_step_hi": hi,
            "measured_share": 0.1, "predicted_step_ms": predicted, "predicted_share": 0.1,
            "step_error": predicted / measured - 1}


def test_validation_simulates_each_cell_with_its_engine_settings(tmp_path, capsys):
    from lightning_ddp.projection.validate import validate_cells

    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps({"overhead_s": 1e-3, "bandwidth_Bps": 1e9, "world_size": 2}))
    row = {"cell_id": "p", "strategy": "bucketed_powersgd_ddp", "bucket_size_mb": "4", "engine_settings": "rank=1 start_iter=10",
           "status": "ok", "world_size": "2", "batch_size": "2", "context_length": "32", "precision": "32-true",
           "step_ms_median": "100", "comm_share": "0.1"}
    copy_Bps = 6 * MiB * 1e3
    (cell,) = validate_cells([row], {"p": three_params().to_dict()}, fit, copy_Bps)
    # rank 1 from the cell's settings (start_iter changes no steady-state step: not modelled, not passed)
    at = {rank: simulate("bucketed_powersgd_ddp", StepModel(three_params(), read_fit(fit).fabric(), 2, copy_Bps), 4.0,
                         rank=rank).step_ms for rank in (1, 4)}
    assert cell["predicted_step_ms"] == pytest.approx(at[1]) and at[1] < at[4] - 0.01
    assert cell["engine_settings"] == "rank=1 start_iter=10"
    older = three_params().to_dict()  # a profile recorded before the CommTimer wrote shapes: left out, and said so
    for q in older["params"]:
        q.pop("shape")
    assert validate_cells([row], {"p": older}, fit, copy_Bps) == []
    assert "not simulated: p: PowerSGD's model needs every parameter's shape" in capsys.readouterr().err


def test_ranking_is_checked_only_where_the_measured_intervals_separate_the_cells():
    from lightning_ddp.projection.validate import ranking_agreement

    cells = [
        _cell("naive_ddp", 130, 125, 135, 140),  # clearly slower than flat and ddp: 2 separated pairs
        _cell("flat_ddp", 100, 95, 105, 90),
        _cell("ddp", 102, 99, 110, 95),  # overlaps flat: not a pair; the prediction's order of them is not checked
        _cell("overlap_ddp", 60, 55, 65, 120, batch=4),  # another group: never compared with the ones above
    ]
    agree, pairs, disagreements = ranking_agreement(cells)
    assert (agree, pairs, disagreements) == (2, 2, [])
    cells[0]["predicted_step_ms"] = 92  # naive now predicted faster than ddp (95) but slower than flat (90)
    agree, pairs, disagreements = ranking_agreement(cells)
    assert (agree, pairs) == (1, 2) and disagreements == ["ddp < naive_ddp (b2 t32)"]


def test_a_catalogue_entry_without_a_model_is_named_in_the_error_and_the_report(tmp_path, monkeypatch, capsys):
    import dataclasses

    bucketed = catalogue.get("bucketed_ddp")
    monkeypatch.setitem(catalogue.STRATEGIES, "toy_unmodelled",
                        dataclasses.replace(bucketed, name="toy_unmodelled", projection=None))
    # one that names an existing model is projected with no other change, under its own name
    monkeypatch.setitem(catalogue.STRATEGIES, "toy_modelled", dataclasses.replace(bucketed, name="toy_modelled"))
    assert "toy_modelled" in simulated_names() and "toy_unmodelled" not in simulated_names()
    assert simulate("toy_modelled", model(), 4.0).step_ms == simulate("bucketed_ddp", model(), 4.0).step_ms
    base = ["--config", str(REPO / "configs" / "projection" / "xl_h100.yaml"), "--study.world_sizes", "[2]",
            "--output.out_dir", str(tmp_path), "--output.plots", "false"]
    with pytest.raises(SystemExit):
        parse_config([*base, "--study.strategies", "[naive_ddp, toy_unmodelled]"])
    assert "has no model in the projection: add a simulate function" in capsys.readouterr().err
    assert main([*base, "--study.strategies", "[naive_ddp]"]) == 0
    (line,) = [line for line in (tmp_path / "results.md").read_text().splitlines() if "Not projected:" in line]
    assert "`toy_unmodelled`" in line


# ---- ZeRO-2, FSDP2, memory, contention --------------------------------------------------------------------------


class InfiniteComm:
    """Every collective is free (infinite bandwidth, no latency)."""

    def collective_s(self, kind: str, nbytes: float, n: int) -> float:
        return 0.0


def blocks_profile() -> ComputeProfile:
    """A root (embedding first, lm_head last in parameters() order) and two blocks of 1 MiB each, fp32 vectors.

    Backward (30 ms): lm_head ready at 5 ms, block 1 at 15, block 0 at 25, the embedding at 30; forward 10 ms,
    optimizer 8 ms: a compute-only step of 48 ms.
    """
    names = ("tok_emb.weight", "blocks.0.w", "blocks.1.w", "lm_head.weight")
    ready = (30.0, 25.0, 15.0, 5.0)
    params = [ParamTiming(name, MiB // 4, MiB, r, (MiB // 4,)) for name, r in zip(names, ready)]
    return ComputeProfile(10.0, 30.0, 8.0, tuple(params), source="hand-made", world_size=2)


@pytest.mark.parametrize("name,size", [("zero2_ddp", 1.0), ("fsdp2", None)])
def test_sharded_strategies_on_one_rank_communicate_nothing(name, size):
    # one rank: every collective of a fabric lasts 0 and there is nothing to copy: the compute-only step
    r = simulate(name, StepModel(blocks_profile(), MeasuredFit(1e-3, 1e9).fabric(), 1, 6 * MiB * 1e3), size)
    assert r.busy_comm_ms == 0 and r.step_ms == pytest.approx(48.0)


@pytest.mark.parametrize("name,size", [("zero2_ddp", 1.0), ("fsdp2", None)])
def test_sharded_strategies_with_free_communication_cost_compute_plus_optimizer_over_n(name, size):
    # infinite bandwidth and copies: forward 10 + backward 30 + optimizer 8 / 4 ranks (4 MiB divide evenly)
    r = simulate(name, StepModel(blocks_profile(), InfiniteComm(), 4, 1e30), size)
    assert r.step_ms == pytest.approx(10 + 30 + 8 / 4)


def test_zero2_reduce_scatters_each_bucket_during_backward_and_all_gathers_after_the_optimizer():
    r = simulate("zero2_ddp", model(), 4.0)
    comm = [(i.label, i.start_ms, i.end_ms) for i in r.intervals if i.stream == "comm"]
    # buckets as bucketed at 4 MiB: [c] (3 MiB), [b, a] (3 MiB); each packed (1 ms), then reduce-scattered (4 ms)
    assert comm[0] == ("c [reduce-scatter]", pytest.approx(21), pytest.approx(25))  # c ready at 20, packed
    assert comm[1] == ("bucket 1 (2 tensors) [reduce-scatter]", pytest.approx(42), pytest.approx(46))  # 40 + 1 + 1
    # optimizer on half (2.5 ms) from 46; per bucket: own 1.5 MiB in (0.5 ms), all-gather 4 ms, unpack 1 ms
    assert comm[2][0] == "c [all-gather]" and comm[2][1] == pytest.approx(46 + 2.5 + 0.5)
    assert r.step_ms == pytest.approx(46 + 2.5 + 2 * (0.5 + 4 + 1))


def test_fsdp2_exposes_at_least_the_first_all_gather_and_gathers_every_block_twice():
    m = StepModel(blocks_profile(), LinearComm(), 2, 6 * MiB * 1e3)
    r = simulate("fsdp2", m)
    gathers = [i for i in r.intervals if i.stream == "comm" and i.label.endswith("[all-gather]")]
    scatters = [i.label for i in r.intervals if i.stream == "comm" and i.label.endswith("[reduce-scatter]")]
    # the root's all-gather (2 MiB: 3 ms) opens the step; each block is gathered for forward and again for backward
    assert [g.label for g in gathers] == ["root [all-gather]", "blocks.0 [all-gather]", "blocks.1 [all-gather]",
                                          "blocks.1 [all-gather]", "blocks.0 [all-gather]"]
    assert scatters == ["blocks.1 [reduce-scatter]", "blocks.0 [reduce-scatter]", "root [reduce-scatter]"]
    assert r.exposed_comm_ms >= gathers[0].end_ms - gathers[0].start_ms == pytest.approx(3.0)


# Two nodes of 2 ranks: NVLink-like 1 GB/s inside a node, one 0.25 GB/s NIC per node; no latency, no call cost.
TWO_BY_TWO = Fabric("2x2", Link("intra", 1e9, 0.0), Link("nic", 0.25e9, 0.0), gpus_per_node=2, nics_per_node=1,
                    call_overhead_s=0.0, algorithm="ring")


def test_hsdp_on_one_node_is_fsdp2():
    # 2 ranks on a node of 2: one shard group, no replica to all-reduce with: fsdp2's step, collectives and memory
    m = StepModel(blocks_profile(), TWO_BY_TWO, 2, 6 * MiB * 1e3)
    hsdp, fsdp2 = simulate("hsdp", m), simulate("fsdp2", m)
    assert (hsdp.step_ms, hsdp.memory_bytes, hsdp.intervals) == (fsdp2.step_ms, fsdp2.memory_bytes, fsdp2.intervals)


def test_hsdp_reduce_scatters_in_the_node_then_all_reduces_the_shard_across_nodes():
    # 4 ranks as 2 nodes x 2: the shard group is a node (shard_size 2), the replicas one rank per node, each on
    # half of its node's one NIC (0.125 GB/s). A 1 MiB unit: reduce-scattered over 2 ranks on the node's link
    # (a ring moves 1/2 MiB: 0.524 ms), then its 1/2 MiB shard all-reduced over 2 replicas (2 passes of 1/2 of it:
    # 1/2 MiB at 0.125 GB/s, 4.19 ms), queued right behind it on the stream.
    assert (TWO_BY_TWO.shard_group_size(4), TWO_BY_TWO.across_nodes().intra.bandwidth_Bps) == (2, 0.125e9)
    m = StepModel(blocks_profile(), TWO_BY_TWO, 4, 6 * MiB * 1e3)
    r = simulate("hsdp", m)
    comm = [i for i in r.intervals if i.stream == "comm" and not i.label.endswith("[all-gather]")]
    assert [i.label for i in comm] == ["blocks.1 [reduce-scatter]", "blocks.1 [all-reduce]",
                                       "blocks.0 [reduce-scatter]", "blocks.0 [all-reduce]",
                                       "root [reduce-scatter]", "root [all-reduce]"]
    scatter, all_reduce = comm[0], comm[1]
    assert all_reduce.nbytes == MiB // 2 and all_reduce.start_ms >= scatter.end_ms
    assert scatter.end_ms - scatter.start_ms == pytest.approx(MiB / 2 / 1e9 * 1e3)
    assert all_reduce.end_ms - all_reduce.start_ms == pytest.approx(MiB / 2 / 0.125e9 * 1e3)
    # the state of fsdp2 on one node of 2 ranks, the optimizer on half the parameters
    assert r.memory_bytes == simulate("fsdp2", StepModel(blocks_profile(), TWO_BY_TWO, 2, 6 * MiB * 1e3)).memory_bytes
    with pytest.raises(ValueError, match="shard_size 3 does not divide the world of 4 ranks"):
        simulate("hsdp", m, shard_size=3)


def test_contention_slows_only_the_compute_beside_a_collective():
    timeline = __import__("lightning_ddp.projection.simulators", fromlist=["Timeline"]).Timeline
    t = timeline(StepModel(three_params(), LinearComm(), 2, 6 * MiB * 1e3, contention=1.0))
    t.collective("x", 10.0, 3 * MiB)  # 4 ms: in flight over [10, 14]
    # 10 ms of work from 5: 5 ms alone to 10, then 4 ms of wall at half speed (2 ms of work), then 3 ms alone
    assert t.compute("backward", 5.0, 10.0) == pytest.approx(17.0) and t.step.contention_ms == pytest.approx(2.0)
    # with s = 0.36 fitted for NCCL, an overlapped strategy's step grows and its wait shrinks by the same or less
    plain = simulate("overlap_ddp", model())
    slowed = simulate("overlap_ddp", StepModel(three_params(), LinearComm(), 2, 6 * MiB * 1e3, contention=0.36))
    assert slowed.step_ms >= plain.step_ms and slowed.contention_ms > 0
    assert slowed.waited_comm_ms <= plain.waited_comm_ms + 1e-9
    # naive overlaps nothing: contention changes nothing
    assert simulate("naive_ddp", StepModel(three_params(), LinearComm(), 2, 6 * MiB * 1e3, contention=1.0)).step_ms == \
        pytest.approx(simulate("naive_ddp", model()).step_ms)


def test_memory_per_rank_shrinks_with_sharding():
    p = blocks_profile()  # 4 MiB of fp32 parameters
    at = {n: StepModel(p, LinearComm(), n, 1e12) for n in (2, 4)}
    # ddp: parameters, gradients, 2 AdamW states and the reducer's buckets: 5 x 4 MiB
    def memory(name: str, n: int, size: float | None = None) -> int:
        return simulate(name, at[n], size).memory_bytes

    assert memory("ddp", 4) == 5 * 4 * MiB
    # zero2 at 4 ranks, one 4 MiB bucket: parameters 4 MiB + gradient shard 1 + the bucket twice 8 + state 2 + shard 1
    assert memory("zero2_ddp", 4, 4.0) == (4 + 1 + 8 + 2 + 1) * MiB
    # fsdp2 at 4 ranks: shard 1 + root (2) and both blocks (2) unsharded + gradient shard 1 + one block 1 + state 2
    assert memory("fsdp2", 4) == (1 + 4 + 1 + 1 + 2) * MiB
    assert memory("fsdp2", 4) < memory("fsdp2", 2) < memory("ddp", 2)


def test_the_fitted_contention_reproduces_from_the_committed_data():
    from lightning_ddp.projection import contention, simulators
    from lightning_ddp.projection.validate import read_sweep, validate_cells

    # python -m lightning_ddp.projection.contention: gloo on the CPU sweep's step times, NCCL on the published runs'
    # wait shares; CONTENTION must hold what the committed data give
    sweep = REPO / "benchmarks/results/cpu"
    assert contention.fit_gloo(sweep) == simulators.CONTENTION["gloo"]
    # every measured cell of the sweep is in the fit (its strategy names are the catalogue's), not a few of them
    profiles = json.loads((sweep / "profiles.json").read_text())
    with open(sweep / "results.csv", newline="") as f:
        measured = [r for r in csv.DictReader(f) if r["status"] == "ok" and r["strategy"] != "reference"
                    and r["cell_id"] in profiles]
    assert len(validate_cells(*read_sweep(sweep), simulators.CPU_COPY_GBPS * 1e9)) == len(measured) > 0
    assert contention.fit_nccl() == simulators.CONTENTION["nccl"]
    # and it is a fit, not a constant: a loss with its minimum elsewhere moves it
    assert contention.fit_contention(lambda s: (s - 0.5) ** 2) == 0.5
