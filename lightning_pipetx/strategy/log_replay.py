"""Make ``self.log`` in ``training_step`` behave as in single-process training, on every stage.

The user's training step runs once per micro-batch, and only the last stage reaches the loss
and the metrics. :class:`LogRecorder` captures the ``self.log`` calls of a step and merges
them per name, on the device, into the value the whole batch would have logged (weighted by
micro-batch size, or by the ``batch_size`` the calls gave); :class:`LogShare` sends the merged
values and the loss from the last stage to the other stages of the replica, and
:func:`replay` issues them through the module's real ``self.log``. Every rank then holds the
same logged values: ``callback_metrics``, ``ModelCheckpoint(monitor=...)``, ``EarlyStopping``,
the progress bar and the loggers behave as in single-process runs.

The values and the loss travel as one tensor broadcast over the replica; the calls' names and
options are pickled only when they change. The last stage replays its own device tensors, so
the rank that the loggers and the progress bar read never waits for the device here.

torchmetrics objects are logged by name: the non-last stages log their own (never updated)
copy, whose state is the neutral element, so the metric's own sync over all ranks at
``compute()`` gives every rank the value over all replicas; its value for the step (what
``on_step=True`` shows) is the last stage's.

Evaluation steps run to their end on every stage (see :mod:`output_relay`) and log directly.
"""

from __future__ import annotations

import contextlib
import inspect
import numbers
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torchmetrics import Metric

from lightning_pipetx.strategy.topology import Topology

_REDUCERS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}
_LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)


@dataclass(frozen=True)
class LogSpec:
    """One merged ``self.log`` call without its value: what travels pickled when it changes."""

    name: str
    metric_path: str | None  # set when a torchmetrics Metric was logged
    has_value: bool  # False for a metric without a single-number value for the step
    options: tuple[tuple[str, Any], ...]  # the call's keyword arguments, without batch_size


@dataclass
class MergedLogs:
    """The merged calls of one step: a value (device tensor, Python number, or None for a
    metric without one) and a batch size per call."""

    specs: tuple[LogSpec, ...] = ()
    values: list[Any] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)


def _reduce_name(reduce_fx: Any) -> str:
    """The reduction Lightning applies for ``reduce_fx`` (it takes Python's ``sum``, ``max`` and
    ``min`` as torch's); anything else merges as a mean, and Lightning refuses it at the replay."""
    if isinstance(reduce_fx, str):
        return _REDUCERS.get(reduce_fx.lower(), "mean")
    for how, functions in (("sum", (torch.sum, sum)), ("max", (torch.max, max)), ("min", (torch.min, min))):
        if any(reduce_fx is f for f in functions):
            return how
    return "mean"


def _whole_batch_size(samples: list[int], given: list[Any], known: int | None) -> int | None:
    """The ``batch_size`` the calls of a step gave when it is the whole batch's, else None.

    ``samples``: the micro-batches' sizes; ``given``: the ``batch_size`` each call passed. One
    integer passed on every micro-batch, other than their sizes, that is the batch's number of
    samples (or was, at an earlier step: the loader's batch size before a short last batch) is
    the whole batch's, as ``batch_size=self.hparams.batch_size`` gives. Anything else (the
    micro-batch's own size, a count of its tokens) is the micro-batch's."""
    if None in given or not all(isinstance(b, numbers.Integral) for b in given):
        return None
    if len(set(given)) != 1 or list(given) == list(samples):
        return None
    size = int(given[0])
    return size if size in (sum(samples), known) else None


def _number(value: float, device: torch.device) -> torch.Tensor:
    """A 0-dim float64 tensor on ``device``, filled there (no copy from the host)."""
    return torch.full((), float(value), dtype=torch.float64, device=device)


def _scalar(value: Any, name: str, device: torch.device) -> torch.Tensor:
    """A logged value as a 0-dim float64 tensor, without a host synchronisation."""
    if not isinstance(value, torch.Tensor):
        return _number(value, device)
    if value.numel() != 1:
        raise ValueError(f"self.log({name!r}, value): value has {value.numel()} elements; log a single number.")
    return value.detach().reshape(()).to(device, torch.float64)


