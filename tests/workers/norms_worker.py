"""Two ranks agree on FreezeCallback's gradient-norm rows (IntervalNorms) when rank 1 recorded one
step fewer, as a rank interrupted inside a step has.

Usage: torchrun --nproc_per_node=2 norms_worker.py (running | stopped)
"running": over the world's group, which refuses the mismatch (a recipe that skips optimizer steps);
"stopped": over a group of the ranks that agreed the run stopped on an exception, where the steps
every rank recorded count and the extra one is dropped.
"""

import sys

import torch
import torch.distributed as dist
from worker_exit import run_worker

from lightning_pipetx.callbacks.block_norms import IntervalNorms


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    norms = IntervalNorms()
    norms.resize(2)
    steps = 3 if rank == 0 else 2
    for step in range(steps):  # [norm of block 0, norm of block 1, finite, measured]: rank r measures block r
        row = torch.zeros(4, dtype=torch.float64)
        row[rank] = float(step + 1)
        row[2:] = 1.0
        norms.rows.append(row)
    stopped = dist.new_group(backend="gloo") if sys.argv[1] == "stopped" else None
    sums, counted = norms.totals(stopped)
    print(f"rank {rank} sums {sums.tolist()} steps {counted}", flush=True)


if __name__ == "__main__":
    run_worker(main)
