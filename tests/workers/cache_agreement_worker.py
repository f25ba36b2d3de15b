"""Fit a tiny BERT on 2 replicas (1x2) under ElasticPipelineStrategy(cache=True), batch 16 = length 16
(so the rows' layout stays unproven), whose training_step masks tokens at random from epoch 1 on and,
on global rank 1 only, crops its batch to 8 tokens in epoch 2 (which switches that rank's cache off).
Every rank must then decide alike at the next epoch's start.

Usage: torchrun --nproc_per_node=2 cache_agreement_worker.py OUT_DIR
"""

from datetime import timedelta

import tiny_models as tm
import torch
from torch.utils.data import DataLoader
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback


class MaskedThenCroppedOnRank1(tm.TinyBertClassifier):
    def __init__(self):
        super().__init__(seed=0, dropout=0.0)

    def training_step(self, batch, batch_idx):
        if self.current_epoch >= 1:
            ids = batch["input_ids"].clone()
            ids[torch.rand(ids.shape) < 0.15] = 1
            batch = {**batch, "input_ids": ids}
        if self.current_epoch == 2 and self.global_rank == 1:
            batch = {key: value if key == "labels" else value[:, :8] for key, value in batch.items()}
        return super().training_step(batch, batch_idx)


def main() -> None:
    strategy = ElasticPipelineStrategy(pipeline_length=1, profile_steps=0, cache=True, timeout=timedelta(seconds=30))
    trainer = tm.make_trainer(
        [FreezeCallback(alpha=0.25, signal="schedule")], max_epochs=4, devices=2, strategy=strategy
    )
    trainer.fit(
        MaskedThenCroppedOnRank1(), DataLoader(tm.RandomTokenDataset(size=64, seed=1), batch_size=16, shuffle=True)
    )
    print(f"[rank{trainer.global_rank}] fit finished", flush=True)


if __name__ == "__main__":
    run_worker(main)
