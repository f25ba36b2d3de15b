"""A sampler that keeps each replica's samples where their cached states are.

Lightning shards every distributed training loader with a ``DistributedSampler``, which deals
the samples to the replicas anew every epoch: a sample cached on one node is next read on
another, and a node-local cache misses. :class:`StableShardSampler` gives replica ``r`` the
``r``-th contiguous slice of one seeded permutation of the dataset, the same every epoch, and
shuffles only within it. When the number of replicas changes from ``R`` to ``k * R`` (or
``R / k``), every new slice lies inside one old slice, so with replicas numbered node by node
the samples stay on their node.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class StableShardSampler(Sampler[int]):
    """Replica ``rank``'s fixed share of ``num_samples`` indices, reshuffled within every epoch.

    Like ``DistributedSampler``: every index once per epoch over all replicas, the shares
    padded by repeating indices (or cut, with ``drop_last``) to one length, ``set_epoch``
    reseeding the order.
    """

    def __init__(
        self,
        num_samples: int,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"StableShardSampler: rank {rank} is not in [0, {num_replicas}).")
        self.num_samples_total = num_samples
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        if drop_last:
            self.shard_size = num_samples // num_replicas
        else:
            self.shard_size = math.ceil(num_samples / num_replicas)

    def shard(self) -> torch.Tensor:
        """This replica's indices, in the run's fixed order."""
        if self.shuffle:
            order = torch.randperm(self.num_samples_total, generator=torch.Generator().manual_seed(self.seed))
        else:
            order = torch.arange(self.num_samples_total)
        total = self.shard_size * self.num_replicas
        if total > len(order):
            order = torch.cat([order, order.repeat(math.ceil(total / len(order)))[: total - len(order)]])
        start = self.rank * self.shard_size
        return order[start : start + self.shard_size]

    def __iter__(self) -> Iterator[int]:
        indices = self.shard()
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + 1 + self.epoch)
            indices = indices[torch.randperm(len(indices), generator=generator)]
        return iter(indices.tolist())

    def __len__(self) -> int:
        return self.shard_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
