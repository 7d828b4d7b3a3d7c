"""advise calibrates an fsdp2 run like any other: its collectives are recorded at the process group, so its busy
time scales the network model as ours do (before, fsdp2's busy time was "not recorded" and nothing was scaled)."""

from __future__ import annotations

import pytest

from lightning_ddp.projection.advise import advise, read_run
from tests.unit.test_advice import _write_run


def test_an_fsdp2_run_is_calibrated_to_its_busy_time(tmp_path) -> None:
    document = advise(read_run(_write_run(tmp_path, strategy="fsdp2")))
    calibration = document["calibration"]
    assert calibration["notes"] == []  # modelled, and calibrated to what the run measured
    assert calibration["comm_factor"] != pytest.approx(1.0)  # the measured busy time moved the model
    (current,) = [row for row in document["recommendations"] if row["current"]]
    assert current["strategy"] == "fsdp2" and current["predicted_step_ms"] == pytest.approx(document["run"]["step_ms"])
