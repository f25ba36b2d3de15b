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

Modules without weights (a dropout) next to the block list are placed by their calls: one of
``pre`` the step called only after the last block (the classifier's dropout XLM-R's token
classifier registers before ``self.roberta``) is not part of the prefix, and keeps its training
mode when the prefix freezes (:meth:`PreTrace.post_modules`); one called between or inside blocks
stays in it. One of ``post`` called only before block 0 (the embedding dropout Phi registers after
its layers) is part of the prefix, and stops dropping when it freezes (:meth:`PreTrace.pre_modules`).

The other way round, a trainable weight registered before the block list that no block's input
is computed from (a head assigned before the backbone, as XLM-R's classifier is, or a weight of
the LightningModule used in its loss) is not ``pre``: the trace walks the autograd graph of
every block's inputs, and counts a read inside a block that another block follows (the graph of a
stage's received input does not reach back to the stage before), and :meth:`PreTrace.post_names`
names the ``pre`` weights it never reached.

All of it rests on the blocks' own calls. A model that calls only the members of its blocks (a
list of lists, as Funnel Transformer's) leaves :attr:`PreTrace.block_called` unset, and then the
trace has no evidence at all.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from lightning_pipetx.blocks import BlockSplit

_BEFORE, _INSIDE, _AFTER, _UNPLACED = 0, 1, 2, 3
_CALL_COLUMN = {_BEFORE: 0, _INSIDE: 1, _UNPLACED: 1, _AFTER: 2}  # a call the trace cannot place is "inside"


