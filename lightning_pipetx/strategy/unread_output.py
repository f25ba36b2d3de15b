"""What a block a stage does not compute returns, where no one may read it.

A stage skips the blocks before its own (an earlier stage computed them, or AutoCache serves
them): each returns the hidden state the stage received, which is only the last skipped
block's output. The model's own loop hands it to the next block, skipped too, and reads
nothing; a model that reads a block's output elsewhere (sums every block's output, a skip
connection past the next block) would read the wrong tensor, and its gradient would not reach
the stage that computed it. :class:`UnreadOutput` stands for such an output: its shape, dtype
and device read as the hidden state's (it requires no gradient), any other use raises an error
naming the fix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from lightning_pipetx.strategy.model_checks import UnsupportedRecipeError

_METADATA = frozenset({"__get__", "size", "dim", "numel", "is_floating_point", "is_complex", "element_size"})


class UnreadOutput(torch.Tensor):
    """The output of block ``block``, which the stage (running from block ``first_run`` on) does not compute."""

    block: int
    first_run: int

    @staticmethod
    def of(hidden: torch.Tensor, block: int, first_run: int) -> UnreadOutput:
        unread = torch.Tensor._make_subclass(UnreadOutput, hidden.detach())
        unread.block, unread.first_run = block, first_run
        return unread

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "__name__", None) in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        unread = next(a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, UnreadOutput))
        raise UnsupportedRecipeError(
            f"the model read block {unread.block}'s output other than as block {unread.block + 1}'s input, on a "
            f"stage that does not compute it (it runs from block {unread.first_run} on: the blocks before ran on "
            f"an earlier stage, or AutoCache serves them). A model that sums the outputs of its blocks, or has a "
            f"skip connection past the next block, needs every block's output where it reads it: pass "
            f"ElasticPipelineStrategy(pipeline_length=1, cache=False)."
        )


def unread(output: Any, block: int, first_run: int) -> Any:
    """``output`` (a skipped block's: a tensor, or a tuple whose first element is the hidden state)
    with its hidden state standing for block ``block``'s output, unread. A model torch.compile traces
    is not checked (dynamo would trace the subclass's reads too): it gets ``output`` as it is."""
    if torch.compiler.is_compiling():
        return output
    if isinstance(output, torch.Tensor):
        return UnreadOutput.of(output, block, first_run)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (UnreadOutput.of(output[0], block, first_run), *output[1:])
    return output
