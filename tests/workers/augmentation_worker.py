"""Random augmentation in the dataset on a 2-stage pipeline that becomes 2 replicas (2x1 -> 1x2):
a replica's stages must draw the same noise.

Usage: torchrun --nproc_per_node=2 augmentation_worker.py OUT_DIR MODE
MODE: ``seeded_workers`` (``seed_everything(0, workers=True)``, drawn in a loader worker) or
``unseeded`` (no ``seed_everything``: each process's own random state; drawn in the main process).
Every rank writes OUT_DIR/rank<N>.json: the layout each epoch, the noise each epoch's samples
drew on this rank, and the rank its training loader's workers were last seeded with (or None).
"""

import json
import os
import sys

import lightning.pytorch as pl
import torch
from tiny_models import Layouts, RandomVectorDataset, TinySequentialRegressor, make_trainer
from torch.utils.data import DataLoader, Dataset
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback


class NoisyVectors(Dataset):
    """:class:`RandomVectorDataset` with fresh noise on every read (torchvision-style augmentation,
    seeded by nothing but the worker's seed); the sample's index rides along."""

    def __init__(self):
        self.samples = RandomVectorDataset(size=32)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        x, y = self.samples[index]
        noise = 0.1 * torch.randn(())
        return x + noise, y, index, noise


class NoiseRecorder(TinySequentialRegressor):
    def __init__(self):
        super().__init__(seed=0, dropout=0.0)
        self.noise = {}

    def training_step(self, batch, batch_idx):
        x, y, index, noise = batch
        epoch = self.noise.setdefault(str(self.current_epoch), {})
        epoch.update({str(i): float(n) for i, n in zip(index.tolist(), noise.tolist())})
        return super().training_step((x, y), batch_idx)


def main() -> None:
    seeded = sys.argv[2] == "seeded_workers"
    if seeded:
        pl.seed_everything(0, workers=True)
    layouts = Layouts()
    strategy = ElasticPipelineStrategy(pipeline_length=2, profile_steps=0, cache=False)
    trainer = make_trainer(
        [FreezeCallback(alpha=0.5, signal="schedule"), layouts], max_epochs=3, devices=2, strategy=strategy
    )
    module = NoiseRecorder()
    trainer.fit(module, DataLoader(NoisyVectors(), batch_size=8, num_workers=1 if seeded else 0))
    seeded_as = trainer.train_dataloader.worker_init_fn.keywords["rank"] if seeded else None
    report = {"layouts": layouts.layouts, "noise": module.noise, "workers_seeded_as_rank": seeded_as}
    with open(os.path.join(sys.argv[1], f"rank{trainer.global_rank}.json"), "w") as handle:
        json.dump(report, handle)


if __name__ == "__main__":
    run_worker(main)
