"""FreezeCallback with real Lightning Trainers on CPU: one device, and Lightning's plain DDP."""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import tiny_models as tm
import torch
from distributed import run_workers
from lightning.pytorch.callbacks import BackboneFinetuning, BaseFinetuning, Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch import nn

from lightning_pipetx import BlockListNotFoundError, FreezeCallback
from lightning_pipetx.callbacks import block_norms

TESTS_DIR = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------- helpers
make_trainer = tm.make_trainer


def seq_module(**kwargs) -> tm.TinySequentialRegressor:
    return tm.TinySequentialRegressor(seed=0, **kwargs)


def seq_loader(size: int = 16, batch_size: int = 4):
    return tm.task_loader("sequential", size=size, batch_size=batch_size)


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def prefix_names(module: nn.Module, fc: FreezeCallback, frozen: int) -> set[str]:
    """Names (inside ``module``) of the parameters that freezing ``frozen`` blocks covers."""
    ids = {id(p) for p in fc.split.prefix_parameters(frozen)}
    return {name for name, p in module.named_parameters() if id(p) in ids}


class EpochProbe(Callback):
    """Records, at every epoch start and at the end of fit, the frozen count and the parameters.

    Put it after the FreezeCallback in ``callbacks``.
    """

    def __init__(self, fc: FreezeCallback) -> None:
        self.fc = fc
        self.frozen_at_start: list[int] = []
        self.decisions_at_start: list[int] = []
        self.params_at_start: list[dict[str, torch.Tensor]] = []
        self.requires_grad_at_start: list[dict[str, bool]] = []
        self.reasons: list[str | None] = []
        self.final_params: dict[str, torch.Tensor] | None = None

    def on_train_epoch_start(self, trainer, pl_module):
        self.frozen_at_start.append(self.fc.frozen_blocks)
        self.decisions_at_start.append(self.fc.decisions)
        self.params_at_start.append(snapshot(pl_module))
        self.requires_grad_at_start.append({n: p.requires_grad for n, p in pl_module.named_parameters()})

    def on_train_epoch_end(self, trainer, pl_module):
        self.reasons.append(None if self.fc.last_decision is None else self.fc.last_decision.reason)

    def on_train_end(self, trainer, pl_module):
        self.final_params = snapshot(pl_module)


class ModeProbe(Callback):
    """Forward pre-hooks on pre, blocks and post record ``module.training`` during training steps."""

    def __init__(self, fc: FreezeCallback) -> None:
        self.fc = fc
        self.seen: list[tuple[int, str, bool]] = []  # (epoch, part, training)
        self._handles = []

    def on_train_start(self, trainer, pl_module):
        split = self.fc.split

        def hook(part):
            def record(module, args):
                if trainer.training:
                    self.seen.append((trainer.current_epoch, part, module.training))

            return record

        for name, module in split.pre:
            self._handles.append(module.register_forward_pre_hook(hook(f"pre:{name}")))
        for i in range(split.num_blocks):
            self._handles.append(split.block(i).register_forward_pre_hook(hook(f"block:{i}")))
        for name, module in split.post:
            self._handles.append(module.register_forward_pre_hook(hook(f"post:{name}")))

    def on_train_end(self, trainer, pl_module):
        for handle in self._handles:
            handle.remove()


class MemoryLogger(Logger):
    """A logger that keeps every logged metric in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, dict(metrics)))

    def values(self, key: str) -> list[float]:
        return [float(m[key]) for _, m in self.rows if key in m]


def rule(frozen: int, mean_norms: list[float], num_blocks: int, alpha: float, min_active: int) -> int:
    """The paper's rule, written out again here so that the callback is checked against it."""
    cap = num_blocks - min_active
    if frozen >= cap:
        return frozen
    alpha_term = frozen + math.ceil(alpha * (num_blocks - frozen) - 1e-9)
    active = list(range(frozen, num_blocks))
    grad_term = min(active, key=lambda i: mean_norms[i]) + 1
    return min(alpha_term, grad_term, cap)


class GradNormProbe(Callback):
    """Measures per-block gradient norms itself and predicts each decision with :func:`rule`.

    At every epoch end it also checks that the callback accumulated the same norms over the
    current interval. Put it before the FreezeCallback in ``callbacks``, so that it sees the
    state before a decision.
    """

    def __init__(self, fc: FreezeCallback, alpha: float, min_active: int = 1, interval: int = 1) -> None:
        self.fc, self.alpha, self.min_active, self.interval = fc, alpha, min_active, interval
        self.sums: list[float] | None = None
        self.steps = 0
        self.pending = False
        self.predicted: list[int] = []
        self.actual: list[int] = []
        self.checked_epochs: list[int] = []

    def _capped(self) -> bool:
        return self.fc.frozen_blocks >= self.fc.split.num_blocks - self.min_active

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self._capped():
            return  # no decision can freeze more: the callback measures nothing
        split = self.fc.split
        if self.sums is None:
            self.sums = [0.0] * split.num_blocks
        for i in range(split.num_blocks):
            grads = [p.grad.detach().float() for p in split.block_parameters(i) if p.grad is not None]
            if grads:
                self.sums[i] += float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        self.steps += 1

    def _record_actual(self) -> None:
        if self.pending:
            self.actual.append(self.fc.frozen_blocks)
            self.pending = False

    def on_train_epoch_start(self, trainer, pl_module):
        self._record_actual()

    def on_train_epoch_end(self, trainer, pl_module):
        state = self.fc.state_dict()
        frozen = self.fc.frozen_blocks
        assert state["norm_steps"] == self.steps
        if self.steps:
            assert state["norm_sums"][frozen:] == pytest.approx(self.sums[frozen:], rel=1e-6)
        else:
            assert not any(state["norm_sums"])
        self.checked_epochs.append(trainer.current_epoch)
        if (trainer.current_epoch + 1) % self.interval:
            return
        means = [s / self.steps for s in self.sums] if self.steps else None
        num_blocks = self.fc.split.num_blocks
        self.predicted.append(frozen if means is None else rule(frozen, means, num_blocks, self.alpha, self.min_active))
        self.sums, self.steps, self.pending = None, 0, True

    def on_train_end(self, trainer, pl_module):
        self._record_actual()


# ---------------------------------------------------------------- argument validation
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(alpha=0.0), "alpha"),
        (dict(alpha=-0.5), "alpha"),
        (dict(alpha=1.5), "alpha"),
        (dict(alpha=float("nan")), "alpha"),
        (dict(freeze_interval=0), "freeze_interval"),
        (dict(freeze_interval=-1), "freeze_interval"),
        (dict(freeze_interval=1.5), "freeze_interval"),
        (dict(freeze_interval="2"), "freeze_interval"),
        (dict(freeze_interval=True), "freeze_interval"),
        (dict(warmup_epochs=-1), "warmup_epochs"),
        (dict(warmup_epochs=0.5), "warmup_epochs"),
        (dict(warmup_epochs=True), "warmup_epochs"),
        (dict(min_active_blocks=True), "min_active_blocks"),
        (dict(min_active_blocks=0), "min_active_blocks"),
        (dict(min_active_blocks=2.0), "min_active_blocks"),
        (dict(signal="loss"), "signal"),
        (dict(alpha="0.3"), "alpha='0.3'"),
        (dict(blocks=3), "blocks=3"),
        (dict(signal="Schedule"), "signal"),
        # the guard's settings are checked without a monitor too
        (dict(mode="bogus"), "mode='bogus'"),
        (dict(tolerance=-1), "tolerance=-1"),
        (dict(monitor="val_acc", tolerance="0.1"), "tolerance='0.1'"),
    ],
)
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FreezeCallback(**kwargs)


