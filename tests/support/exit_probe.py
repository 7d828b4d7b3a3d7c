"""One rank of the abort-at-exit reproducer: ``python -m tests.support.exit_probe RANK PORT ENDING``.

Rank 0 launches an all-reduce whose future carries a Python completion callback (as the ``Recorder`` does) and
ends at once; rank 1 joins the collective 2 s later, so the callback runs on gloo's worker thread while rank 0 ends.
Rank 0's ``ENDING``: ``interpreter`` (return, and let Python finalize: the callback takes the GIL during the
finalization) or ``teardown`` (``lightning_ddp.teardown``, as rank 1 always ends: the group freed while Python is
whole, the callback run then, and an exit without finalizing).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from lightning_ddp.local_group import init_local_process_group
from lightning_ddp.teardown import exit_without_finalizing, tear_down_process_group

CALLBACK_RAN = "rank 0: the completion callback ran"
PEER_DELAY_S = 2.0
"""How long rank 1 waits before joining: rank 0 reaches its ending within milliseconds of the launch."""


def main(rank: int, port: int, ending: str) -> None:
    init_local_process_group(rank, 2, port)
    if rank == 0:
        dist.all_reduce(torch.ones(4), async_op=True).get_future().then(lambda future: print(CALLBACK_RAN, flush=True))
    else:
        time.sleep(PEER_DELAY_S)
        dist.all_reduce(torch.ones(4))
    if rank == 1 or ending == "teardown":  # rank 1 is not the subject: it always ends cleanly
        tear_down_process_group()
        exit_without_finalizing()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
