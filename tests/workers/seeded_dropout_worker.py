"""Train the tiny sequential model with dropout under Lightning's DDP or ElasticPipelineStrategy
(pipeline_length=1) from the same seed; rank 0 saves the weights.

Usage: torchrun --nproc_per_node=2 seeded_dropout_worker.py {ddp,pipetx} OUT_FILE
"""

import sys

import lightning.pytorch as pl
import torch
from tiny_models import build_task, task_loader

from lightning_pipetx import ElasticPipelineStrategy


def main() -> None:
    which, out_file = sys.argv[1], sys.argv[2]
    pl.seed_everything(0)
    model = build_task("sequential", dropout=0.3)
    strategy = "ddp" if which == "ddp" else ElasticPipelineStrategy(pipeline_length=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, task_loader("sequential"))
    if trainer.is_global_zero:
        torch.save({name: p.detach().clone() for name, p in model.named_parameters()}, out_file)


if __name__ == "__main__":
    main()
