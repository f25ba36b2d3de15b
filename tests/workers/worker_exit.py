"""How every worker script ends: its process group destroyed while the interpreter is whole.

A process that exits with a gloo group alive can abort in the interpreter's teardown
("terminate called without an active exception", SIGABRT; pytorch/pytorch#190489), a rare
failure of a run that succeeded. A worker that raises leaves the group to the exit as before."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist


def run_worker(main: Callable[[], None]) -> None:
    """Run ``main``; then, if it returned, destroy the process group."""
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
