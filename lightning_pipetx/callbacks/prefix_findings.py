"""Which weights and modules outside the block list belong to the frozen prefix, as the first
training step's trace finds them for :class:`~lightning_pipetx.FreezeCallback`."""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_pipetx.blocks import BlockSplit, block_lists_in_pre
from lightning_pipetx.callbacks.freeze_context import all_reduce_max
from lightning_pipetx.pre_trace import PreTrace

log = logging.getLogger("lightning_pipetx")


class PrefixFindings:
    """What tracing the first training step (:class:`~lightning_pipetx.pre_trace.PreTrace`)
    found, agreed by every rank and kept in checkpoints: weights registered after the blocks
    that the step read only before them (:attr:`pre_weights`: they freeze with the prefix),
    trainable weights registered before the blocks that feed none (:attr:`post_weights`: they
    train on), weightless modules registered before the blocks but called after them
    (:attr:`post_modules`: they keep their mode), and weightless modules registered after the
    blocks but called before them (:attr:`pre_modules`: they freeze with the prefix)."""

    def __init__(self) -> None:
        self.pre_weights: list[str] | None = None  # None until a step was traced
        self.post_weights: list[str] = []
        self.post_modules: list[str] = []
        self.pre_modules: list[str] = []
        self._trace: PreTrace | None = None

    def applied(self, split: BlockSplit | None) -> BlockSplit | None:
        """``split`` with the findings applied. Findings about another model (names ``split``'s
        lacks) are dropped, so that this model's first step is traced."""
        if split is None or self.pre_weights is None:
            return split
        names = {name for name, _ in split.root.named_parameters()}
        modules = {name for name, _ in split.root.named_modules()}
        if names.issuperset(self.pre_weights + self.post_weights) and modules.issuperset(
            self.post_modules + self.pre_modules
        ):
            split = split.with_pre_weights(self.pre_weights).with_post_weights(self.post_weights)
            return split.with_post_modules(self.post_modules).with_pre_modules(self.pre_modules)
        self.pre_weights, self.post_weights, self.post_modules, self.pre_modules = None, [], [], []
        return split

    def start(self, split: BlockSplit | None) -> None:
        """Trace the coming training step, unless the findings are known."""
        if split is not None and self.pre_weights is None and self._trace is None:
            self._trace = PreTrace(split)
            self._trace.start()

    def end(self, split: BlockSplit | None, trainer: pl.Trainer) -> BlockSplit | None:
        """After a traced step: agree on the findings (a collective) and apply them to ``split``."""
        if split is None or self._trace is None:
            return split
        trace, self._trace = self._trace, None
        trace.stop()
        if not bool(all_reduce_max(trace.block_called.to(torch.float64))):
            self.pre_weights, self.post_weights, self.post_modules, self.pre_modules = [], [], [], []
            rank_zero_warn(
                f"FreezeCallback: the first training step called no module of the block list {split.path!r} itself "
                f"(the model calls their members: a list of lists, as Funnel Transformer's), so the step could not "
                f"show which weights outside it run before the blocks: they freeze by where they are registered. "
                f"Pass blocks='...' naming a list whose modules the model calls to have them placed by use."
            )
            return self.applied(split)
        # A pipeline's first stage never runs the head: combine what every rank saw.
        reads = all_reduce_max(trace.reads.to(torch.float64)) if trace.names else trace.reads
        seen = torch.stack([trace.feeds_blocks, trace.pre_reads]).to(torch.float64)
        seen = all_reduce_max(seen) if trace.pre_names_registered else seen
        self.pre_weights, self.post_weights = trace.pre_names(reads), trace.post_names(seen)
        calls = all_reduce_max(trace.module_calls.to(torch.float64)) if trace.module_names else trace.module_calls
        self.post_modules, self.pre_modules = trace.post_modules(calls), trace.pre_modules(calls)
        split = self.applied(split)
        self._report(split, trainer.is_global_zero)
        return split

    def _report(self, split: BlockSplit, global_zero: bool) -> None:
        for path in block_lists_in_pre(split):
            rank_zero_warn(
                f"FreezeCallback freezes the blocks of {split.path!r}; the block list {path!r}, registered "
                f"before them, is part of their prefix and freezes whole with the first block. Pass blocks='...' to "
                f"freeze another list."
            )
        if not global_zero:
            return
        if self.pre_weights:
            log.info("pipetx: %s, read only before the blocks, freeze with them", ", ".join(self.pre_weights))
        if self.post_weights:
            log.info(
                "pipetx: %s, registered before the blocks but feeding none, train on", ", ".join(self.post_weights)
            )
        if self.post_modules:
            log.info(
                "pipetx: %s, registered before the blocks but called after them, keep their mode",
                ", ".join(self.post_modules),
            )
        if self.pre_modules:
            log.info(
                "pipetx: %s, registered after the blocks but called before them, freeze with them",
                ", ".join(self.pre_modules),
            )

    def abandon(self) -> None:
        """Stop a trace a failed step left running."""
        if self._trace is not None:
            self._trace.stop()
            self._trace = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "pre_weights": self.pre_weights,
            "post_weights": self.post_weights,
            "post_modules": self.post_modules,
            "pre_modules": self.pre_modules,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pre_weights = state_dict.get("pre_weights")
        self.post_weights = state_dict.get("post_weights") or []
        self.post_modules = state_dict.get("post_modules") or []
        self.pre_modules = state_dict.get("pre_modules") or []
