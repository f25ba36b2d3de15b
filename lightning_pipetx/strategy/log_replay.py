"""Make ``self.log`` behave as in single-process training, on every stage.

The user's step runs once per micro-batch, and only the last stage reaches the loss and
the metrics. :class:`LogRecorder` captures the ``self.log`` calls of a step, merges them
per name into the value the whole batch would have logged (weighted by micro-batch
size), and the merged calls are replayed on every stage of the replica. Every rank then
holds the same logged values: ``callback_metrics``, ``ModelCheckpoint(monitor=...)``,
``EarlyStopping``, the progress bar and the loggers behave as in single-process runs.

torchmetrics objects are logged by name: the non-last stages log their own (never
updated) copy, whose state is the neutral element, so the metric's own sync over all
ranks at ``compute()`` gives every rank the value over all replicas.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torchmetrics import Metric

_REDUCERS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}


@dataclass
class LogCall:
    """One merged ``self.log`` call, ready to travel between ranks."""

    name: str
    value: float | None  # the merged value, or the metric's forward value
    metric_path: str | None  # set when a torchmetrics Metric was logged
    kwargs: dict[str, Any] = field(default_factory=dict)


def _as_float(value: Any) -> float:
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


def _reduce_name(reduce_fx: Any) -> str:
    if isinstance(reduce_fx, str):
        return _REDUCERS.get(reduce_fx.lower(), "mean")
    return {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}.get(reduce_fx, "mean")


class LogRecorder:
    """Captures ``self.log`` calls made by the user's step on each micro-batch."""

    def __init__(self, module: pl.LightningModule) -> None:
        self.module = module
        self._calls: dict[str, list[tuple[Any, dict[str, Any], int]]] = {}
        self._weight = 1

    @contextlib.contextmanager
    def capture(self) -> Iterator[LogRecorder]:
        self._calls = {}
        self.module.log = self._record  # instance attribute shadows LightningModule.log
        try:
            yield self
        finally:
            del self.module.log

    def set_weight(self, weight: int) -> None:
        """Samples in the micro-batch whose calls follow."""
        self._weight = weight

    def _record(self, name: str, value: Any, **kwargs: Any) -> None:
        kwargs.pop("batch_size", None)
        self._calls.setdefault(name, []).append((value, kwargs, self._weight))

    def merged(self) -> list[LogCall]:
        """One call per name, in first-logged order, as the whole batch would have logged it."""
        metric_names = {id(m): n for n, m in self.module.named_modules() if isinstance(m, Metric)}
        result = []
        for name, calls in self._calls.items():
            value, kwargs, _ = calls[-1]
            total = sum(w for _, _, w in calls)
            kwargs = {**kwargs, "batch_size": total}
            if isinstance(value, Metric):
                if id(value) not in metric_names:
                    raise ValueError(f"self.log({name!r}, metric): the metric must be an attribute of the module")
                cache = value._forward_cache
                forward_value = float(cache) if isinstance(cache, torch.Tensor) and cache.numel() == 1 else None
                result.append(LogCall(name, forward_value, metric_names[id(value)], kwargs))
                continue
            values = torch.tensor([_as_float(v) for v, _, _ in calls], dtype=torch.float64)
            weights = torch.tensor([w for _, _, w in calls], dtype=torch.float64)
            how = _reduce_name(kwargs.get("reduce_fx", "mean"))
            if how == "sum":
                merged = values.sum()
            elif how == "max":
                merged = values.max()
            elif how == "min":
                merged = values.min()
            else:
                merged = (values * weights).sum() / weights.sum()
            result.append(LogCall(name, float(merged), None, kwargs))
        return result


def replay(module: pl.LightningModule, calls: list[LogCall], device: torch.device) -> None:
    """Issue the merged calls through the module's real ``self.log``."""
    for call in calls:
        if call.metric_path is not None:
            metric = module.get_submodule(call.metric_path)
            if call.value is not None:
                metric._forward_cache = torch.tensor(call.value, device=device)
            module.log(call.name, metric, **call.kwargs)
        else:
            module.log(call.name, torch.tensor(call.value, device=device, dtype=torch.float32), **call.kwargs)
