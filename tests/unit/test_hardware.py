"""The one hardware table (``lightning_ddp.hardware``): names matched word by word, MIG slices as their share of the
GPU, and every reader (MFU, the projection) taking its figures from it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_ddp import hardware
from lightning_ddp.callbacks import comm_timer
from lightning_ddp.hardware import (DEVICES, compute_share, dense_peak_flops, find_device, job_peak_flops,
                                    mig_profile)


@pytest.mark.parametrize("name,key", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200", "h200-sxm"),
    ("NVIDIA H200 NVL", "h200-nvl"),
    ("NVIDIA GH200 480GB", "gh200"),  # 96 GB HBM3; the 480 GB is the Grace CPU's LPDDR5X
    ("NVIDIA GH200 144G HBM3e", "gh200-144gb"),
    ("NVIDIA B200", "b200"),
    ("NVIDIA A100-SXM4-80GB", "a100-sxm-80gb"),
    ("NVIDIA A100-SXM4-40GB", "a100-sxm-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"),
    ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb"),
    ("NVIDIA L4", "l4"),
    # A MIG slice matches its whole GPU's row; the profile's "10gb"/"20gb" is not read as the GPU's memory.
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "h100-sxm"),
    ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", "a100-sxm-40gb"),
    ("NVIDIA A100-SXM4-80GB MIG 1g.10gb", "a100-sxm-80gb"),
])
def test_device_names_match_their_row(name: str, key: str) -> None:
    assert find_device(name).key == key


@pytest.mark.parametrize("name", ["NVIDIA L40S", "NVIDIA GB200", "NVIDIA GeForce RTX 4090", "NVIDIA H800", ""])
def test_other_devices_match_nothing(name: str) -> None:
    # L40S is not an L4 and GB200 not a B200 (word by word); the rest are simply not in the table: no MFU
    # rather than a wrong one.
    assert find_device(name) is None
    assert dense_peak_flops(name, "bf16") is None


def test_mig_slice_is_its_share_of_the_gpu() -> None:
    h100 = 989.4e12
    # Without the SM count: the "1g" profile is 1 of 7 compute slices: 989.4 / 7 = 141.3 TFLOP/s, not 989.4
    # (the whole GPU, the old ~7x overstatement of the peak, hence a 7x too low MFU).
    assert dense_peak_flops("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "bf16") == pytest.approx(h100 / 7)
    # With it: an H100 1g.10gb has 16 of the 132 SMs: 989.4 x 16 / 132 = 119.9 TFLOP/s.
    assert dense_peak_flops("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "bf16", sm_count=16) == pytest.approx(h100 * 16 / 132)
    # A100 3g.20gb: 3/7 of 312 = 133.7 TFLOP/s; with its 42 of 108 SMs, 121.3.
    assert dense_peak_flops("NVIDIA A100-SXM4-40GB MIG 3g.20gb", "bf16") == pytest.approx(312e12 * 3 / 7)
    assert dense_peak_flops("NVIDIA A100-SXM4-40GB MIG 3g.20gb", "bf16", sm_count=42) == pytest.approx(312e12 * 42 / 108)
    # A whole GPU is never scaled, whatever SM count is passed.
    assert compute_share("NVIDIA H100 80GB HBM3", sm_count=16) == 1.0
    assert dense_peak_flops("NVIDIA H100 80GB HBM3", "bf16", sm_count=132) == h100
    # The compute-instance form "Cc.Ng.Mgb" has C slices.
    assert mig_profile("NVIDIA H100 80GB HBM3 MIG 1c.3g.40gb") == (1, 40)
    assert (mig_profile("NVIDIA H100 80GB HBM3 MIG 1g.10gb"), mig_profile("NVIDIA H100 80GB HBM3")) == ((1, 10), None)


def test_new_rows_have_their_datasheet_figures() -> None:
    # GH200: H100 SXM compute with more and faster memory; B200: HGX B200's per-GPU figures, sparse / 2.
    for key in ("gh200", "gh200-144gb"):
        assert DEVICES[key].dense_tflops == DEVICES["h100-sxm"].dense_tflops
    assert (DEVICES["gh200"].memory_GB, DEVICES["gh200"].memory_GBps) == (96, 4000)
    assert (DEVICES["gh200-144gb"].memory_GB, DEVICES["gh200-144gb"].memory_GBps) == (144, 4900)
    b200 = DEVICES["b200"]
    assert b200.dense_tflops == {"fp32": 75.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0}
    assert (b200.memory_GB, b200.memory_GBps, b200.sm_count) == (180, 7700, 148)
    for spec in DEVICES.values():
        assert set(spec.dense_tflops) == set(hardware.DTYPES) and spec.source and spec.sm_count > 0, spec.key


def test_cpu_peak_is_per_core() -> None:
    assert hardware.CPU_FP32_TFLOPS_PER_CORE == 0.078
    assert dense_peak_flops("cpu", "fp32", threads=4) == pytest.approx(4 * 0.078e12)
    assert dense_peak_flops("cpu", "bf16") is None  # no CPU bf16 figure: no MFU rather than a guess


def test_projection_gpus_are_built_from_the_table() -> None:
    from lightning_ddp.projection.flops import GPUS, get_gpu

    for key in ("h100-sxm", "h100-pcie", "h200-sxm", "a100-sxm-80gb", "a100-pcie-40gb", "gh200", "b200"):
        spec = DEVICES[key]
        assert GPUS[key].bf16_flops == spec.dense_tflops["bf16"] * 1e12
        assert GPUS[key].memory_Bps == spec.memory_GBps * 1e9
    assert get_gpu("h100-sxm").memory_Bps == 3.35e12  # the projection's figures are unchanged
    assert list(GPUS)[:5] == ["h100-sxm", "h100-pcie", "h200-sxm", "a100-sxm-80gb", "a100-pcie-40gb"]


def test_job_peak_counts_each_device_once() -> None:
    # Two ranks on one GPU (gloo's one-GPU layout) share its peak; two GPUs add theirs; an unknown peak: no MFU.
    assert job_peak_flops([(("host", "GPU-0"), 1e15), (("host", "GPU-0"), 1e15)]) == 1e15
    assert job_peak_flops([(("host", "GPU-0"), 1e15), (("host", "GPU-1"), 1e15)]) == 2e15
    assert job_peak_flops([(("host", "GPU-0"), 1e15), (("host", "GPU-1"), None)]) is None


def test_comm_timer_passes_the_sm_count_so_a_mig_slice_is_its_share(monkeypatch) -> None:
    # No GPU here: a fake trainer on "cuda:0" whose device is an H100 1g.10gb slice with 16 SMs, bf16-mixed.
    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3 MIG 1g.10gb", multi_processor_count=16, uuid="MIG-1")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(comm_timer.compat, "compute_dtype", lambda trainer: torch.bfloat16)
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))
    peak, hosts = comm_timer._job_peak_flops(trainer, peak_tflops=None)
    assert hosts == 1
    assert peak == pytest.approx(989.4e12 * 16 / 132)  # 119.9 TFLOP/s, not the whole GPU's 989.4
