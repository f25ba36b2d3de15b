"""AutoPipe: choose the pipeline length and the stage boundaries for a frozen prefix.

Costs per block are relative compute times (parameter counts as the fallback). A frozen
block runs forward only, so it costs ``frozen_time`` (a third) of a trainable block, or
nothing when its output is cached; the frozen prefix always sits on the first stage,
outside the pipeline's backward. Memory per block follows its parameter count (never its
time): four units per parameter for a trainable block (weights, gradients, two Adam moments)
and three for a frozen block, which keeps its weights and moments (a checkpoint holds them).

The pipeline length ``K`` is chosen among the divisors of the initial length ``K0`` (so the
global batch splits evenly over the new replicas). The paper's rule takes the smallest
``K`` whose largest stage costs no more than the largest stage at the start (the longest
buildable pipeline when none does); the throughput model
``replicas * M / ((M + K - 1) * largest_stage_time)`` replaces that choice by a faster one
whose largest stage needs no more memory than the largest stage at the start. Either way a
layout must fit the device: its largest stage's training state within the share of the memory
budget that ``pipeline_length="auto"`` allows (or within what the start needed, if more). When
no ``K`` fits around the frozen prefix, splits the global batch and fits the device, the layout
stays and the blocks freeze in place (the prefix then spans the first stages).

The *initial* pipeline length (``pipeline_length="auto"``) is chosen in bytes instead: among
the divisors of the world size, the layout predicted fastest whose largest stage's training
state (weights, gradients, two optimizer moments, and every weight outside the block list)
fits in the part of the device's memory not kept for activations. With the throughput model
that is the shortest pipeline that fits: a model that fits one device trains as pure data
parallelism.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightning_pipetx.blocks import BlockSplit
from lightning_pipetx.strategy.partition import partition, stage_costs
from lightning_pipetx.strategy.topology import Layout, divisors

FROZEN_TIME = 1 / 3
FROZEN_MEMORY = 3 / 4  # weights and Adam's two moments, kept when a block freezes; no gradient
OPTIMIZER_STATE_BYTES = 8  # per trainable element: Adam's two float32 moments
ACTIVATION_SHARE = 0.5  # of a device's memory, kept for activations (unknown before the first batch)


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
    sizes: Sequence[float] | None = None,
) -> Plan:
    """The plan for a given pipeline length (``num_microbatches=None``: 1 for K=1, else 2K); its
    stages' memory from ``sizes`` (parameters per block; ``costs`` when None)."""
    bounds = tuple(frozen_partition(costs, frozen, pipeline_length, frozen_time))
    m = num_microbatches or (1 if pipeline_length == 1 else 2 * pipeline_length)
    return Plan(
        Layout.for_world(world_size, pipeline_length),
        m,
        bounds,
        _stage_values(costs, frozen, bounds, frozen_time),
        _stage_values(costs if sizes is None else sizes, frozen, bounds, FROZEN_MEMORY),
    )


def max_stages(num_blocks: int, frozen: int) -> int:
    """The most stages a frozen prefix allows: it shares the first stage."""
    return num_blocks if frozen <= 0 else 1 + num_blocks - frozen


def buildable_lengths(
    num_blocks: int, frozen: int, world_size: int, initial_length: int, accept: Callable[[Layout], bool] | None = None
) -> list[int]:
    """The divisors of ``initial_length`` that fit around a frozen prefix on the first stage and
    whose layout ``accept`` keeps (the initial layout always is)."""
    return [
        k
        for k in divisors(initial_length)
        if k <= max_stages(num_blocks, frozen)
        and (k == initial_length or accept is None or accept(Layout.for_world(world_size, k)))
    ]


def kept_reason(num_blocks: int, frozen: int, initial_length: int, by_memory: bool = False) -> str:
    """Why :func:`choose_plan` found no layout for ``frozen`` blocks (``by_memory``: none that
    could be built fits the device's memory)."""
    if by_memory:
        return (
            f"with {frozen} of {num_blocks} blocks frozen no layout that can be built fits the device's memory "
            "(frozen blocks keep their weights and optimizer moments): the layout stays and the blocks freeze in place"
        )
    return (
        f"with {frozen} of {num_blocks} blocks frozen at most {max_stages(num_blocks, frozen)} stages fit around "
        f"the frozen prefix, and no shorter pipeline length dividing {initial_length} splits the global batch over "
        "its replicas: the layout stays and the blocks freeze in place (keep_global_batch=False lifts this)"
    )


