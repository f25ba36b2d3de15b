"""A tiny HF ResNet (BatchNorm in every block) through a 2x1 -> 1x2 transition on 2 processes.

Usage: torchrun --nproc_per_node=2 buffers_worker.py OUT_DIR [direct|replicas]
Every rank writes OUT_DIR/buffers_rank<N>.json: the layout, and every block's BatchNorm
statistics at the start of each epoch and after fit. ``direct``: 3 of 4 blocks freeze after
epoch 0, so the layout goes from 2x1 to 1x2 at once, and no checkpoint is written before.
``replicas``: 1x2 from the start, every batch norm training on its replica's half of each batch.
Otherwise, from epoch 1 on every batch norm is in eval mode (a fine-tune recipe), so transitions may add
replicas: while one trains, the strategy keeps the number of replicas.
"""

import json
import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from tiny_models import RandomImageDataset
from torch.utils.data import DataLoader
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback


def tiny_resnet() -> torch.nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(
        num_channels=3,
        embedding_size=8,
        hidden_sizes=[8, 8, 8, 8],
        depths=[1, 1, 1, 1],
        layer_type="basic",
        num_labels=5,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return ResNetForImageClassification(config)


class ResNetClassifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = tiny_resnet()

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return self.model(pixel_values=images, labels=labels).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def statistics(module: pl.LightningModule) -> list[list[float]]:
    """Per block: the sum of its running means, of its running variances, and its batch count."""
    blocks = module.model.resnet.encoder.stages
    result = []
    for block in blocks:
        buffers = dict(block.named_buffers())
        result.append(
            [
                float(sum(v.sum() for k, v in buffers.items() if k.endswith("running_mean"))),
                float(sum(v.sum() for k, v in buffers.items() if k.endswith("running_var"))),
                float(sum(v.sum() for k, v in buffers.items() if k.endswith("num_batches_tracked"))),
            ]
        )
    return result


def embedder_statistics(module: pl.LightningModule) -> list[float]:
    """The same sums for the BatchNorm before the blocks (``pre``: the embedder's)."""
    buffers = dict(module.model.resnet.embedder.named_buffers())
    return [float(sum(v.sum() for k, v in buffers.items() if k.endswith(name))) for name in ("mean", "var", "tracked")]


class BatchNormStatisticsFreeze(Callback):
    """Every batch norm in eval mode after epoch 0: put it before FreezeCallback, whose decision
    (and transition) at the epoch's end must see them so."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch > 0:
            self._freeze(pl_module)

    def on_train_epoch_end(self, trainer, pl_module):
        self._freeze(pl_module)

    @staticmethod
    def _freeze(pl_module):
        for module in pl_module.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.eval()


class Recorder(Callback):
    """Put it before FreezeCallback: its epoch end runs before a decision's transition."""

    def __init__(self, out_dir: str, save: bool):
        self.out_dir, self.save = out_dir, save
        self.epochs = []
        self.embedder_at_epoch_end = []

    def on_train_epoch_start(self, trainer, pl_module):
        layout = trainer.strategy.layout
        self.epochs.append({"layout": str(layout), "blocks": statistics(pl_module)})

    def on_train_epoch_end(self, trainer, pl_module):
        self.embedder_at_epoch_end.append(embedder_statistics(pl_module))
        if trainer.current_epoch == 0 and self.save:
            trainer.save_checkpoint(os.path.join(self.out_dir, "epoch0.ckpt"))

    def on_train_end(self, trainer, pl_module):
        self.at_train_end = statistics(pl_module)


def main():
    out_dir, mode = sys.argv[1], (sys.argv[2:] or [""])[0]
    direct, replicas = mode == "direct", mode == "replicas"
    recorder = Recorder(out_dir, save=not direct)
    bn_freeze = [] if replicas else [BatchNormStatisticsFreeze()]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ElasticPipelineStrategy(
            pipeline_length=1 if replicas else 2, num_microbatches=1, profile_steps=0, cache=False
        ),
        callbacks=[recorder, *bn_freeze, FreezeCallback(alpha=3 / 4 if direct else 1 / 2, signal="schedule")],
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    module = ResNetClassifier()
    trainer.fit(module, DataLoader(RandomImageDataset(size=32, seed=1), batch_size=8))
    report = {
        "epochs": recorder.epochs,
        "at_train_end": recorder.at_train_end,
        "final": statistics(module),
        "embedder_at_epoch_end": recorder.embedder_at_epoch_end,
        "final_embedder": embedder_statistics(module),
    }
    with open(os.path.join(out_dir, f"buffers_rank{trainer.global_rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    run_worker(main)
