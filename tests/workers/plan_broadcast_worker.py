"""Ranks whose planners disagree take global rank 0's plan: on 2 processes (2x1 over 4 blocks)
rank 1's planner is made to keep the layout at every freeze, as if its profile said another
layout was slower, while rank 0's moves to 1x2.

Usage: torchrun --nproc_per_node=2 plan_broadcast_worker.py OUT_DIR
Every rank writes OUT_DIR/rank<R>.json: the layout each epoch and the frozen blocks.
"""

import json
import os
import sys

import torch.distributed as dist
from tiny_models import Layouts, RandomVectorDataset, TinySequentialRegressor, make_trainer
from torch.utils.data import DataLoader
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback
from lightning_pipetx.strategy.autopipe import AutoPipe


class KeepsTheLayout(Layouts):
    """On global rank 1, from set-up on: a planner that finds no layout for any frozen prefix."""

    def setup(self, trainer, pl_module, stage):
        if trainer.global_rank == 1:
            original = AutoPipe.plan
            AutoPipe.plan = lambda planner, frozen, *args: None if frozen > 0 else original(planner, frozen, *args)


def main() -> None:
    out_dir = sys.argv[1]
    freeze, layouts = FreezeCallback(alpha=0.5, signal="schedule"), KeepsTheLayout()
    strategy = ElasticPipelineStrategy(pipeline_length=2, profile_steps=0, cache=False)
    trainer = make_trainer([freeze, layouts], max_epochs=3, devices=2, strategy=strategy)
    trainer.fit(TinySequentialRegressor(seed=0, dropout=0.0), DataLoader(RandomVectorDataset(size=16), batch_size=4))
    report = {"layouts": layouts.layouts, "frozen": freeze.frozen_blocks}
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as handle:
        json.dump(report, handle)


if __name__ == "__main__":
    run_worker(main)