def test_valid_arguments_are_kept():
    fc = FreezeCallback(alpha=1.0, freeze_interval=3, min_active_blocks=2, signal="schedule", blocks="model.blocks")
    assert (fc.alpha, fc.freeze_interval, fc.min_active_blocks, fc.signal, fc.blocks) == (
        1.0,
        3,
        2,
        "schedule",
        "model.blocks",
    )
    assert fc.frozen_blocks == 0 and fc.decisions == 0 and fc.last_decision is None


def test_split_before_fit_raises():
    with pytest.raises(RuntimeError, match="trainer.fit"):
        FreezeCallback().split  # noqa: B018


def test_min_active_blocks_leaving_nothing_to_freeze_fails_at_setup():
    trainer = make_trainer([FreezeCallback(min_active_blocks=4)], max_epochs=1)
    with pytest.raises(ValueError, match="min_active_blocks=4"):
        trainer.fit(seq_module(), seq_loader())


def test_a_sharding_strategy_is_refused_at_setup():
    from lightning.pytorch.strategies import ModelParallelStrategy

    class Parallelized(tm.TinySequentialRegressor):
        def configure_model(self):  # where a user applies fully_shard / tensor parallelism
            pass

    trainer = make_trainer([FreezeCallback()], max_epochs=1, strategy=ModelParallelStrategy())
    with pytest.raises(ValueError, match="FreezeCallback does not support ModelParallelStrategy"):
        trainer.fit(Parallelized(seed=0), seq_loader())


def test_bad_blocks_path_fails_at_setup():
    trainer = make_trainer([FreezeCallback(blocks="model.layers")], max_epochs=1)
    with pytest.raises(BlockListNotFoundError, match="blocks='model.layers'"):
        trainer.fit(seq_module(), seq_loader())


def test_model_without_block_list_fails_at_setup_naming_blocks():
    class Flat(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = make_trainer([FreezeCallback()], max_epochs=1)
    with pytest.raises(BlockListNotFoundError, match="blocks="):
        trainer.fit(Flat(), seq_loader())


class Distillation(tm.TinyBertClassifier):
    """A student trained against a frozen teacher with more weights, registered after it."""

    def __init__(self):
        super().__init__(seed=0, dropout=0.0)
        self.teacher = tm.tiny_bert(seed=1, dropout=0.0, num_labels=tm.NUM_LABELS)
        self.teacher.bert.encoder.layer.extend(tm.tiny_bert(seed=2, dropout=0.0).bert.encoder.layer)
        self.teacher.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            target = self.teacher(**batch).logits.softmax(-1)
        logits = self(batch).logits
        return nn.functional.cross_entropy(logits, target) + self(batch).loss


def test_the_trained_block_list_is_frozen_not_a_frozen_teachers():
    module, freeze = Distillation(), FreezeCallback(alpha=1 / 3, signal="schedule")
    teacher = {n: p.detach().clone() for n, p in module.teacher.named_parameters()}
    make_trainer([freeze], max_epochs=2).fit(module, tm.task_loader("bert", size=16))
    assert freeze.split.path == "model.bert.encoder.layer" and freeze.frozen_blocks == 3
    assert not any(p.requires_grad for p in module.model.bert.encoder.layer[:3].parameters())
    assert all(torch.equal(p, teacher[n]) for n, p in module.teacher.named_parameters())


def test_a_block_list_that_trains_nothing_is_refused():
    module = Distillation()
    trainer = make_trainer([FreezeCallback(blocks="teacher.bert.encoder.layer")], max_epochs=1)
    with pytest.raises(ValueError, match="no weight of the blocks 'teacher.bert.encoder.layer' trains"):
        trainer.fit(module, tm.task_loader("bert", size=16))


def test_a_linear_probe_is_told_to_train_without_the_callback():
    # Only the head trains: no block list does, and naming another would not help.
    module = tm.TinyBertClassifier(seed=0, dropout=0.0)
    module.model.bert.requires_grad_(False)
    trainer = make_trainer([FreezeCallback()], max_epochs=1)
    with pytest.raises(ValueError, match="or train without FreezeCallback where only weights outside the blocks"):
        trainer.fit(module, tm.task_loader("bert", size=16))


def test_blocks_the_user_froze_do_not_count_as_the_active_ones_the_callback_keeps():
    # The user froze the last two of 4 blocks and the head: min_active_blocks=1 kept "one" of them,
    # and the schedule froze blocks 0-1, the last that trained: epochs without a trainable weight.
    module = tm.TinyBertClassifier(seed=0, dropout=0.0)
    for frozen in (*module.model.bert.encoder.layer[2:], module.model.bert.pooler, module.model.classifier):
        frozen.requires_grad_(False)
    freeze = FreezeCallback(alpha=1 / 2, signal="schedule")
    make_trainer([freeze], max_epochs=4).fit(module, tm.task_loader("bert", size=16))
    assert freeze.frozen_blocks == 1
    assert "blocks you froze do not count as active" in freeze.last_decision.reason
    assert all(p.requires_grad for p in module.model.bert.encoder.layer[1].parameters())


def test_the_first_freeze_names_the_weights_before_block_0_it_freezes(caplog):
    # A soft prompt, or the embeddings, stop training with the prefix: the log says so, once.
    module = tm.TinyBertClassifier(seed=0, dropout=0.0)
    module.model.bert.embeddings.token_type_embeddings.requires_grad_(False)  # frozen by the user: not named
    with caplog.at_level("INFO", logger="lightning_pipetx"):
        make_trainer([FreezeCallback(alpha=1 / 2, signal="schedule")], max_epochs=3).fit(
            module, tm.task_loader("bert", size=16)
        )
    named = [r.message for r in caplog.records if "weights before block 0 freeze with the prefix" in r.message]
    assert named == [
        "pipetx: weights before block 0 freeze with the prefix: model.bert.embeddings.word_embeddings.weight, "
        "model.bert.embeddings.position_embeddings.weight, model.bert.embeddings.LayerNorm.weight and 1 more"
    ]


class BackboneClassifier(tm.TinyBertClassifier):
    """A module BackboneFinetuning accepts: its encoder is ``backbone``, its optimizer takes what trains."""

    @property
    def backbone(self):
        return self.model.bert

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


class EmbeddingsBackboneClassifier(BackboneClassifier):
    """:class:`BackboneClassifier` whose ``backbone`` is the embeddings, which freeze with block 0."""

    @property
    def backbone(self):
        return self.model.bert.embeddings


@pytest.mark.parametrize(
    "module, held",
    [
        (BackboneClassifier, "the blocks 'model.bert.encoder.layer'"),
        (EmbeddingsBackboneClassifier, "weights before the blocks 'model.bert.encoder.layer' \\(the embeddings\\)"),
    ],
)
@pytest.mark.parametrize("freeze_first", [True, False])
def test_backbone_finetuning_of_the_blocks_is_refused_before_training(module, held, freeze_first):
    freeze, finetuning = FreezeCallback(signal="schedule"), BackboneFinetuning(unfreeze_backbone_at_epoch=1)
    trainer = make_trainer([freeze, finetuning] if freeze_first else [finetuning, freeze], max_epochs=2)
    with pytest.raises(
        ValueError, match=f"BackboneFinetuning unfreezes the LightningModule's backbone, which holds {held}.*use one"
    ):
        trainer.fit(module(), tm.task_loader("bert", size=16))
    assert trainer.global_step == 0


class FreezeEncoder(BaseFinetuning):
    """A finetuning callback of a user's that keeps the whole encoder frozen."""

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.model.bert.encoder)

    def finetune_function(self, pl_module, epoch, optimizer):
        pass


