"""AutoDP: move a running pipeline to the layout AutoPipe chose, end to end.

A transition, after AutoPipe picked a plan with another layout for the new frozen prefix:

1. the old engine lets go of its hooks, process groups and gradient sync;
2. blocks move, with their optimizer state and buffers, to the ranks that run them in the new
   layout (:func:`~lightning_pipetx.strategy.transition.move_blocks`); the rest are released;
3. a new engine is built for the plan: process groups per stage and per replica, block hooks,
   gradient sync;
4. the training and validation loaders are rebuilt for the new number of replicas: each
   replica's batch is resized so that the global batch stays the user's (``keep_global_batch``).

Every rank calls :meth:`AutoDP.transition` at the same point with the same plans: every step
is a collective or a point-to-point exchange in an order all ranks derive from the two plans.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_pipetx.strategy.autopipe import Plan
from lightning_pipetx.strategy.dataloading import batch_size_to_keep, global_batch_fits, keep_epoch_length, rebatch
from lightning_pipetx.strategy.engine import PipelineEngine
from lightning_pipetx.strategy.param_store import ParamStore
from lightning_pipetx.strategy.topology import Layout
from lightning_pipetx.strategy.transition import move_blocks

log = logging.getLogger("lightning_pipetx")


@dataclass(frozen=True)
class Transition:
    """What one transition did on this rank."""

    old_layout: Layout
    new_layout: Layout
    seconds: float
    blocks_received: int
    bytes_received: int

    def describe(self) -> str:
        return (
            f"layout {self.old_layout} -> {self.new_layout}, {self.seconds:.1f} s, "
            f"{self.bytes_received / 2**20:.1f} MiB received"
        )


class AutoDP:
    """Owns transitions between layouts, and the global batch they keep.

    Args:
        keep_global_batch: resize each replica's batch so that ``batch_size * replicas`` stays
            the user's global batch; layouts whose replica count does not divide it are refused.
    """

    def __init__(self, keep_global_batch: bool = True) -> None:
        self.keep_global_batch = keep_global_batch
        self.batch0: tuple[int | None, int] | None = None  # the user's batch size, and the replicas it was for
        self.moving = False  # blocks are changing hands

    def reset(self) -> None:
        self.batch0, self.moving = None, False

    def accepts(self, layout: Layout) -> bool:
        """Whether ``layout`` keeps the global batch (always, without ``keep_global_batch``)."""
        return not self.keep_global_batch or global_batch_fits(self.batch0, layout.replicas)

    def reshard(self, dataloader: DataLoader, replicas: int) -> DataLoader:
        """The training loader for ``replicas`` replicas (Lightning's sampler shards it by replica)."""
        if self.batch0 is None:
            self.batch0 = (batch_size_to_keep(dataloader), replicas)
            if self.keep_global_batch and self.batch0[0] is None:
                log.info(
                    "pipetx: the training DataLoader cannot be re-batched (a batch_sampler or an IterableDataset): "
                    "layouts keep %d replicas, so that the global batch stays yours; keep_global_batch=False lifts this",
                    replicas,
                )
        if not self.keep_global_batch or replicas == self.batch0[1]:
            return dataloader
        return keep_epoch_length(rebatch(dataloader, self.batch0, replicas), self.batch0)

    def transition(
        self,
        trainer: pl.Trainer,
        engine: PipelineEngine,
        plan: Plan,
        build_engine: Callable[[Plan], PipelineEngine],
        blocks: nn.Module,
        optimizers: list[Optimizer],
        store: ParamStore,
        rank: int,
        device: torch.device,
    ) -> tuple[PipelineEngine, Transition]:
        """Move from ``engine``'s layout to ``plan``'s; returns the new engine and what was done."""
        started = time.perf_counter()
        old_plan = engine.plan
        # Buffers outside the blocks from the ranks that kept them current in the old layout (its
        # first stage's for pre, its last stage's for the rest): the new layout's may not have.
        engine.share_outer_buffers()
        self.moving = True
        engine.close(restore_weights=False, destroy_groups=False)  # the caller frees them: logged values may need them
        received, nbytes = move_blocks(blocks, optimizers, store, old_plan, plan, rank, device)
        new_engine = build_engine(plan)
        self.moving = False
        reload_dataloaders(trainer)
        seconds = time.perf_counter() - started
        return new_engine, Transition(old_plan.layout, plan.layout, seconds, received, nbytes)


def reload_dataloaders(trainer: pl.Trainer) -> None:
    """Have Lightning build the training and validation loaders again before they are next used
    (Lightning's own tuner does the same; the attributes are checked at setup)."""
    trainer.fit_loop._combined_loader = None
    trainer.fit_loop.epoch_loop.val_loop._combined_loader = None
