"""Launch a worker script on N CPU processes, from a test."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent
LAUNCHER_ENV = "PIPETX_TEST_LAUNCHER"
RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env(extra: dict | None = None) -> dict:
    """This environment for a worker process: one thread, the tests' import paths, ``extra``."""
    env = {
        **os.environ,
        **(extra or {}),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(TESTS_DIR / "workers"), str(TESTS_DIR), str(REPO), os.environ.get("PYTHONPATH", "")]
        ),
        "PYTHONUNBUFFERED": "1",
    }
    for name in ("PL_GLOBAL_SEED", *RENDEZVOUS_VARIABLES):  # the launcher gives each rank its own
        env.pop(name, None)
    return env


def run_workers(
    script: str, nprocs: int, *args: str, timeout: float = 600, expect_failure: bool = False, env: dict | None = None
) -> str:
    """Run ``tests/workers/<script>`` on ``nprocs`` gloo processes; return its output.

    ``env`` adds environment variables (for example ``PIPETX_STRICT_P2P=1``). The ranks are
    forked by :mod:`fork_launcher`, which imported torch and Lightning once for the session
    (``PIPETX_TEST_LAUNCHER=torchrun``: each launch is a ``torchrun`` of its own).

    Fails the calling test with the workers' output when they fail (or, with
    ``expect_failure``, when they succeed).
    """
    path, env = str(TESTS_DIR / "workers" / script), worker_env(env)
    if os.environ.get(LAUNCHER_ENV, "fork") == "torchrun":
        returncode, output = _torchrun(path, nprocs, args, timeout, env)
    else:
        returncode, output = _fork_server().launch(path, nprocs, args, timeout, env)
    if expect_failure:
        assert returncode != 0, f"workers were expected to fail:\n{output[-6000:]}"
    else:
        assert returncode == 0, f"workers failed (exit {returncode}):\n{output[-8000:]}"
    return output


def _torchrun(path: str, nprocs: int, args: tuple[str, ...], timeout: float, env: dict) -> tuple[int, str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nprocs}",
        f"--master_port={free_port()}",
        path,
        *args,
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    return proc.returncode, proc.stdout + proc.stderr


class ForkServer:
    """The client of one :mod:`fork_launcher` process: a launch at a time."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-u", str(TESTS_DIR / "fork_launcher.py")],
            env=worker_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        ready = self._answer(300)
        if not ready.get("ready"):
            raise RuntimeError(f"the fork launcher did not start: {ready}")

    def _answer(self, timeout: float) -> dict:
        readable, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if readable else ""
        if not line:
            raise TimeoutError("the fork launcher did not answer") if not readable else EOFError("it exited")
        return json.loads(line)

    def launch(self, path: str, nprocs: int, args: tuple[str, ...], timeout: float, env: dict) -> tuple[int, str]:
        """Run ``path`` on ``nprocs`` ranks with ``env`` as their whole environment, as torchrun would."""
        env = {**env, "MASTER_PORT": str(free_port())}
        with tempfile.TemporaryDirectory() as folder:
            out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
            request = {"script": path, "args": list(args), "nprocs": nprocs, "env": env, "stdout": out, "stderr": err}
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            pid = self._answer(60)["pid"]
            try:
                returncode = self._answer(timeout)["returncode"]
            except TimeoutError:
                os.killpg(pid, signal.SIGKILL)
                self._answer(60)
                raise subprocess.TimeoutExpired(path, timeout, output=_read(out) + _read(err)) from None
            return returncode, _read(out) + _read(err)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


_server: ForkServer | None = None


def _fork_server() -> ForkServer:
    global _server
    if _server is None or _server.process.poll() is not None:
        _server = ForkServer()
        atexit.register(_server.close)
    return _server


def run_nodes(script: str, nodes: int, nprocs: int, *args: str, timeout: float = 600) -> str:
    """Run ``tests/workers/<script>`` as ``nodes`` simulated nodes of ``nprocs`` gloo processes
    each: one ``torchrun --nnodes`` launcher per node, all on this machine."""
    env = worker_env()
    port = free_port()
    launchers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={nodes}",
                f"--node_rank={node}",
                f"--nproc_per_node={nprocs}",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                str(TESTS_DIR / "workers" / script),
                *args,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
        )
        for node in range(nodes)
    ]
    outputs, codes = [], []
    try:
        for launcher in launchers:
            outputs.append(launcher.communicate(timeout=timeout)[0])
            codes.append(launcher.returncode)
    finally:
        for launcher in launchers:
            launcher.kill()
    output = "\n".join(outputs)
    assert codes == [0] * nodes, f"nodes failed (exits {codes}):\n{output[-8000:]}"
    return output