@pytest.mark.parametrize("freeze_first", [True, False])
def test_a_finetuning_callback_that_froze_every_block_is_named(freeze_first):
    freeze, finetuning = FreezeCallback(), FreezeEncoder()
    trainer = make_trainer([freeze, finetuning] if freeze_first else [finetuning, freeze], max_epochs=1)
    with pytest.raises(ValueError, match="no weight of the blocks .* trains .*; FreezeEncoder among the callbacks"):
        trainer.fit(BackboneClassifier(), tm.task_loader("bert", size=16))
    assert trainer.global_step == 0


class UnfreezeAt(Callback):
    """Makes every weight trainable again when epoch ``epoch`` starts."""

    def __init__(self, epoch):
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            pl_module.requires_grad_(True)


@pytest.mark.parametrize("strategy", ["one device", "ElasticPipelineStrategy"])
def test_a_frozen_weight_made_trainable_again_is_refused_before_it_would_train(tmp_path, strategy):
    # Freezing by schedule with alpha=1/2: 2 of 4 blocks after epoch 0, 3 after epoch 1.
    if strategy == "one device":
        trainer = make_trainer([FreezeCallback(alpha=1 / 2, signal="schedule"), UnfreezeAt(2)], max_epochs=3)
    else:
        trainer = tm.cached_trainer(tmp_path, cache=True, callbacks=[UnfreezeAt(2)], max_epochs=3)
    pattern = r"froze the first 3 blocks and the weights before them, but 'model\.bert\.embeddings\.\S+' was made"
    with pytest.raises(ValueError, match=pattern):
        trainer.fit(tm.TinyBertClassifier(), tm.task_loader("bert", size=16))
    assert trainer.current_epoch == 2 and trainer.global_step == 4  # before epoch 2's first step


class BuiltInConfigureModel(tm.TinyBertClassifier):
    """Builds its model in configure_model, as Lightning recommends for large models."""

    def __init__(self):
        pl.LightningModule.__init__(self)
        self.model = None
        self.hparams.lr = 1e-3

    def configure_model(self):
        if self.model is None:
            self.model = tm.tiny_bert(seed=0, dropout=0.0)


@pytest.mark.parametrize("strategy", ["auto", "elastic"])
def test_a_model_built_in_configure_model_is_found_and_frozen(strategy):
    from lightning_pipetx import ElasticPipelineStrategy

    freeze = FreezeCallback(alpha=1 / 3, signal="schedule")
    chosen = ElasticPipelineStrategy() if strategy == "elastic" else "auto"
    make_trainer([freeze], max_epochs=2, strategy=chosen).fit(BuiltInConfigureModel(), tm.task_loader("bert", size=16))
    assert freeze.split.path == "model.bert.encoder.layer" and freeze.frozen_blocks == 3


def test_explicit_blocks_path_is_used():
    module = seq_module()
    # ``model.blocks`` holds 4 blocks; a smaller, explicit list of 2 Linear layers takes precedence.
    fc = FreezeCallback(alpha=1.0, signal="schedule", blocks="model.embed")
    module.model.embed = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16))
    trainer = make_trainer([fc], max_epochs=1)
    trainer.fit(module, seq_loader())
    assert fc.split.path == "model.embed"
    assert fc.frozen_blocks == 1  # L = 2, cap 1
    assert not any(p.requires_grad for p in module.model.embed[0].parameters())
    assert all(p.requires_grad for p in module.model.embed[1].parameters())
    assert all(p.requires_grad for p in module.model.blocks.parameters())


class TwoBlockLists(pl.LightningModule):
    """A Transformer-like ``blocks`` list, and a bigger list of ``heads`` after it (what the
    automatic search would pick)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([tm.ResidualMLPBlock(16, dropout=0.0) for _ in range(4)])
        self.heads = nn.ModuleList([nn.Sequential(nn.Linear(16, 256), nn.GELU()) for _ in range(3)])
        self.out = nn.Linear(3 * 256, 2)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.out(torch.cat([head(h) for head in self.heads], -1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_two_lists(freeze, strategy):
    trainer = make_trainer([freeze], max_epochs=2, strategy=strategy)
    module = TwoBlockLists()
    trainer.fit(module, seq_loader())
    return module


def test_the_block_list_given_to_the_strategy_is_the_one_that_freezes():
    from lightning_pipetx import ElasticPipelineStrategy

    freeze = FreezeCallback(alpha=0.5, signal="schedule")
    module = _fit_two_lists(freeze, ElasticPipelineStrategy(blocks="blocks", profile_steps=0))
    assert freeze.split.path == "blocks" and freeze.frozen_blocks == 3
    frozen = {name.split(".")[0] for name, p in module.named_parameters() if not p.requires_grad}
    assert frozen == {"embed", "blocks"}
    assert all(p.requires_grad for p in module.heads.parameters())


def test_different_block_lists_for_the_callback_and_the_strategy_are_refused():
    from lightning_pipetx import ElasticPipelineStrategy

    with pytest.raises(ValueError, match=r"blocks='heads'.*blocks='blocks'.*name different block lists"):
        _fit_two_lists(FreezeCallback(blocks="heads"), ElasticPipelineStrategy(blocks="blocks"))
    # Given to the callback only, while the strategy finds another list by itself.
    with pytest.raises(ValueError, match=r"freeze the blocks of 'blocks'.*pipelines those of 'heads'"):
        _fit_two_lists(FreezeCallback(blocks="blocks"), ElasticPipelineStrategy())


# ------------------------------------------------------------------ decision cadence
def test_freeze_interval_decides_every_n_epochs():
    fc = FreezeCallback(alpha=1 / 3, freeze_interval=2, signal="schedule")
    probe = EpochProbe(fc)
    make_trainer([fc, probe], max_epochs=5).fit(seq_module(), seq_loader())
    # Decisions after epochs 1 and 3 only. L = 4: ceil(4/3) = 2, then ceil(4 * 5/9) = 3.
    assert probe.frozen_at_start == [0, 0, 2, 2, 3]
    assert probe.decisions_at_start == [0, 0, 1, 1, 2]
    assert fc.decisions == 2 and fc.frozen_blocks == 3
    assert probe.reasons[0] is None and probe.reasons[2] == probe.reasons[1]


@pytest.mark.parametrize(
    ("warmup_epochs", "freeze_interval", "frozen_at_start"),
    [(1, 1, [0, 0, 2, 3, 3, 3]), (2, 1, [0, 0, 0, 2, 3, 3]), (1, 2, [0, 0, 0, 2, 2, 3])],
)
def test_warmup_epochs_delays_the_first_decision(warmup_epochs, freeze_interval, frozen_at_start):
    fc = FreezeCallback(alpha=1 / 3, freeze_interval=freeze_interval, warmup_epochs=warmup_epochs, signal="schedule")
    probe = EpochProbe(fc)
    make_trainer([fc, probe], max_epochs=6).fit(seq_module(), seq_loader())
    # The first decision ends the first interval after the warm-up; L = 4, alpha 1/3: 2, then 3 (the cap).
    assert probe.frozen_at_start == frozen_at_start
    assert probe.decisions_at_start[warmup_epochs + freeze_interval - 1] == 0
    assert probe.decisions_at_start[warmup_epochs + freeze_interval] == 1


class PendingRows(Callback):
    """How many steps' gradient norms wait on the device after each batch."""

    def __init__(self, fc):
        self.fc, self.seen = fc, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(len(self.fc._norms.rows))


