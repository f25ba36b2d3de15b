"""Whether a stage boundary needs the elements a block returns beside its hidden state.

BLOOM's, RoFormer's and Falcon's blocks (eager attention) return their attention probabilities,
Hugging Face's Swin stages another view of their output: sent across a stage boundary they can
cost several times the hidden state's traffic, and a gradient of their size comes back. The
model's code reads them only when asked for every block's outputs (refused under a pipeline,
see :class:`~lightning_pipetx.strategy.model_checks.CollectedOutputChecks`); T5's position bias,
in contrast, is read by the next block.

The stage that receives them finds out in its first training micro-batch that brings them: its
forward runs under :class:`~lightning_pipetx.autocache.extra_outputs.ExtraOutputReads`, and the
answer (a one-element tensor) travels back with that micro-batch's gradients, in the same batch
of transfers (so the order that keeps NCCL from deadlocking is unchanged). Where nothing read
them the sending stage sends the hidden state alone from then on, and the receiver's blocks get
None in their place, as AutoCache serves them. A new layout asks again.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from lightning_pipetx.autocache.extra_outputs import ExtraOutputReads
from lightning_pipetx.strategy.p2p import Activation

log = logging.getLogger(__name__)


def _asks(act: Activation | None) -> bool:
    """Whether ``act`` carries extra elements and a gradient back (the answer's way home)."""
    return act is not None and act.extra_tensors > 0 and any(act.needs_grad)


def without_extras(act: Activation) -> Activation:
    """``act`` with its hidden state only: the other elements become None."""
    count = len(act.tensors)
    return replace(
        act, tensors=(act.tensors[0],) + (None,) * (count - 1), needs_grad=act.needs_grad[:1] + (False,) * (count - 1)
    )


class BoundaryExtras:
    """One stage's side of the question, towards the next stage (sending) and the previous one
    (receiving). Both ends count the same activations, so they agree on which micro-batch asks."""

    def __init__(self, stage: int, device: torch.device) -> None:
        self.stage = stage
        self.device = device
        self.next_reads: bool | None = None  # the next stage's answer; None: not known yet
        self._asking = False  # an activation in flight carries the question
        self._answered = False  # this stage has watched the activation that asked

    # ------------------------------------------------------------ sending
    def outgoing(self, act: Activation) -> tuple[Activation, bool]:
        """What to send of ``act``, and whether the answer comes back with its gradients."""
        if self.next_reads is False:
            return without_extras(act), False
        if self.next_reads is None and not self._asking and _asks(act):
            self._asking = True
            return act, True
        return act, False

    def answer_buffer(self) -> torch.Tensor:
        return torch.empty(1, dtype=torch.int64, device=self.device)

    def take_answer(self, answer: torch.Tensor) -> None:
        self._asking = False
        self.next_reads = bool(answer.item())
        if not self.next_reads:
            log.info(
                "pipetx: stage %d reads nothing its blocks' outputs hold beside the hidden state: stage %d sends "
                "the hidden state alone",
                self.stage + 1,
                self.stage,
            )

    # ---------------------------------------------------------- receiving
    def watch(self, incoming: Activation | None) -> ExtraOutputReads | None:
        """The watch over this stage's forward of ``incoming``, if it is the activation that asks."""
        if self._answered or not _asks(incoming):
            return None
        self._answered = True
        return ExtraOutputReads(incoming.tensors[1:])

    def answer(self, watch: ExtraOutputReads) -> torch.Tensor:
        """What to send back with the watched micro-batch's gradients."""
        return torch.tensor([int(watch.read)], dtype=torch.int64, device=self.device)
