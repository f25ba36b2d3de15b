"""What AutoCache keeps: each depth's tiers, the states read a step ahead, and an epoch's counts."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from lightning_pipetx.autocache.tiers import Tier


@dataclass
class Depth:
    tiers: list[Tier]
    tuple_len: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Prefetched:
    level: int
    position: torch.Tensor  # host, per sample: its row in ``states``, or -1
    states: torch.Tensor
    source: torch.Tensor  # host, per row: the tier it came from (index into TIER_NAMES)
    ready: torch.cuda.Event | None


@dataclass
class EpochCounts:
    """What the cache did since the last :meth:`AutoCache.take_counts`."""

    hits: int = 0
    lookups: int = 0
    served: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # samples per tier
    served_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    prefetched: int = 0  # samples whose states were read a step ahead

    def add(self, other: EpochCounts) -> None:
        self.hits += other.hits
        self.lookups += other.lookups
        self.prefetched += other.prefetched
        for name, samples in other.served.items():
            self.served[name] += samples
        for name, size in other.served_bytes.items():
            self.served_bytes[name] += size
