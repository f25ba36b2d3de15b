"""What a rank sees at start, for tests/test_launcher.py.

Usage: launch_worker.py OUT_DIR (report | fail)
"report": each rank writes its rendezvous variables, first random draws and Lightning's rank,
after a barrier over a gloo group. "fail": rank 1 raises at once, rank 0 waits for it forever.
"""

import json
import os
import random
import sys
import time

import lightning.pytorch  # noqa: F401 - sets rank_zero_only.rank when imported, as in every worker
import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_only
from worker_exit import run_worker


def main() -> None:
    out_dir, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    if mode == "fail":
        if rank == 1:
            raise ValueError("rank 1 stops here")
        time.sleep(600)
    dist.init_process_group("gloo")
    dist.barrier()
    report = {
        name: os.environ.get(name)
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID", "PIPETX_PROBE")
    }
    report.update(
        torch_draw=torch.rand(1).item(),
        python_draw=random.random(),
        lightning_rank=rank_zero_only.rank,
        main=__name__,
        argv=sys.argv[1:],
        group_rank=dist.get_rank(),
        group_size=dist.get_world_size(),
    )
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    run_worker(main)
