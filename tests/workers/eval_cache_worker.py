"""Fit the same run with AutoCache off and on; each rank writes its validation losses and what
the validation cache served in every validation.

Usage: torchrun --nproc_per_node=2 eval_cache_worker.py OUT_DIR PIPELINE_LENGTH
(2: a static 2-stage pipeline, the first stage serves validation; 1: two replicas that share
the node's RAM tier)
"""

import json
import os
import sys

import lightning.pytorch as pl
import tiny_models as tm
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback

EPOCHS = 4


class ValidationRecord(Callback):
    def __init__(self):
        self.losses, self.served, self.stage = [], [], None

    def on_validation_epoch_end(self, trainer, pl_module):
        self.losses.append(float(trainer.callback_metrics["val_loss"]))
        self.stage = trainer.strategy.engine.topology.stage
        cache = trainer.strategy.engine.eval_cache
        self.served.append(None if cache is None else [cache.counts.hits, cache.counts.lookups])


def fit(cache: bool, pipeline_length: int, spill: str) -> dict:
    record = ValidationRecord()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=ElasticPipelineStrategy(
            pipeline_length=pipeline_length, elastic=False, cache=cache, profile_steps=0, cache_dir=spill
        ),
        max_epochs=EPOCHS,
        callbacks=[FreezeCallback(alpha=1 / 2, signal="schedule"), record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    module = tm.TinyBertClassifier(seed=0, dropout=0.0)
    train = DataLoader(tm.RandomTokenDataset(size=32, seed=1), batch_size=8 // (2 // pipeline_length))
    val = DataLoader(tm.RandomTokenDataset(size=24, seed=2), batch_size=4)
    trainer.fit(module, train, val)
    return {"losses": record.losses, "served": record.served, "stage": record.stage}


def main():
    out_dir, pipeline_length = sys.argv[1], int(sys.argv[2])
    rank = int(os.environ["RANK"])
    spill = os.path.join(out_dir, "spill")
    report = {str(cache): fit(cache, pipeline_length, spill) for cache in (False, True)}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(report, handle)


if __name__ == "__main__":
    run_worker(main)
