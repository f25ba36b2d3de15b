"""FreezeBoundary: the frozen prefix stays in eval mode and out of the backward while steps run."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import tiny_models as tm
import torch
from torch.utils.checkpoint import checkpoint

from lightning_pipetx import FreezeCallback, find_blocks
from lightning_pipetx.callbacks.freeze_boundary import FreezeBoundary

FREEZE_ONE_PER_EPOCH = dict(alpha=0.25, signal="schedule")  # 4 blocks: 1, then 2 frozen


class TrainsInItsStep(tm.TinySequentialRegressor):
    """A training_step that puts the whole model in training mode, as code ported from a loop may."""

    def training_step(self, batch, batch_idx):
        self.train()
        return super().training_step(batch, batch_idx)


class ModeAfterForward(pl.Callback):
    """``module.training`` of block 0 while its forward ran, at the first training step of each epoch."""

    def __init__(self):
        self.modes, self._handle = [], None

    def on_train_epoch_start(self, trainer, module):
        def record(block, args, output):
            self.modes.append(block.training)
            self._handle.remove()

        self._handle = module.model.blocks[0].register_forward_hook(record)


def test_a_training_step_that_calls_train_keeps_the_frozen_prefix_in_eval_mode():
    module, probe = TrainsInItsStep(seed=0), ModeAfterForward()
    tm.make_trainer([FreezeCallback(**FREEZE_ONE_PER_EPOCH), probe], max_epochs=3).fit(
        module, tm.task_loader("sequential", size=16, batch_size=4)
    )
    assert probe.modes == [True, False, False]
    module.train()  # after fit the model is the user's again
    module.model.blocks[0](torch.zeros(1, 16))
    assert module.model.blocks[0].training


class CheckpointedBlocks(tm.TinySequentialRegressor):
    """Each block under torch's activation checkpointing, reentrant or not."""

    def __init__(self, use_reentrant: bool):
        super().__init__(seed=0, dropout=0.0)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        h = self.model.embed(x)
        for block in self.model.blocks:
            h = checkpoint(block, h, use_reentrant=self.use_reentrant)
        return self.model.head(self.model.norm(h))


def test_reentrant_checkpointing_is_refused_once_a_frozen_prefix_leaves_the_blocks_without_gradient():
    # Once block 0 is frozen, block 1's input needs no gradient, and a reentrant segment gives block 1
    # (and every later checkpointed block) none: they would silently stop training.
    trainer = tm.make_trainer([FreezeCallback(**FREEZE_ONE_PER_EPOCH)], max_epochs=3)
    with pytest.raises(
        RuntimeError,
        match="block 1, the first block still training, got no gradient: it ran in a reentrant.*use_reentrant=False",
    ):
        trainer.fit(CheckpointedBlocks(use_reentrant=True), tm.task_loader("sequential", size=16, batch_size=4))
    assert trainer.current_epoch == 1 and trainer.global_step == 4  # refused at the first step after the freeze


def test_non_reentrant_checkpointing_keeps_every_active_block_training():
    module = CheckpointedBlocks(use_reentrant=False)
    freeze = FreezeCallback(**FREEZE_ONE_PER_EPOCH)
    before = [block.fc1.weight.detach().clone() for block in module.model.blocks]
    tm.make_trainer([freeze], max_epochs=3).fit(module, tm.task_loader("sequential", size=16, batch_size=4))
    assert freeze.frozen_blocks == 3
    assert all(not torch.equal(b, block.fc1.weight) for b, block in zip(before, module.model.blocks))


def test_hugging_face_gradient_checkpointing_trains_as_without_it_as_blocks_freeze():
    # gradient_checkpointing_enable makes the embeddings' output require a gradient, so the frozen
    # prefix stays in the autograd graph: the boundary's hooks change no weight's update.
    weights = {}
    for checkpointed in (False, True):
        module = tm.TinyBertClassifier(seed=0, dropout=0.0)
        if checkpointed:
            module.model.gradient_checkpointing_enable()
        freeze = FreezeCallback(**FREEZE_ONE_PER_EPOCH)
        tm.make_trainer([freeze], max_epochs=3).fit(module, tm.task_loader("bert", size=16, batch_size=4))
        assert freeze.frozen_blocks == 3
        weights[checkpointed] = {name: p.detach().clone() for name, p in module.named_parameters()}
    for name, value in weights[False].items():
        torch.testing.assert_close(weights[True][name], value, rtol=0, atol=1e-6, msg=name)


