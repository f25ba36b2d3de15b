"""The (replica, stage) grid over the world, and the process groups built on it.

``world = replicas x pipeline_length``. Ranks of one replica are consecutive; inside a
replica the *last* stage takes the lowest rank, so global rank 0 is the last stage of
replica 0: the rank where the loss, ``self.log`` values and predictions are produced is
the rank Lightning's loggers, progress bar and spawn launcher read from.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    """``replicas`` data-parallel copies of a pipeline of ``pipeline_length`` stages."""

    pipeline_length: int
    replicas: int

    @property
    def world_size(self) -> int:
        return self.pipeline_length * self.replicas

    def coords(self, rank: int) -> tuple[int, int]:
        """``(replica, stage)`` of a global rank."""
        replica, offset = divmod(rank, self.pipeline_length)
        return replica, self.pipeline_length - 1 - offset

    def rank(self, replica: int, stage: int) -> int:
        """Global rank of ``(replica, stage)``."""
        return replica * self.pipeline_length + (self.pipeline_length - 1 - stage)

    def stage_ranks(self, stage: int) -> list[int]:
        """Ranks that run ``stage``, one per replica (gradient all-reduce)."""
        return [self.rank(r, stage) for r in range(self.replicas)]

    def replica_ranks(self, replica: int) -> list[int]:
        """Ranks of one replica's stages, first stage first (activations)."""
        return [self.rank(replica, s) for s in range(self.pipeline_length)]

    def __str__(self) -> str:
        return f"{self.pipeline_length}x{self.replicas}"

    @classmethod
    def for_world(cls, world_size: int, pipeline_length: int) -> Layout:
        if pipeline_length < 1 or world_size % pipeline_length:
            raise ValueError(
                f"pipeline_length={pipeline_length} does not divide the world size {world_size}: "
                f"choose a pipeline length in {divisors(world_size)} or change the number of devices."
            )
        return cls(pipeline_length, world_size // pipeline_length)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


class Topology:
    """One rank's place in a :class:`Layout`, with the process groups it communicates in.

    ``stage_group``: this stage across replicas (gradient all-reduce, metric sync).
    ``replica_group``: this replica's stages (log replay, gradient-norm sum).
    Groups are built collectively by every rank and destroyed with :meth:`destroy`, so a
    transition can replace the topology.
    """

    def __init__(self, layout: Layout, rank: int, timeout: timedelta | None = None) -> None:
        self.layout = layout
        self.global_rank = rank
        self.replica, self.stage = layout.coords(rank)
        self._groups: list[dist.ProcessGroup] = []
        self.stage_group = self._build([layout.stage_ranks(s) for s in range(layout.pipeline_length)], timeout)[
            self.stage
        ]
        self.replica_group = self._build([layout.replica_ranks(r) for r in range(layout.replicas)], timeout)[
            self.replica
        ]

    def _build(self, rank_lists: list[list[int]], timeout: timedelta | None) -> list[dist.ProcessGroup | None]:
        groups = []
        for ranks in rank_lists:
            # Every rank must call new_group for every group, in the same order.
            group = dist.new_group(ranks, timeout=timeout) if dist.is_initialized() else None
            if group is not None and self.global_rank in ranks:
                self._groups.append(group)
            groups.append(group)
        return groups

    @property
    def pipeline_length(self) -> int:
        return self.layout.pipeline_length

    @property
    def replicas(self) -> int:
        return self.layout.replicas

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.layout.pipeline_length - 1

    @property
    def prev_rank(self) -> int | None:
        return None if self.is_first_stage else self.layout.rank(self.replica, self.stage - 1)

    @property
    def next_rank(self) -> int | None:
        return None if self.is_last_stage else self.layout.rank(self.replica, self.stage + 1)

    @property
    def last_stage_rank(self) -> int:
        return self.layout.rank(self.replica, self.layout.pipeline_length - 1)

    @property
    def groups(self) -> list[dist.ProcessGroup]:
        """The process groups this rank belongs to."""
        return list(self._groups)

    def destroy(self) -> None:
        while self._groups:  # one at a time: an interrupted destroy leaves the rest listed
            dist.destroy_process_group(self._groups.pop())
