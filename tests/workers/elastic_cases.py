"""The elastic run shared by the 4-process worker and the single-process reference."""

from __future__ import annotations

import lightning.pytorch as pl
from equivalence_cases import build_case_module
from tiny_models import TASKS
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pipetx import FreezeCallback

EPOCHS = 3
GLOBAL_BATCH = 8
# The training loader drops the last, short batch: 4 batches and 4 samples left out an epoch on 1
# replica, 2 per replica on 2, 1 on 4 (the same global batches). AutoCache caches the samples left
# out after each epoch, on the first stages of the replicas.
TRAIN_SIZE = 36


def freeze_callback() -> FreezeCallback:
    # The closed-form schedule: decisions that do not depend on float noise in gradient norms.
    return FreezeCallback(alpha=1 / 2, signal="schedule")


def build_module(model: str, optimizer: str = "adamw") -> pl.LightningModule:
    return build_case_module({"model": model, "lr": 1e-3, "optimizer": optimizer})


def train_loader(model: str, batch_size: int = GLOBAL_BATCH, sampler=None) -> DataLoader:
    dataset = TASKS[model].dataset(size=TRAIN_SIZE, seed=1)
    return DataLoader(dataset, batch_size=batch_size, shuffle=sampler is None, sampler=sampler, drop_last=True)


def val_loader(model: str) -> DataLoader:
    return DataLoader(TASKS[model].dataset(size=8, seed=2), batch_size=4)


def reference_run(
    model: str, epochs: int = EPOCHS, checkpoint_dir: str | None = None, optimizer: str = "adamw"
) -> dict:
    """One process, the same global batches and freeze decisions.

    Returns the final weights, optimizer state and frozen count; with ``checkpoint_dir``,
    also writes a checkpoint there at the end of every epoch.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = build_module(model, optimizer)
    freeze = freeze_callback()
    dataset = TASKS[model].dataset(size=TRAIN_SIZE, seed=1)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    callbacks = [freeze]
    if checkpoint_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, save_top_k=-1, every_n_epochs=1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=checkpoint_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, train_loader(model, sampler=sampler))
    return {
        "state": module.state_dict(),
        "optimizer": trainer.optimizers[0].state_dict(),
        "frozen": freeze.frozen_blocks,
        "pre_weights": freeze.pre_weights,
    }
