"""A training step that changes its batch before the model call, on a 2-stage pipeline (2x1).

``mixup``: Mixup drawn in ``training_step``: the first stage mixes the inputs and the last stage
the targets, so both must draw the same mixing (one micro-batch). ``in_place``: the step scales its
inputs in place (as timm's Mixup mixes), 2 micro-batches under GPipe: one micro-batch's change must
not touch what another's forward saved for its backward. ``draws_after_call``: the step draws from
Python's and NumPy's random after the model call (which only the last stage runs), and the data set
adds Python and NumPy noise in the main process: both stages must still read the same batches
(``draws_after_call_pcg64``: with NumPy's global functions on a PCG64 bit generator).

Usage: torchrun --nproc_per_node=2 step_randomness_worker.py OUT_DIR RECIPE
Every rank writes OUT_DIR/rank<N>.pt: the final weights, and a number drawn from Python's and from
NumPy's random after fit. :func:`train` is also the one-process reference (devices=1), on the same
global batches.
"""

import os
import random
import sys

import lightning.pytorch as pl
import numpy as np
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


class DrawingAfterCallRegressor(TinySequentialRegressor):
    """Draws from Python's and NumPy's random after the model call (to sample what it logs, say)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        random.random(), np.random.rand()
        return loss


class NoisyVectors(RandomVectorDataset):
    """Inputs with Python and NumPy noise added as they are read (in the main process)."""

    def __getitem__(self, index):
        x, y = super().__getitem__(index)
        return x + 0.01 * (random.random() + float(np.random.rand())), y


RECIPES = {  # module, micro-batches
    "mixup": (MixupRegressor, 1),
    "in_place": (InPlaceScaledRegressor, 2),
    "draws_after_call": (DrawingAfterCallRegressor, 1),
    "draws_after_call_pcg64": (DrawingAfterCallRegressor, 1),
}


def train(devices: int, recipe: str) -> dict[str, torch.Tensor]:
    """The weights after 2 epochs of 4 global batches of 8 (one process: DistributedSampler's order)."""
    module_class, num_microbatches = RECIPES[recipe]
    if recipe.endswith("_pcg64"):
        np.random.set_bit_generator(np.random.PCG64(0))
    pl.seed_everything(0)
    dataset = NoisyVectors(size=32) if recipe.startswith("draws_after_call") else RandomVectorDataset(size=32)
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
    state = train(devices=2, recipe=sys.argv[2])
    drawn = {"python": random.random(), "numpy": float(np.random.rand())}
    torch.save({"state": state, "drawn": drawn}, os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    run_worker(main)
