"""Callbacks that monitor a value only the last stage updates, on 2 processes as a 2-stage pipeline.

Usage: torchrun --nproc_per_node=2 decisions_worker.py OUT_DIR
``training_step`` counts the samples it has seen after the model call, which under a pipeline runs
on the last stage only; ``on_train_epoch_end`` logs the count. ModelCheckpoint keeps the highest,
EarlyStopping stops when it stops rising. Every rank writes OUT_DIR/decisions_rank<N>.json.
"""

import json
import os
import sys

from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from tiny_models import RandomVectorDataset, TinySequentialRegressor, make_trainer
from torch.utils.data import DataLoader
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy


class CountingRegressor(TinySequentialRegressor):
    def __init__(self):
        super().__init__(dropout=0.0)
        self.samples_seen = 0

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.samples_seen += len(batch[0])  # after the model call: the last stage only
        return loss

    def on_train_epoch_end(self):
        self.log("samples_seen", float(self.samples_seen), sync_dist=True, reduce_fx="sum")


def main() -> None:
    out_dir = sys.argv[1]
    checkpoint = ModelCheckpoint(dirpath=out_dir, monitor="samples_seen", mode="max", save_top_k=1)
    stopping = EarlyStopping(monitor="samples_seen", mode="max", patience=0, check_on_train_epoch_end=True)
    strategy = ElasticPipelineStrategy(pipeline_length=2, num_microbatches=2, profile_steps=0)
    trainer = make_trainer(
        [checkpoint, stopping], max_epochs=3, devices=2, strategy=strategy, enable_checkpointing=True
    )
    trainer.fit(CountingRegressor(), DataLoader(RandomVectorDataset(size=16), batch_size=8))
    report = {"best": os.path.basename(checkpoint.best_model_path), "epochs": trainer.current_epoch}
    with open(os.path.join(out_dir, f"decisions_rank{trainer.global_rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    run_worker(main)