def _merge(values: list[Any], weights: list[float], how: str, name: str, device: torch.device) -> Any:
    """The value the whole batch would have logged, from one value per micro-batch."""
    total = sum(weights)
    if not any(isinstance(v, torch.Tensor) for v in values):  # Python numbers stay on the host
        numbers = [float(v) for v in values]
        if how in ("max", "min"):
            return max(numbers) if how == "max" else min(numbers)
        return sum(numbers) if how == "sum" else sum(v * w for v, w in zip(numbers, weights)) / total
    tensors = [_scalar(v, name, device) for v in values]
    if how in ("max", "min"):
        stacked = torch.stack(tensors)
        return stacked.max() if how == "max" else stacked.min()
    if how == "sum":
        return sum(tensors)
    return sum(t * (w / total) for t, w in zip(tensors, weights))


class LogRecorder:
    """Captures the ``self.log`` calls the user's training step makes on each micro-batch."""

    def __init__(self, module: pl.LightningModule, pipelined: bool = False) -> None:
        self.module = module
        self.pipelined = pipelined  # the calls are replayed on every stage of the replica
        # per name, one call per micro-batch: (value, options, the micro-batch's samples, the batch_size given)
        self._calls: dict[str, list[tuple[Any, dict[str, Any], int, int | None]]] = {}
        self._weight = 1
        self._logged_now: set[str] = set()  # names logged on the current micro-batch
        self._metric_paths: dict[int, str] = {}  # id of a logged torchmetrics Metric -> its module path
        self._whole_batch_sizes: dict[str, int] = {}  # per name, the batch_size its calls gave for a whole batch

    @contextlib.contextmanager
    def capture(self) -> Iterator[LogRecorder]:
        self._calls, self._logged_now = {}, set()
        self.module.log = self._record  # instance attribute shadows LightningModule.log
        try:
            yield self
        finally:
            del self.module.log

    def set_weight(self, weight: int) -> None:
        """Samples in the micro-batch whose calls follow."""
        self._weight = weight
        self._logged_now = set()

    def _record(self, *args: Any, **kwargs: Any) -> None:
        arguments = _LOG_SIGNATURE.bind(self.module, *args, **kwargs).arguments
        arguments.pop("self")
        name, value = arguments.pop("name"), arguments.pop("value")
        batch_size = arguments.pop("batch_size", None)
        if self.pipelined and arguments.get("sync_dist_group") is not None:
            raise ValueError(
                f"self.log({name!r}, ..., sync_dist_group=...) in training_step under a pipeline: the call is "
                f"replayed on every stage of the replica, where the group's ranks hold other stages. Leave "
                f"sync_dist_group unset: sync_dist=True then syncs over the replicas."
            )
        if isinstance(value, torch.Tensor):  # what it holds now: the step may change it after the call
            value = value.detach().clone()
        calls = self._calls.setdefault(name, [])
        if name in self._logged_now:  # logged again on this micro-batch: the last call counts, as in Lightning
            calls.pop()
        self._logged_now.add(name)
        calls.append((value, arguments, self._weight, batch_size))

    def _metric_path(self, name: str, metric: Metric) -> str:
        path = self._metric_paths.get(id(metric))
        if path is None or not self._holds(path, metric):  # walk the modules when a metric is new, not every step
            self._metric_paths = {id(m): n for n, m in self.module.named_modules() if isinstance(m, Metric)}
            path = self._metric_paths.get(id(metric))
        if path is None:
            raise ValueError(f"self.log({name!r}, metric): the metric must be an attribute of the module")
        return path

    def _holds(self, path: str, metric: Metric) -> bool:
        try:
            return self.module.get_submodule(path) is metric
        except AttributeError:
            return False

    def merged(self, device: torch.device) -> MergedLogs:
        """One call per name, in first-logged order, as the whole batch would have logged it."""
        specs, values, sizes = [], [], []
        for name, calls in self._calls.items():
            value, options = calls[-1][:2]
            samples, given = [c[2] for c in calls], [c[3] for c in calls]
            whole = _whole_batch_size(samples, given, self._whole_batch_sizes.get(name))
            if whole is not None:  # the values weigh by the samples, and the step logs the batch's size
                self._whole_batch_sizes[name] = whole
                weights, size = [float(n) for n in samples], whole
            else:
                weights = [float(n if b is None else b) for n, b in zip(samples, given)]
                size = int(sum(weights))
            frozen_options = tuple(sorted(options.items()))
            if isinstance(value, Metric):
                step_value = value._forward_cache
                known = isinstance(step_value, torch.Tensor) and step_value.numel() == 1
                specs.append(LogSpec(name, self._metric_path(name, value), known, frozen_options))
                values.append(step_value.detach().reshape(()) if known else None)
            else:
                how = _reduce_name(options.get("reduce_fx", "mean"))
                specs.append(LogSpec(name, None, True, frozen_options))
                values.append(_merge([c[0] for c in calls], weights, how, name, device))
            sizes.append(size)
        return MergedLogs(tuple(specs), values, sizes)


