"""Gather ``trainer.predict`` results from every replica, in dataset order, on global rank 0."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_pipetx.strategy.microbatch import batch_size, chunk, join_outputs, take
from lightning_pipetx.strategy.topology import Topology


def gather_predictions(local: list[Any], topology: Topology, device: torch.device) -> list[Any]:
    """Every stage gets its replica's predictions; global rank 0 gets all, in dataset order.

    Only the last stage computes predictions; it shares them with the other stages of its
    replica, so every rank holds its data-parallel shard, as under DDP. Lightning's
    prediction sampler gives replica ``r`` the samples ``r, r + D, r + 2D, ...`` without
    padding; on rank 0 the shards are interleaved back and re-batched with the first
    batch's size, as a single process would have produced them.
    """
    if topology.pipeline_length > 1:
        message = [local if topology.is_last_stage else None]
        dist.broadcast_object_list(message, src=topology.last_stage_rank, group=topology.replica_group, device=device)
        local = message[0]
    replicas = topology.replicas
    if replicas == 1 or not topology.is_last_stage or not local:
        return local
    gathered: list[Any] | None = [None] * replicas if topology.global_rank == 0 else None
    dist.gather_object(local, gathered, dst=0, group=topology.stage_group)
    if topology.global_rank != 0:
        return local
    per_replica = [join_outputs(batches) for batches in gathered]
    counts = [batch_size(p) for p in per_replica]
    offsets = [sum(counts[:r]) for r in range(replicas)]
    order = [offsets[j % replicas] + j // replicas for j in range(sum(counts))]
    merged = take(join_outputs(per_replica), order)
    return chunk(merged, batch_size(local[0]))
