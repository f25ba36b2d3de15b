"""Train tiny models under ElasticPipelineStrategy for each case; rank 0 saves weights and predictions.

Usage: torchrun --nproc_per_node=N equivalence_worker.py OUT_DIR CASE_JSON [CASE_JSON ...]
"""

import json
import os
import sys

import lightning.pytorch as pl
import torch
from equivalence_cases import build_case_module, case_loader, eval_loader
from lightning.pytorch.callbacks import Callback
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy


def dist_rank() -> int:
    return int(os.environ["RANK"])


class GradientSyncRecorder(Callback):
    """How gradients were reduced: buckets started during the backward, and the stages whose
    gradients make up each parameter outside the block list."""

    def on_train_end(self, trainer, pl_module):
        sync = trainer.strategy.engine.grad_sync
        shared = {id(p) for p in sync.shared_params}
        self.record = {
            "launched_during_backward": sync.launched_during_backward,
            "shared_stages": {
                name: list(sync.stages_using(p)) for name, p in pl_module.named_parameters() if id(p) in shared
            },
        }


class BoundaryRecorder(Callback):
    """Per rank: the next stage's answer to whether it reads the extra elements of this stage's
    blocks' outputs (None: no such elements, or no next stage), and the bytes sent in each step."""

    def __init__(self, path: str):
        self.path = path
        self.bytes_sent = []  # by each training step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.bytes_sent.append(trainer.strategy.engine.runner.channel.bytes_sent - sum(self.bytes_sent))

    def on_train_end(self, trainer, pl_module):
        runner = trainer.strategy.engine.runner
        with open(self.path, "w") as f:
            json.dump({"next_reads": runner.extras.next_reads, "bytes_sent": self.bytes_sent}, f)


def main() -> None:
    out_dir, cases = sys.argv[1], [json.loads(arg) for arg in sys.argv[2:]]
    world = int(os.environ["WORLD_SIZE"])
    for case in cases:
        replicas = world // case["pipeline_length"]
        module = build_case_module(case)
        strategy = ElasticPipelineStrategy(
            pipeline_length=case["pipeline_length"],
            num_microbatches=case["microbatches"],
            schedule=case["schedule"],
        )
        recorder = GradientSyncRecorder()
        trainer = pl.Trainer(
            callbacks=[recorder, BoundaryRecorder(os.path.join(out_dir, f"{case['name']}_rank{dist_rank()}.json"))],
            accelerator="cpu",
            devices=world,
            strategy=strategy,
            max_steps=case["steps"],
            gradient_clip_val=case["clip"] or None,
            accumulate_grad_batches=case["accumulate"],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        trainer.fit(module, case_loader(case, case["global_batch"] // replicas))
        predictions = trainer.predict(module, eval_loader(case, case["global_batch"] // replicas))
        if trainer.is_global_zero:
            torch.save(
                {"state": module.state_dict(), "predictions": torch.cat(predictions), "sync": recorder.record},
                os.path.join(out_dir, f"{case['name']}.pt"),
            )


if __name__ == "__main__":
    run_worker(main)
