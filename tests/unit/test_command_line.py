"""A config built in Python is held to what its command line holds it to, with the command line's message
(``lightning_ddp.command_line.check_field_types``, called first by every study config's ``__post_init__``)."""

from __future__ import annotations

import pytest

from lightning_ddp.bench.config import RunConfig, SweepConfig
from lightning_ddp.bench.engine_step import EngineStepConfig
from lightning_ddp.bench.memory_per_rank import MemoryBenchConfig
from lightning_ddp.bench.straggler import StragglerBenchConfig
from lightning_ddp.command_line import parse_dataclass
from lightning_ddp.projection.config import ComputeConfig, NetworkConfig, ProjectionConfig, StudyConfig

# (what Python builds, the command line of the same value, the config class that command line parses)
CASES = [
    (lambda: StragglerBenchConfig(delays_ms=[0.0, -5.0]), ["--delays_ms", "[0.0, -5.0]"], StragglerBenchConfig),
    (lambda: StragglerBenchConfig(slow_rank=-1), ["--slow_rank", "-1"], StragglerBenchConfig),
    (lambda: EngineStepConfig(batch_size=0), ["--batch_size", "0"], EngineStepConfig),
    (lambda: MemoryBenchConfig(devices=0), ["--devices", "0"], MemoryBenchConfig),
    (lambda: RunConfig(accelerator="tpu"), ["--run.accelerator", "tpu"], SweepConfig),
    (lambda: ComputeConfig(batch_size=0), ["--compute.batch_size", "0"], ProjectionConfig),
    (lambda: NetworkConfig(contention=-1.0), ["--network.contention", "-1.0"], ProjectionConfig),
    (lambda: StudyConfig(world_sizes=[8, "many"]), ["--study.world_sizes", "[8, many]"], ProjectionConfig),
]


@pytest.mark.parametrize("build, args, parsed", CASES, ids=[" ".join(args) for _, args, _ in CASES])
def test_a_bad_value_built_in_python_fails_with_the_command_lines_message(build, args, parsed, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_dataclass(parsed, args, prog="prog")
    assert exit_info.value.code == 2
    cli_error = capsys.readouterr().err
    with pytest.raises(ValueError) as info:
        build()
    # The reasons, word for word, after the key (which the command line names with its section: compute.batch_size).
    key, *reasons = str(info.value).splitlines()
    assert key.startswith("Parser key") and reasons, str(info.value)
    for reason in reasons:
        if "Given value type" not in reason:  # a command line gives text, Python the number itself
            assert reason.strip() in cli_error, (reason, cli_error)


def test_good_values_built_in_python_pass() -> None:
    StragglerBenchConfig(delays_ms=[0.0, 5.0], slow_rank=0)
    ProjectionConfig(compute=ComputeConfig(batch_size=2), network=NetworkConfig(contention=0.5))
