"""When AutoCache must not serve: a frozen prefix that still trains, and inputs that change.

* :func:`trainable_prefix_weights`: a weight of ``pre`` or of a frozen block that still
  requires a gradient (GPT-2's input embedding, tied to its LM head) would make a cached
  state stale and lose its gradient.
* :class:`InputGuard`: a fingerprint of every sample's input tensors, kept on the training device;
  a sample whose input changed since the last epoch that saw it (random augmentation,
  dynamic padding) is counted on the device, without a host copy, once per epoch, when the
  count is read. The cache serves nothing before one such check of the loaded batches has
  passed, so a stale state is never read for a change the loader makes to a tensor: the epoch
  that fills the cache is always compared with an earlier one. After the loader's hook built it
  again (a reload, which may have changed its dataset in place) it serves nothing until a check of
  the batches loaded since passed. A second guard watches what enters the
  frozen blocks (the output of the frozen embeddings), which a ``training_step`` that changes
  its batch before the model call (noise, masking) changes too: that is found one epoch after
  the first one served from the cache, and switches it off. (Only the hidden state is compared:
  a step that changes only the attention mask is not seen.) Checkpoints keep both guards'
  fingerprints where the run had shown them unchanged from epoch to epoch
  (:func:`agreed_fingerprints`): a resumed fit compares its first epoch with them
  (:meth:`InputGuard.restore`) instead of waiting for its second.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_pipetx.blocks import BlockSplit


class TrainablePrefixError(ValueError):
    """``cache=True`` was asked for a frozen prefix that still has a trainable weight."""


def trainable_prefix_weights(root: torch.nn.Module, split: BlockSplit, frozen_blocks: int) -> list[str]:
    """Names of the weights of ``pre`` and blocks ``[0, frozen_blocks)`` that still require a gradient."""
    if frozen_blocks <= 0:
        return []
    prefix = {id(p) for p in split.pre_parameters()}
    for i in range(frozen_blocks):
        prefix.update(id(p) for p in split.block_parameters(i))
    return [name for name, p in root.named_parameters() if id(p) in prefix and p.requires_grad]


def shown_names(names: list[str], limit: int = 3) -> str:
    """The first ``limit`` of ``names`` for a message, and how many more there are."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def trainable_prefix_reason(names: list[str]) -> str:
    """Why the cache cannot serve a prefix in which ``names`` still train."""
    shown = shown_names(names)
    return (
        f"the frozen prefix still trains {shown} (for example an input embedding tied to the output layer, as in "
        f"GPT-2): cached hidden states would go stale and the gradient through them would be lost"
    )


CHANGED_INPUT = (
    "a sample's input changed between epochs (random augmentation, dynamic padding that pads it to another "
    "length, a dataset a reload changed in place, or a collate_fn that reorders the samples of a batch, so that "
    "its rows are not in the sampler's order). Cache only deterministic, fixed-shape inputs in the sampler's "
    "order, or pass cache=False."
)

CHANGED_PREFIX_INPUT = (
    "what enters the frozen blocks changed between epochs for samples the loader yielded unchanged (the step "
    "changes its batch before the model call: noise, masking, mixing)."
)

SERVED_STALE = (
    " The last epoch may have used states cached from an earlier one for such samples; pass cache=False for an "
    "exact run."
)


