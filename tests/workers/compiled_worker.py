"""A model compiled with ``torch.compile`` (backend ``aot_eager``) under a 2-stage pipeline that
freezes blocks (2x1 -> 1x2). The backward torch compiles under the first micro-batch's fused
backward donates its buffers, which the split of the step's last backward cannot retain: the
stage falls back to fused backwards.

Usage: torchrun --nproc_per_node=2 compiled_worker.py OUT_DIR
Rank 0 writes the fitted weights to OUT_DIR/fitted.pt and the layouts to OUT_DIR/layouts.json.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from tiny_models import Layouts, RandomVectorDataset, TinySequentialRegressor, make_trainer
from torch.utils.data import DataLoader
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback

GLOBAL_BATCH, EPOCHS = 8, 3


class CompiledRegressor(TinySequentialRegressor):
    """The tiny regressor, its model compiled in ``__init__`` (``compile=False``: the same, eager)."""

    def __init__(self, compile: bool = True):
        super().__init__(seed=0, dropout=0.0)
        if compile:
            self.model = torch.compile(self.model, backend="aot_eager")


def main() -> None:
    out_dir = sys.argv[1]
    layouts = Layouts()
    strategy = ElasticPipelineStrategy(pipeline_length=2, num_microbatches=2, profile_steps=0, cache=False)
    freeze = FreezeCallback(alpha=0.5, signal="schedule")
    trainer = make_trainer([freeze, layouts], devices=2, strategy=strategy, max_epochs=EPOCHS, default_root_dir=out_dir)
    module = CompiledRegressor()
    trainer.fit(module, DataLoader(RandomVectorDataset(size=32), batch_size=GLOBAL_BATCH))
    if dist.get_rank() == 0:
        torch.save(module.state_dict(), os.path.join(out_dir, "fitted.pt"))
        with open(os.path.join(out_dir, "layouts.json"), "w") as handle:
            json.dump(layouts.layouts, handle)


if __name__ == "__main__":
    run_worker(main)
