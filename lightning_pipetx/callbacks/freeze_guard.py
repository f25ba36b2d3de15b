"""The freeze guard: no more freezing once a monitored validation metric has degraded."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

_MODES = ("max", "min")


def check_guard_arguments(mode: Any, tolerance: Any) -> None:
    """Raise a ``ValueError`` for a ``mode`` or ``tolerance`` the guard cannot use (checked with or
    without a ``monitor``, as Lightning's callbacks check theirs)."""
    if mode not in _MODES:
        raise ValueError(f"FreezeCallback(mode={mode!r}): choose one of {_MODES}.")
    if not isinstance(tolerance, numbers.Real) or isinstance(tolerance, bool) or not tolerance >= 0:
        raise ValueError(f"FreezeCallback(tolerance={tolerance!r}): use a number >= 0.")


class FreezeGuard:
    """Judges ``monitor`` once an epoch (the callback gives it the epoch's last validation); once it is
    worse than its best so far by more than ``tolerance``, :attr:`stopped` turns True for the rest of the run.

    Args:
        monitor: a metric the LightningModule logs (e.g. ``"val_acc"``).
        mode: ``"max"`` when higher is better (accuracy), ``"min"`` when lower is (loss).
        tolerance: how much worse than the best the metric may get, in its own units.
    """

    def __init__(self, monitor: str, mode: str = "max", tolerance: float = 0.0) -> None:
        check_guard_arguments(mode, tolerance)
        self.monitor, self.mode, self.tolerance = monitor, mode, float(tolerance)
        self.best: float | None = None
        self.stopped = False

    def read(self, metrics: Mapping[str, Any]) -> float:
        """The monitored value among ``metrics`` (``trainer.callback_metrics``)."""
        if self.monitor not in metrics:
            raise ValueError(
                f"FreezeCallback(monitor={self.monitor!r}): no such metric was logged on this rank (logged: "
                f"{sorted(metrics) or 'none'}). Log it in validation_step with self.log on every rank (not with "
                f"rank_zero_only=True or under `if self.trainer.is_global_zero`), or pick one of those."
            )
        return float(metrics[self.monitor])

    def judge(self, value: float) -> bool:
        """Take this epoch's value; True when it is worse than the best by more than the tolerance."""
        sign = 1.0 if self.mode == "max" else -1.0
        if math.isnan(value):
            return True
        if self.best is None or sign * (value - self.best) > 0:
            self.best = value
        return sign * (self.best - value) > self.tolerance

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "stopped": self.stopped}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best, self.stopped = state.get("best"), bool(state.get("stopped", False))
