"""EpochReport with a real single-device CPU Trainer, next to FreezeCallback(signal="schedule")."""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import pytest
import tiny_models as tm
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_pipetx import FreezeCallback
from lightning_pipetx.callbacks.report import EpochReport

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MONITOR = "val_loss"  # TinySequentialRegressor logs val_loss (no accuracy: it is a regression)


# ---------------------------------------------------------------------------- helpers
make_trainer = tm.make_trainer


def seq_module() -> tm.TinySequentialRegressor:
    return tm.TinySequentialRegressor(seed=0)


def seq_loader(size: int = 16, batch_size: int = 4, seed: int = 0):
    return tm.task_loader("sequential", size=size, batch_size=batch_size, seed=seed)


class Probe(Callback):
    """What the report should see, taken independently: the frozen count while each epoch
    trains, and the monitored metric right after each (non-sanity) validation run."""

    def __init__(self, fc: FreezeCallback, monitor: str = MONITOR) -> None:
        self.fc = fc
        self.monitor = monitor
        self.frozen_during: list[int] = []
        self.validated: dict[int, float] = {}  # epoch -> monitored value

    def on_train_epoch_start(self, trainer, pl_module):
        self.frozen_during.append(self.fc.frozen_blocks)

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.validated[trainer.current_epoch] = float(trainer.callback_metrics[self.monitor])


def ordered(position: str, report: Callback, fc: FreezeCallback, probe: Probe) -> list[Callback]:
    if position == "first":
        return [report, fc, probe]
    if position == "middle":
        return [fc, report, probe]
    return [probe, fc, report]


def read_png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, "timeline.png is not a PNG file"
    assert data[12:16] == b"IHDR", "timeline.png has no IHDR chunk first"
    return struct.unpack(">II", data[16:24])


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("position", ["first", "middle", "last"])
def test_records_follow_freezing_in_any_callback_position(tmp_path, capsys, position):
    fc = FreezeCallback(signal="schedule")
    probe = Probe(fc)
    report = EpochReport(output_dir=str(tmp_path / "out"), monitor=MONITOR)
    trainer = make_trainer(ordered(position, report, fc, probe), max_epochs=3)
    trainer.fit(seq_module(), seq_loader(), seq_loader(size=8, seed=1))

    records = report.records
    assert [r["epoch"] for r in records] == [0, 1, 2]
    # The frozen count logged for an epoch is the one in force while it trained, and the
    # schedule did freeze something in this run (otherwise the check would prove nothing).
    assert [r["frozen_blocks"] for r in records] == probe.frozen_during
    assert len(set(probe.frozen_during)) > 1
    assert all(isinstance(r["frozen_blocks"], int) for r in records)
    for record in records:
        assert record["samples_per_sec"] > 0
        assert math.isfinite(record["samples_per_sec"])
        assert record["train_seconds"] is not None and record["train_seconds"] > 0
        assert record[MONITOR] == pytest.approx(probe.validated[record["epoch"]])
    # Single device, no pipeline strategy: no layout metrics to report.
    assert not any("pipeline_length" in r or "replicas" in r for r in records)

    timeline = json.loads((tmp_path / "out" / "timeline.json").read_text())
    assert timeline["monitor"] == MONITOR
    assert timeline["epochs"] == records
    assert timeline["total_train_seconds"] == pytest.approx(sum(r["train_seconds"] for r in records))
    width, height = read_png_size(tmp_path / "out" / "timeline.png")
    assert width > 100 and height > 100

    out = capsys.readouterr().out
    assert "EpochReport" in out  # the summary table at the end of fit
    assert "over 3 epochs" in out
    assert report.summary().splitlines()[-1] in out