class InputGuard:
    """Per-sample input fingerprints on ``device``, compared with those of earlier epochs.

    A step only records its fingerprints (two writes on the device); the comparison with the
    last earlier fingerprint of each sample is made once, when the counts are taken (at the
    start of an epoch). ``tolerance``: the relative difference that counts as a change (0: any;
    a float input computed on a GPU may differ in its last bits from run to run)."""

    def __init__(self, num_samples: int, device: torch.device, tolerance: float = 0.0) -> None:
        self.tolerance = tolerance
        self._earlier = torch.zeros(num_samples, dtype=torch.float64, device=device)
        self._earlier_seen = torch.zeros(num_samples, dtype=torch.bool, device=device)
        self._latest = torch.zeros_like(self._earlier)  # since the counts were last taken
        self._latest_seen = torch.zeros_like(self._earlier_seen)
        self.trusted = False  # one verdict found compared samples and no change
        self._verdicts_to_skip = 0  # verdicts that cannot grant trust (they compared samples loaded before a reload)
        self._from_checkpoint = torch.zeros_like(self._earlier_seen)  # earlier fingerprints a checkpoint gave

    def observe(self, indices: torch.Tensor, fingerprints: torch.Tensor) -> None:
        """Record this step's fingerprints (``indices`` on the host); no host synchronisation."""
        indices = indices.to(self._latest.device, non_blocking=True)
        self._latest[indices] = fingerprints
        self._latest_seen[indices] = True

    def differ(self, earlier: torch.Tensor, latest: torch.Tensor) -> torch.Tensor:
        """Where two fingerprints of the same samples count as a change."""
        if self.tolerance:
            return (earlier - latest).abs() > self.tolerance * (earlier.abs() + 1.0)
        return earlier != latest

    def take_counts(self) -> torch.Tensor:
        """``[compared, changed, compared with the checkpoint, changed since the checkpoint]`` since
        the last call (on the device): each sample recorded since then against its fingerprint
        from before it, counted apart where that fingerprint came from a checkpoint (:meth:`restore`)."""
        compared, changed = self._pending()
        restored, own = compared & self._from_checkpoint, compared & ~self._from_checkpoint
        counts = torch.stack([own.sum(), (own & changed).sum(), restored.sum(), (restored & changed).sum()])
        self._earlier = torch.where(self._latest_seen, self._latest, self._earlier)
        self._earlier_seen |= self._latest_seen
        self._from_checkpoint &= ~self._latest_seen
        self._latest_seen.zero_()
        return counts.to(torch.float64)

    def judge(self, compared: float, changed: float, restored: float = 0.0, restored_changed: float = 0.0) -> bool:
        """Whether an input changed, given the counts of every rank (:meth:`take_counts`); trusts
        the inputs once a check compared samples and found none changed. The first check that
        compares with a checkpointed run's fingerprints counts them for trust only where none
        changed, never as a change (that run's data may have been changed on purpose), and ends
        their use on every rank: the samples not loaded yet are compared within this run."""
        if restored > 0:
            self._earlier_seen &= ~self._from_checkpoint
            self._from_checkpoint.zero_()
            compared += restored if restored_changed == 0 else 0.0
        if self._verdicts_to_skip:
            self._verdicts_to_skip -= 1
        elif changed == 0 and compared > 0:
            self.trusted = True
        return changed > 0

    def distrust(self) -> None:
        """The loader was built again by its hook, whose dataset may now hold other inputs at the
        same positions: trust again only a check of samples loaded since. The next verdict, taken
        before any of them were loaded, reports changes but grants no trust."""
        self.trusted = False
        self._verdicts_to_skip = 1

    def known(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sample's latest fingerprint, and whether one was recorded."""
        return torch.where(self._latest_seen, self._latest, self._earlier), self._earlier_seen | self._latest_seen

    def _pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples the verdict still to come compares, and those of them that changed (masks)."""
        compared = self._earlier_seen & self._latest_seen
        return compared, compared & self.differ(self._earlier, self._latest)

    def pending_counts(self) -> torch.Tensor:
        """``[compared, changed]`` of the verdict still to come, without taking it (on the device)."""
        compared, changed = self._pending()
        return torch.stack([compared.sum(), changed.sum()]).to(torch.float64)

    def shows_stable(self, compared: float, changed: float) -> bool:
        """Whether the inputs were shown unchanged from one epoch to the next, given the pending
        counts of every rank: trusted, or about to be, with no change pending."""
        return changed == 0 and (self.trusted or (compared > 0 and not self._verdicts_to_skip))

    def restore(self, fingerprints: torch.Tensor, seen: torch.Tensor) -> None:
        """Start from the fingerprints a checkpointed run recorded (:func:`agreed_fingerprints`): the
        batches the resumed run loads first are compared with them, so its first verdict can trust
        the inputs that a fresh guard could trust only an epoch later."""
        self._earlier = fingerprints.to(self._earlier, copy=True)
        self._earlier_seen = seen.to(self._earlier_seen, copy=True)
        self._from_checkpoint = self._earlier_seen.clone()
        self._latest_seen.zero_()


def agreed_fingerprints(guard: InputGuard, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``guard``'s known fingerprints over every rank (collective), on the host: each rank saw the
    samples of its shards. Kept only where this run had shown its inputs unchanged from one epoch
    to the next (:meth:`InputGuard.shows_stable`; two ranks that recorded different fingerprints
    for a sample count as a change), so that a fit resumed from them continues that comparison of
    consecutive epochs; else none are kept (a fresh guard's start, as without a checkpoint)."""
    fingerprints, seen = guard.known()
    highest = torch.where(seen, fingerprints, torch.full_like(fingerprints, -torch.inf))
    lowest = torch.where(seen, fingerprints, torch.full_like(fingerprints, torch.inf))
    pending = guard.pending_counts()
    if world_size > 1:
        dist.all_reduce(highest, op=dist.ReduceOp.MAX)
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
        dist.all_reduce(pending)
    seen = torch.isfinite(highest)
    disagree = int((seen & guard.differ(highest, lowest)).sum())
    compared, changed = pending.tolist()
    if not guard.shows_stable(compared, changed + disagree):
        return torch.zeros_like(highest, device="cpu"), torch.zeros_like(seen, device="cpu")
    return torch.nan_to_num(highest, neginf=0.0).cpu(), seen.cpu()
