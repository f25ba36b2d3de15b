"""Launch a worker script on N CPU processes with torchrun, from a test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent


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
    env.pop("PL_GLOBAL_SEED", None)
    return env


def run_workers(
    script: str, nprocs: int, *args: str, timeout: float = 600, expect_failure: bool = False, env: dict | None = None
) -> str:
    """Run ``tests/workers/<script>`` on ``nprocs`` gloo processes; return its output.

    ``env`` adds environment variables (for example ``PIPETX_STRICT_P2P=1``).

    Fails the calling test with the workers' output when they fail (or, with
    ``expect_failure``, when they succeed).
    """
    env = worker_env(env)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nprocs}",
        f"--master_port={free_port()}",
        str(TESTS_DIR / "workers" / script),
        *args,
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    output = proc.stdout + proc.stderr
    if expect_failure:
        assert proc.returncode != 0, f"workers were expected to fail:\n{output[-6000:]}"
    else:
        assert proc.returncode == 0, f"workers failed (exit {proc.returncode}):\n{output[-8000:]}"
    return output


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