class FailsInEpoch(tm.TinySequentialRegressor):
    def training_step(self, batch, batch_idx):
        if self.current_epoch == 2:
            raise RuntimeError("the step failed")
        return super().training_step(batch, batch_idx)


def test_a_fit_that_fails_leaves_the_model_without_the_boundarys_hooks():
    module = FailsInEpoch(seed=0)
    with pytest.raises(RuntimeError, match="the step failed"):
        tm.make_trainer([FreezeCallback(**FREEZE_ONE_PER_EPOCH)], max_epochs=3).fit(
            module, tm.task_loader("sequential", size=16, batch_size=4)
        )
    modes = []
    module.model.blocks[0].register_forward_hook(lambda block, args, output: modes.append(block.training))
    module.train()
    module.model.blocks[0](torch.zeros(1, 16))
    assert modes == [True]


class PseudoLabels(tm.TinySequentialRegressor):
    """Labels from the model itself under no_grad; a step without a confident batch is skipped (None)."""

    def training_step(self, batch, batch_idx):
        x, _ = batch
        with torch.no_grad():
            targets = self(x)
        if batch_idx % 2:
            return None
        return torch.nn.functional.mse_loss(self(x), targets + 0.1)


def test_a_step_run_under_no_grad_and_skipped_is_not_taken_for_reentrant_checkpointing():
    freeze = FreezeCallback(**FREEZE_ONE_PER_EPOCH)
    tm.make_trainer([freeze], max_epochs=3).fit(
        PseudoLabels(seed=0), tm.task_loader("sequential", size=16, batch_size=4)
    )
    assert freeze.frozen_blocks == 3


@pytest.mark.parametrize("backward_ran", [True, False])
def test_a_stage_whose_blocks_all_ran_in_reentrant_segments_without_gradient_is_refused(backward_ran):
    # A pipeline stage between the frozen first stage and the head: what it receives needs no
    # gradient, so its reentrant segments give its blocks none, and no weight of the stage gets one.
    module = tm.TinySequentialRegressor(seed=0, dropout=0.0)
    split = find_blocks(module)
    for param in [*split.pre_parameters(), *split.block_parameters(0)]:
        param.requires_grad_(False)
    boundary = FreezeBoundary()
    boundary.install(split, 1)
    boundary.in_training_step = True  # as FreezeCallback sets it around a training batch
    hidden = torch.randn(4, 16)
    for index in (1, 2):
        hidden = checkpoint(split.blocks[index], hidden, use_reentrant=True)
    if backward_ran:
        with pytest.raises(RuntimeError, match="block 1, the first block still training, got no gradient"):
            boundary.check(split, backward_ran=True, runs_here=True)
    else:  # a step skipped before its backward (training_step returned None) proves nothing
        boundary.check(split, backward_ran=False, runs_here=True)
    boundary.remove()


class ReentrantHFViT(tm.TinyViTClassifier):
    """HF's ViT with its own reentrant checkpointing: GradientCheckpointingLayer checkpoints each
    block's forward inside the block's call, and pixel inputs get no enable_input_require_grads."""

    def __init__(self):
        super().__init__(seed=0, dropout=0.0)
        self.model = tm.tiny_hf_vit(seed=0, dropout=0.0)
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})

    def forward(self, images):
        return self.model(pixel_values=images).logits


