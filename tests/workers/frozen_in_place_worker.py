"""A freeze that leaves no layout, on 3 processes: 3x1 over 4 blocks, with a training loader
whose global batch 3 replicas cannot share. With 3 blocks frozen at most 2 stages fit around the
frozen prefix and 1 stage would need 3 replicas: the 3x1 layout stays and the blocks freeze in place.

Usage: torchrun --nproc_per_node=3 frozen_in_place_worker.py OUT_DIR
Trains with each loader of :func:`loader` (``iterable``: an IterableDataset; ``batch``: batches
of 4); rank 0 writes OUT_DIR/<KIND>.json: the layout each epoch, the frozen blocks, the weights.
"""

import json
import os
import sys

from loader_kinds_worker import Stream
from tiny_models import Layouts, RandomVectorDataset, TinySequentialRegressor, make_trainer
from torch.utils.data import DataLoader, DistributedSampler
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback

KINDS = ("iterable", "batch")


def loader(kind: str, reference: bool = False) -> DataLoader:
    """The training loader of ``kind``; ``reference``: in the order Lightning's sampler gives 1 replica."""
    if kind == "iterable":
        return DataLoader(Stream(), batch_size=4)
    samples = RandomVectorDataset(size=24)
    sampler = DistributedSampler(samples, num_replicas=1, rank=0, shuffle=True, seed=0) if reference else None
    return DataLoader(samples, batch_size=4, shuffle=not reference, sampler=sampler)


def main() -> None:
    out_dir = sys.argv[1]
    for kind in KINDS:
        freeze, layouts = FreezeCallback(alpha=0.5, signal="schedule"), Layouts()
        strategy = ElasticPipelineStrategy(pipeline_length=3, profile_steps=0)
        trainer = make_trainer([freeze, layouts], max_epochs=3, devices=3, strategy=strategy)
        module = TinySequentialRegressor(seed=0, dropout=0.0)
        trainer.fit(module, loader(kind))
        state = module.state_dict()  # every rank holds every block after fit
        if trainer.is_global_zero:
            report = {"layouts": layouts.layouts, "frozen": freeze.frozen_blocks}
            report["weights"] = {key: value.tolist() for key, value in state.items()}
            with open(os.path.join(out_dir, f"{kind}.json"), "w") as handle:
                json.dump(report, handle)


if __name__ == "__main__":
    run_worker(main)
