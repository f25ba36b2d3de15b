"""A sampler that keeps each replica's samples where their cached states are.

Lightning shards every distributed training loader with a ``DistributedSampler``, which deals
the samples to the replicas anew every epoch: a sample cached on one node is next read on
another, and a node-local cache misses. :class:`StableShardSampler` gives replica ``r`` the
``r``-th of ``R`` contiguous slices of one seeded permutation of the ``n`` samples, cut at
``r * n // R`` (their sizes differ by one at most), the same every epoch, and shuffles only
within it. When the number of replicas changes from ``R`` to ``k * R``, the old cuts are among
the new ones, so every new slice lies inside one old slice (and from ``k * R`` to ``R`` joins
``k`` of them): with replicas numbered node by node, the samples stay on their node.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class StableShardSampler(Sampler[int]):
    """Replica ``rank``'s fixed share of ``num_samples`` indices, reshuffled within every epoch.

    Like ``DistributedSampler``: every index once per epoch over all replicas, the shares
    brought to one length by repeating one index of the shorter shares (or, with ``drop_last``,
    leaving one out of the longer ones), ``set_epoch`` reseeding the order. The index of a
    share repeated or left out changes with the epoch, each in turn: none is left out for good.
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

    def order(self) -> torch.Tensor:
        """All indices in the run's fixed order, which the replicas slice."""
        if self.shuffle:
            return torch.randperm(self.num_samples_total, generator=torch.Generator().manual_seed(self.seed))
        return torch.arange(self.num_samples_total)

    def shard(self) -> torch.Tensor:
        """This replica's indices, in the run's fixed order, before they are brought to one length."""
        total, replicas = self.num_samples_total, self.num_replicas
        return self.order()[self.rank * total // replicas : (self.rank + 1) * total // replicas]

    def __iter__(self) -> Iterator[int]:
        indices = self._to_length(self.shard())
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + 1 + self.epoch)
            indices = indices[torch.randperm(len(indices), generator=generator)]
        return iter(indices.tolist())

    def _to_length(self, shard: torch.Tensor) -> torch.Tensor:
        """``shard`` brought to ``shard_size``: the index at position ``epoch mod len(shard)``
        left out of a longer shard, or repeated in a shorter one, so each takes its turn."""
        if len(shard) > self.shard_size:
            at = self.epoch % len(shard)
            return torch.cat([shard[:at], shard[at + 1 :]])
        if len(shard) < self.shard_size:
            pool = shard if len(shard) else self.order()  # fewer samples than replicas
            return torch.cat([shard, pool[self.epoch % len(pool)].reshape(1)])
        return shard

    def __len__(self) -> int:
        return self.shard_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
