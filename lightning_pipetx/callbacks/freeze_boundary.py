"""Hooks that hold a frozen prefix in place while training steps run.

:class:`FreezeBoundary` is installed by :class:`~lightning_pipetx.FreezeCallback` at each
freeze and removed at the end of fit (or when it stops on an error):

* a prefix module called in training mode (a ``training_step`` that calls ``model.train()``)
  goes back to eval mode before it runs;
* a step whose first active block ran inside a reentrant activation checkpoint (torch's
  ``checkpoint`` with ``use_reentrant=True``) and got no gradient from the step's backward is
  refused: such a segment gets no gradient once its input stops requiring one, which freezing
  the blocks before it causes, and the blocks would silently stop training.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
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
        self._in_checkpoint = False  # the first active block ran inside a reentrant checkpoint's forward
        self._with_grad = False  # ... and with autograd on (a reentrant segment's recompute in the backward)
        self._handles: list[Any] = []

    def install(self, split: BlockSplit, frozen_blocks: int) -> None:
        """Hold the prefix of ``frozen_blocks`` blocks (after their weights stopped training)."""
        self.remove()
        if frozen_blocks <= 0 or frozen_blocks >= split.num_blocks:
            return
        for module in split.prefix_modules(frozen_blocks):
            self._handles.append(module.register_forward_pre_hook(_keep_eval))
        self._handles.append(split.blocks[frozen_blocks].register_forward_pre_hook(self._enter_first_active))
        self.first_active = frozen_blocks

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.first_active, self._in_checkpoint, self._with_grad = None, False, False

    def _enter_first_active(self, block: nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled():
            self._with_grad = True
        elif block.training and _in_reentrant_checkpoint():
            self._in_checkpoint = True

    def check(self, split: BlockSplit, backward_ran: bool, runs_here: bool) -> None:
        """Before the optimizer steps (``backward_ran``: the step ran its backward, not skipped by a
        ``training_step`` returning None; ``runs_here``: this rank holds the first active block's
        weights): refuse a step whose first active block ran inside a reentrant checkpoint, never
        with autograd, and got no gradient."""
        suspect = self._in_checkpoint and not self._with_grad and backward_ran
        self._in_checkpoint = self._with_grad = False
        if not suspect or self.first_active is None or not runs_here:
            return
        block = [p for p in split.blocks[self.first_active].parameters() if p.requires_grad]
        if block and all(p.grad is None for p in block):
            raise RuntimeError(
                f"FreezeCallback: block {self.first_active}, the first block still training, got no gradient: it ran "
                f"in a reentrant activation checkpoint (torch.utils.checkpoint with use_reentrant=True, its "
                f"default when use_reentrant is not passed), which gives a block no gradient once its input no "
                f"longer requires one, as after the blocks before it froze. Pass use_reentrant=False to "
                f"checkpoint (torch's recommendation), or make the blocks' input require a gradient (Hugging "
                f"Face: model.enable_input_require_grads())."
            )
