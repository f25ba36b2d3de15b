"""Gather ``trainer.predict`` results from every replica on global rank 0.

Every stage of a replica computes the same predictions (evaluation steps run to their end on
every stage), so every rank holds its replica's shard, as under DDP. Where Lightning's
prediction sampler sharded a loader by replica, global rank 0 also receives the other
replicas' shards, from their last stages, and returns all predictions:

* in dataset order, re-batched with the first batch's size, when the batches can be joined
  (each tensor has its input batch's samples along its first dimension, and the same shape
  beyond it in every batch): Lightning's prediction sampler
  gives replica ``r`` of ``D`` the samples ``r, r + D, r + 2D, ...`` without padding, and
  the shards are interleaved back;
* otherwise (per-token outputs whose length changes from batch to batch, or predictions
  without a batch dimension) every batch as it was produced, interleaved by batch: batch 0
  of replica 0, batch 0 of replica 1, ..., batch 1 of replica 0, ...; sample ``i`` of batch
  ``b`` of replica ``r`` is dataset sample ``r + D * (b * batch_size + i)``.

A loader that Lightning did not shard (``Trainer(use_distributed_sampler=False)``, an
``IterableDataset``) gives each rank the predictions of what it read, as under DDP.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.utilities import CombinedLoader

from lightning_pipetx.strategy.microbatch import BatchSplitError, _tensors, batch_size, chunk, join_outputs, take
from lightning_pipetx.strategy.topology import Topology


def input_rows(batch: Any) -> int | None:
    """The samples of an input batch (None where it has no batch dimension to tell)."""
    try:
        return batch_size(batch)
    except BatchSplitError:
        return None


def gather_predictions(local: list[Any], rows: list[int | None], topology: Topology) -> list[Any]:
    """This rank's predictions (``rows``: the samples of the input batch of each); on global rank
    0, every replica's (a collective over the last stages)."""
    if topology.replicas == 1 or not topology.is_last_stage:
        return local
    gathered: list[Any] | None = [None] * topology.replicas if topology.global_rank == 0 else None
    dist.gather_object((local, rows), gathered, dst=0, group=topology.stage_group)  # a replica without batches too
    if topology.global_rank != 0:
        return local
    return merge_shards([shard for shard, _ in gathered], [sizes for _, sizes in gathered])


def sharded_by_replica(loader: Any, replicas: int) -> bool:
    """Whether Lightning's prediction sampler dealt ``loader``'s samples to ``replicas`` replicas
    (replica ``r`` of ``D``: samples ``r, r + D, ...`` of the loader's own order, none repeated)."""
    samplers = (getattr(getattr(loader, "batch_sampler", None), "sampler", None), getattr(loader, "sampler", None))
    return any(isinstance(s, UnrepeatedDistributedSampler) and s.num_replicas == replicas for s in samplers)


def gather_trainer_predictions(trainer: Any, topology: Topology, rows: dict[int, list[int | None]]) -> None:
    """Gather what ``trainer.predict`` returns, for each loader Lightning's sampler sharded by
    replica (a collective over the last stages; every rank decides alike from its loaders, which
    Lightning sets up also where its loop has no batch). ``rows[d]``: see :func:`gather_loop_predictions`."""
    loaders = trainer.predict_dataloaders
    if loaders is None:
        return
    sharded = [sharded_by_replica(loader, topology.replicas) for loader in CombinedLoader(loaders).flattened]
    gather_loop_predictions(trainer.predict_loop, topology, rows, sharded)


def gather_loop_predictions(
    loop: Any, topology: Topology, rows: dict[int, list[int | None]], sharded: list[bool]
) -> None:
    """Gather into the lists that ``trainer.predict`` returns, in place (a collective over the
    last stages); a loop that had no batch on this replica takes part with empty lists.
    ``rows[d]``: the samples of each input batch of dataloader ``d``; ``sharded[d]``: whether
    Lightning's sampler sharded it by replica (else each rank keeps its own predictions)."""
    if not loop.return_predictions:
        return
    if loop.skip:
        per_loader = [[] for _ in range(loop.num_dataloaders)]
    else:
        predictions = loop.predictions
        per_loader = [predictions] if loop.num_dataloaders == 1 else predictions
    for index, local in enumerate(per_loader):
        if index < len(sharded) and sharded[index]:
            local[:] = gather_predictions(local, rows.get(index, []) if local else [], topology)


def _per_sample(output: Any, rows: int) -> bool:
    """Whether every value of ``output`` holds one entry per sample of its ``rows``: a tensor along
    dim 0, a list of per-sample values (strings, numbers). A single number, a 0-dim tensor or
    another object describes the batch, and cannot be dealt to samples (None and empty lists have
    nothing to deal)."""
    if output is None or (isinstance(output, (list, tuple)) and not output):
        return True
    if isinstance(output, torch.Tensor):
        return output.dim() > 0 and output.shape[0] == rows
    if isinstance(output, Mapping):
        return all(_per_sample(value, rows) for value in output.values())
    if isinstance(output, (list, tuple)):
        if not _tensors(output):  # joined and taken item by item
            return len(output) == rows
        return all(_per_sample(value, rows) for value in output)
    return False


def _joinable(batches: list[Any], rows: list[int | None]) -> bool:
    """Whether every prediction holds a tensor, has its input batch's samples along the first
    dimension of each (see :func:`_per_sample`), and the same shapes beyond it."""
    if len(rows) != len(batches):
        return False
    if not all(_tensors(batch) and _per_sample(batch, size) for batch, size in zip(batches, rows)):
        return False
    shapes = [[t.shape[1:] for t in _tensors(batch)] for batch in batches]
    return all(s == shapes[0] for s in shapes)


def merge_shards(shards: list[list[Any]], rows: list[list[int | None]]) -> list[Any]:
    """All replicas' predictions (``shards[r]``: replica ``r``'s batches; ``rows[r]``: the samples
    of their input batches), in the documented order."""
    batches = [batch for shard in shards for batch in shard]
    if not batches:
        return []
    replicas = len(shards)
    if not _joinable(batches, [size for sizes in rows for size in sizes]):
        longest = max(len(shard) for shard in shards)
        return [shards[r][b] for b in range(longest) for r in range(replicas) if b < len(shards[r])]
    joined = [join_outputs(shard, [batch_size(b) for b in shard]) for shard in shards if shard]
    counts = [sum(batch_size(b) for b in shard) for shard in shards]
    offsets = [sum(counts[:r]) for r in range(replicas)]
    order = [offsets[j % replicas] + j // replicas for j in range(sum(counts))]
    merged = join_outputs(joined, [c for c in counts if c])
    return chunk(take(merged, order), batch_size(batches[0]))


class QuietWriters:
    """Keeps ``BasePredictionWriter`` callbacks from writing on a stage other than the last:
    every stage of a replica holds the same predictions, and the writers would write them once
    per stage (with Lightning's per-rank file pattern, once per rank)."""

    _METHODS = ("write_on_batch_end", "write_on_epoch_end")

    def __init__(self) -> None:
        self._quieted: list[BasePredictionWriter] = []

    def enter(self, callbacks: list[Any], topology: Topology) -> None:
        if topology.is_last_stage:
            return
        for callback in callbacks:
            if isinstance(callback, BasePredictionWriter):
                for name in self._METHODS:
                    setattr(callback, name, _write_nothing)
                self._quieted.append(callback)

    def exit(self) -> None:
        for callback in self._quieted:
            for name in self._METHODS:
                callback.__dict__.pop(name, None)
        self._quieted.clear()


def _write_nothing(*args: Any, **kwargs: Any) -> None:
    return None
