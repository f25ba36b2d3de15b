"""Hooks that hold a frozen prefix in place while training steps run.

:class:`FreezeBoundary` is installed by :class:`~lightning_pipetx.FreezeCallback` at each
freeze and removed at the end of fit (or when it stops on an error):

* a prefix module called in training mode (a ``training_step`` that calls ``model.train()``)
  goes back to eval mode before it runs;
* a step whose first active block ran hidden from autograd in a training step and got no
  gradient from the step's backward is refused. Reentrant activation checkpointing (torch's
  ``checkpoint`` with ``use_reentrant=True``) gives a segment no gradient once its input stops
  requiring one, which freezing the blocks before it causes, and the blocks would silently stop
  training. Seen from inside the segment (the block run by ``CheckpointFunction.forward``) or
  from outside it (a block whose ``forward`` a wrapper checkpoints, as Hugging Face's
  ``GradientCheckpointingLayer`` and torch's ``checkpoint_wrapper`` do: autograd on, trainable
  weights, and an output that needs no gradient).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointFunction

from lightning_pipetx.blocks import BlockSplit

_REENTRANT_FORWARD = CheckpointFunction.forward.__code__  # torch.utils.checkpoint's reentrant segment
_FRAMES_SEARCHED = 12


def _keep_eval(module: nn.Module, args: tuple) -> None:
    if module.training:
        module.eval()


def _in_reentrant_checkpoint() -> bool:
    frame = sys._getframe(2)
    for _ in range(_FRAMES_SEARCHED):
        if frame is None:
            return False
        if frame.f_code is _REENTRANT_FORWARD:
            return True
        frame = frame.f_back
    return False


class FreezeBoundary:
    """The hooks for one frozen prefix of ``split`` (see the module's docstring)."""

    def __init__(self) -> None:
        self.first_active: int | None = None
        self.in_training_step = False  # set by FreezeCallback around each training batch
        self._in_checkpoint = False  # the first active block ran inside a reentrant checkpoint's forward
        self._with_grad = False  # ... and with autograd on (a reentrant segment's recompute in the backward)
        self._hidden = False  # ... or returned, with autograd on, an output that needs no gradient
        self._handles: list[Any] = []

    def install(self, split: BlockSplit, frozen_blocks: int) -> None:
        """Hold the prefix of ``frozen_blocks`` blocks (after their weights stopped training)."""
        self.remove()
        if frozen_blocks <= 0 or frozen_blocks >= split.num_blocks:
            return
        for module in split.prefix_modules(frozen_blocks):
            self._handles.append(module.register_forward_pre_hook(_keep_eval))
        block = split.blocks[frozen_blocks]
        self._handles.append(block.register_forward_pre_hook(self._enter_first_active))
        self._handles.append(block.register_forward_hook(self._leave_first_active))
        self.first_active = frozen_blocks

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.first_active, self._in_checkpoint, self._with_grad, self._hidden = None, False, False, False

    def _enter_first_active(self, block: nn.Module, args: tuple) -> None:
        if not self.in_training_step:
            return
        if torch.is_grad_enabled():
            self._with_grad = True
        elif _in_reentrant_checkpoint():
            self._in_checkpoint = True

    def _leave_first_active(self, block: nn.Module, args: tuple, output: Any) -> None:
        if not (self.in_training_step and torch.is_grad_enabled()):
            return
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        trains = any(p.requires_grad for p in block.parameters())
        if trains and tensors and not any(t.requires_grad for t in tensors):
            self._hidden = True

    def check(self, split: BlockSplit, backward_ran: bool, runs_here: bool) -> None:
        """Before the optimizer steps (``backward_ran``: the step ran its backward, not skipped by a
        ``training_step`` returning None; ``runs_here``: this rank holds the first active block's
        weights): refuse a step whose first active block ran inside a reentrant checkpoint, never
        with autograd, and got no gradient."""
        suspect = ((self._in_checkpoint and not self._with_grad) or self._hidden) and backward_ran
        self._in_checkpoint = self._with_grad = self._hidden = False
        if not suspect or self.first_active is None or not runs_here:
            return
        block = [p for p in split.blocks[self.first_active].parameters() if p.requires_grad]
        if block and all(p.grad is None for p in block):
            raise RuntimeError(
                f"FreezeCallback: block {self.first_active}, the first block still training, got no gradient: it ran "
                f"hidden from autograd, as in a reentrant activation checkpoint (torch.utils.checkpoint with "
                f"use_reentrant=True, its default when use_reentrant is not passed), which gives a block no "
                f"gradient once its input no longer requires one, as after the blocks before it froze. Pass "
                f"use_reentrant=False (Hugging Face: gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                f"{{'use_reentrant': False}})), or make the blocks' input require a gradient (Hugging Face: "
                f"model.enable_input_require_grads())."
            )