class ReentrantInEvalMode(CheckpointedBlocks):
    """Reentrant segments, with the whole model put in eval mode in each step (no dropout)."""

    def training_step(self, batch, batch_idx):
        self.eval()
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("case", ["hf_vit", "eval_mode"])
def test_reentrant_checkpointing_is_refused_wherever_it_wraps_the_block(case):
    if case == "hf_vit":
        module, loader = ReentrantHFViT(), tm.make_loader(tm.RandomImageDataset(size=16), batch_size=4)
    else:
        module, loader = ReentrantInEvalMode(use_reentrant=True), tm.task_loader("sequential", size=16, batch_size=4)
    trainer = tm.make_trainer([FreezeCallback(**FREEZE_ONE_PER_EPOCH)], max_epochs=3)
    with pytest.raises(RuntimeError, match="got no gradient: it ran in a reentrant activation checkpoint"):
        trainer.fit(module, loader)
    assert trainer.current_epoch == 1


class SkipsItself(torch.nn.Module):
    """A block that decides inside its call to skip itself (LayerDrop), handing its input back."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return x if self.training and torch.rand(()) < 0.5 else self.inner(x)


class BlocksThatSkipThemselves(tm.TinySequentialRegressor):
    def __init__(self):
        super().__init__(seed=0, dropout=0.0)
        for index, block in enumerate(self.model.blocks):
            self.model.blocks[index] = SkipsItself(block)


def test_a_block_that_skips_itself_is_not_taken_for_a_checkpoint():
    torch.manual_seed(0)
    freeze = FreezeCallback(**FREEZE_ONE_PER_EPOCH)
    tm.make_trainer([freeze], max_epochs=3).fit(
        BlocksThatSkipThemselves(), tm.task_loader("sequential", size=32, batch_size=4)
    )
    assert freeze.frozen_blocks == 3


class SkipsItselfAtStep4(torch.nn.Module):
    """A block that skips itself at global step 4 only (a LayerDrop draw made deterministic)."""

    def __init__(self, inner, owner):
        super().__init__()
        self.inner, self._owner = inner, [owner]  # in a list: not a submodule

    def forward(self, x):
        return x if self.training and self._owner[0].trainer.global_step == 4 else self.inner(x)


class CheckpointedBlocksSkippingAtStep4(CheckpointedBlocks):
    def __init__(self):
        super().__init__(use_reentrant=True)
        for index, block in enumerate(self.model.blocks):
            self.model.blocks[index] = SkipsItselfAtStep4(block, self)


def test_reentrant_checkpointing_is_refused_at_a_later_step_where_the_block_skipped_the_first():
    # Step 4, the first after the freeze, runs without the watched block 1: the step after it is checked.
    trainer = tm.make_trainer([FreezeCallback(**FREEZE_ONE_PER_EPOCH)], max_epochs=3)
    with pytest.raises(RuntimeError, match="block 1, the first block still training, got no gradient"):
        trainer.fit(CheckpointedBlocksSkippingAtStep4(), tm.task_loader("sequential", size=16, batch_size=4))
    assert trainer.global_step == 5


class UntrainedFirstActiveBlock(CheckpointedBlocks):
    """Block 1 trains nothing (an adapter left off it); blocks 2 and 3 run in reentrant segments."""

    def __init__(self, zero_in_place: bool = False):
        super().__init__(use_reentrant=True)
        self.zero_in_place = zero_in_place
        for param in self.model.blocks[1].parameters():
            param.requires_grad_(False)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=not self.zero_in_place)


@pytest.mark.parametrize("zero_in_place", [False, True])
def test_the_first_block_that_trains_after_the_prefix_is_watched(zero_in_place):
    # Once block 0 freezes, block 2 (the first that trains) gets no gradient from its segment;
    # with gradients zeroed in place they stay zero tensors instead of None.
    trainer = tm.make_trainer([FreezeCallback(**FREEZE_ONE_PER_EPOCH)], max_epochs=3)
    with pytest.raises(RuntimeError, match="block 2, the first block still training, got no gradient"):
        trainer.fit(UntrainedFirstActiveBlock(zero_in_place), tm.task_loader("sequential", size=16, batch_size=4))
    assert trainer.current_epoch == 1