def test_gradient_norms_wait_on_the_device_for_a_bounded_number_of_steps(monkeypatch):
    # The ranks agree on the recorded steps at each epoch's end and, within a long epoch, once
    # that many have waited: here every 3 steps of 4-step epochs. The sums stay those of every step.
    monkeypatch.setattr(block_norms, "ROWS_AGREED_AT_ONCE", 3)
    fc = FreezeCallback(alpha=0.25, freeze_interval=2)
    grad_probe, pending = GradNormProbe(fc, alpha=0.25, interval=2), PendingRows(fc)
    make_trainer([grad_probe, fc, pending], max_epochs=5).fit(seq_module(), seq_loader())
    assert grad_probe.checked_epochs == [0, 1, 2, 3, 4] and grad_probe.actual == grad_probe.predicted
    assert max(pending.seen) == 2 and pending.seen[:4] == [1, 2, 0, 1]


def test_freeze_interval_accumulates_gradient_norms_over_the_interval():
    # alpha 1/4 on 4 blocks freezes at most one block per decision: the cap (3) is not reached.
    fc = FreezeCallback(alpha=0.25, freeze_interval=2)
    grad_probe = GradNormProbe(fc, alpha=0.25, interval=2)
    make_trainer([grad_probe, fc], max_epochs=5).fit(seq_module(), seq_loader())
    # The probe compared the callback's sums with its own at every epoch end: over 2 epochs
    # (8 steps) before each decision, and restarted from zero after it.
    assert grad_probe.checked_epochs == [0, 1, 2, 3, 4]
    assert fc.decisions == 2 and 0 < fc.frozen_blocks < 3
    assert grad_probe.actual == grad_probe.predicted and len(grad_probe.predicted) == 2
    state = fc.state_dict()
    assert state["norm_steps"] == 4  # epoch 4 only, not decided yet
    assert all(s > 0 for s in state["norm_sums"][fc.frozen_blocks :])


class _FusedOptionRegressor(tm.TinySequentialRegressor):
    def __init__(self, fused: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fused = fused

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, fused=self.fused)


class _NormsAtEpochEnd(Callback):
    """The callback's gradient-norm sums before its decision (put it before the FreezeCallback)."""

    def __init__(self, fc: FreezeCallback) -> None:
        self.fc = fc
        self.states: list[dict] = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.states.append(self.fc.state_dict())


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))],
)
def test_gradient_norms_are_measured_unscaled_under_fp16_with_a_fused_optimizer(device):
    # Lightning unscales the gradients before on_before_optimizer_step, except for an optimizer that
    # unscales inside its own step (fused AdamW): there they still carry the loss scale (2**12). On a
    # GPU, the callback divides by the scale read on the device.
    states = {}
    for fused in (False, True):
        pl.seed_everything(0)
        fc = FreezeCallback()
        peek = _NormsAtEpochEnd(fc)
        scaler = torch.amp.GradScaler(device, init_scale=2.0**12)
        plugin = pl.plugins.MixedPrecision("16-mixed", device, scaler=scaler)
        trainer = make_trainer(
            [peek, fc], max_epochs=1, plugins=[plugin], accelerator="gpu" if device == "cuda" else "cpu"
        )
        trainer.fit(_FusedOptionRegressor(fused), seq_loader())
        assert scaler.get_scale() == 2.0**12  # no step overflowed: every step was measured
        states[fused] = peek.states[0]
    assert states[True]["norm_steps"] == states[False]["norm_steps"] == 4
    assert 0 < states[False]["norm_sums"][0] < 100
    assert states[True]["norm_sums"] == pytest.approx(states[False]["norm_sums"], rel=1e-6 if device == "cpu" else 1e-3)


class _HeadOverflowAtStep1(tm.TinySequentialRegressor):
    def on_after_backward(self):
        if self.global_step == 1:
            self.model.head.weight.grad.fill_(float("inf"))


class _SkippedSteps(Callback):
    """Optimizer steps the loss scaler skipped (its scale fell)."""

    def __init__(self):
        self.skipped = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._scale = trainer.precision_plugin.scaler.get_scale()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.precision_plugin.scaler.get_scale() < self._scale:
            self.skipped.append(batch_idx)


def test_a_step_skipped_for_an_overflow_outside_the_blocks_is_not_measured():
    fc, skipped = FreezeCallback(freeze_interval=2), _SkippedSteps()  # no decision: the interval's counts stay
    peek = _NormsAtEpochEnd(fc)
    plugin = pl.plugins.MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))
    make_trainer([peek, fc, skipped], max_epochs=1, plugins=[plugin]).fit(_HeadOverflowAtStep1(seed=0), seq_loader())
    assert 1 in skipped.skipped
    assert peek.states[0]["norm_steps"] == 4 - len(skipped.skipped)


class _NoStepRegressor(tm.TinySequentialRegressor):
    """Returns no loss: Lightning takes no optimizer step, so no gradient is ever measured."""

    def training_step(self, batch, batch_idx):
        return None


def test_no_gradient_norms_are_measured_once_the_cap_is_reached():
    # Block 3 has the smallest gradients: alpha 1 and the gradient term both say 4, the cap 3.
    fc = FreezeCallback(alpha=1.0)
    probe = EpochProbe(fc)
    module = seq_module(block_scales=[1.0, 1.0, 1.0, 1e-3])
    make_trainer([fc, probe], max_epochs=3).fit(module, seq_loader())
    assert probe.frozen_at_start == [0, 3, 3]
    # Decisions go on at the cap (same reason every epoch), without gradient norms.
    assert fc.decisions == 3
    assert probe.reasons == ["bound by cap (min_active_blocks=1)"] + ["cap reached (min_active_blocks=1)"] * 2
    state = fc.state_dict()
    assert state["norm_steps"] == 0 and not any(state["norm_sums"])


def test_no_gradient_signal_means_no_decision():
    fc = FreezeCallback(alpha=1.0)
    make_trainer([fc], max_epochs=2).fit(_NoStepRegressor(seed=0), seq_loader())
    assert fc.frozen_blocks == 0 and fc.decisions == 0


def test_signal_schedule_ignores_gradients():
    # Block 0 has by far the smallest gradients: the gradient term would stop at 1 block.
    fc = FreezeCallback(alpha=1 / 3, signal="schedule")
    probe = EpochProbe(fc)
    module = seq_module(block_scales=[1e-3, 1.0, 1.0, 1.0])
    make_trainer([fc, probe], max_epochs=3).fit(module, seq_loader())
    assert probe.frozen_at_start == [0, 2, 3]
    assert fc.frozen_blocks == 3 and fc.decisions == 3
    assert probe.reasons[0] == "bound by schedule"
    assert probe.reasons[2].startswith("cap reached")


def test_grad_norm_signal_with_same_model_stops_at_smallest_block():
    fc = FreezeCallback(alpha=1 / 3)
    module = seq_module(block_scales=[1e-3, 1.0, 1.0, 1.0])
    make_trainer([fc], max_epochs=1).fit(module, seq_loader())
    assert fc.frozen_blocks == 1
    assert fc.last_decision.reason == "bound by gradient norm (smallest at block 0)"