def _graph_leaves(values: list[Any], seen: set[Any]) -> set[int]:
    """Ids of the weights the tensors among ``values`` were computed from (graph nodes in
    ``seen`` are not walked again)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    leaves = {id(t) for t in tensors if t.requires_grad and t.grad_fn is None}  # a weight passed as it is
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a weight
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(parent for parent, _ in node.next_functions)
    return leaves


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
        pre = {id(p) for p in split.pre_parameters()}
        self.pre_names_registered = [name for name, p in split.root.named_parameters() if id(p) in pre]
        self._pre_index = {id(params[name]): i for i, name in enumerate(self.pre_names_registered)}
        # per pre weight: whether a block's input was computed from it, and whether the step read it
        self.feeds_blocks = torch.zeros(len(self.pre_names_registered), dtype=torch.bool)
        self.pre_reads = torch.zeros(len(self.pre_names_registered), dtype=torch.bool)
        # modules without weights of pre, then of post: whether the step called each before the
        # blocks, between or inside them (or where the trace cannot place it), and after them
        self._pre_weightless = [name for name, module in split.pre if next(module.parameters(), None) is None]
        self._post_weightless = [name for name, module in split.post if next(module.parameters(), None) is None]
        self.module_names = self._pre_weightless + self._post_weightless
        self.module_calls = torch.zeros(len(self.module_names), 3, dtype=torch.bool)
        self.block_called = torch.zeros(1, dtype=torch.bool)  # whether the step called a block of the list
        self._block, self._last_block = -1, len(split.blocks) - 1  # the block called last, and the list's last
        self._walked: set[Any] = set()
        self._phase = _UNPLACED
        self._mode: _ReadRecorder | None = None
        self._handles: list[Any] = []

    def record(self, values: list[Any]) -> None:
        for value in values:
            if not isinstance(value, nn.Parameter):
                continue
            index = self._index.get(id(value))
            if index is not None:
                self.reads[index, min(self._phase, _AFTER)] = True
            index = self._pre_index.get(id(value))
            if index is not None:
                self.pre_reads[index] = True
                if self._phase == _INSIDE and self._block < self._last_block:
                    # read in a block that another follows: the next block's input is computed from it
                    # (there, on a later stage, the received input carries no graph back to it)
                    self.feeds_blocks[index] = True

    def _set_phase(self, phase: int) -> Any:
        def hook(*_: Any) -> None:
            self._phase = phase

        return hook

    def _record_call(self, index: int) -> Any:
        def hook(*_: Any) -> None:
            self.module_calls[index, _CALL_COLUMN[self._phase]] = True

        return hook

    def _record_block_call(self, index: int) -> Any:
        def hook(*_: Any) -> None:
            self.block_called[0] = True
            self._block = index

        return hook

    def _record_block_inputs(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        for leaf in _graph_leaves(tree_flatten((args, kwargs))[0], self._walked):
            index = self._pre_index.get(leaf)
            if index is not None:
                self.feeds_blocks[index] = True

    def start(self) -> None:
        if self._mode is not None or self._handles:
            return
        blocks = self.split.blocks
        for index, block in enumerate(blocks):
            self._handles.append(block.register_forward_pre_hook(self._record_block_call(index)))
        if self._pre_index:
            for block in blocks:
                self._handles.append(block.register_forward_pre_hook(self._record_block_inputs, with_kwargs=True))
        modules = dict(self.split.root.named_modules())
        for index, name in enumerate(self.module_names):
            self._handles.append(modules[name].register_forward_pre_hook(self._record_call(index)))
        if self.names or self.module_names:
            first_link = self.split.root.get_submodule(self.split.path.split(".")[0])
            if first_link is not blocks:
                self._handles.append(first_link.register_forward_pre_hook(self._set_phase(_BEFORE)))
            self._handles.append(blocks[0].register_forward_pre_hook(self._set_phase(_INSIDE)))
            self._handles.append(blocks[len(blocks) - 1].register_forward_hook(self._set_phase(_AFTER)))
        self._phase = _UNPLACED
        if self.names or self._pre_index:
            self._mode = _ReadRecorder(self)
            self._mode.__enter__()

    def stop(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._walked.clear()

    def pre_names(self, reads: torch.Tensor | None = None) -> list[str]:
        """Candidates read before block 0 and nowhere else, by ``reads`` (this trace's
        :attr:`reads`, or those of every rank combined by a maximum)."""
        reads = self.reads if reads is None else reads
        only_before = (reads[:, _BEFORE] > 0) & (reads[:, _INSIDE] == 0) & (reads[:, _AFTER] == 0)
        return [name for name, keep in zip(self.names, only_before.tolist()) if keep]

    def post_names(self, seen: torch.Tensor | None = None) -> list[str]:
        """Trainable ``pre`` weights the step read in a recorded op but computed no block's input
        from (a weight it did not read stays ``pre``: no evidence), by ``seen``: rows
        :attr:`feeds_blocks` and :attr:`pre_reads` (this trace's, or every rank's by a maximum)."""
        feeds, read = (self.feeds_blocks, self.pre_reads) if seen is None else (seen[0] > 0, seen[1] > 0)
        params = dict(self.split.root.named_parameters())
        return [
            name
            for name, fed, was_read in zip(self.pre_names_registered, feeds.tolist(), read.tolist())
            if was_read and not fed and params[name].requires_grad
        ]

    def post_modules(self, calls: torch.Tensor | None = None) -> list[str]:
        """Modules of ``pre`` without weights that the step called, and only after the last block,
        by ``calls``: :attr:`module_calls` (this trace's, or every rank's by a maximum)."""
        return self._called_only(2, self._pre_weightless, calls)

    def pre_modules(self, calls: torch.Tensor | None = None) -> list[str]:
        """Modules of ``post`` without weights that the step called, and only before block 0, by
        ``calls`` (as for :meth:`post_modules`)."""
        return self._called_only(0, self._post_weightless, calls)

    def _called_only(self, column: int, names: list[str], calls: torch.Tensor | None) -> list[str]:
        calls = self.module_calls if calls is None else calls > 0
        wanted = set(names)
        return [
            name
            for name, row in zip(self.module_names, calls.tolist())
            if name in wanted and row[column] and sum(row) == 1
        ]
