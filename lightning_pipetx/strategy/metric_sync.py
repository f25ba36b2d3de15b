"""Where the torchmetrics metrics of a module and of its callbacks sync their states under a pipeline.

In a training step the code after the model call runs on the last stages only: a metric
updated there holds the replica's samples on its last stage and its initial state on the
other stages (one that a training hook updates from the batch or the loss, which every stage
holds, has a copy on every stage). In an evaluation step every stage updates its own copy
with the same output. DDP would sync each metric over one rank per replica; so do these.
During fit every metric the epoch's sync is installed on reads the last stage of each
replica, in training and in validation alike: that copy holds the replica's states whichever
steps updated it, so a training metric computed in a validation hook gives DDP's value too.
Other metrics (outside fit, or made during a validation) sync over the ranks of their stage
while evaluation runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors

from lightning_pipetx.strategy.output_relay import wire_dtype
from lightning_pipetx.strategy.topology import Layout, Topology


class MetricGroups:
    """Points the module's torchmetrics metrics at one stage's group while steps run: in
    evaluation, where every stage updates its own copy, so that they sync over one rank per
    replica, not over the world (which would count every replica's samples once per stage); in
    training too, so that a metric synced on every update (``dist_sync_on_step``) syncs over the
    replicas: after the model call on the last stages alone (the only ones that reach that code),
    before it on every stage alike."""

    def __init__(self) -> None:
        self._changed: list[Metric] = []

    def enter(
        self, metrics: Iterable[Metric], group: dist.ProcessGroup, keep: Callable[[Metric], bool] = lambda m: False
    ) -> None:
        """Point ``metrics`` without a group of their own at ``group``, except those ``keep`` accepts."""
        for metric in metrics:
            if metric.process_group is None and not keep(metric):
                metric.process_group = group
                self._changed.append(metric)

    def exit(self) -> None:
        for metric in self._changed:
            metric.process_group = None
        self._changed = []


_MODULE_STATE = ("_modules", "_parameters", "_buffers")


def module_metrics(module: nn.Module) -> list[Metric]:
    """The torchmetrics metrics among ``module``'s submodules."""
    return [metric for metric in module.modules() if isinstance(metric, Metric)]


def reachable_metrics(module: nn.Module, owners: Iterable[object] = ()) -> list[Metric]:
    """The metrics of ``module`` (its submodules, and those it keeps in a dict, list or tuple) and
    those ``owners`` (the trainer's callbacks) keep as attributes or in such containers."""
    found = {id(metric): metric for metric in module_metrics(module)}
    for owner in (module, *owners):
        for name, value in vars(owner).items():
            if name in _MODULE_STATE:  # the submodules are found above
                continue
            items = (
                value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
            )
            for item in items:
                if isinstance(item, nn.Module) and item is not module:
                    found.update((id(metric), metric) for metric in module_metrics(item))
    return list(found.values())


def gather_from_ranks(tensor: torch.Tensor, sources: list[int]) -> list[torch.Tensor]:
    """The ``tensor`` of each rank in ``sources``, on every rank of the world (a collective:
    every rank calls it; the others' tensors are not read)."""
    rank = dist.get_rank()
    specs: list[tuple[tuple[int, ...], torch.dtype] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(specs, (tuple(tensor.shape), tensor.dtype) if rank in sources else None)
    gathered = []
    for source in sources:
        shape, dtype = specs[source]
        wire = wire_dtype(dtype)
        if rank == source:
            buffer = tensor.detach().to(wire).contiguous()
        else:
            buffer = torch.empty(shape, dtype=wire, device=tensor.device)
        dist.broadcast(buffer, src=source)
        gathered.append(buffer.to(dtype))
    return gathered


class LastStageSync:
    """Makes a metric's sync over the world read the last stage of each replica only, the one
    rank of a replica whose copy a training step updated.

    Installed as the metrics' ``dist_sync_fn`` (torchmetrics' own hook) for the fit: a
    metric logged in ``training_step`` with ``on_epoch=True``, or computed in
    ``on_train_epoch_end``, then gives DDP's value whatever its states (lists that are
    concatenated, sums, means). ``sources`` says which ranks those are (the layout the epoch
    trained under), or None when every rank holds its replica's state: then, and for a sync
    over a group of the strategy's (:class:`MetricGroups`), torchmetrics' gather runs as usual.
    Metrics with a ``dist_sync_fn`` of their own are left alone."""

    def __init__(self, sources: Callable[[], list[int] | None]) -> None:
        self.sources = sources
        self._gather: _GatherFromSources | None = None
        self._installed: list[Metric] = []

    def install(self, metrics: Iterable[Metric]) -> None:
        self._gather = self._gather or _GatherFromSources(self.sources)
        for metric in metrics:
            if metric.dist_sync_fn is None:
                metric.dist_sync_fn = self._gather
                self._installed.append(metric)

    def syncs(self, metric: Metric) -> bool:
        """Whether ``metric`` reads the ranks of :attr:`sources` when it syncs over the world."""
        return self._gather is not None and metric.dist_sync_fn is self._gather

    def remove(self) -> None:
        for metric in self._installed:
            if metric.dist_sync_fn is self._gather:
                metric.dist_sync_fn = None
        self._installed, self._gather = [], None

    def __getstate__(self) -> dict:  # the strategy travels to spawned processes before fit
        return {"sources": self.sources, "_gather": None, "_installed": []}


class _GatherFromSources:
    """A metric's ``dist_sync_fn`` while :class:`LastStageSync` is installed."""

    def __init__(self, sources: Callable[[], list[int] | None]) -> None:
        self.sources = sources

    def __call__(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
        sources = self.sources()
        if sources is None or (group is not None and group is not dist.group.WORLD):
            return gather_all_tensors(tensor, group)
        return gather_from_ranks(tensor, sources)

    # A copy of the module made during fit (deepcopy, pickle) must not copy the strategy.
    def __deepcopy__(self, memo: dict) -> _GatherFromSources:
        return self

    def __reduce__(self) -> tuple:
        return _torchmetrics_gather, ()


def _torchmetrics_gather() -> Callable:
    return gather_all_tensors


class PipelineMetrics:
    """The strategy's side of logged values and metrics: which group each metric syncs over
    while steps run, which ranks hold a training metric's states when the epoch syncs it, and
    the layout the epoch's training values were logged under while a transition in the epoch
    made it differ from the running one (:attr:`logged_layout`, until the next epoch starts),
    whose process groups are kept to reduce them. ``running_layout`` gives the running engine's
    layout (None before set-up)."""

    def __init__(self, running_layout: Callable[[], Layout | None]) -> None:
        self.running_layout = running_layout
        self.logged_layout: Layout | None = None
        self.logged_stage_group: dist.ProcessGroup | None = None
        self._free_logged_groups: Callable[[], None] | None = None
        self._evaluating = False
        self._evaluation_group: dist.ProcessGroup | None = None  # while evaluation runs under a pipeline
        self._evaluation = MetricGroups()
        self._training = MetricGroups()
        self._epoch_sync = LastStageSync(self.state_ranks)

    def logged_under(
        self, layout: Layout, stage_group: dist.ProcessGroup | None, free_groups: Callable[[], None]
    ) -> None:
        """A transition in a training epoch: its values were logged under ``layout``, and reduce
        over this rank's ``stage_group`` of it (the ranks that logged the same keys: a hook may log
        values of its stage's own, the gradient norms of its blocks) until the next epoch starts;
        then ``free_groups`` frees that layout's groups."""
        self.forget_logged()
        self.logged_layout, self.logged_stage_group, self._free_logged_groups = layout, stage_group, free_groups

    def waited_in(self) -> list[dist.ProcessGroup]:
        """The group a reduction of logged values may wait in besides the running layout's (the
        old layout's stage group, after a transition in a training epoch)."""
        return [] if self.logged_stage_group is None else [self.logged_stage_group]

    def forget_logged(self) -> None:
        if self._free_logged_groups is not None:
            self._free_logged_groups()
        self.logged_layout, self.logged_stage_group, self._free_logged_groups = None, None, None

    def begin_epoch(self, module: nn.Module) -> None:
        """A training epoch starts: the last one's values are reduced by now."""
        self.forget_logged()
        self._epoch_sync.install(step_metrics(module))  # metrics made since the last epoch too

    @contextlib.contextmanager
    def training_step(self, module: nn.Module, topology: Topology) -> Generator[None, None, None]:
        """Under a pipeline, metrics a training step updates sync among the ranks of their stage (the
        last stages alone reach the code after the model call); after it every rank forgets the
        values its metrics' ``compute()`` cached."""
        if topology.pipeline_length == 1:
            yield
            return
        self._training.enter(step_metrics(module), topology.stage_group)
        try:
            yield
        finally:
            self._training.exit()
        metrics = step_metrics(module)
        self._epoch_sync.install(metrics)  # a metric the step made, too
        forget_computed(metrics)

    def evaluation_starts(self, module: nn.Module, topology: Topology) -> None:
        """Every stage updates its metrics in evaluation steps: those the epoch's sync reads from
        the last stages keep doing so (a training metric's states are there alone), the others
        sync over the ranks of their stage."""
        self._evaluating = True
        self._evaluation_group = topology.stage_group if topology.pipeline_length > 1 else None
        self.evaluation_step_done(module)

    def evaluation_step_done(self, module: nn.Module) -> None:
        """A metric the step made syncs over its stage too, and so do metrics the module keeps in a
        container and the callbacks' (each stage's copy sees the same outputs)."""
        if self._evaluation_group is not None:
            self._evaluation.enter(step_metrics(module), self._evaluation_group, keep=self._epoch_sync.syncs)

    def evaluation_ends(self) -> None:
        self._evaluating, self._evaluation_group = False, None
        self._evaluation.exit()

    def state_ranks(self) -> list[int] | None:
        """The ranks whose copies of a metric hold the states (the last stages of the layout the
        epoch trained under, or while evaluation runs the running one); None when every rank's
        copy does."""
        layout = None if self._evaluating else self.logged_layout
        layout = layout or self.running_layout()
        if layout is None or layout.pipeline_length == 1:
            return None
        return layout.stage_ranks(layout.pipeline_length - 1)

    def remove(self) -> None:
        """The run ended, or failed (in a validation, too)."""
        self._epoch_sync.remove()
        self._evaluation.exit()
        self._training.exit()
        self._evaluating, self._evaluation_group = False, None
        self.forget_logged()


def step_metrics(module: nn.Module) -> list[Metric]:
    """The metrics a step or a hook around it may update: the module's and its callbacks'."""
    return reachable_metrics(module, module.trainer.callbacks)


def forget_computed(metrics: Iterable[Metric]) -> None:
    """Drop the value each metric's last ``compute()`` cached. A metric returns that value without
    syncing until its next update, and a training step updates the copies of the last stages only:
    the other stages' cached values would be stale, and their ``compute()`` would skip the sync that
    the last stages enter."""
    for metric in metrics:
        metric._computed = None
