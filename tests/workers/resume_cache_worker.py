"""AutoCache after a resume that moves to another layout: 2 processes, 2x1 -> 1x2 as blocks freeze, 5 epochs,
a checkpoint after every epoch; resumed from one, FreezeCallback re-applies the frozen prefix at
the start of fit and the strategy moves to 1x2 before the first step.

Usage: torchrun --nproc_per_node=2 resume_cache_worker.py OUT_DIR [CKPT|-] [validate]
Rank 0 writes OUT_DIR/report.json: the training cache's hit rate logged each epoch (None: not logged).
``validate``: with a validation loader, and the checkpoints written after each epoch's last batch
(a resumed fit then builds the validation loader while ``trainer.training`` is set).
``other_data``: the training set holds other samples (of the same number) than the checkpoint's run's.
Rank 0 also saves the module's final weights as OUT_DIR/final.pt.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from tiny_models import RandomVectorDataset, TinySequentialRegressor, make_trainer
from torch.utils.data import DataLoader
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback


class HitRates(Callback):
    def __init__(self):
        self.rates = {}

    def on_train_epoch_end(self, trainer, pl_module):
        rate = trainer.callback_metrics.get("pipetx/cache_hit_rate")
        self.rates[trainer.current_epoch] = None if rate is None else float(rate)


def main() -> None:
    out_dir, ckpt, *options = sys.argv[1:] + ["-"] * (len(sys.argv) < 3)
    validate, other_data = options == ["validate"], options == ["other_data"]
    rates = HitRates()
    every = {"every_n_train_steps": 4} if validate else {"every_n_epochs": 1}  # 4 batches an epoch
    checkpoints = ModelCheckpoint(dirpath=out_dir, save_top_k=-1, filename="{epoch}", **every)
    strategy = ElasticPipelineStrategy(pipeline_length=2, num_microbatches=2, profile_steps=0, cache=True)
    callbacks = [FreezeCallback(alpha=0.5, signal="schedule"), rates, checkpoints]
    trainer = make_trainer(callbacks, max_epochs=5, devices=2, strategy=strategy, enable_checkpointing=True)
    loader = DataLoader(RandomVectorDataset(size=32, seed=3 if other_data else 1), batch_size=8, shuffle=True)
    val_loader = DataLoader(RandomVectorDataset(size=8, seed=2), batch_size=4) if validate else None
    module = TinySequentialRegressor(seed=0, dropout=0.0)
    trainer.fit(module, loader, val_loader, ckpt_path=None if ckpt == "-" else ckpt)
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "report.json"), "w") as handle:
            json.dump(rates.rates, handle)
        torch.save(module.state_dict(), os.path.join(out_dir, "final.pt"))


if __name__ == "__main__":
    run_worker(main)
