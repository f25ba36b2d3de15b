"""Whether anything reads what the frozen prefix's last block returns beside its hidden state.

Some blocks return a tuple: T5's pass their position bias on to the next block, which reads it;
BLOOM's, RoFormer's and Falcon's (eager attention) return their attention probabilities, and Hugging
Face's Swin stages another view of their output, which the model reads only when asked for every
block's outputs (refused or switched off, see
:class:`~lightning_pipetx.strategy.model_checks.CollectedOutputChecks`). AutoCache keeps the hidden
state only and serves the other elements as None, which is exact only where nothing reads them.

:class:`ExtraOutputReads` watches one micro-batch from the capture to the end of its forward (the
blocks after the prefix, the head, the loss) for a torch function that takes one of those elements.
Only a forward that ends on this rank can show it: on a stage whose forward goes on on a later
stage it is not known, and the cache keeps no state of such blocks there until it is (a transition
to a layout whose stage ends the forward).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten


class ExtraOutputReads(TorchFunctionMode):
    """Records whether a torch function takes one of ``extras`` between :meth:`start` and :meth:`stop`."""

    def __init__(self, extras: tuple[torch.Tensor | None, ...]) -> None:
        super().__init__()
        self._extras = [t for t in extras if t is not None]  # kept alive: their ids stay theirs
        self._ids = {id(t) for t in self._extras}
        self.read = False
        self._active = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.read and any(
            isinstance(value, torch.Tensor) and id(value) in self._ids for value in tree_flatten((args, kwargs))[0]
        ):
            self.read = True
        return func(*args, **(kwargs or {}))

    def start(self) -> None:
        self.__enter__()
        self._active = True

    def stop(self) -> None:
        if self._active:
            self._active = False
            self.__exit__(None, None, None)
