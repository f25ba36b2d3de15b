"""A tiny GPT-2 with dropout on 2 processes as a 2-stage pipeline: which elements each block's MLP
dropout zeroed, per micro-batch, and the process's random state after fit.

Usage: torchrun --nproc_per_node=2 dropout_streams_worker.py OUT_DIR
Every rank writes OUT_DIR/masks_rank<N>.json.
"""

import json
import os
import sys

import lightning.pytorch as pl
import torch
from tiny_models import TASKS, make_trainer
from torch.utils.data import DataLoader
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy


def record_masks(module: pl.LightningModule) -> dict[int, list[list[bool]]]:
    """Each block's MLP dropout mask, per training call (by wrapping its forward: a forward hook
    on a block is refused under a pipeline)."""
    masks: dict[int, list[list[bool]]] = {}
    for index, block in enumerate(module.model.transformer.h):
        dropout, original = block.mlp.dropout, block.mlp.dropout.forward

        def forward(x, dropout=dropout, original=original, index=index):
            out = original(x)
            if dropout.training:
                masks.setdefault(index, []).append((out == 0).flatten().tolist())
            return out

        dropout.forward = forward
    return masks


def main() -> None:
    out_dir = sys.argv[1]
    pl.seed_everything(0)
    module = TASKS["gpt2"].module(dropout=0.5)
    masks = record_masks(module)
    strategy = ElasticPipelineStrategy(pipeline_length=2, num_microbatches=2)
    trainer = make_trainer([], max_steps=2, devices=2, strategy=strategy)
    trainer.fit(module, DataLoader(TASKS["gpt2"].dataset(size=32, seed=0), batch_size=8))
    report = {"masks": masks, "random_state": torch.get_rng_state().tolist()}
    with open(os.path.join(out_dir, f"masks_rank{trainer.global_rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    run_worker(main)
