"""FreezeCallback's guard: no more freezing once the monitored validation metric degrades."""

import json

import pytest
import tiny_models as tm
import torch
from distributed import run_workers
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pipetx import FreezeCallback
from lightning_pipetx.callbacks.freeze_guard import FreezeGuard


def test_the_guard_trips_once_the_metric_is_worse_than_its_best_by_more_than_the_tolerance():
    guard = FreezeGuard("val_acc", mode="max", tolerance=0.02)
    assert [guard.judge(v) for v in (0.80, 0.90, 0.89, 0.87)] == [False, False, False, True]
    assert guard.best == pytest.approx(0.90)
    loss = FreezeGuard("val_loss", mode="min")
    values = [loss.read({"val_loss": torch.tensor(v)}) for v in (1.0, 0.5, 0.5, 0.6)]
    assert [loss.judge(v) for v in values] == [False, False, False, True]
    assert FreezeGuard("val_acc").judge(float("nan"))


def test_bad_guard_settings_and_a_missing_metric_are_refused():
    with pytest.raises(ValueError, match="mode"):
        FreezeGuard("val_acc", mode="up")
    with pytest.raises(ValueError, match="tolerance"):
        FreezeGuard("val_acc", tolerance=-1)
    with pytest.raises(
        ValueError, match=r"no such metric was logged on this rank \(logged: \['val_loss'\]\).*rank_zero_only=True"
    ):
        FreezeGuard("val_acc").read({"val_loss": 1.0})


class ScriptedAccuracy(tm.TinySequentialRegressor):
    """Logs ``val_acc`` from a fixed list, one value per epoch."""

    def __init__(self, accuracies):
        super().__init__(seed=0, num_blocks=6)
        self.accuracies = accuracies

    def validation_step(self, batch, batch_idx):
        self.log("val_acc", self.accuracies[self.current_epoch])


def fit(accuracies, trainer_kwargs=None, callbacks=(), ckpt_path=None, **freeze_kwargs):
    freeze = FreezeCallback(alpha=1 / 3, signal="schedule", **freeze_kwargs)
    trainer = tm.make_trainer([freeze, *callbacks], max_epochs=len(accuracies), **(trainer_kwargs or {}))
    loader = tm.task_loader("sequential", size=16)
    trainer.fit(ScriptedAccuracy(accuracies), loader, loader, ckpt_path=ckpt_path)
    return freeze, trainer


def test_freezing_stops_for_good_when_validation_accuracy_drops():
    accuracies = [0.80, 0.85, 0.80, 0.90, 0.95]
    unguarded, _ = fit(accuracies)
    assert unguarded.frozen_blocks == 5  # 0 -> 2 -> 4 -> 5 (min_active_blocks=1)
    guarded, trainer = fit(accuracies, monitor="val_acc", tolerance=0.02)
    # Epoch 0: 2 frozen; epoch 1: 4 frozen; epoch 2's 0.80 is 0.05 below the best 0.85: stop.
    assert guarded.frozen_blocks == 4 and guarded.guard.stopped
    assert guarded.state_dict()["guard"] == {"best": pytest.approx(0.85), "stopped": True}
    assert trainer.callback_metrics["pipetx/frozen_blocks"] == 4


def test_the_guard_judges_the_epochs_that_validated_only():
    # Validation after epochs 1, 3 and 5 (the values of the others are never logged).
    accuracies = [None, 0.85, None, 0.86, None, 0.80]
    guarded, _ = fit(accuracies, {"check_val_every_n_epoch": 2}, monitor="val_acc", tolerance=0.02)
    # Frozen 2, 4, 5 after epochs 0-2; epoch 5's 0.80 trips the guard, too late to matter.
    assert guarded.frozen_blocks == 5 and guarded.guard.stopped
    assert guarded.guard.best == pytest.approx(0.86)


def test_a_validation_outside_fit_is_not_judged():
    # trainer.validate before fit, and fit validating after odd epochs only: the pre-fit value
    # must not become the guard's best.
    freeze = FreezeCallback(alpha=1 / 3, signal="schedule", monitor="val_acc", tolerance=0.02)
    trainer = tm.make_trainer([freeze], max_epochs=6, check_val_every_n_epoch=2)
    loader = tm.task_loader("sequential", size=16)
    model = ScriptedAccuracy([0.99])
    trainer.validate(model, loader)
    model.accuracies = [None, 0.85, None, 0.86, None, 0.87]
    trainer.fit(model, loader, loader)
    assert freeze.frozen_blocks == 5 and not freeze.guard.stopped
    assert freeze.guard.best == pytest.approx(0.87)


def test_within_the_tolerance_freezing_goes_on():
    guarded, _ = fit([0.80, 0.85, 0.84, 0.84, 0.85], monitor="val_acc", tolerance=0.02)
    assert guarded.frozen_blocks == 5 and not guarded.guard.stopped


