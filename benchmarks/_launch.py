"""Run a benchmark worker on N local processes (torchrun) and collect what each rank wrote; run
configurations in rounds, and say whether the rounds resolve a ratio from 1."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from math import ceil, comb, floor, isfinite, ulp
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def add_worker_options(parser: argparse.ArgumentParser) -> None:
    """The hidden options :func:`launch` starts a worker with: ``--worker CONFIG --result-dir DIR``."""
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)


def launch(script: str, config: str, nprocs: int, argv: list[str], result_dir: str) -> list[dict]:
    """Run ``script --worker CONFIG`` on ``nprocs`` processes (one plain process for 0);
    return the JSON results the ranks wrote as ``<result_dir>/<config>_rank<N>.json``."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "examples"), env.get("PYTHONPATH", "")])
    launcher = [sys.executable]
    if nprocs > 0:
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={nprocs}", f"--master_port={free_port()}"]
    command = [*launcher, script, *argv, "--worker", config, "--result-dir", result_dir]
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{config} failed:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return [json.loads(p.read_text()) for p in sorted(Path(result_dir).glob(f"{config}_rank*.json"))]


def in_turn(configs: list[str], repeats: int) -> list[tuple[int, str]]:
    """``(round, config)`` in the order to run them: every configuration once per round, in
    reverse order every other round, so that a machine whose speed drifts during a round
    favours no configuration of a pair."""
    order = []
    for repeat in range(repeats):
        order += [(repeat, config) for config in (configs if repeat % 2 == 0 else configs[::-1])]
    return order


def median_interval(values: list[float], confidence: float = 0.9) -> tuple[float, float, float] | None:
    """A distribution-free interval for the median of what ``values`` sample (rounds of a ratio taken
    in turn): the narrowest pair of order statistics whose binomial coverage is at least
    ``confidence``, as ``(low, high, coverage)``; None where the values are too few for any."""
    ordered, n = sorted(values), len(values)
    interval = None
    for k in range(1, n // 2 + 1):  # (k-th smallest, k-th largest)
        coverage = 1 - 2 * sum(comb(n, i) for i in range(k)) / 2**n
        if coverage < confidence:
            break
        interval = (ordered[k - 1], ordered[n - k], coverage)
    return interval


def unfavourable(value: float, digits: int, higher_is_better: bool = True) -> str:
    """``value`` to ``digits`` decimals, rounded toward the unfavourable side (down where higher
    is better), so that a printed figure never claims more than was measured."""
    if not isfinite(value):
        return str(value)
    scaled = value * 10**digits
    noise = max(1e-9, 8 * ulp(scaled))  # float noise: 0.29 * 100 is 28.999999999999996
    scaled = floor(scaled + noise) if higher_is_better else ceil(scaled - noise)
    return f"{scaled / 10**digits:.{digits}f}"


def ratio_figure(value: float | None, digits: int = 2) -> str:
    """A speed-up or throughput ratio for a table (higher is better), as ``1.23x``; ``-`` for None."""
    return "-" if value is None else f"{unfavourable(value, digits)}x"


def ratio_verdict(ratios: list[float], target: float = 1.0) -> str:
    """Whether the rounds' ratios put their median above or below ``target``, or do not resolve it.
    The median round's ratio and its interval's ends are printed rounded down: a "below" never
    prints an end at or above ``target``, an "above" may print its low end as ``target`` itself."""
    interval = median_interval(ratios)
    if interval is None:
        return f"too few rounds for an interval ({len(ratios)})"
    low, high, coverage = interval
    where = "above" if low > target else "below" if high < target else "not resolved from"
    middle, ends = unfavourable(median(ratios), 3), f"{unfavourable(low, 3)}-{unfavourable(high, 3)}"
    return f"median round {middle}, its {floor(100 * coverage)}% interval {ends}: {where} {target}"


def write_json(path: str | Path, result: dict) -> None:
    """Write a benchmark's figures to ``path`` (folders created) and say where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
