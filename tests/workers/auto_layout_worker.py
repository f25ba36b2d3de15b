"""Train one step with pipeline_length="auto" under each memory budget; rank 0 writes the layouts.

Usage: torchrun --nproc_per_node=N auto_layout_worker.py OUT_FILE BUDGET [BUDGET ...]
(BUDGET: bytes per device, or "default").
"""

import json
import os
import sys

import lightning.pytorch as pl
from tiny_models import build_task, task_loader
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy


class LayoutSeen(pl.Callback):
    def __init__(self):
        self.layout = None

    def on_train_start(self, trainer, pl_module):
        self.layout = str(trainer.strategy.layout)


def main() -> None:
    out_file, budgets = sys.argv[1], sys.argv[2:]
    world = int(os.environ["WORLD_SIZE"])
    layouts = {}
    for budget in budgets:
        strategy = ElasticPipelineStrategy(memory_budget=None if budget == "default" else int(budget))
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=strategy,
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        seen = LayoutSeen()
        trainer.callbacks.append(seen)
        trainer.fit(build_task("sequential", dropout=0.0), task_loader("sequential", batch_size=4))
        layouts[budget] = seen.layout
    if trainer.is_global_zero:
        with open(out_file, "w") as f:
            json.dump(layouts, f)


if __name__ == "__main__":
    run_worker(main)