@pytest.mark.parametrize(
    ("scales", "alpha", "min_active", "frozen", "reason"),
    [
        # gradient term: block 1 has 1000x smaller gradients -> 2; alpha 4; cap 3.
        ([1.0, 1e-3, 1.0, 1.0], 1.0, 1, 2, "bound by gradient norm (smallest at block 1)"),
        # alpha term: ceil(4 * 0.25) = 1; the gradient term points at the last block (4).
        ([1.0, 1.0, 1.0, 1e-3], 0.25, 1, 1, "bound by alpha"),
        # cap: alpha and gradient terms both say 4; L - 1 = 3.
        ([1.0, 1.0, 1.0, 1e-3], 1.0, 1, 3, "bound by cap (min_active_blocks=1)"),
        ([1.0, 1.0, 1.0, 1e-3], 1.0, 2, 2, "bound by cap (min_active_blocks=2)"),
    ],
)
def test_which_term_binds_end_to_end(scales, alpha, min_active, frozen, reason):
    fc = FreezeCallback(alpha=alpha, min_active_blocks=min_active)
    module = seq_module(block_scales=scales)
    make_trainer([fc], max_epochs=1).fit(module, seq_loader())
    assert fc.frozen_blocks == frozen
    assert fc.last_decision.reason == reason
    names = prefix_names(module, fc, frozen)
    for name, p in module.named_parameters():
        assert p.requires_grad == (name not in names), name


# ------------------------------------------------------------ what freezing does
def test_frozen_parameters_stay_bit_identical_and_active_ones_train():
    fc = FreezeCallback(alpha=0.25)  # one more block per decision: 1, 2, 3
    probe = EpochProbe(fc)
    module = seq_module()
    make_trainer([fc, probe], max_epochs=4).fit(module, seq_loader())
    assert probe.frozen_at_start == [0, 1, 2, 3]

    params = probe.params_at_start + [probe.final_params]
    all_names = set(params[0])
    for epoch in range(4):
        frozen = prefix_names(module, fc, probe.frozen_at_start[epoch])
        before, after = params[epoch], params[epoch + 1]
        for name in all_names:
            if name in frozen:
                assert torch.equal(before[name], after[name]), f"epoch {epoch}: frozen {name} changed"
                assert not probe.requires_grad_at_start[epoch][name]
            else:
                assert not torch.equal(before[name], after[name]), f"epoch {epoch}: active {name} did not train"
                assert probe.requires_grad_at_start[epoch][name]
    # The embedding (pre) froze at the first decision, the head never did.
    assert not module.model.embed[0].weight.requires_grad
    assert module.model.head.weight.requires_grad and module.model.blocks[3].fc1.weight.requires_grad


def test_frozen_parameters_leave_the_optimizer_alone():
    fc = FreezeCallback(alpha=0.25)
    module = seq_module()
    trainer = make_trainer([fc], max_epochs=2)
    trainer.fit(module, seq_loader())
    assert fc.frozen_blocks == 2
    optimizer = trainer.optimizers[0]
    frozen_at_first = set(map(id, fc.split.prefix_parameters(1)))
    # AdamW took no step for them after the first freeze; nothing holds a gradient.
    steps = {id(p): int(optimizer.state[p]["step"]) for g in optimizer.param_groups for p in g["params"]}
    active_steps = {steps[id(p)] for p in module.parameters() if p.requires_grad}
    assert active_steps == {8}
    assert {steps[i] for i in frozen_at_first} == {4}
    assert all(p.grad is None for p in fc.split.prefix_parameters(2))


class TrainAfterValidation(tm.TinySequentialRegressor):
    """Overrides a documented Lightning hook whose default puts the *whole* model in train mode."""

    def on_validation_model_train(self):
        super().on_validation_model_train()


@pytest.mark.parametrize(
    ("val_check_interval", "module_class"),
    [(1.0, tm.TinySequentialRegressor), (0.5, tm.TinySequentialRegressor), (0.5, TrainAfterValidation)],
)
def test_frozen_prefix_runs_in_eval_mode_and_active_blocks_in_train_mode(val_check_interval, module_class):
    fc = FreezeCallback(alpha=0.5)  # L = 4: 2, then 3 (cap)
    probe = ModeProbe(fc)
    module = module_class(seed=0, block_scales=[1.0, 1.0, 1.0, 1e-3])  # the alpha term binds
    trainer = make_trainer(
        [fc, probe],
        max_epochs=3,
        val_check_interval=val_check_interval,
        limit_val_batches=1,
        num_sanity_val_steps=1,
    )
    trainer.fit(module, seq_loader(), seq_loader(size=8))
    frozen_by_epoch = {0: 0, 1: 2, 2: 3}
    assert fc.frozen_blocks == 3
    seen_parts = {part for _, part, _ in probe.seen}
    assert seen_parts == {"pre:model.embed"} | {f"block:{i}" for i in range(4)} | {"post:model.norm", "post:model.head"}
    for epoch, part, training in probe.seen:
        frozen = frozen_by_epoch[epoch]
        if part.startswith("pre:"):
            expect_train = frozen == 0
        elif part.startswith("block:"):
            expect_train = int(part.split(":")[1]) >= frozen
        else:
            expect_train = True
        assert training == expect_train, (epoch, part, training)
    assert {epoch for epoch, _, _ in probe.seen} == {0, 1, 2}
    if module_class is tm.TinySequentialRegressor:
        # Lightning restored the modes after the last validation.
        assert not module.model.embed.training and not module.model.blocks[2].training
        assert module.model.blocks[3].training and module.model.head.training


