"""Train with FreezeCallback under an elastic pipeline; rank 0 saves weights and the layout per epoch.

Usage: torchrun --nproc_per_node=N elastic_worker.py OUT_DIR MODEL (bert | timm_vit) [static] [groups] [reload2]
[datamodule] [resume CKPT] ("static": elastic=False, the layout stays while blocks freeze; "groups": two AdamW
parameter groups split by parameter shape; "reload2": reload_dataloaders_every_n_epochs=2; "datamodule": the
loaders from a LightningDataModule's hooks; "resume": fit from CKPT)
"""

import json
import os
import sys

import lightning.pytorch as pl
import torch
from elastic_cases import EPOCHS, build_module, freeze_callback, train_loader, val_loader
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy


class LayoutRecorder(Callback):
    """The layout each epoch trained on, the frozen prefix it trained with, and the share of its
    training samples AutoCache served (None before anything froze)."""

    def __init__(self, freeze):
        self.freeze = freeze
        self.epochs = []
        self.served = []
        self.reloads = []

    def on_train_epoch_start(self, trainer, pl_module):
        layout = trainer.strategy.layout
        batch = trainer.train_dataloader.batch_size
        self.epochs.append([self.freeze.frozen_blocks, layout.pipeline_length, layout.replicas, batch])

    def on_train_epoch_end(self, trainer, pl_module):
        self.reloads.append(trainer.fit_loop._last_train_dl_reload_epoch)  # reload_dataloaders_every_n_epochs counts on
        metrics = trainer.callback_metrics
        shares = [float(v) for k, v in metrics.items() if k.startswith("pipetx/cache_served_") and "bytes" not in k]
        self.served.append(sum(shares) if self.epochs[-1][0] > 0 else None)


class CountingData(pl.LightningDataModule):
    """The worker's loaders from a DataModule's hooks, which record the epoch of each of their calls."""

    def __init__(self, model_name):
        super().__init__()
        self.model_name = model_name
        self.calls = {"train": [], "val": []}

    def train_dataloader(self):
        self.calls["train"].append(self.trainer.current_epoch)
        return train_loader(self.model_name)

    def val_dataloader(self):
        self.calls["val"].append(self.trainer.current_epoch)
        return val_loader(self.model_name)


class ValidationBatchLog(Callback):
    """Logs each validation batch of fit for the step only: the logger writes it at the step
    Lightning counts validation batches by (which DDP never resets during fit)."""

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if trainer.state.fn == "fit":
            pl_module.log("val_batch", float(batch_idx), on_step=True, on_epoch=False)


def main():
    out_dir, model_name = sys.argv[1], sys.argv[2]
    options = sys.argv[3:]
    elastic = "static" not in options
    ckpt_path = options[options.index("resume") + 1] if "resume" in options else None
    reload_every = 2 if "reload2" in options else 0
    optimizer = "adamw_groups" if "groups" in options else "adamw"
    world = int(os.environ["WORLD_SIZE"])
    freeze = freeze_callback()
    recorder = LayoutRecorder(freeze)
    checkpoint = ModelCheckpoint(dirpath=out_dir, save_top_k=-1, every_n_epochs=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        # Parameter counts as costs (no profiling): the test predicts the plan from them.
        strategy=ElasticPipelineStrategy(
            pipeline_length=min(4, world),
            num_microbatches="auto" if model_name == "batchnorm" else 2,  # batch norms: whole batches
            profile_steps=0,
            elastic=elastic,
        ),
        max_epochs=EPOCHS,
        callbacks=[freeze, recorder, checkpoint, ValidationBatchLog()],
        logger=CSVLogger(out_dir, name="csv", version=0),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        reload_dataloaders_every_n_epochs=reload_every,
    )
    module = build_module(model_name, optimizer)
    if "datamodule" in options:
        data = CountingData(model_name)
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    else:
        data = None
        trainer.fit(module, train_loader(model_name), val_loader(model_name), ckpt_path=ckpt_path)
    fit_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    trainer.save_checkpoint(os.path.join(out_dir, "after_fit.ckpt"))
    metrics = trainer.validate(module, val_loader(model_name), verbose=False)[0]
    trainer.save_checkpoint(os.path.join(out_dir, "after_validate.ckpt"), weights_only=True)
    try:
        trainer.save_checkpoint(os.path.join(out_dir, "refused.ckpt"))
        refused = None
    except RuntimeError as error:
        refused = str(error)
    if trainer.is_global_zero:
        torch.save({"state": module.state_dict()}, os.path.join(out_dir, "final.pt"))
        report = {
            "epochs": recorder.epochs,
            "served": recorder.served,
            "train_reloads": recorder.reloads,
            "hook_calls": data.calls if data is not None else None,
            "metrics": fit_metrics,
            "validate": metrics,
            "refused_after_validate": refused,
            "checkpoints": sorted(f for f in os.listdir(out_dir) if f.startswith("epoch=") and f.endswith(".ckpt")),
        }
        with open(os.path.join(out_dir, "report.json"), "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    run_worker(main)
