"""Why a rank whose work was done could exit -6, and that ours exit 0 (docs/troubleshooting.md, "exits -6").

gloo finishes each collective on a worker thread of its own, which takes the GIL to run a Python completion callback
or to let go of what the collective held. Once the interpreter has begun to finalize, CPython ends a thread that
takes the GIL by unwinding it; through gloo's destructor, which may not throw, that is ``std::terminate``: SIGABRT,
"terminate called without an active exception". ``tests.support.exit_probe`` makes the timing certain: rank 0's
collective completes 2 s after its ``main`` returned.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from lightning_ddp.local_group import find_free_port
from tests.support.cli_utils import REPO, repo_first_on_path
from tests.support.exit_probe import CALLBACK_RAN

pytestmark = pytest.mark.multiprocess


def _run_probe(ending: str) -> list[subprocess.CompletedProcess]:
    port = str(find_free_port())
    env = {**repo_first_on_path(), "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.support.exit_probe", str(rank), port, ending], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [p.communicate(timeout=120) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, *output) for p, output in zip(procs, outputs)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the abort's message and signal as glibc gives them")
def test_a_gloo_thread_taking_the_gil_while_python_finalizes_aborts_the_finished_process() -> None:
    rank0, rank1 = _run_probe("interpreter")
    # If this starts to pass through (exit 0), torch or CPython has changed: the teardown may then be unnecessary.
    assert rank0.returncode == -signal.SIGABRT, (rank0.returncode, rank0.stderr[-2000:])
    assert "terminate called without an active exception" in rank0.stderr
    assert rank1.returncode == 0, rank1.stderr[-2000:]


def test_the_teardown_runs_the_callback_while_python_is_whole_and_exits_0() -> None:
    rank0, rank1 = _run_probe("teardown")
    assert (rank0.returncode, rank1.returncode) == (0, 0), (rank0.stderr[-2000:], rank1.stderr[-2000:])
    assert CALLBACK_RAN in rank0.stdout
    assert "terminate called" not in rank0.stderr + rank1.stderr