def test_frozen_dropout_is_off():
    # With dropout 0.5 in pre and blocks, a frozen prefix in eval mode gives the same output twice.
    fc = FreezeCallback(alpha=0.25)
    outputs: list[tuple[torch.Tensor, torch.Tensor]] = []

    class Twice(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.current_epoch == 1 and batch_idx == 0:
                x, _ = batch
                h1 = pl_module.model.blocks[0](pl_module.model.embed(x))
                h2 = pl_module.model.blocks[0](pl_module.model.embed(x))
                outputs.append((h1, h2))
                o1 = pl_module.model.blocks[1](h1)
                o2 = pl_module.model.blocks[1](h1)
                outputs.append((o1, o2))

    module = seq_module(dropout=0.5)
    make_trainer([fc, Twice()], max_epochs=2).fit(module, seq_loader())
    (h1, h2), (o1, o2) = outputs
    assert torch.equal(h1, h2)  # embed + block 0 frozen: eval mode
    assert not torch.equal(o1, o2)  # block 1 active: dropout on


# ------------------------------------------------------------------------- logging
def test_logs_frozen_blocks_and_throughput_every_epoch():
    fc = FreezeCallback(alpha=0.5)  # L = 4: 2 after the first decision, then 3 (cap)
    logger = MemoryLogger()
    trainer = make_trainer([fc], max_epochs=4, logger=logger, log_every_n_steps=1)
    trainer.fit(seq_module(block_scales=[1.0, 1.0, 1.0, 1e-3]), seq_loader(size=16, batch_size=4))
    # Blocks frozen *during* each epoch (the decision at an epoch's end shows in the next one).
    assert logger.values("pipetx/frozen_blocks") == [0.0, 2.0, 3.0, 3.0]
    throughput = logger.values("pipetx/samples_per_sec")
    assert len(throughput) == 4
    assert all(math.isfinite(v) and v > 0 for v in throughput)
    assert float(trainer.callback_metrics["pipetx/frozen_blocks"]) == 3.0
    assert float(trainer.callback_metrics["pipetx/samples_per_sec"]) == throughput[-1]


# --------------------------------------------------------------- real LightningModules
def test_bert_lightning_module_freezes_by_the_papers_rule():
    alpha = 1 / 3
    fc = FreezeCallback(alpha=alpha)
    grad_probe = GradNormProbe(fc, alpha)
    probe = EpochProbe(fc)
    module = tm.TinyBertClassifier(seed=0)
    trainer = make_trainer([grad_probe, fc, probe], max_epochs=3)
    trainer.fit(module, tm.task_loader("bert", size=32, batch_size=8), tm.task_loader("bert", size=8, seed=1))

    # Each decision matches the rule applied to gradient norms measured independently.
    assert grad_probe.actual == grad_probe.predicted
    # Every decision freezes at least one more block; with L = 4 and cap 3 that is 3 after 3 epochs.
    assert fc.frozen_blocks == 3 and fc.decisions == 3
    frozen = prefix_names(module, fc, 3)
    assert {n for n, p in module.named_parameters() if not p.requires_grad} == frozen
    assert any(n.startswith("model.bert.embeddings.") for n in frozen)
    assert any(n.startswith("model.bert.encoder.layer.2.") for n in frozen)
    assert not any(n.startswith(("model.bert.encoder.layer.3.", "model.classifier.")) for n in frozen)
    last = probe.frozen_at_start[-1]
    for name in prefix_names(module, fc, last):
        assert torch.equal(probe.params_at_start[-1][name], probe.final_params[name]), name
    assert not torch.equal(probe.params_at_start[-1]["model.classifier.weight"], module.model.classifier.weight)
    assert math.isfinite(float(trainer.callback_metrics["val_loss"]))


def test_timm_vit_lightning_module_freezes_one_block_per_epoch():
    fc = FreezeCallback(alpha=0.25)  # L = 4: the alpha term adds one block per decision
    probe = EpochProbe(fc)
    module = tm.TinyViTClassifier(seed=0)
    trainer = make_trainer([fc, probe], max_epochs=3)
    trainer.fit(module, tm.task_loader("timm_vit", size=16, batch_size=8))
    assert probe.frozen_at_start == [0, 1, 2]
    assert fc.frozen_blocks == 3
    vit = module.model
    assert not vit.cls_token.requires_grad and not vit.pos_embed.requires_grad
    assert not any(p.requires_grad for p in vit.patch_embed.parameters())
    assert not any(p.requires_grad for b in vit.blocks[:3] for p in b.parameters())
    assert all(p.requires_grad for p in vit.blocks[3].parameters())
    assert all(p.requires_grad for p in vit.head.parameters()) and vit.norm.weight.requires_grad
    # During the last epoch (2 frozen) the prefix stayed put, the rest trained.
    for name in prefix_names(module, fc, 2):
        assert torch.equal(probe.params_at_start[2][name], probe.final_params[name]), name
    assert not torch.equal(probe.params_at_start[2]["model.blocks.2.mlp.fc1.weight"], vit.blocks[2].mlp.fc1.weight)
    assert not torch.equal(probe.params_at_start[2]["model.head.weight"], vit.head.weight)


# ------------------------------------------------------------------ checkpoint / resume
class _FrozenAtEpochStart(Callback):
    def __init__(self, freeze):
        self.freeze, self.rows, self.throughputs = freeze, [], []

    def on_train_epoch_start(self, trainer, pl_module):
        self.rows.append((trainer.current_epoch, self.freeze.frozen_blocks))
        if "pipetx/samples_per_sec" in trainer.callback_metrics:  # the last epoch's
            self.throughputs.append(float(trainer.callback_metrics["pipetx/samples_per_sec"]))


def _fit_steps(max_steps, checkpoints, ckpt_path=None):
    freeze = FreezeCallback(alpha=0.25, signal="schedule")
    rows = _FrozenAtEpochStart(freeze)
    saver = ModelCheckpoint(dirpath=checkpoints, save_top_k=-1, filename="{epoch}-{step}")
    trainer = make_trainer([freeze, rows, saver], max_epochs=-1, max_steps=max_steps, enable_checkpointing=True)
    trainer.fit(seq_module(dropout=0.0, num_blocks=8), seq_loader(size=32), ckpt_path=ckpt_path)
    return rows.rows, freeze.frozen_blocks, freeze.decisions, rows.throughputs


def test_an_epoch_cut_short_is_decided_when_a_resumed_run_completes_it(tmp_path):
    # 8 batches an epoch. 28 steps end inside epoch 3: no decision on half an epoch.
    rows, frozen, decisions, whole = _fit_steps(28, tmp_path / "whole")
    assert rows == [(0, 0), (1, 2), (2, 4), (3, 5)] and (frozen, decisions) == (5, 3)
    # Stopped at step 10, inside epoch 1 (saved there), then resumed to step 28: the same decisions.
    _fit_steps(10, tmp_path / "first")
    rows, frozen, decisions, resumed = _fit_steps(
        28, tmp_path / "resumed", str(tmp_path / "first" / "epoch=1-step=10.ckpt")
    )
    assert rows == [(2, 4), (3, 5)] and (frozen, decisions) == (5, 3)
    # The resumed epoch's throughput is timed from the resumed run's start.
    assert resumed[0] > min(whole) / 1000  # not from the clock's origin: about a millionth of it


def test_state_dict_round_trip():
    fc = FreezeCallback(alpha=1 / 3, freeze_interval=2)
    make_trainer([fc], max_epochs=3).fit(seq_module(), seq_loader())
    state = fc.state_dict()
    assert state["frozen_blocks"] == fc.frozen_blocks >= 1 and state["decisions"] == 1
    # Epoch 2 accumulated (4 steps), not decided yet; the decision after epoch 1 reset the sums.
    assert state["norm_steps"] == 4 and len(state["norm_sums"]) == 4

    other = FreezeCallback(alpha=1 / 3, freeze_interval=2)
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert other.frozen_blocks == fc.frozen_blocks and other.decisions == 1
    # The state is plain data: it loads back with torch.load(weights_only=True).
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == state


def _resume_trainer(tmp_path: Path, fc: FreezeCallback, probe: Callback, max_epochs: int, **kwargs):
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, filename="{epoch}-{step}")
    return make_trainer([fc, probe, ckpt], max_epochs=max_epochs, enable_checkpointing=True, **kwargs)


