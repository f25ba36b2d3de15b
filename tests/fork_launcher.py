"""A launcher for the tests' worker scripts that imports torch, Lightning and the models once.

Starting a worker process costs about 7 seconds of imports on the test machines, so a
two-process ``torchrun`` launch of a tiny run spends most of its time importing. This server,
started once per test session by :func:`distributed.run_workers`, imports what every worker
imports and then forks one child per launch; that child forks the ranks and watches them as
``torchrun`` does (the first rank that fails has the others terminated, after a few seconds
in which they may end by themselves). Each rank gets the
environment ``torchrun`` gives (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ...),
its own random seeds, Lightning's rank for ``rank_zero_only``, and runs the worker script as
``__main__``; its process group is a real gloo group, created from that environment.

Protocol, one JSON line each way per launch: the request ``{"script", "args", "nprocs",
"env", "stdout", "stderr"}`` (the ranks' whole environment, with ``MASTER_PORT``, and the two
output files), then the answers ``{"pid": ...}`` (the launch's process group, for the client
to kill on a timeout) and ``{"returncode": ...}``.
``PIPETX_TEST_LAUNCHER=torchrun`` makes the tests launch with ``torchrun`` instead.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import runpy
import signal
import sys
import tempfile
import time
import traceback

# What the worker scripts import, loaded before any fork (no threads may exist then).
import lightning.pytorch  # noqa: F401
import numpy as np
import timm  # noqa: F401
import tiny_models  # noqa: F401
import torch
import transformers  # noqa: F401
from lightning.fabric.utilities.rank_zero import _get_rank
from lightning_utilities.core.rank_zero import rank_zero_only

import lightning_pipetx  # noqa: F401

TERMINATE_GRACE_SECONDS = 30.0  # as torchrun: SIGTERM to the remaining ranks, SIGKILL after this
# Before that, the remaining ranks may end by themselves: a rank raising the same error as the first
# reports it (its traceback) a little later, on a busy machine after the first rank has exited.
SETTLE_SECONDS = 5.0
POLL_SECONDS = 0.05


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _run_rank(script: str, args: list[str], env: dict[str, str]) -> int:
    """In a forked rank: the worker script as ``__main__``, as ``python script args`` runs it."""
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # found again from this environment's TMPDIR when first asked
    torch.seed()  # a new process draws its seeds from the system, not from its parent's
    random.seed()
    np.random.seed()
    rank_zero_only.rank = _get_rank() or 0  # what Lightning sets when it is imported in a rank
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:  # sys.exit(n); sys.exit("message") prints it and exits with 1
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - the uncaught exception of the script: report it, as Python would
        sys.excepthook(*sys.exc_info())
        code = 1
    atexit._run_exitfuncs()
    return code


def _launch(request: dict) -> int:
    """In the launch's child: fork the ranks, watch them, return torchrun's exit code."""
    os.setpgid(0, 0)
    nprocs = request["nprocs"]
    base = {
        **request["env"],
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": str(nprocs),
        "MASTER_ADDR": "127.0.0.1",
        "TORCHELASTIC_RUN_ID": f"fork-{os.getpid()}",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    pids = set()
    for rank in range(nprocs):
        rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(out, 1), os.dup2(err, 2)
            code = 1
            try:
                code = _run_rank(request["script"], request["args"], rank_env)
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os._exit(code)
        pids.add(pid)
    return _watch(pids)


def _watch(pids: set[int]) -> int:
    """Wait for every rank; when one fails, terminate the others (torchrun's exit status: 1)
    unless they end within ``SETTLE_SECONDS``."""
    failed = False
    while pids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(POLL_SECONDS)
            continue
        pids.discard(pid)
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed = True
            _wait_for(pids, SETTLE_SECONDS)
            _terminate(pids)
    return 1 if failed else 0


def _wait_for(pids: set[int], seconds: float) -> None:
    """Reap the ranks of ``pids`` that end within ``seconds``."""
    deadline = time.monotonic() + seconds
    while pids and time.monotonic() < deadline:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(POLL_SECONDS)
        else:
            pids.discard(pid)


def _terminate(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    _wait_for(pids, TERMINATE_GRACE_SECONDS)
    for pid in list(pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pids.discard(pid)


def _answer(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def serve() -> None:
    """Answer launch requests from stdin until it closes."""
    threads = _threads()
    if threads != 1:
        _answer(
            {"error": f"{threads} threads after the imports, so forking is unsafe: set PIPETX_TEST_LAUNCHER=torchrun"}
        )
        return
    _answer({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _launch(request)
            except BaseException:  # noqa: BLE001 - the launch failed: say why in its output
                with open(request["stderr"], "a") as err:
                    traceback.print_exc(file=err)
            finally:
                os._exit(code)
        _answer({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _answer({"returncode": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    serve()
