"""Hooks that hold a frozen prefix in place while training steps run.

:class:`FreezeBoundary` is installed by :class:`~lightning_pipetx.FreezeCallback` at each
freeze and removed at the end of fit:

* a prefix module called in training mode (a ``training_step`` that calls ``model.train()``)
  goes back to eval mode before it runs;
* the first active block's hidden state is cut from the prefix's autograd graph when only a
  hook made it require a gradient (Hugging Face's ``enable_input_require_grads``, which
  ``gradient_checkpointing_enable`` turns on for text models) and no prefix weight trains: the
  backward then stops at the boundary instead of running through every frozen block;
* a call of the first active block without autograd in a training step is noted, and
  :meth:`FreezeBoundary.check` refuses the step if the block then got no gradient: reentrant
  activation checkpointing (torch's ``checkpoint`` with ``use_reentrant=True``) gives a segment
  no gradient once its input stops requiring one, which freezing the blocks before it causes.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import torch
from torch import nn

from lightning_pipetx.blocks import BlockSplit


def _keep_eval(module: nn.Module, args: tuple) -> None:
    if module.training:
        module.eval()


def _input_grads_forced(root: nn.Module) -> bool:
    """Whether a Hugging Face model under ``root`` makes its input embeddings' output require a gradient."""
    return any(getattr(module, "_require_grads_hook", None) is not None for module in root.modules())


class FreezeBoundary:
    """The hooks for one frozen prefix of ``split`` (see the module's docstring)."""

    def __init__(self) -> None:
        self.first_active: int | None = None
        self._ran_without_grad = False
        self._cut = False
        self._first_arg: str | None = None
        self._handles: list[Any] = []

    def install(self, split: BlockSplit, frozen_blocks: int) -> None:
        """Hold the prefix of ``frozen_blocks`` blocks (after their weights stopped training)."""
        self.remove()
        if frozen_blocks <= 0 or frozen_blocks >= split.num_blocks:
            return
        for module in split.prefix_modules(frozen_blocks):
            self._handles.append(module.register_forward_pre_hook(_keep_eval))
        prefix = itertools.chain(split.pre_parameters(), split.prefix_parameters(frozen_blocks))
        self._cut = not any(p.requires_grad for p in prefix) and _input_grads_forced(split.root)
        block = split.blocks[frozen_blocks]
        self._first_arg = next(iter(inspect.signature(block.forward).parameters), None)
        self._handles.append(block.register_forward_pre_hook(self._enter_first_active, with_kwargs=True))
        self.first_active = frozen_blocks

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.first_active, self._ran_without_grad = None, False

    def _enter_first_active(self, block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not torch.is_grad_enabled():
            self._ran_without_grad = self._ran_without_grad or block.training
            return None
        if not self._cut:
            return None
        if args and _float_requiring_grad(args[0]):
            return (args[0].detach().requires_grad_(), *args[1:]), kwargs
        if not args and _float_requiring_grad(kwargs.get(self._first_arg)):
            return args, {**kwargs, self._first_arg: kwargs[self._first_arg].detach().requires_grad_()}
        return None

    def check(self, split: BlockSplit, runs_here: bool) -> None:
        """After a step's backward: refuse a step whose first active block ran without autograd
        and got no gradient (``runs_here``: this rank holds the block's weights)."""
        ran_without_grad, self._ran_without_grad = self._ran_without_grad, False
        if not ran_without_grad or self.first_active is None or not runs_here:
            return
        params = [p for p in split.blocks[self.first_active].parameters() if p.requires_grad]
        if params and all(p.grad is None for p in params):
            raise RuntimeError(
                f"FreezeCallback: block {self.first_active}, the first block still training, got no gradient: it ran "
                f"without autograd. Reentrant activation checkpointing (torch.utils.checkpoint with "
                f"use_reentrant=True, its default when use_reentrant is not passed) gives a checkpointed block no "
                f"gradient once its input no longer requires one, as after the blocks before it froze. Pass "
                f"use_reentrant=False to checkpoint (torch's recommendation), or make the blocks' input require a "
                f"gradient (Hugging Face: model.enable_input_require_grads())."
            )


def _float_requiring_grad(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad and value.is_floating_point()
