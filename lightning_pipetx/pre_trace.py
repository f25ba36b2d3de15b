"""Which weights registered after the block list the forward reads only before block 0.

:func:`~lightning_pipetx.blocks.find_blocks` sorts the modules around the block list by where
they are registered. Some models register a module after the blocks but call it before them:
MPNet's encoder computes its relative position bias from ``relative_attention_bias`` (declared
after ``layer``) and hands it to every block. Such a weight belongs to the frozen prefix: while
it trains, the frozen blocks' output changes and AutoCache cannot serve it.

:class:`PreTrace` watches one training step. Every call of a torch function whose output the
autograd graph records (not an optimizer's in-place update) records the candidate weights among
its arguments, with the phase of the forward it happened in: before block 0 (from the call of
the chain's first module, which the model's forward enters once per micro-batch), inside the
blocks, or after the last one. A candidate read before block 0 and in no other phase, on any
rank, is ``pre``. Reads the trace cannot place (a LightningModule's own code before the chain's
first module) count as after the blocks: a weight is never moved on doubtful evidence, it only
keeps training.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from lightning_pipetx.blocks import BlockSplit

_BEFORE, _INSIDE, _AFTER = 0, 1, 2


def candidate_names(split: BlockSplit) -> list[str]:
    """Root parameters outside ``pre`` and the block list, in registration order."""
    known = {id(p) for p in split.pre_parameters()}
    known.update(id(p) for p in split.blocks.parameters())
    return [name for name, p in split.root.named_parameters() if id(p) not in known]


class _ReadRecorder(TorchFunctionMode):
    def __init__(self, trace: PreTrace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.grad_fn is not None for t in tree_flatten(output)[0]):
            self.trace.record(tree_flatten((args, kwargs))[0])
        return output


class PreTrace:
    """Records, over the steps between :meth:`start` and :meth:`stop`, the phases in which each
    candidate weight of ``split`` is read (:attr:`reads`, one row per name of :attr:`names`)."""

    def __init__(self, split: BlockSplit) -> None:
        self.split = split
        self.names = candidate_names(split)
        params = dict(split.root.named_parameters())
        self._index = {id(params[name]): i for i, name in enumerate(self.names)}
        self.reads = torch.zeros(len(self.names), 3, dtype=torch.bool)
        self._phase = _AFTER
        self._mode: _ReadRecorder | None = None
        self._handles: list[Any] = []

    def record(self, values: list[Any]) -> None:
        for value in values:
            index = self._index.get(id(value)) if isinstance(value, nn.Parameter) else None
            if index is not None:
                self.reads[index, self._phase] = True

    def _set_phase(self, phase: int) -> Any:
        def hook(*_: Any) -> None:
            self._phase = phase

        return hook

    def start(self) -> None:
        if not self.names or self._mode is not None:
            return
        first_link = self.split.root.get_submodule(self.split.path.split(".")[0])
        blocks = self.split.blocks
        if first_link is not blocks:
            self._handles.append(first_link.register_forward_pre_hook(self._set_phase(_BEFORE)))
        self._handles.append(blocks[0].register_forward_pre_hook(self._set_phase(_INSIDE)))
        self._handles.append(blocks[len(blocks) - 1].register_forward_hook(self._set_phase(_AFTER)))
        self._phase = _AFTER
        self._mode = _ReadRecorder(self)
        self._mode.__enter__()

    def stop(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def pre_names(self, reads: torch.Tensor | None = None) -> list[str]:
        """Candidates read before block 0 and nowhere else, by ``reads`` (this trace's
        :attr:`reads`, or those of every rank combined by a maximum)."""
        reads = self.reads if reads is None else reads
        only_before = (reads[:, _BEFORE] > 0) & (reads[:, _INSIDE] == 0) & (reads[:, _AFTER] == 0)
        return [name for name, keep in zip(self.names, only_before.tolist()) if keep]
