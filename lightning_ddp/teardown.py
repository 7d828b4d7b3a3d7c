"""Ending a process whose distributed run finished, so that it exits 0 (docs/troubleshooting.md, "A finished run
exits -6"): ``tear_down_process_group`` frees the group while Python is whole, then ``exit_without_finalizing``.

gloo runs each collective on worker threads that take the GIL to let go of what it held (its tensors' Python
objects, a Python completion callback). CPython ends a thread that takes the GIL while the interpreter finalizes by
unwinding its stack; inside gloo's destructor, which may not throw, that aborts the process ("terminate called
without an active exception"). Destroying the group joins those threads only if nothing else holds it, and torch
itself may (FSDP2's device mesh in DTensor's dispatch cache; ``group=group.WORLD`` defaults of torch modules imported
after the group was made): so a finished process also skips the interpreter's finalization. Imports no torch.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
from typing import NoReturn


def tear_down_process_group() -> None:
    """Destroy the default process group, if any, and free it now; only after a run that finished (after a failure
    a peer may still wait in a collective, and the destructor waits for the collectives in flight)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()  # the finished run's reference cycles (a Trainer, its strategy) may still hold the group


def exit_without_finalizing(code: int = 0) -> NoReturn:
    """Exit with ``code`` as the interpreter does (other non-daemon threads joined, ``atexit`` handlers run, output
    flushed), save the finalization during which a backend thread taking the GIL aborts the process."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
