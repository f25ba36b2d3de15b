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
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_pipetx.strategy.autopipe import Plan
from lightning_pipetx.strategy.dataloading import (
    DealtLoader,
    batch_size_to_keep,
    deal_again,
    deals_to_replicas,
    foreign_dealing,
    global_batch_fits,
    keep_epoch_length,
    rebatch,
)
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
        self.replicas0: int | None = None  # the replicas the user's training loaders are for: the run's first
        self.batch_sizes: list[int | None] = []  # of the training loaders built last (None: cannot be re-batched)
        self.fixed_replicas: int | None = None  # the training samples cannot be dealt to other replicas
        self._told: set[str] = set()  # why layouts keep their replicas, logged once a run
        self.batch_norm_replicas: int | None = None  # batch norms in training normalize each replica's batch
        self._warned_epoch_length = False
        self.validation: dict[DealtLoader, float] = {}  # fit's validation loaders, and a float limit_val_batches
        self.moving = False  # blocks are changing hands
        self.world_size = 1

    def reset(self, world_size: int) -> None:
        self.replicas0, self.fixed_replicas, self.moving, self.world_size = None, None, False, world_size
        self.batch_sizes, self.batch_norm_replicas = [], None
        self._warned_epoch_length = False
        self._told.clear()
        self.validation.clear()

    def accepts(self, layout: Layout) -> bool:
        """Whether ``layout`` can train the run's samples: they can be dealt to its replicas, it keeps
        the global batch (``keep_global_batch``), and each replica still validates a batch where a
        float ``limit_val_batches`` takes a share of its loader (Lightning refuses a share of none)."""
        replicas = layout.replicas
        if self.fixed_replicas not in (None, replicas) or self.batch_norm_replicas not in (None, replicas):
            return False
        if any(int(loader.batches(replicas) * limit) < 1 for loader, limit in self.validation.items()):
            return False
        if not self.keep_global_batch:
            return True
        return all(global_batch_fits((size, self.replicas0), replicas) for size in self.batch_sizes)

    def keep_replicas_for_batch_norms(self, names: list[str], replicas: int) -> None:
        """While batch norms ``names`` train (in training mode: they normalize each replica's batch by
        its own statistics), layouts keep ``replicas``: more would normalize smaller batches."""
        kept = replicas if names else None
        if kept is not None and self.batch_norm_replicas is None and self.world_size > replicas:
            log.info(
                "pipetx: batch norms in training (%s, ...) normalize each replica's batch: layouts keep %d "
                "replicas while they train, as more would normalize smaller batches than the run's",
                names[0],
                replicas,
            )
        self.batch_norm_replicas = kept

    def training_loaders_requested(self) -> None:
        """Lightning asked the source for the training loaders (a fit's first build, a reload of the
        user's, or a rebuild for new replicas): their constraints are taken again as each is processed."""
        self.batch_sizes.clear()
        self.fixed_replicas = None

    def reshard(self, dataloader: DataLoader, replicas: int, rank: int) -> DataLoader:
        """The training loader ``dataloader`` (one of a ``CombinedLoader``'s, or the only one, with
        the batch size the user gave it) for replica ``rank`` of ``replicas``."""
        if self.replicas0 is None:
            self.replicas0 = replicas
        reason = foreign_dealing(dataloader, (self.replicas0, replicas), self.world_size)
        if reason is not None:
            raise ValueError(f"ElasticPipelineStrategy: {reason}.")
        batch0 = (batch_size_to_keep(dataloader), self.replicas0)
        self.batch_sizes.append(batch0[0])
        if not deals_to_replicas(dataloader) and self.fixed_replicas is None:
            self.fixed_replicas = replicas
            self._tell(
                "fixed",
                "the training DataLoader's samples are not dealt to the replicas by a DistributedSampler (a sampler "
                "of yours, or an IterableDataset): layouts keep %d replicas, as more would train the same samples; a "
                "map-style dataset with Lightning's sampler (use_distributed_sampler=True) lifts this",
                replicas,
            )
        elif self.keep_global_batch and batch0[0] is None:
            self._tell(
                "batch_sampler",
                "the training DataLoader cannot be re-batched (a batch_sampler): layouts keep %d replicas, so that "
                "the global batch stays yours; keep_global_batch=False lifts this",
                replicas,
            )
        dataloader = deal_again(dataloader, replicas, rank)
        if replicas == self.replicas0:
            return dataloader
        if not self.keep_global_batch:
            if not self._warned_epoch_length:
                self._warned_epoch_length = True
                rank_zero_warn(
                    f"ElasticPipelineStrategy(keep_global_batch=False): {replicas} replicas (the run began with "
                    f"{self.replicas0}) each keep the batch size, so the global batch changed and an epoch has "
                    f"another number of optimizer steps than trainer.estimated_stepping_batches counted: a "
                    f"learning-rate schedule stepped per step and sized from it no longer ends with the run. Keep "
                    f"the default keep_global_batch=True, or size the schedule in epochs."
                )
            return dataloader
        return keep_epoch_length(rebatch(dataloader, batch0, replicas), batch0)

    def _tell(self, reason: str, message: str, replicas: int) -> None:
        if reason not in self._told and self.world_size > replicas:
            self._told.add(reason)
            log.info("pipetx: " + message, replicas)

    def note_validation(self, dataloader: DataLoader, limit: float | int) -> None:
        """Record one of fit's validation loaders, where ``limit`` (``limit_val_batches``) is a share."""
        loader = DealtLoader.of(dataloader)
        if isinstance(limit, float) and 0.0 < limit < 1.0 and loader is not None:
            self.validation[loader] = limit

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