def test_monitor_is_none_in_epochs_without_validation(tmp_path):
    fc = FreezeCallback(signal="schedule")
    probe = Probe(fc)
    report = EpochReport(output_dir=str(tmp_path), monitor=MONITOR, verbose=False)
    # Validation after epoch 1 only; the sanity check before epoch 0 must not count.
    trainer = make_trainer([fc, report, probe], max_epochs=3, check_val_every_n_epoch=2, num_sanity_val_steps=1)
    trainer.fit(seq_module(), seq_loader(), seq_loader(size=8, seed=1))

    assert list(probe.validated) == [1]
    monitored = [r[MONITOR] for r in report.records]
    assert monitored[0] is None
    assert monitored[1] == pytest.approx(probe.validated[1])
    # Epoch 2 did not validate: the stale val_loss from epoch 1 is still in callback_metrics,
    # and must not be reported again.
    assert MONITOR in trainer.callback_metrics
    assert monitored[2] is None
    assert [r["frozen_blocks"] for r in report.records] == probe.frozen_during

    timeline = json.loads((tmp_path / "timeline.json").read_text())
    assert [e[MONITOR] for e in timeline["epochs"]] == monitored


def test_monitor_is_none_without_a_validation_loader(tmp_path):
    fc = FreezeCallback(signal="schedule")
    probe = Probe(fc)
    report = EpochReport(output_dir=str(tmp_path), monitor=MONITOR, verbose=False)
    trainer = make_trainer([report, fc, probe], max_epochs=2)
    trainer.fit(seq_module(), seq_loader())

    assert probe.validated == {}
    assert [r["epoch"] for r in report.records] == [0, 1]
    assert all(MONITOR in r and r[MONITOR] is None for r in report.records)
    assert all(r["samples_per_sec"] > 0 for r in report.records)
    assert "final" not in report.summary()  # no final metric in the footer

    timeline = json.loads((tmp_path / "timeline.json").read_text())
    assert timeline["epochs"] == report.records
    read_png_size(tmp_path / "timeline.png")  # NaN-only metric panel still renders


def test_default_output_dir_is_log_dir_and_plot_can_be_off(tmp_path):
    fc = FreezeCallback(signal="schedule")
    report = EpochReport(monitor=MONITOR, plot=False, verbose=False)
    trainer = make_trainer([fc, report], max_epochs=2, default_root_dir=str(tmp_path))
    trainer.fit(seq_module(), seq_loader())

    assert trainer.log_dir == str(tmp_path)
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    assert [e["epoch"] for e in timeline["epochs"]] == [0, 1]
    assert timeline["epochs"] == report.records
    assert not (tmp_path / "timeline.png").exists()


def test_resume_from_an_end_of_epoch_checkpoint_keeps_every_epoch(tmp_path):
    def fit(max_epochs, ckpt_path=None):
        fc = FreezeCallback(signal="schedule")
        report = EpochReport(output_dir=str(tmp_path), monitor=MONITOR, plot=False, verbose=False)
        checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
        trainer = make_trainer([fc, report, checkpoints], max_epochs=max_epochs, enable_checkpointing=True)
        trainer.fit(seq_module(), seq_loader(), seq_loader(size=8, seed=1), ckpt_path=ckpt_path)
        return report

    first = fit(max_epochs=2)
    assert [r["epoch"] for r in first.records] == [0, 1]
    resumed = fit(max_epochs=3, ckpt_path=str(tmp_path / "epoch=0.ckpt"))
    assert [r["epoch"] for r in resumed.records] == [0, 1, 2]
    # The epoch-end checkpoint holds the epoch's time until it was written, before the rest of its end.
    first_record, resumed_record = dict(first.records[0]), dict(resumed.records[0])
    assert resumed_record.pop("train_seconds") > 0 and first_record.pop("train_seconds") > 0
    assert resumed_record == first_record


class SlowEpochEnd(Callback):
    """Epoch-end work (as a freeze decision and a transition are) that takes at least 0.2 s."""

    def on_train_epoch_end(self, trainer, pl_module):
        time.sleep(0.2)


@pytest.mark.parametrize("position", ["first", "last"])
def test_the_epoch_end_work_counts_in_the_epochs_time_in_any_callback_position(tmp_path, position):
    report = EpochReport(output_dir=str(tmp_path), plot=False, verbose=False)
    callbacks = [report, SlowEpochEnd()] if position == "first" else [SlowEpochEnd(), report]
    make_trainer(callbacks, max_epochs=2).fit(seq_module(), seq_loader())
    assert all(record["train_seconds"] >= 0.2 for record in report.records)
