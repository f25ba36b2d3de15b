"""An unchanged LightningModule with the usual Lightning features, trained under the strategy.

Usage: features_worker.py OUT_DIR MODE, where MODE is
  torchrun   (launched by torchrun on 4 processes: 2 stages x 2 replicas)
  spawn      (plain python; strategy="elastic_pipeline_spawn", 2 devices, bf16-mixed)
  popen      (plain python; strategy="elastic_pipeline", 2 devices, fast_dev_run)
  deadpeer   (launched by torchrun on 2 processes; global rank 1 dies in its third step)
  deadreplica (the same with 2 replicas of one stage: rank 0 waits for it in the gradient all-reduce)
  deadmover  (the same, global rank 1 dying as blocks move for 1x2 after epoch 0)
Every rank writes what it saw to OUT_DIR/rank<N>.json.
"""

import json
import os
import sys
from datetime import timedelta

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torchmetrics
from lightning.pytorch.callbacks import (
    BasePredictionWriter,
    Callback,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
)
from lightning.pytorch.loggers import CSVLogger
from tiny_models import RandomTokenDataset, tiny_bert
from torch.utils.data import DataLoader
from worker_exit import run_worker

import lightning_pipetx  # noqa: F401  (registers the strategy names)
from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback
from lightning_pipetx.strategy import transition


def pad_to_longest(samples):
    """Dynamic padding: every batch is as long as its longest sequence."""
    batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    length = int(batch["attention_mask"].sum(1).max())
    return {k: (v[:, :length] if v.dim() == 2 else v) for k, v in batch.items()}


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = tiny_bert(seed=0, dropout=0.0)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=3)

    die_at_step = None

    def training_step(self, batch, batch_idx):
        if batch_idx == self.die_at_step and self.global_rank == 1:
            os._exit(0)  # a peer that vanishes without a word
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        out = self.model(**batch)
        self.val_acc(out.logits, batch["labels"])
        self.log("val_acc", self.val_acc, prog_bar=True)
        self.log("val_loss", out.loss, sync_dist=True)

    def test_step(self, batch, batch_idx):
        out = self.model(**batch)
        self.test_acc(out.logits, batch["labels"])
        self.log("test_acc", self.test_acc)
        self.log("test_loss", out.loss, sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)]

    saved_keys = ()

    def on_save_checkpoint(self, checkpoint):
        # An export copy of the encoder read from the module itself (as EMA or fp16 export recipes do).
        checkpoint["encoder_copy"] = {k: v.clone() for k, v in self.model.bert.encoder.state_dict().items()}
        self.saved_keys = sorted(checkpoint["state_dict"])  # every rank calls the hook, as under DDP


class ReleasedWeights(Callback):
    """How many encoder weights read NaN on this rank as each epoch starts (those of the blocks it
    does not run): a checkpoint saved at the last epoch's end lends them values only while it is saved."""

    def __init__(self):
        self.counts = []

    def on_train_epoch_start(self, trainer, pl_module):
        weights = pl_module.model.bert.encoder.parameters()
        self.counts.append(sum(bool(torch.isnan(w).all()) for w in weights))


class IndexWriter(BasePredictionWriter):
    """Lightning's per-rank pattern: each rank writes the dataset indices it predicted."""

    def __init__(self, out_dir):
        super().__init__("epoch")
        self.out_dir = out_dir

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        indices = [i for batch in batch_indices[0] for i in batch]
        with open(os.path.join(self.out_dir, f"written_rank{trainer.global_rank}.json"), "w") as f:
            json.dump(indices, f)


def loader(size, batch_size, seed):
    return DataLoader(RandomTokenDataset(size=size, seed=seed), batch_size=batch_size, collate_fn=pad_to_longest)


def metrics(trainer):
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def main():
    out_dir, mode = sys.argv[1], sys.argv[2]
    report = {}
    model = Classifier()
    if mode == "torchrun":
        checkpoint = ModelCheckpoint(dirpath=out_dir, monitor="val_acc", mode="max", save_top_k=1)
        stopping = EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0)  # stops after 2 epochs
        released = ReleasedWeights()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=4,
            strategy=ElasticPipelineStrategy(pipeline_length=2, num_microbatches=2),
            max_epochs=4,
            # Gradient norms measured every step, no decision within the run: what a checkpoint keeps of them.
            callbacks=[
                checkpoint,
                stopping,
                LearningRateMonitor(),
                FreezeCallback(warmup_epochs=10),
                IndexWriter(out_dir),
                released,
            ],
            logger=CSVLogger(out_dir),
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        # 30 samples, 2 replicas, batch 4: a partial last batch of 3, and lengths vary by batch.
        trainer.fit(model, loader(30, 4, 1), loader(14, 4, 2))
        report["fit"] = metrics(trainer)
        report["epochs"] = trainer.current_epoch
        report["stopped"] = stopping.stopped_epoch
        report["best_model_path"] = checkpoint.best_model_path
        report["released_nan"] = released.counts
        report["saved_keys"] = model.saved_keys
        report["lr"] = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]
        report["validate"] = trainer.validate(model, loader(14, 4, 2), verbose=False)[0]
        report["test"] = trainer.test(model, loader(14, 4, 3), verbose=False)[0]
        predictions = trainer.predict(model, loader(14, 4, 3))
        report["predictions"] = torch.cat(predictions).tolist()  # every rank holds predictions
        # After the run every rank holds the whole model again: predict directly for comparison.
        data = next(iter(DataLoader(RandomTokenDataset(size=14, seed=3), batch_size=14)))
        with torch.no_grad():
            report["direct"] = (
                model.model(input_ids=data["input_ids"], attention_mask=data["attention_mask"])
                .logits.argmax(-1)
                .tolist()
            )
    elif mode == "spawn":
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy="elastic_pipeline_spawn",
            precision="bf16-mixed",
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, loader(16, 4, 1), loader(8, 4, 2))
        report["fit"] = metrics(trainer)
        report["layout"] = None
    elif mode == "popen":
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy="elastic_pipeline",
            fast_dev_run=True,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, loader(16, 4, 1), loader(8, 4, 2))
        report["fit"] = metrics(trainer)
        report["strategy"] = type(trainer.strategy).__name__
        report["layout"] = str(trainer.strategy.layout) if trainer.strategy.engine else None
    elif mode in ("deadpeer", "deadreplica", "deadmover"):
        model.die_at_step = 2 if mode != "deadmover" else None
        length = 1 if mode == "deadreplica" else 2  # 1: rank 0 waits in the gradient all-reduce
        if mode == "deadmover":  # rank 1 vanishes as the blocks start moving for 1x2, after epoch 0
            mover = transition.BlockMover
            send = mover.send

            def send_or_die(self, block, dst):
                if dist.get_rank() == 1:
                    os._exit(0)
                send(self, block, dst)

            mover.send = send_or_die
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=ElasticPipelineStrategy(pipeline_length=length, timeout=timedelta(seconds=30)),
            max_epochs=2 if mode == "deadmover" else 1,
            callbacks=[FreezeCallback(alpha=0.5, signal="schedule")] if mode == "deadmover" else None,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        try:
            trainer.fit(model, loader(32, 4, 1))
        finally:  # printed now: a rank whose peer vanished mid-run says why it has no layout left
            try:
                print(f"[rank{trainer.global_rank}] layout after the run: {trainer.strategy.layout}", flush=True)
            except RuntimeError as error:
                print(f"[rank{trainer.global_rank}] no layout: {error}", flush=True)
    report["rank"] = trainer.global_rank
    with open(os.path.join(out_dir, f"{mode}_rank{trainer.global_rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    run_worker(main)