def choose_plan(
    costs: Sequence[float],
    frozen: int,
    world_size: int,
    initial_length: int,
    num_microbatches: int | None = None,
    accept: Callable[[Layout], bool] | None = None,
    frozen_time: float = FROZEN_TIME,
    sizes: Sequence[float] | None = None,
    fits: Callable[[Plan], bool] | None = None,
) -> Plan | None:
    """The plan for ``frozen`` blocks, starting from ``initial_length`` stages with none frozen.

    ``accept`` can rule layouts out (for example those the global batch does not split over);
    ``frozen_time`` is a frozen block's cost relative to a trainable one (0 when cached);
    ``sizes`` are the blocks' parameter counts when ``costs`` are measured times: memory is
    counted in them, against the largest stage of the start, which split them. ``fits``: whether
    a plan fits the device (:func:`device_fit`).
    None when no layout is left (:func:`kept_reason`): the caller keeps its layout.
    """
    lengths = buildable_lengths(len(costs), frozen, world_size, initial_length, accept)
    sizes = costs if sizes is None else sizes
    plans = [make_plan(costs, frozen, world_size, k, num_microbatches, frozen_time, sizes) for k in lengths]
    plans = [p for p in plans if fits is None or fits(p)]
    if not plans:
        return None
    start = make_plan(costs, 0, world_size, initial_length, num_microbatches)
    time_bound = max(start.stage_times) * (1 + 1e-9)
    memory_bound = max(stage_costs(sizes, partition(sizes, initial_length))) * (1 + 1e-9)
    papers = next((p for p in plans if max(p.stage_times) <= time_bound), plans[-1])
    fitting = [p for p in plans if max(p.stage_memory) <= memory_bound]
    faster = max(fitting, key=lambda p: (p.predicted_throughput, -p.layout.pipeline_length), default=None)
    if faster is not None and faster.predicted_throughput > papers.predicted_throughput:
        return faster
    return papers


def frozen_in_place(plan: Plan, costs: Sequence[float], frozen: int, frozen_time: float = FROZEN_TIME) -> Plan:
    """``plan``'s layout and stages with ``frozen`` blocks frozen where they are (they may span stages)."""
    times = _stage_values(costs, frozen, plan.bounds, frozen_time)
    memory = _stage_values(costs, frozen, plan.bounds, FROZEN_MEMORY)
    return Plan(plan.layout, plan.num_microbatches, plan.bounds, times, memory)


def block_costs(split: BlockSplit) -> list[float]:
    """Parameter count per block: the cost model's fallback."""
    return [float(sum(p.numel() for p in split.block_parameters(i))) for i in range(split.num_blocks)]


def _weight_bytes(params: Iterable[nn.Parameter]) -> float:
    return float(sum(p.numel() * p.element_size() for p in params))


def training_bytes(params: Iterable[nn.Parameter]) -> float:
    """Weights, and for trainable ones gradients and Adam's two float32 moments, in bytes."""
    total = 0.0
    for p in params:
        weight = p.numel() * p.element_size()
        total += weight + (weight + p.numel() * OPTIMIZER_STATE_BYTES if p.requires_grad else 0)
    return total


def _state_bytes(params: Sequence[nn.Parameter]) -> float:
    """Gradients and optimizer state of ``params``, without their weights."""
    return training_bytes(params) - _weight_bytes(params)


@dataclass(frozen=True)
class ModelMemory:
    """Bytes of training state: per block, and outside the block list.

    Every rank holds all weights outside the block list; their gradients and optimizer state
    live where they are trained: ``pre`` on the first stage, ``post`` on the last (a weight
    tied between them, on both: once where one stage is both).
    """

    blocks: tuple[float, ...]
    shared_weights: float
    pre_training: float
    post_training: float
    tied_training: float = 0.0  # the part of pre_training that post_training counts too

    @classmethod
    def of(cls, split: BlockSplit) -> ModelMemory:
        in_blocks = {id(p) for i in range(split.num_blocks) for p in split.block_parameters(i)}
        shared = [p for p in split.root.parameters() if id(p) not in in_blocks]
        pre = {id(p) for p in split.pre_parameters()}
        post = {id(p) for _, module in split.post for p in module.parameters()}
        pre_params = [p for p in shared if id(p) in pre]
        post_params = [p for p in shared if id(p) in post or id(p) not in pre]
        return cls(
            tuple(training_bytes(split.block_parameters(i)) for i in range(split.num_blocks)),
            _weight_bytes(shared),
            _state_bytes(pre_params),
            _state_bytes(post_params),
            _state_bytes([p for p in pre_params if id(p) in post]),
        )

    def stage_bytes(self, bounds: Sequence[tuple[int, int]], frozen: int = 0) -> list[float]:
        """Training-state bytes of each stage of a partition whose blocks ``[0, frozen)`` are frozen."""
        last = len(bounds) - 1
        return [
            sum(self.blocks[i] * (FROZEN_MEMORY if i < frozen else 1.0) for i in range(start, end))
            + self.shared_weights
            + (self.pre_training if stage == 0 else 0.0)
            + (self.post_training if stage == last else 0.0)
            - (self.tied_training if stage == 0 == last else 0.0)
            for stage, (start, end) in enumerate(bounds)
        ]


