"""EpochReport: one line per epoch and a timeline of freezing, layout and throughput."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

log = logging.getLogger("lightning_pipetx")

# (metric key in trainer.callback_metrics, record field, column title, number format)
_PIPETX_METRICS = (
    ("pipetx/frozen_blocks", "frozen_blocks", "frozen", "{:.0f}"),
    ("pipetx/pipeline_length", "pipeline_length", "stages", "{:.0f}"),
    ("pipetx/replicas", "replicas", "replicas", "{:.0f}"),
    ("pipetx/samples_per_sec", "samples_per_sec", "samples/s", "{:.1f}"),
    ("pipetx/cache_hit_rate", "cache_hit_rate", "cache hit", "{:.1%}"),
)
_COUNTS = ("frozen_blocks", "pipeline_length", "replicas")
_ALWAYS_SHOWN = ("epoch", "frozen_blocks", "samples_per_sec", "train_seconds")


class EpochReport(Callback):
    """Report per epoch what freezing and the elastic pipeline did, and write a timeline.

    After every training epoch, reads ``trainer.callback_metrics`` and records the epoch,
    ``pipetx/frozen_blocks``, ``pipetx/samples_per_sec``, the validation metric ``monitor``
    and, where logged, ``pipetx/pipeline_length``, ``pipetx/replicas`` and
    ``pipetx/cache_hit_rate``, plus the epoch's training wall time: from its start to the
    next epoch's (or the end of training), validation excluded, the epoch-end work (a freeze
    decision and a transition, checkpoints) included. An epoch is recorded then, once all of
    its metrics and its time are final, so the order of callbacks does not matter.

    Global rank 0 prints one aligned line per epoch and, at the end of fit, a summary table,
    ``<output_dir>/timeline.json`` and ``<output_dir>/timeline.png``. Every rank keeps the
    same records in :attr:`records`; a checkpoint carries the records of the epochs completed
    before it was written (one written at an epoch's end, that epoch's time until then), and
    resuming continues them.

    Args:
        output_dir: where the timeline files go; ``None`` uses ``trainer.log_dir``.
        monitor: the validation metric to report; missing in epochs without validation.
        plot: write ``timeline.png`` (needs matplotlib).
        verbose: print the per-epoch lines and the summary table.
    """

    def __init__(
        self,
        output_dir: str | None = None,
        monitor: str = "val_acc",
        plot: bool = True,
        verbose: bool = True,
    ) -> None:
        self.output_dir = output_dir
        self.monitor = monitor
        self.plot = plot
        self.verbose = verbose

        self.records: list[dict[str, Any]] = []
        self._columns: list[str] = []
        self._pending: dict[str, Any] | None = None
        self._resolved_dir: str | None = None
        self._epoch_start: float | None = None
        self._val_start = 0.0
        self._val_seconds = 0.0
        self._validated = False

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            # trainer.log_dir broadcasts, so every rank resolves it here.
            self._resolved_dir = self.output_dir if self.output_dir is not None else trainer.log_dir

    # ------------------------------------------------------------------ timing
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer, pl_module)
        _synchronize(pl_module)
        self._epoch_start = time.perf_counter()
        self._val_seconds = 0.0
        self._validated = False

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            _synchronize(pl_module)
            self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        _synchronize(pl_module)
        self._val_seconds += time.perf_counter() - self._val_start
        self._validated = True

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Callbacks listed after this one, and the module's own hook, may still log or work for
        # this epoch: the record is completed in ``_flush``.
        self._pending = {"epoch": trainer.current_epoch, "validated": self._validated}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer, pl_module)

    # ------------------------------------------------------------------ output
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer, pl_module)
        if not trainer.is_global_zero or not self.records:
            return
        if self.verbose:
            pl_module.print(self.summary())
        if self._resolved_dir is not None:
            self.write(self._resolved_dir)

    def summary(self) -> str:
        """The records as a table, with the total training time and the final metric."""
        columns = self._columns or list(_ALWAYS_SHOWN)
        lines = [self._header(columns)] + [self._line(record, columns) for record in self.records]
        total = _total_seconds(self.records)
        footer = f"total training time {total:.1f}s over {len(self.records)} epochs"
        finals = [record[self.monitor] for record in self.records if record.get(self.monitor) is not None]
        if finals:
            footer += f"; final {self.monitor} {finals[-1]:.4f}"
        rule = "-" * max(len(line) for line in lines)
        return "\n".join(["EpochReport", rule, lines[0], rule, *lines[1:], rule, footer])

    def write(self, output_dir: str) -> None:
        """Write ``timeline.json`` and, with ``plot=True``, ``timeline.png`` to ``output_dir``."""
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, "timeline.json")
        timeline = {
            "monitor": self.monitor,
            "total_train_seconds": _total_seconds(self.records),
            "epochs": self.records,
        }
        with open(path, "w") as file:
            json.dump(timeline, file, indent=2)
        written = [path]
        if self.plot:
            png = os.path.join(output_dir, "timeline.png")
            if self._plot(png):
                written.append(png)
        log.info("pipetx: wrote %s", ", ".join(written))

    # ---------------------------------------------------------------- internals
    def _flush(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        record = self._complete({**pending, "train_seconds": self._seconds_so_far(pl_module)}, trainer)
        self._epoch_start = None
        self.records.append(record)

        new_columns = self._update_columns(record)
        if self.verbose and trainer.is_global_zero:
            if new_columns:
                pl_module.print(self._header(self._columns))
            pl_module.print(self._line(record, self._columns))

    def _seconds_so_far(self, pl_module: pl.LightningModule) -> float | None:
        """The epoch's training time until now; None when it was resumed inside its end."""
        if self._epoch_start is None:
            return None
        _synchronize(pl_module)
        return time.perf_counter() - self._epoch_start - self._val_seconds

    def _complete(self, pending: dict[str, Any], trainer: pl.Trainer) -> dict[str, Any]:
        """The epoch's record, from its timing and the metrics logged for it."""
        metrics = trainer.callback_metrics
        record: dict[str, Any] = {"epoch": pending["epoch"]}
        for key, field, _, _ in _PIPETX_METRICS:
            if key in metrics:
                value = _to_float(metrics[key])
                record[field] = round(value) if field in _COUNTS and value.is_integer() else value
        record[self.monitor] = (
            _to_float(metrics[self.monitor]) if pending["validated"] and self.monitor in metrics else None
        )
        record["train_seconds"] = pending["train_seconds"]
        return record

    def _update_columns(self, record: dict[str, Any]) -> bool:
        """Add columns for metrics seen for the first time; True when the set changed."""
        wanted = set(_ALWAYS_SHOWN) | {self.monitor} | {key for key, value in record.items() if value is not None}
        if wanted.issubset(self._columns):
            return False
        self._columns = [field for field in self._all_fields() if field in wanted or field in self._columns]
        return True

    def _all_fields(self) -> list[str]:
        return ["epoch"] + [field for _, field, _, _ in _PIPETX_METRICS] + [self.monitor, "train_seconds"]

    def _formats(self) -> dict[str, tuple[str, str]]:
        formats = {field: (title, fmt) for _, field, title, fmt in _PIPETX_METRICS}
        formats["epoch"] = ("epoch", "{:.0f}")
        formats[self.monitor] = (self.monitor, "{:.4f}")
        formats["train_seconds"] = ("train s", "{:.1f}")
        return formats

    def _header(self, columns: list[str]) -> str:
        formats = self._formats()
        return "  ".join(formats[field][0].rjust(_width(formats[field][0])) for field in columns)

    def _line(self, record: dict[str, Any], columns: list[str]) -> str:
        formats = self._formats()
        cells = []
        for field in columns:
            title, fmt = formats[field]
            value = record.get(field)
            text = "-" if value is None or not math.isfinite(value) else fmt.format(value)
            cells.append(text.rjust(_width(title)))
        return "  ".join(cells)

    def _plot(self, path: str) -> bool:
        try:
            from matplotlib.figure import Figure  # Figure without pyplot renders with Agg
        except ImportError:
            log.warning("pipetx: matplotlib is not installed; skipping %s", path)
            return False
        epochs = [record["epoch"] for record in self.records]

        def series(field: str) -> list[float]:
            return [math.nan if record.get(field) is None else record[field] for record in self.records]

        def present(field: str) -> bool:
            return any(record.get(field) is not None for record in self.records)

        figure = Figure(figsize=(7, 7), layout="constrained")
        layout_ax, speed_ax, metric_ax = figure.subplots(3, 1, sharex=True)
        plotted = False
        for field, label in (
            ("frozen_blocks", "frozen blocks"),
            ("pipeline_length", "pipeline stages"),
            ("replicas", "replicas"),
        ):
            if present(field):
                layout_ax.plot(epochs, series(field), marker="o", drawstyle="steps-post", label=label)
                plotted = True
        if plotted:
            layout_ax.legend(loc="upper left")
        layout_ax.set_ylabel("blocks / ranks")
        layout_ax.set_title("pipetx timeline")
        if present("samples_per_sec"):
            speed_ax.plot(epochs, series("samples_per_sec"), marker="o", color="tab:green")
            speed_ax.set_ylabel("samples / s")
        else:  # no FreezeCallback: show the epoch times instead
            speed_ax.plot(epochs, series("train_seconds"), marker="o", color="tab:green")
            speed_ax.set_ylabel("train s / epoch")
        metric_ax.plot(epochs, series(self.monitor), marker="o", color="tab:red")
        metric_ax.set_ylabel(self.monitor)
        metric_ax.set_xlabel("epoch")
        metric_ax.set_xticks(epochs)
        for ax in (layout_ax, speed_ax, metric_ax):
            ax.grid(alpha=0.3)
        figure.savefig(path, dpi=100)
        return True

    # -------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"records": self.records}

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        # A checkpoint written at an epoch's end carries that epoch, still pending here.
        if self._pending is not None:
            state = checkpoint["callbacks"][self.state_key]
            pending = {**self._pending, "train_seconds": self._seconds_so_far(pl_module)}
            state["records"] = [*self.records, self._complete(pending, trainer)]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.records = list(state_dict.get("records", []))


def _total_seconds(records: list[dict[str, Any]]) -> float:
    return sum(record["train_seconds"] for record in records if record.get("train_seconds") is not None)


def _width(title: str) -> int:
    return max(len(title), 9)


def _to_float(value: Any) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _synchronize(pl_module: pl.LightningModule) -> None:
    if pl_module.device.type == "cuda":
        torch.cuda.synchronize(pl_module.device)