def test_the_guard_state_is_restored_from_a_checkpoint():
    guarded = FreezeCallback(monitor="val_acc")
    guarded.load_state_dict(
        {
            "frozen_blocks": 3,
            "decisions": 2,
            "norm_sums": None,
            "norm_steps": 0,
            "guard": {"best": 0.9, "stopped": True},
        }
    )
    assert guarded.guard.best == 0.9 and guarded.guard.stopped and guarded.frozen_blocks == 3


def test_a_run_resumed_between_validation_and_the_decision_judges_that_validation(tmp_path):
    """ModelCheckpoint(save_on_train_epoch_end=False) writes in on_validation_end, before the epoch's
    decision; the resumed run takes that decision without validating again."""
    accuracies = [0.80, 0.85, 0.80, 0.90, 0.95]
    checkpoints = dict(dirpath=tmp_path, save_top_k=-1, save_on_train_epoch_end=False, filename="{epoch}")
    options = dict(monitor="val_acc", tolerance=0.02)
    first, _ = fit(accuracies, {"enable_checkpointing": True}, [ModelCheckpoint(**checkpoints)], **options)
    assert first.frozen_blocks == 4 and first.guard.stopped  # epoch 2's 0.80 stopped it
    saved = torch.load(tmp_path / "epoch=2.ckpt", weights_only=False)["callbacks"]["FreezeCallback"]
    assert saved["guard"] == {"best": pytest.approx(0.85), "stopped": False}
    assert saved["observed"] == pytest.approx(0.80)
    resumed, _ = fit(accuracies, ckpt_path=tmp_path / "epoch=2.ckpt", **options)
    assert resumed.frozen_blocks == 4 and resumed.guard.stopped


def test_a_monitor_that_is_not_logged_fails_with_the_logged_names():
    with pytest.raises(ValueError, match="monitor='val_f1'"):
        fit([0.8, 0.8], monitor="val_f1")


def test_the_guard_judges_the_mean_over_replicas_across_a_transition(tmp_path):
    run_workers("guard_worker.py", 2, str(tmp_path))
    for rank in range(2):
        report = json.loads((tmp_path / f"guard_rank{rank}.json").read_text())
        assert report["layouts"] == ["2x1", "1x2", "1x2"]
        # Each replica sees 0 or 1 after the transition; their mean stays the 0.5 of one replica.
        assert report["best"] == pytest.approx(0.5) and not report["stopped"]
        assert report["frozen"] == 3


class MidEpochDip(tm.TinySequentialRegressor):
    """Validates twice an epoch: ``val_acc`` 0.0 at epoch 1's first validation, 1.0 at every other."""

    def __init__(self):
        super().__init__(seed=0, num_blocks=8)

    def validation_step(self, batch, batch_idx):
        loop = self.trainer.fit_loop.epoch_loop
        mid_epoch = loop.batch_progress.current.ready < self.trainer.num_training_batches
        self.log("val_acc", 0.0 if self.current_epoch == 1 and mid_epoch else 1.0)


def _fit_to(max_steps, ckpt_path=None, checkpoints=None):
    freeze = FreezeCallback(alpha=0.25, signal="schedule", monitor="val_acc", tolerance=0.5)
    callbacks = [freeze] + ([ModelCheckpoint(**checkpoints)] if checkpoints else [])
    options = dict(
        max_steps=max_steps, val_check_interval=0.5, limit_val_batches=1, enable_checkpointing=bool(checkpoints)
    )
    trainer = tm.make_trainer(callbacks, max_epochs=-1, **options)
    loader = tm.task_loader("sequential", size=32, batch_size=4)  # 8 steps an epoch
    trainer.fit(MidEpochDip(), loader, tm.task_loader("sequential", size=4, batch_size=4), ckpt_path=ckpt_path)
    return freeze


def test_an_epoch_cut_short_is_judged_when_the_resumed_run_completes_it(tmp_path):
    # Only the last validation of an epoch is judged: epoch 1's dip is followed by 1.0 at its end.
    whole = _fit_to(32)
    assert whole.frozen_blocks == 6 and not whole.guard.stopped
    # Cut at step 14 (epoch 1, after its first validation), resumed to step 32: as the whole run.
    checkpoints = dict(dirpath=tmp_path, filename="{step}", save_top_k=-1, save_on_train_epoch_end=True)
    cut = _fit_to(14, checkpoints=checkpoints)
    assert cut.frozen_blocks == 2 and not cut.guard.stopped
    resumed = _fit_to(32, ckpt_path=tmp_path / "step=14.ckpt")
    assert resumed.frozen_blocks == 6 and not resumed.guard.stopped


def test_a_decision_before_any_guarded_validation_warns_once():
    # No validation loader: the guard never sees its metric, and says so at the first decision.
    freeze = FreezeCallback(alpha=1 / 3, signal="schedule", monitor="val_acc")
    trainer = tm.make_trainer([freeze], max_epochs=3)
    with pytest.warns(UserWarning, match="monitor='val_acc'.*before the decision after epoch 0") as caught:
        trainer.fit(tm.TinySequentialRegressor(seed=0, num_blocks=6), tm.task_loader("sequential", size=16))
    assert freeze.frozen_blocks == 5 and sum("monitor='val_acc'" in str(w.message) for w in caught) == 1
