"""A stage's backward in two halves: the input gradient now, the weight gradients later.

The previous stage waits for the gradient of what it sent; the weight gradients of this stage
are needed only by the optimizer. :func:`backward_input` computes the input gradients alone
(the weight branches of the graph do not run) and returns the rest as :class:`WeightGradients`,
which the stage runs while its message is under way (zero-bubble pipelining's split of B
into B and W, Qi et al. 2023). The stage runner splits only a step's last backward, where the
stage would otherwise idle while the stage before it runs its own last backward: the two
halves cost more than one fused backward (on CPU, about 63 against 54 ms for a micro-batch of
``benchmarks/pipelining_peer.py``'s last stage), so splitting every backward gained nothing.

Together the halves compute the fused backward's gradients: the weight half starts from the
gradients the input half saw at the nodes where the weight branches join, and accumulates into
``.grad`` through the usual accumulators, so that post-accumulate-grad hooks (gradient sync)
and tensor hooks run as in a fused backward.

Which nodes those are comes from torch's own implementation of the split,
``torch.distributed.pipelining._backward.stage_backward_input`` (private: :data:`AVAILABLE`
says whether this torch has it; without it stages run fused backwards).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

try:
    from torch.distributed.pipelining._backward import stage_backward_input
except ImportError:  # another torch: stages keep fused backwards
    AVAILABLE = False
else:
    AVAILABLE = True


class WeightGradients:
    """The weight half of one micro-batch's backward, to :meth:`run` once."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self._groups = [g for g in groups if g.get("grads") is not None]  # a group no gradient reached adds nothing

    def run(self) -> None:
        """Accumulate the weight gradients into ``.grad``, a group of weights at a time (a group:
        the weights whose branches join the input half's graph at the same nodes)."""
        groups, self._groups = self._groups, []
        for group in groups:
            _run_group(group)


def _run_group(group: dict[str, Any]) -> None:
    roots, grads, handles = [], [], []
    for saved, node in zip(group["grads"], group["intermediates"]):
        roots += [GradientEdge(node, i) for i, g in enumerate(saved) if g is not None]
        grads += [g for g in saved if g is not None]
        if len(group["intermediates"]) > 1:  # one reached from another gets what it got before, not that twice
            handles.append(node.register_prehook(lambda _, saved=saved: saved))
    try:
        if roots:  # through the weights' own accumulators, so that their hooks run
            # Groups may share nodes (a weight used in two places): the graph goes with the last reference.
            torch.autograd.backward(roots, grads, inputs=[node.variable for node in group["params"]], retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()


def backward_input(
    roots: list[torch.Tensor],
    root_grads: list[torch.Tensor] | None,
    inputs: list[torch.Tensor],
    weights: Sequence[torch.Tensor],
) -> WeightGradients:
    """Set ``inputs[i].grad`` to the gradient of ``roots`` (the loss, or the stage's outputs
    with ``root_grads``); return what is left to compute for ``weights``."""
    # Finding the weights' accumulators views each weight: not a read of the model's, so hidden
    # from torch function modes (FreezeCallback's trace of which weights the forward reads).
    with torch._C.DisableTorchFunction():
        _, groups = stage_backward_input(roots, root_grads, inputs, iter(weights))
    return WeightGradients(groups)


def cannot_split(error: RuntimeError) -> bool:
    """Whether :func:`backward_input` failed, with no gradient accumulated and the graph kept,
    because the graph holds a part that runs only under one whole ``backward()``: a reentrant
    activation checkpoint, or a backward ``torch.compile`` compiled to donate its buffers
    (which refuses ``retain_graph``)."""
    message = str(error.__cause__ or error)
    checkpoint = "checkpoint" in message.lower() and "compatible with .grad()" in message
    return checkpoint or "donated buffers" in message