@dataclass(frozen=True)
class Candidate:
    """A possible initial layout: its plan, its largest stage's bytes, whether that fits."""

    plan: Plan
    peak_bytes: float
    fits: bool


def choose_initial_plan(
    costs: Sequence[float],
    memory: ModelMemory,
    world_size: int,
    max_length: int,
    budget_bytes: float,
    num_microbatches: int | None = None,
) -> tuple[Plan, list[Candidate]]:
    """The initial plan for ``pipeline_length="auto"``, and every candidate considered.

    Candidates are the divisors of ``world_size`` up to ``max_length``. A candidate fits when
    its largest stage's training state takes at most ``1 - ACTIVATION_SHARE`` of
    ``budget_bytes``; the fastest fitting one by the throughput model is chosen (the shorter
    pipeline on a tie), or the one needing the least memory when none fits.
    """
    candidates = []
    for k in divisors(world_size):
        if k > max_length:
            continue
        plan = make_plan(costs, 0, world_size, k, num_microbatches)
        peak = max(memory.stage_bytes(plan.bounds))
        candidates.append(Candidate(plan, peak, peak <= budget_bytes * (1 - ACTIVATION_SHARE)))
    fitting = [c for c in candidates if c.fits]
    if fitting:
        best = max(fitting, key=lambda c: (c.plan.predicted_throughput, -c.plan.layout.pipeline_length))
    else:
        best = min(candidates, key=lambda c: (c.peak_bytes, c.plan.layout.pipeline_length))
    return best.plan, candidates


def transition_limit(memory: ModelMemory, budget_bytes: float, start: Plan) -> float:
    """Training-state bytes a stage may hold after a transition: the share of ``budget_bytes`` that
    ``pipeline_length="auto"`` allows, or what the ``start`` plan's largest stage needed, if more."""
    return max(budget_bytes * (1 - ACTIVATION_SHARE), max(memory.stage_bytes(start.bounds)))


def device_fit(memory: ModelMemory, frozen: int, limit_bytes: float) -> Callable[[Plan], bool]:
    """Whether a plan's largest stage, with ``frozen`` blocks frozen, keeps its training state within ``limit_bytes``."""
    return lambda plan: max(memory.stage_bytes(plan.bounds, frozen)) <= limit_bytes * (1 + 1e-9)


