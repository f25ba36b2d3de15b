"""The freeze guard across a 2x1 -> 1x2 transition, with a metric logged without ``sync_dist``.

Usage: torchrun --nproc_per_node=2 guard_worker.py OUT_DIR
Validation logs ``val_parity``, the mean parity of the validation samples' indices, without
``sync_dist``: 0.5 over the whole set (one replica), 0 on one replica's half and 1 on the other's
after the transition. The model does not change it, so the guard must never trip. Every rank
writes OUT_DIR/guard_rank<N>.json: the layout each epoch, the frozen blocks and the guard's state.
"""

import json
import os
import sys

import torch
from tiny_models import Layouts, RandomVectorDataset, TinySequentialRegressor, make_loader, make_trainer
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback


class ParityRegressor(TinySequentialRegressor):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_parity", y[:, 0].mean(), batch_size=len(y))  # no sync_dist: each replica's own


def main():
    out_dir = sys.argv[1]
    validation = RandomVectorDataset(size=8, seed=1)
    validation.y = torch.tensor([[float(i % 2), 0.0] for i in range(8)])  # replica halves: even, odd indices
    freeze = FreezeCallback(alpha=0.5, signal="schedule", monitor="val_parity", tolerance=0.1)
    layouts = Layouts()
    trainer = make_trainer(
        [freeze, layouts],
        max_epochs=3,
        devices=2,
        strategy=ElasticPipelineStrategy(pipeline_length=2, profile_steps=0),
    )
    trainer.fit(
        ParityRegressor(seed=0, dropout=0.0), make_loader(RandomVectorDataset(size=16)), make_loader(validation)
    )
    report = {
        "layouts": layouts.layouts,
        "frozen": freeze.frozen_blocks,
        "stopped": freeze.guard.stopped,
        "best": freeze.guard.best,
    }
    with open(os.path.join(out_dir, f"guard_rank{trainer.global_rank}.json"), "w") as handle:
        json.dump(report, handle)


if __name__ == "__main__":
    run_worker(main)
