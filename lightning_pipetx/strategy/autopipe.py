"""AutoPipe: choose the pipeline length and the stage boundaries for a frozen prefix.

Costs per block are relative compute times (parameter counts as the fallback). A frozen
block runs forward only, so it costs ``frozen_time`` (a third) of a trainable block, or
nothing when its output is cached; the frozen prefix always sits on the first stage,
outside the pipeline's backward. Memory per block is counted as four units for a
trainable block (weights, gradients, two Adam moments) and one for a frozen block.

The pipeline length ``K`` is chosen among the divisors of the initial length ``K0`` (so the
global batch splits evenly over the new replicas). The paper's rule takes the smallest
``K`` whose largest stage costs no more than the largest stage at the start (the longest
buildable pipeline when none does); the throughput model
``replicas * M / ((M + K - 1) * largest_stage_time)`` replaces that choice by a faster one
whose largest stage needs no more memory than the largest stage at the start.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_pipetx.blocks import BlockSplit
from lightning_pipetx.strategy.partition import partition
from lightning_pipetx.strategy.topology import Layout, divisors

FROZEN_TIME = 1 / 3
FROZEN_MEMORY = 1 / 4


@dataclass(frozen=True)
class Plan:
    """A layout, its micro-batch count, and which blocks each stage runs."""

    layout: Layout
    num_microbatches: int
    bounds: tuple[tuple[int, int], ...]
    stage_times: tuple[float, ...]
    stage_memory: tuple[float, ...]

    @property
    def predicted_throughput(self) -> float:
        k, m = self.layout.pipeline_length, self.num_microbatches
        return self.layout.replicas * m / ((m + k - 1) * max(self.stage_times))

    def same_layout(self, other: Plan) -> bool:
        """Whether both plans put the same blocks on the same ranks (costs aside)."""
        return (self.layout, self.bounds, self.num_microbatches) == (
            other.layout,
            other.bounds,
            other.num_microbatches,
        )

    def describe(self) -> str:
        times = ", ".join(f"{t:.3g}" for t in self.stage_times)
        return f"layout {self.layout}, {self.num_microbatches} micro-batches, blocks {list(self.bounds)}, stage costs [{times}]"


def frozen_partition(
    costs: Sequence[float], frozen: int, num_stages: int, frozen_time: float = FROZEN_TIME
) -> list[tuple[int, int]]:
    """Min-max partition in which blocks ``[0, frozen)`` all sit on the first stage."""
    if frozen <= 0:
        return partition(costs, num_stages)
    items = [sum(costs[:frozen]) * frozen_time, *costs[frozen:]]
    merged = partition(items, num_stages)
    # Item 0 is the frozen prefix; item j > 0 is block frozen + j - 1.
    return [(0 if s == 0 else s + frozen - 1, e + frozen - 1) for s, e in merged]


def _stage_values(costs: Sequence[float], frozen: int, bounds: Sequence[tuple[int, int]], frozen_weight: float):
    return tuple(
        float(sum(costs[i] * (frozen_weight if i < frozen else 1.0) for i in range(start, end)))
        for start, end in bounds
    )


def make_plan(
    costs: Sequence[float],
    frozen: int,
    world_size: int,
    pipeline_length: int,
    num_microbatches: int | None,
    frozen_time: float = FROZEN_TIME,
) -> Plan:
    """The plan for a given pipeline length (``num_microbatches=None``: 1 for K=1, else 2K)."""
    bounds = tuple(frozen_partition(costs, frozen, pipeline_length, frozen_time))
    m = num_microbatches or (1 if pipeline_length == 1 else 2 * pipeline_length)
    return Plan(
        Layout.for_world(world_size, pipeline_length),
        m,
        bounds,
        _stage_values(costs, frozen, bounds, frozen_time),
        _stage_values(costs, frozen, bounds, FROZEN_MEMORY),
    )


def max_stages(num_blocks: int, frozen: int) -> int:
    """The most stages a frozen prefix allows: it shares the first stage."""
    return num_blocks if frozen <= 0 else 1 + num_blocks - frozen


def choose_plan(
    costs: Sequence[float],
    frozen: int,
    world_size: int,
    initial_length: int,
    num_microbatches: int | None = None,
    accept: Callable[[Layout], bool] | None = None,
    frozen_time: float = FROZEN_TIME,
) -> Plan:
    """The plan for ``frozen`` blocks, starting from ``initial_length`` stages with none frozen.

    ``accept`` can rule layouts out (for example those the global batch does not split over);
    ``frozen_time`` is a frozen block's cost relative to a trainable one (0 when cached).
    """
    start = make_plan(costs, 0, world_size, initial_length, num_microbatches)
    time_bound, memory_bound = max(start.stage_times) * (1 + 1e-9), max(start.stage_memory) * (1 + 1e-9)
    feasible = [
        k
        for k in divisors(initial_length)
        if k <= max_stages(len(costs), frozen)
        and (k == initial_length or accept is None or accept(Layout.for_world(world_size, k)))
    ]
    if not feasible:
        raise ValueError(
            f"with {frozen} of {len(costs)} blocks frozen at most {max_stages(len(costs), frozen)} stages can be built, "
            f"and no such pipeline length divides {initial_length} with a global batch that splits over its "
            f"replicas: choose a global batch divisible by {world_size}, or pass keep_global_batch=False."
        )
    plans = [make_plan(costs, frozen, world_size, k, num_microbatches, frozen_time) for k in feasible]
    papers = next((p for p in plans if max(p.stage_times) <= time_bound), plans[-1])
    fitting = [p for p in plans if max(p.stage_memory) <= memory_bound]
    faster = max(fitting, key=lambda p: (p.predicted_throughput, -p.layout.pipeline_length), default=None)
    if faster is not None and faster.predicted_throughput > papers.predicted_throughput:
        return faster
    return papers


def block_costs(split: BlockSplit) -> list[float]:
    """Parameter count per block: the cost model's fallback."""
    return [float(sum(p.numel() for p in split.block_parameters(i))) for i in range(split.num_blocks)]
