"""Lightning's learning-rate finder, then a fit that freezes blocks, under a 2-stage pipeline: the
finder restores the module it saved before its trial steps while each rank holds only its
stage's blocks.

Usage: torchrun --nproc_per_node=2 tuner_worker.py OUT_DIR
Every rank writes OUT_DIR/rank<R>.json: the finder's losses, the learning rate it chose, whether
the weights after it were the initial ones, and the layouts of the fit; rank 0 writes the fitted
weights to OUT_DIR/fitted.pt.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from tiny_models import Layouts, RandomVectorDataset, TinySequentialRegressor, make_trainer
from torch.utils.data import DataLoader
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback

GLOBAL_BATCH = 8


def tune_and_fit(trainer, loader) -> tuple[TinySequentialRegressor, dict]:
    """The finder (16 trial steps, two epochs of 8), then the fit, on ``trainer``."""
    from lightning.pytorch.tuner import Tuner

    module = TinySequentialRegressor(seed=0, dropout=0.0)
    initial = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    finder = Tuner(trainer).lr_find(
        module, train_dataloaders=loader, min_lr=1e-4, max_lr=1.0, num_training=16, early_stop_threshold=None
    )
    restored = all(torch.equal(tensor, initial[name]) for name, tensor in module.state_dict().items())
    report = {"losses": finder.results["loss"], "lr": module.hparams.lr, "restored": restored}
    trainer.fit(module, loader)
    return module, report


def main() -> None:
    out_dir = sys.argv[1]
    layouts = Layouts()
    strategy = ElasticPipelineStrategy(pipeline_length=2, profile_steps=0, cache=False)
    freeze = FreezeCallback(alpha=0.5, signal="schedule")
    trainer = make_trainer([freeze, layouts], devices=2, strategy=strategy, default_root_dir=out_dir)
    loader = DataLoader(RandomVectorDataset(size=64), batch_size=GLOBAL_BATCH)
    module, report = tune_and_fit(trainer, loader)
    report["layouts"] = layouts.layouts
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as handle:
        json.dump(report, handle)
    if dist.get_rank() == 0:
        torch.save(module.state_dict(), os.path.join(out_dir, "fitted.pt"))


if __name__ == "__main__":
    run_worker(main)