@pytest.mark.parametrize("resume_epoch", [0, 1])
def test_resume_from_checkpoint_matches_an_uninterrupted_run(tmp_path, resume_epoch):
    """freeze_interval=2: the epoch-0 checkpoint holds accumulated gradient norms and no decision,
    the epoch-1 checkpoint holds a frozen prefix. Resumed runs must match a run never stopped."""

    def new():
        fc = FreezeCallback(alpha=1 / 3, freeze_interval=2)
        return fc, EpochProbe(fc)

    module_args = dict(dropout=0.0, block_scales=[1.0, 1e-3, 1.0, 1.0])
    fc_a, probe_a = new()
    module_a = seq_module(**module_args)
    _resume_trainer(tmp_path / "a", fc_a, probe_a, 4).fit(module_a, seq_loader())
    assert probe_a.frozen_at_start == [0, 0, 2, 2]  # gradient term: smallest at block 1
    assert fc_a.frozen_blocks == 3

    ckpt = tmp_path / "a" / f"epoch={resume_epoch}-step={4 * (resume_epoch + 1)}.ckpt"
    saved = torch.load(ckpt, weights_only=False)["callbacks"]["FreezeCallback"]
    if resume_epoch == 0:
        assert saved["frozen_blocks"] == 0 and saved["decisions"] == 0 and saved["norm_steps"] == 4
    else:
        assert saved["frozen_blocks"] == 2 and saved["decisions"] == 1 and saved["norm_steps"] == 0

    fc_b, probe_b = new()
    module_b = seq_module(**module_args)

    class AtTrainStart(Callback):
        def on_train_start(self, trainer, pl_module):
            self.requires_grad = {n: p.requires_grad for n, p in pl_module.named_parameters()}

    at_start = AtTrainStart()
    trainer = _resume_trainer(tmp_path / "b", fc_b, probe_b, 4)
    trainer.callbacks.append(at_start)
    trainer.fit(module_b, seq_loader(), ckpt_path=ckpt)

    # The frozen prefix is back before the first resumed step.
    frozen_names = prefix_names(module_b, fc_b, saved["frozen_blocks"])
    assert {n for n, flag in at_start.requires_grad.items() if not flag} == frozen_names
    assert probe_b.frozen_at_start == probe_a.frozen_at_start[resume_epoch + 1 :]
    assert fc_b.frozen_blocks == fc_a.frozen_blocks and fc_b.decisions == fc_a.decisions
    assert fc_b.state_dict() == fc_a.state_dict()
    for name, value in probe_a.final_params.items():
        assert torch.equal(value, probe_b.final_params[name]), name


def test_resume_from_a_checkpoint_written_before_the_decision(tmp_path):
    """With validation twice per epoch, ModelCheckpoint saves in on_validation_end, before the
    epoch's decision in on_train_epoch_end; resuming must still take that decision."""
    fc_a = FreezeCallback(alpha=0.25)
    probe_a = EpochProbe(fc_a)
    options = dict(val_check_interval=0.5, limit_val_batches=1)
    module_args = dict(dropout=0.0)
    _resume_trainer(tmp_path / "a", fc_a, probe_a, 3, **options).fit(
        seq_module(**module_args), seq_loader(), seq_loader(size=4)
    )
    assert probe_a.frozen_at_start == [0, 1, 2]
    ckpt = tmp_path / "a" / "epoch=0-step=4.ckpt"
    saved = torch.load(ckpt, weights_only=False)["callbacks"]["FreezeCallback"]
    assert saved["frozen_blocks"] == 0 and saved["norm_steps"] == 4  # written before the decision

    fc_b = FreezeCallback(alpha=0.25)
    probe_b = EpochProbe(fc_b)
    trainer = _resume_trainer(tmp_path / "b", fc_b, probe_b, 3, **options)
    trainer.fit(seq_module(**module_args), seq_loader(), seq_loader(size=4), ckpt_path=ckpt)
    assert probe_b.frozen_at_start == [1, 2]
    assert fc_b.frozen_blocks == fc_a.frozen_blocks == 3
    for name, value in probe_a.final_params.items():
        assert torch.equal(value, probe_b.final_params[name]), name


class _ScoredRegressor(tm.TinySequentialRegressor):
    """Validates with a fixed ``score``: 1 in epochs 0-1, then 0 (what FreezeCallback's guard watches)."""

    def validation_step(self, batch, batch_idx):
        self.log("score", 1.0 if self.current_epoch < 2 else 0.0)


def _fit_saving_every_epoch_end_batch(folder, fc, ckpt_path=None, **options):
    """4 epochs of 4 batches; ModelCheckpoint(every_n_train_steps=4) saves after each epoch's last batch."""
    probe = EpochProbe(fc)
    saver = ModelCheckpoint(dirpath=folder, save_top_k=-1, every_n_train_steps=4, filename="{epoch}-{step}")
    trainer = make_trainer([fc, probe, saver], max_epochs=4, enable_checkpointing=True, **options)
    validation = seq_loader(size=4) if options else None
    module = _ScoredRegressor(seed=0, dropout=0.0, block_scales=[1.0, 1e-3, 1.0, 1.0])
    trainer.fit(module, seq_loader(), validation, ckpt_path=ckpt_path)
    return probe


@pytest.mark.parametrize("signal", ["grad_norm", "schedule"])
@pytest.mark.parametrize("resume_epoch", [0, 1])
def test_resume_from_a_checkpoint_of_an_epochs_last_batch_takes_that_epochs_decision(tmp_path, signal, resume_epoch):
    """Resumed from a checkpoint of an epoch's last batch, Lightning goes on with the next epoch
    without the finished one's end (nor the next one's start)."""
    fc_a, fc_b = FreezeCallback(alpha=1 / 3, signal=signal), FreezeCallback(alpha=1 / 3, signal=signal)
    probe_a = _fit_saving_every_epoch_end_batch(tmp_path / "a", fc_a)
    ckpt = tmp_path / "a" / f"epoch={resume_epoch}-step={4 * (resume_epoch + 1)}.ckpt"
    probe_b = _fit_saving_every_epoch_end_batch(tmp_path / "b", fc_b, str(ckpt))
    assert probe_a.frozen_at_start[resume_epoch + 2 :] == probe_b.frozen_at_start
    assert fc_b.frozen_blocks == fc_a.frozen_blocks and fc_b.decisions == fc_a.decisions == 4  # the skipped one taken
    for name, value in probe_a.final_params.items():
        assert torch.equal(value, probe_b.final_params[name]), name


def test_a_callback_added_on_resume_takes_no_decision_for_the_epochs_before(tmp_path):
    saver = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="{epoch}")
    make_trainer([saver], max_epochs=2, enable_checkpointing=True).fit(seq_module(dropout=0.0), seq_loader())
    fc = FreezeCallback(alpha=0.5, signal="schedule")
    probe = EpochProbe(fc)
    trainer = make_trainer([fc, probe], max_epochs=4)
    trainer.fit(seq_module(dropout=0.0), seq_loader(), ckpt_path=str(tmp_path / "epoch=1.ckpt"))
    assert probe.frozen_at_start == [0, 2] and fc.decisions == 2  # decided after epochs 2 and 3 only


def test_a_resume_past_a_skipped_epoch_end_still_lets_the_guard_judge_that_epochs_validation(tmp_path):
    # The score falls in epoch 2's mid-epoch validation: the guard stops freezing before epoch 2's
    # decision. Resumed from epoch 2's last batch, the checkpoint holds that observation.
    def fit(folder, ckpt_path=None):
        fc = FreezeCallback(alpha=0.25, monitor="score", mode="max")
        _fit_saving_every_epoch_end_batch(folder, fc, ckpt_path, val_check_interval=0.5, limit_val_batches=1)
        return fc

    whole = fit(tmp_path / "a")
    resumed = fit(tmp_path / "b", str(tmp_path / "a" / "epoch=2-step=12.ckpt"))
    assert whole.guard.stopped and resumed.guard.stopped
    assert resumed.frozen_blocks == whole.frozen_blocks == 2


