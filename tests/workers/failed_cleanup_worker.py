"""Fit a tiny BERT on 2 processes (2x1 turning 1x2 after epoch 0, AutoCache on, a validation loader)
whose global rank 0 raises in its first validation step of epoch 1, while rank 1 still validates.

Usage: torchrun --nproc_per_node=2 failed_cleanup_worker.py OUT_DIR
"""

import os
import sys
from datetime import timedelta

import tiny_models as tm
from torch.utils.data import DataLoader
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback


class FailsInValidation(tm.TinyBertClassifier):
    def __init__(self):
        super().__init__(seed=0, dropout=0.0)

    def validation_step(self, batch, batch_idx):
        if self.current_epoch == 1 and batch_idx == 0 and self.global_rank == 0:
            raise RuntimeError("a validation step failed on global rank 0")
        return super().validation_step(batch, batch_idx)


def main() -> None:
    out = sys.argv[1]
    strategy = ElasticPipelineStrategy(
        pipeline_length=2, profile_steps=0, cache_dir=os.path.join(out, "spill"), timeout=timedelta(seconds=30)
    )
    freeze = FreezeCallback(alpha=0.5, signal="schedule")
    trainer = tm.make_trainer([freeze], max_epochs=3, devices=2, strategy=strategy)
    train = DataLoader(tm.RandomTokenDataset(size=32, seed=1), batch_size=8, shuffle=True)
    trainer.fit(FailsInValidation(), train, DataLoader(tm.RandomTokenDataset(size=16, seed=2), batch_size=4))


if __name__ == "__main__":
    run_worker(main)
