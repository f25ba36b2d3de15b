"""A LightningModule that gives its block list a second name, checkpointed during fit on a 2x1 pipeline.

Usage: torchrun --nproc_per_node=2 alias_worker.py OUT_DIR. ModelCheckpoint writes
OUT_DIR/step=2.ckpt after the second step, while each rank holds its stage's blocks only.
"""

import sys

from lightning.pytorch.callbacks import ModelCheckpoint
from tiny_models import RandomVectorDataset, TinySequentialRegressor, make_trainer
from torch.utils.data import DataLoader
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy


class SecondName(TinySequentialRegressor):
    """``self.backbone`` names the block list again, after ``self.model`` (as ``self.backbone = self.model.bert``)."""

    def __init__(self):
        super().__init__(seed=0, dropout=0.0)
        self.backbone = self.model.blocks


def main():
    out_dir = sys.argv[1]
    saves = ModelCheckpoint(dirpath=out_dir, filename="{step}", every_n_train_steps=2)
    strategy = ElasticPipelineStrategy(pipeline_length=2, num_microbatches=2, profile_steps=0)
    trainer = make_trainer([saves], devices=2, max_steps=2, strategy=strategy, enable_checkpointing=True)
    trainer.fit(SecondName(), DataLoader(RandomVectorDataset(size=32, seed=1), batch_size=8))


if __name__ == "__main__":
    run_worker(main)
