"""A training step that changes its batch before the model call, on a 2-stage pipeline (2x1).

``mixup``: Mixup drawn in ``training_step``: the first stage mixes the inputs and the last stage
the targets, so both must draw the same mixing (one micro-batch). ``in_place``: the step scales its
inputs in place (as timm's Mixup mixes), 2 micro-batches under GPipe: one micro-batch's change must
not touch what another's forward saved for its backward.

Usage: torchrun --nproc_per_node=2 step_randomness_worker.py OUT_DIR RECIPE
Every rank writes OUT_DIR/rank<N>.pt: the final weights. :func:`train` is also the one-process
reference (devices=1), on the same global batches.
"""

import os
import sys

import lightning.pytorch as pl
import torch
from tiny_models import RandomVectorDataset, TinySequentialRegressor, make_trainer
from torch.utils.data import DataLoader, DistributedSampler
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy


class MixupRegressor(TinySequentialRegressor):
    """Mixes each batch with a random permutation of itself, by a random weight, before the model."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        weight, order = torch.rand(()), torch.randperm(len(x))
        mixed_x, mixed_y = weight * x + (1 - weight) * x[order], weight * y + (1 - weight) * y[order]
        return torch.nn.functional.mse_loss(self(mixed_x), mixed_y)


class InPlaceScaledRegressor(TinySequentialRegressor):
    """Halves its inputs in place before the model."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        x.mul_(0.5)
        return torch.nn.functional.mse_loss(self(x), y)


RECIPES = {"mixup": (MixupRegressor, 1), "in_place": (InPlaceScaledRegressor, 2)}  # module, micro-batches


def train(devices: int, recipe: str) -> dict[str, torch.Tensor]:
    """The weights after 2 epochs of 4 global batches of 8 (one process: DistributedSampler's order)."""
    module_class, num_microbatches = RECIPES[recipe]
    pl.seed_everything(0)
    dataset = RandomVectorDataset(size=32)
    if devices == 1:
        loader = DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset, num_replicas=1, rank=0, seed=0))
        strategy = "auto"
    else:
        loader = DataLoader(dataset, batch_size=8, shuffle=True)
        strategy = ElasticPipelineStrategy(
            pipeline_length=2, num_microbatches=num_microbatches, profile_steps=0, cache=False
        )
    module = module_class(seed=0, dropout=0.0)
    make_trainer([], max_epochs=2, devices=devices, strategy=strategy).fit(module, loader)
    return module.state_dict()


def main() -> None:
    torch.save(train(devices=2, recipe=sys.argv[2]), os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    run_worker(main)
