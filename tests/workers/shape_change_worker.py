"""Fit a tiny BERT on 2 processes, 2x1 turning 1x2 as blocks freeze, whose training_step keeps only
the first 8 of the 16 tokens from epoch ``CROP`` on; rank 0 writes the weights, the layouts and the
hit rates.

Usage: torchrun --nproc_per_node=2 shape_change_worker.py OUT_DIR CACHE(auto|false) CROP
"""

import json
import os
import sys

import tiny_models as tm
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback


class CroppedFrom(tm.TinyBertClassifier):
    def __init__(self, epoch):
        super().__init__(seed=0, dropout=0.0)
        self.crop_from = epoch

    def training_step(self, batch, batch_idx):
        if self.current_epoch >= self.crop_from:
            batch = {key: value if key == "labels" else value[:, :8] for key, value in batch.items()}
        return super().training_step(batch, batch_idx)


def main() -> None:
    out, cache, crop = sys.argv[1], sys.argv[2], int(sys.argv[3])
    layouts, rates = tm.Layouts(), tm.HitRates()
    strategy = ElasticPipelineStrategy(
        pipeline_length=2,
        profile_steps=0,
        cache={"auto": "auto", "false": False}[cache],
        cache_dir=os.path.join(out, "spill"),
    )
    # 1 then 2 of 4 blocks frozen after epochs 0 and 1: 2x1, 2x1, then 1x2 from epoch 2
    freeze = FreezeCallback(alpha=0.25, signal="schedule")
    trainer = tm.make_trainer([freeze, layouts, rates], max_epochs=4, devices=2, strategy=strategy)
    module = CroppedFrom(crop)
    trainer.fit(module, DataLoader(tm.RandomTokenDataset(size=32, seed=1), batch_size=8, shuffle=True))
    if dist.get_rank() == 0:
        torch.save(module.state_dict(), os.path.join(out, f"{cache}.pt"))
        with open(os.path.join(out, f"{cache}.json"), "w") as f:
            json.dump({"layouts": layouts.layouts, "rates": rates.rates}, f)


if __name__ == "__main__":
    run_worker(main)
