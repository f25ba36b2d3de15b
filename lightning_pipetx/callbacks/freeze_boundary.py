"""Hooks that hold a frozen prefix in place while training steps run.

:class:`FreezeBoundary` is installed by :class:`~lightning_pipetx.FreezeCallback` at each
freeze and removed at the end of fit (or when it stops on an error):

* a prefix module called in training mode (a ``training_step`` that calls ``model.train()``)
  goes back to eval mode before it runs;
* a step whose first block with trainable weights after the prefix ran inside a reentrant
  activation checkpoint (torch's ``checkpoint`` with ``use_reentrant=True``) and never with
  autograd, and got no gradient from the step's backward, is refused: such a segment gets no
  gradient once its input stops requiring one, which freezing the blocks before it causes, and
  the blocks would silently stop training. The block's modules holding weights are watched, so a
  checkpoint taken inside the block's call (Hugging Face's ``GradientCheckpointingLayer``,
  torch's ``checkpoint_wrapper``) is seen as well as one around it. The first step after each
  freeze that ran its backward decides on every rank alike (under a pipeline only the ranks
  holding the block see it, and the others must not go on to the next step's transfers); a
  later step (the block skipped itself before, or checkpointing began later) stops the ranks
  holding the block.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_pipetx.blocks import BlockSplit
from lightning_pipetx.callbacks.freeze_context import all_reduce_max
from lightning_pipetx.checkpointing import in_reentrant_checkpoint
from lightning_pipetx.strategy.installed import InstalledHook


def _keep_eval(module: nn.Module, args: tuple) -> None:
    if module.training:
        module.eval()


class FreezeBoundary:
    """The hooks for one frozen prefix of ``split`` (see the module's docstring)."""

    def __init__(self) -> None:
        self.watched: int | None = None  # the first block after the prefix with weights that train
        self.in_training_step = False  # set by FreezeCallback around each training batch
        self._in_checkpoint = False  # the watched block ran inside a reentrant checkpoint's forward
        self._with_grad = False  # ... and with autograd on (a reentrant segment's recompute in the backward)
        self._unchecked = False  # no step ran its backward since the watched block was chosen
        self._handles: list[Any] = []

    def install(self, split: BlockSplit, frozen_blocks: int) -> None:
        """Hold the prefix of ``frozen_blocks`` blocks (after their weights stopped training)."""
        self.remove()
        if frozen_blocks <= 0:
            return
        for module in split.prefix_modules(frozen_blocks):
            self._handles.append(module.register_forward_pre_hook(InstalledHook(_keep_eval)))
        trains = split.trainable_blocks(frozen_blocks)
        if not trains:
            return
        self.watched, self._unchecked = trains[0], True
        for module in split.blocks[self.watched].modules():
            if any(p.requires_grad for p in module.parameters(recurse=False)):
                self._handles.append(module.register_forward_pre_hook(InstalledHook(self._enter)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.watched, self._in_checkpoint, self._with_grad, self._unchecked = None, False, False, False

    def _enter(self, module: nn.Module, args: tuple) -> None:
        if not self.in_training_step:
            return
        if torch.is_grad_enabled():
            self._with_grad = True
        elif not self._in_checkpoint and in_reentrant_checkpoint():
            self._in_checkpoint = True

    def check(self, split: BlockSplit, backward_ran: bool, runs_here: bool) -> None:
        """Before the optimizer steps (``backward_ran``: the step ran its backward, not skipped by a
        ``training_step`` returning None; ``runs_here``: this rank holds the watched block's
        weights): refuse a step whose watched block ran inside a reentrant checkpoint, never with
        autograd, and got no gradient; in the first such step after a freeze on every rank (a
        collective), later on the ranks holding the block."""
        suspect = self._in_checkpoint and not self._with_grad and backward_ran and runs_here
        self._in_checkpoint = self._with_grad = False
        if self.watched is None or not backward_ran:
            return
        params = [p for p in split.blocks[self.watched].parameters() if p.requires_grad]
        # zeroed in place: set_to_none=False
        gradless = suspect and all(p.grad is None or not bool(p.grad.any()) for p in params)
        if self._unchecked:  # the first step after a freeze: every rank decides alike
            self._unchecked = False
            gradless = bool(all_reduce_max(torch.tensor([float(gradless)]))[0] > 0)
        if gradless:
            raise RuntimeError(
                f"FreezeCallback: block {self.watched}, the first block still training, got no gradient: it ran "
                f"in a reentrant activation checkpoint (torch.utils.checkpoint with use_reentrant=True, its "
                f"default when use_reentrant is not passed), which gives a block no gradient once its input no "
                f"longer requires one, as after the blocks before it froze. Pass use_reentrant=False (Hugging "
                f"Face: gradient_checkpointing_enable(gradient_checkpointing_kwargs={{'use_reentrant': False}})), "
                f"or make the blocks' input require a gradient (Hugging Face: model.enable_input_require_grads())."
            )