def device_memory(device: torch.device, processes_per_node: int) -> float:
    """A device's memory in bytes: the GPU's, or the host's divided among the node's processes."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / max(1, processes_per_node)


def explain_choice(chosen: Plan, candidates: Sequence[Candidate], budget_bytes: float) -> str:
    """One line on why ``chosen`` was picked among ``candidates``."""
    limit = budget_bytes * (1 - ACTIVATION_SHARE)
    rows = ", ".join(
        f"{c.plan.layout} {c.peak_bytes / 2**30:.2f} GiB x{c.plan.predicted_throughput / chosen.predicted_throughput:.2f}"
        f"{'' if c.fits else ' too big'}"
        for c in candidates
    )
    budget = (
        f"{limit / 2**30:.2f} GiB ({1 - ACTIVATION_SHARE:.0%} of {budget_bytes / 2**30:.2f} GiB per device, the rest "
        f"kept for activations)"
    )
    if any(c.fits for c in candidates):
        why = f"the fastest predicted whose largest stage's weights, gradients and optimizer state fit in {budget}"
    else:
        need = min(c.peak_bytes for c in candidates)
        why = (
            f"none fits; the one needing least, whose largest stage's weights, gradients and optimizer state need "
            f"{need / 2**30:.2f} GiB, more than {budget}"
        )
    return f"layout {chosen.layout}: {why}. Candidates (GiB per device, throughput relative to the choice): {rows}"


class AutoPipe:
    """One run's layout planner: the block costs, the first pipeline length, and the plan
    for each frozen prefix.

    Costs start as parameter counts; with ``profile`` the forward seconds per block measured
    before the first freeze replace them there (:meth:`take_profile`). Memory is counted in
    parameters (``sizes``) throughout.

    Args:
        pipeline_length: stages to start with, or ``"auto"`` (chosen within a memory budget).
        num_microbatches: micro-batches per batch, or ``"auto"``.
    """

    def __init__(self, pipeline_length: int | str, num_microbatches: int | str) -> None:
        self.pipeline_length = pipeline_length
        self.microbatches = None if num_microbatches == "auto" else num_microbatches
        self.costs: list[float] = []
        self.sizes: list[float] = []  # parameters per block: what memory is counted in
        self.profiled = False  # the costs are measured forward times
        self.initial_length = 1
        self.memory: ModelMemory | None = None
        self.memory_limit = float("inf")  # bytes of training state a stage may hold
        self.kept_by_memory = False  # the last plan was None because no layout fits the device
        self._awaiting_profile = False

    def start(
        self,
        split: BlockSplit,
        world_size: int,
        max_length: int,
        budget: Callable[[], float],
        profile: bool,
    ) -> tuple[Plan, str | None]:
        """Plan the run's start: costs from parameter counts, the first pipeline length (at most
        ``max_length`` stages under ``"auto"``, whose stages must fit ``budget()`` bytes per device),
        and the plan with nothing frozen; with it, under ``"auto"``, a line on why."""
        self.costs = block_costs(split)
        self.sizes = list(self.costs)
        self._awaiting_profile = profile
        self.memory, bytes_per_device = ModelMemory.of(split), budget()
        why = None
        if self.pipeline_length == "auto":
            plan, candidates = choose_initial_plan(
                self.costs, self.memory, world_size, max_length, bytes_per_device, self.microbatches
            )
            self.initial_length = plan.layout.pipeline_length
            why = explain_choice(plan, candidates, bytes_per_device)
        else:
            Layout.for_world(world_size, self.pipeline_length)  # refuses a length that does not divide the world
            if self.pipeline_length > split.num_blocks:
                raise ValueError(
                    f"ElasticPipelineStrategy(pipeline_length={self.pipeline_length}) is more stages than the "
                    f"{split.num_blocks} blocks of {split.path!r}: use a pipeline_length of at most "
                    f"{split.num_blocks}."
                )
            self.initial_length = self.pipeline_length
        start = self.plan(0, world_size)
        self.memory_limit = transition_limit(self.memory, bytes_per_device, start)
        return start, why

    def take_profile(self, seconds: Callable[[], list[float] | None]) -> list[float] | None:
        """At the first freeze (on every rank: ``seconds`` may be a collective): the profiled
        forward seconds per block become the costs. Returns them when they did."""
        if not self._awaiting_profile:
            return None
        self._awaiting_profile = False
        profiled = seconds()
        if profiled is not None:
            self.costs, self.profiled = profiled, True
        return profiled

    def restore_profile(self, costs: list[float] | None) -> None:
        """The measured costs of the run a checkpoint was saved in (None: it had not measured them),
        so that a resumed run plans as that run did instead of profiling frozen blocks again."""
        if costs is not None and len(costs) == len(self.costs):
            self.costs, self.profiled, self._awaiting_profile = [float(c) for c in costs], True, False

    def plan(
        self,
        frozen: int,
        world_size: int,
        accept: Callable[[Layout], bool] | None = None,
        frozen_time: float = FROZEN_TIME,
    ) -> Plan | None:
        """The plan for ``frozen`` leading blocks, or None to keep the layout (see :func:`choose_plan`)."""
        if frozen == 0:
            return make_plan(self.costs, 0, world_size, self.initial_length, self.microbatches, sizes=self.sizes)
        fits = None if self.memory is None else device_fit(self.memory, frozen, self.memory_limit)
        plan = choose_plan(
            self.costs,
            frozen,
            world_size,
            self.initial_length,
            self.microbatches,
            accept,
            frozen_time,
            self.sizes,
            fits,
        )
        buildable = buildable_lengths(len(self.costs), frozen, world_size, self.initial_length, accept)
        self.kept_by_memory = plan is None and bool(buildable)
        return plan

    def kept_reason(self, frozen: int) -> str:
        """Why :meth:`plan` gave None for ``frozen`` blocks."""
        return kept_reason(len(self.costs), frozen, self.initial_length, self.kept_by_memory)