# -------------------------------------------------------------------- Lightning's DDP
DDP_SCRIPT = textwrap.dedent(
    """
    import gc, sys, weakref
    sys.path.insert(0, sys.argv[1])
    import torch
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from torch.nn.parallel import DistributedDataParallel
    import tiny_models as tm
    from lightning_pipetx import FreezeCallback

    torch.set_num_threads(1)

    class Probe(Callback):
        def __init__(self, fc):
            self.fc, self.frozen, self.params, self.wrappers, self.alive = fc, [], [], [], []

        def on_train_epoch_start(self, trainer, pl_module):
            self.frozen.append(self.fc.frozen_blocks)
            self.params.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})
            wrapper = trainer.strategy.model
            is_new = not hasattr(wrapper, "_probe_seen")  # ids can be reused; a mark cannot
            wrapper._probe_seen = True
            self.wrappers.append((isinstance(wrapper, DistributedDataParallel), is_new, weakref.ref(wrapper)))
            gc.collect()
            self.alive = [ref() is not None for _, _, ref in self.wrappers]

    fc = FreezeCallback(alpha=0.25)  # grad_norm signal: the all-reduced path
    probe = Probe(fc)
    model = tm.TinySequentialRegressor(seed=0, dropout=0.0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[fc, probe],
    )
    trainer.fit(model, tm.task_loader("sequential", size=32, batch_size=4))
    torch.save(
        {
            "frozen": probe.frozen + [fc.frozen_blocks],
            "decisions": fc.decisions,
            "params": probe.params + [{n: p.detach().clone() for n, p in model.named_parameters()}],
            "prefix": [n for n, p in model.named_parameters()
                       if any(p is q for q in fc.split.prefix_parameters(1))],
            "is_ddp": [w[0] for w in probe.wrappers],
            "new_wrapper": [w[1] for w in probe.wrappers],
            "alive": probe.alive,
            "world_size": trainer.world_size,
        },
        sys.argv[2] + f"/rank{trainer.global_rank}.pt",
    )
    torch.distributed.destroy_process_group()  # as tests/workers/worker_exit.py does
    """
)


def test_lightning_ddp_keeps_working_after_a_freeze(tmp_path):
    script = tmp_path / "ddp_freeze.py"
    script.write_text(DDP_SCRIPT)
    pythonpath = [str(TESTS_DIR)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(pythonpath))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(script),
        str(TESTS_DIR),
        str(tmp_path),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for out in ranks:
        assert out["world_size"] == 2
        assert out["frozen"] == [0, 1, 2, 3] and out["decisions"] == 3
        assert all(out["is_ddp"])
        # Re-wrapped after each freeze, and the old wrappers (with their reducers) are gone.
        assert out["new_wrapper"] == [True, True, True]
        assert out["alive"] == [False, False, True]
        params = out["params"]  # at the start of epochs 0, 1, 2 and at the end
        prefix = set(out["prefix"])
        assert prefix and "model.embed.0.weight" in prefix and "model.blocks.0.fc1.weight" in prefix
        for name in params[0]:
            if name in prefix:  # frozen after epoch 0
                assert torch.equal(params[1][name], params[3][name]), name
                assert not torch.equal(params[0][name], params[1][name]), name
            else:  # still trained in epoch 1 (blocks 1.. and head)
                assert not torch.equal(params[1][name], params[2][name]), name
        assert not torch.equal(params[2]["model.head.weight"], params[3]["model.head.weight"])
        assert torch.equal(params[2]["model.blocks.1.fc1.weight"], params[3]["model.blocks.1.fc1.weight"])
    # Both ranks took the same decisions and hold the same weights at every epoch.
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[n], b[n]) for n in a)


def test_another_block_list_in_the_prefix_is_named_in_a_warning():
    # T5's decoder blocks are the block list: its encoder is part of their prefix (named once the
    # first step showed that it feeds the blocks).
    trainer = make_trainer([FreezeCallback()], max_epochs=1, max_steps=1)
    with pytest.warns(UserWarning, match="the block list 'model.encoder.block', registered before them"):
        trainer.fit(tm.build_task("t5"), tm.task_loader("t5", size=8))


def test_a_frozen_model_validates_and_predicts_with_the_callback():
    # model.freeze() before inference, with the Trainer the run was built with.
    module = tm.TinyBertClassifier(seed=0, dropout=0.0)
    module.freeze()
    trainer = make_trainer([FreezeCallback()], max_epochs=1)
    loader = tm.task_loader("bert", size=8)
    assert "val_acc" in trainer.validate(module, loader, verbose=False)[0]
    assert len(trainer.predict(module, loader)) == 1


def test_the_per_step_rows_use_a_float_the_device_holds():
    # Apple's MPS holds no float64: FreezeCallback's per-step rows there are float32.
    from lightning_pipetx.callbacks.freeze_context import widest_float

    assert widest_float(torch.device("mps")) is torch.float32
    assert widest_float(torch.device("cpu")) is widest_float(torch.device("cuda", 0)) is torch.float64


def test_gradient_norm_rows_of_a_stopped_run_count_the_steps_every_rank_recorded():
    # Rank 0 recorded 3 steps, rank 1 only 2 (interrupted in its third). While the run trains that
    # is a recipe error; once the ranks agreed that the run stopped, the third step is dropped.
    output = run_workers("norms_worker.py", 2, "running", expect_failure=True, timeout=120)
    assert "the ranks measured different numbers of optimizer steps (2 to 3)" in output
    output = run_workers("norms_worker.py", 2, "stopped", timeout=120)
    for rank in (0, 1):
        assert f"rank {rank} sums [3.0, 3.0] steps 2" in output, output[-3000:]


class _FrozenAtStart(Callback):
    """The number of weights that do not train when a fit starts."""

    def __init__(self):
        self.frozen = []

    def on_train_start(self, trainer, pl_module):
        self.frozen.append(sum(not p.requires_grad for p in pl_module.parameters()))


def test_a_callback_reused_for_another_model_starts_it_with_nothing_frozen():
    freeze, at_start = FreezeCallback(alpha=0.25, signal="schedule"), _FrozenAtStart()
    first = tm.TinySequentialRegressor(seed=0, num_blocks=8)
    tm.make_trainer([freeze, at_start], max_epochs=2).fit(first, tm.task_loader("sequential", size=16))
    assert (freeze.frozen_blocks, freeze.decisions) == (4, 2)
    # The same model fitted on: its frozen prefix stays and the decisions go on.
    tm.make_trainer([freeze, at_start], max_epochs=1).fit(first, tm.task_loader("sequential", size=16))
    assert (freeze.frozen_blocks, freeze.decisions) == (5, 3) and at_start.frozen[1] > 0
    # Another model: trained from nothing frozen, decided as by a new callback.
    second = tm.TinySequentialRegressor(seed=0, num_blocks=8)
    tm.make_trainer([freeze, at_start], max_epochs=2).fit(second, tm.task_loader("sequential", size=16))
    assert at_start.frozen[2] == 0 and (freeze.frozen_blocks, freeze.decisions) == (4, 2)


class _FreezeEveryBlockFromEpoch1(Callback):
    """The user's own freezing: every block stops training from epoch 1 on (the head trains)."""

    frozen_at_epoch_1: int | None = None

    def __init__(self, freeze: FreezeCallback) -> None:
        self.freeze = freeze

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            pl_module.model.blocks.requires_grad_(False)
            self.frozen_at_epoch_1 = self.freeze.frozen_blocks


def test_a_decision_without_a_measured_gradient_says_so(caplog):
    # Once the user froze every block, no active block measures a gradient.
    module = tm.TinySequentialRegressor(seed=0, dropout=0.0)
    freeze = FreezeCallback(alpha=1 / 2)
    user = _FreezeEveryBlockFromEpoch1(freeze)
    with caplog.at_level("INFO", logger="lightning_pipetx"):
        make_trainer([freeze, user], max_epochs=3).fit(module, tm.task_loader("sequential", size=16, batch_size=4))
    assert freeze.frozen_blocks == user.frozen_at_epoch_1 > 0
    skipped = [r.message for r in caplog.records if "no decision" in r.message]
    assert skipped and all("no active block measured a gradient" in message for message in skipped)