def _message_length(specs: tuple[LogSpec, ...]) -> int:
    return 2 + 2 * len(specs)  # changed flag, loss, then (value, batch size) per call


class LogShare:
    """Sends the last stage's merged logs and loss to every stage of its replica.

    One float64 tensor per step: ``[changed, loss, value_1, batch_size_1, ...]``, its length
    fixed by the calls of the previous step. When the calls changed, the flag is set, and the
    new calls (pickled) and their values follow."""

    def __init__(self, topology: Topology, device: torch.device) -> None:
        self.topology = topology
        self.device = device
        self._specs: tuple[LogSpec, ...] = ()
        self.structure_messages = 0  # steps whose calls changed, and were sent pickled

    def exchange(self, logs: MergedLogs | None, loss: torch.Tensor | None) -> tuple[MergedLogs, torch.Tensor]:
        """Every stage gets the last stage's ``(logs, loss)``."""
        topo = self.topology
        if topo.pipeline_length == 1:
            return logs, loss
        src, group = topo.last_stage_rank, topo.replica_group
        if topo.is_last_stage:
            entries = [loss.to(self.device, torch.float64)]
            for spec, value, size in zip(logs.specs, logs.values, logs.batch_sizes):
                entries.append(
                    _number(float("nan"), self.device) if value is None else _scalar(value, spec.name, self.device)
                )
                entries.append(_number(size, self.device))
            values = torch.stack(entries)
            changed = logs.specs != self._specs
            if not changed:
                dist.broadcast(torch.cat([values.new_zeros(1), values]), src=src, group=group)
                return logs, loss
            flag = values.new_zeros(_message_length(self._specs))
            flag[0] = 1.0
            dist.broadcast(flag, src=src, group=group)
            dist.broadcast_object_list([logs.specs], src=src, group=group, device=self.device)
            dist.broadcast(values, src=src, group=group)
            self._specs = logs.specs
            self.structure_messages += 1
            return logs, loss
        message = torch.empty(_message_length(self._specs), dtype=torch.float64, device=self.device)
        dist.broadcast(message, src=src, group=group)
        values = message[1:]
        if message[0].item():  # the calls changed (a host read on this rank only)
            specs: list[Any] = [None]
            dist.broadcast_object_list(specs, src=src, group=group, device=self.device)
            self._specs = specs[0]
            self.structure_messages += 1
            values = torch.empty(_message_length(self._specs) - 1, dtype=torch.float64, device=self.device)
            dist.broadcast(values, src=src, group=group)
        sizes = [int(size) for size in values[2::2].tolist()]
        step_values = [v if spec.has_value else None for spec, v in zip(self._specs, values[1::2].unbind())]
        return MergedLogs(self._specs, step_values, sizes), values[0].to(torch.get_default_dtype())


def replay(module: pl.LightningModule, logs: MergedLogs, received: bool) -> None:
    """Issue the merged calls through the module's real ``self.log``; ``received``: the values
    came from the last stage (a metric's step value is then set on this rank's copy)."""
    dtype = torch.get_default_dtype()
    for spec, value, size in zip(logs.specs, logs.values, logs.batch_sizes):
        options = dict(spec.options, batch_size=size)
        if spec.metric_path is None:
            module.log(spec.name, value.to(dtype) if isinstance(value, torch.Tensor) else value, **options)
            continue
        metric = module.get_submodule(spec.metric_path)
        if received and value is not None:
            metric._forward_cache = value.to(dtype)
        module.log(spec.name, metric, **options)
