"""Fine-tune the tiny BERT (dropout on, a linear-decay schedule over ``trainer.estimated_stepping_batches``,
shuffled, validated every epoch) under Lightning's DDP or ElasticPipelineStrategy(pipeline_length=1)
from the same seed, optionally with FreezeCallback; rank 0 saves the weights.

Usage: torchrun --nproc_per_node=2 seeded_dropout_worker.py {ddp,pipetx} {none,freeze} OUT_FILE
"""

import sys

import lightning.pytorch as pl
import torch
from tiny_models import TASKS, TinyBertClassifier, make_trainer
from torch.utils.data import DataLoader
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback


class ScheduledBert(TinyBertClassifier):
    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        total = self.trainer.estimated_stepping_batches  # builds the training loader during setup
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def main() -> None:
    which, freezing, out_file = sys.argv[1:4]
    pl.seed_everything(0)
    model = ScheduledBert(dropout=0.3)
    strategy = "ddp" if which == "ddp" else ElasticPipelineStrategy(pipeline_length=1)
    callbacks = [FreezeCallback()] if freezing == "freeze" else []
    trainer = make_trainer(callbacks, max_epochs=3, devices=2, strategy=strategy)
    # Loaders without a generator of their own, as most users write them: each iteration draws a
    # seed from torch's global generator.
    # The training loader drops each replica's last, short batch (25 samples, 6 batches of 4): AutoCache
    # caches the dropped sample's frozen prefix after the epoch, which must not change the run either.
    train = DataLoader(TASKS["bert"].dataset(size=50, seed=0), batch_size=4, drop_last=True)
    val = DataLoader(TASKS["bert"].dataset(size=16, seed=0), batch_size=4)
    trainer.fit(model, train, val)
    if trainer.is_global_zero:
        torch.save({name: p.detach().clone() for name, p in model.named_parameters()}, out_file)


if __name__ == "__main__":
    run_worker(main)
