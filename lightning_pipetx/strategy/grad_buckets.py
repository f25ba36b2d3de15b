"""Gradient buckets: flat buffers all-reduced as one, started as soon as their gradients are in.

A bucket holds the gradients of a few parameters of one dtype that are reduced over the same
process group, back to back in one flat tensor, followed by one presence flag per parameter
(1 where this rank has a gradient). After the all-reduce a flag above zero means some rank
had a gradient: the parameter's ``.grad`` becomes its slice of the reduced buffer; otherwise
it keeps ``grad=None``, so the optimizer skips it exactly as it would in one process.

A bucket owns two buffers and synchronised steps take turns with them: the gradients handed
to the optimizer stay intact through the next step's reduction (which writes the other
buffer), and no step allocates a buffer (on CPU a fresh multi-megabyte buffer per step costs
page faults that made the step several percent slower than DDP's, which keeps its buckets).
As with DDP's ``gradient_as_bucket_view=True``, a reference kept to a ``.grad`` longer than
that sees a later step's gradient.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipetx.strategy.p2p import waiting_on

FIRST_BUCKET_BYTES = 2**20  # as DDP's first bucket


class Bucket:
    """Gradients of ``params`` (one dtype and device), reduced over ``group`` and divided by ``divisor``."""

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup | None, divisor: int) -> None:
        self.params = list(params)
        self.group = group
        self.divisor = divisor
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.params))]
        self.size = sum(self.numels)
        self.buffer: torch.Tensor | None = None
        self.work: dist.Work | None = None
        self._views: list[torch.Tensor] = []  # each parameter's slice of the buffer, shaped as the parameter
        self._buffers: list[tuple[torch.Tensor, list[torch.Tensor]]] = []  # with their views; this step's first
        self._filled: list[bool] = []
        self._present: list[bool] = []  # this rank has a gradient: its presence flag
        self._unfilled = 0

    def reset(self) -> None:
        """Take the buffer the previous synchronised step did not use (its gradients stay intact)."""
        if len(self._buffers) < 2:
            first = self.params[0]
            flat = torch.empty(self.size + len(self.params), dtype=first.dtype, device=first.device)
            views = [flat[o : o + n].view_as(p) for o, n, p in zip(self.offsets, self.numels, self.params)]
            self._buffers.insert(0, (flat, views))
        else:
            self._buffers.reverse()
        self.buffer, self._views = self._buffers[0]
        self.work = None
        self._filled = [False] * len(self.params)
        self._present = [False] * len(self.params)
        self._unfilled = len(self.params)

    @property
    def complete(self) -> bool:
        return self._unfilled == 0

    def fill(self, index: int, grad: torch.Tensor | None, earlier: torch.Tensor | None = None) -> None:
        """Put ``grad + earlier`` (either may be None), divided by ``divisor``, into parameter ``index``'s slice."""
        if self._filled[index]:
            raise RuntimeError(
                f"a parameter of shape {tuple(self.params[index].shape)} received its gradient twice in the last "
                "backward pass of a step (a weight shared between reentrant checkpointed segments?). Gradient sync "
                "under ElasticPipelineStrategy, as under DDP, needs one gradient per parameter and backward pass: "
                "use non-reentrant activation checkpointing (use_reentrant=False)."
            )
        self._filled[index] = True
        self._unfilled -= 1
        view = self._views[index]
        if grad is None:
            grad, earlier = earlier, None
        if grad is None:
            view.zero_()
            return
        self._present[index] = True
        if earlier is not None:
            torch.add(grad, earlier, out=view)
            if self.divisor != 1:
                view.div_(self.divisor)
        elif self.divisor != 1:
            torch.div(grad, self.divisor, out=view)  # one pass over the gradient
        else:
            view.copy_(grad)

    def fill_missing(self, grads: Sequence[torch.Tensor | None], earlier: Sequence[torch.Tensor | None]) -> None:
        """Fill every parameter not filled yet, from ``grads`` and ``earlier`` (aligned with ``params``)."""
        for index in range(len(self.params)):
            if not self._filled[index]:
                self.fill(index, grads[index], earlier[index])

    def launch(self) -> None:
        self.flags()
        self.work = dist.all_reduce(self.buffer, group=self.group, async_op=True)

    def flags(self) -> torch.Tensor:
        """The presence flags: this rank's until the all-reduce starts (written on the device, from no
        host data), the sum over the group after it."""
        flags = self.buffer[self.size :]
        if self.work is None:
            if all(self._present):
                flags.fill_(1)
            else:
                flags.zero_()
                for index, present in enumerate(self._present):
                    if present:
                        flags[index] = 1
        return flags

    def install(self, present: Sequence[float]) -> None:
        """Hand the reduced slices to ``.grad`` (``present``: the reduced flags, as floats)."""
        for index, param in enumerate(self.params):
            param.grad = self._views[index] if present[index] > 0 else None
        self.buffer, self.work = None, None


def wait_and_install(buckets: Iterable[Bucket]) -> None:
    """Wait for every bucket's all-reduce, then set the gradients (one host copy of all flags)."""
    buckets = [b for b in buckets if b.work is not None]
    for bucket in buckets:
        with waiting_on(_peers(bucket.group), "a gradient all-reduce"):
            bucket.work.wait()
    if not buckets:
        return
    present = torch.cat([b.flags() for b in buckets]).tolist()
    start = 0
    for bucket in buckets:
        bucket.install(present[start : start + len(bucket.params)])
        start += len(bucket.params)


def make_buckets(
    params: Sequence[nn.Parameter],
    group: dist.ProcessGroup | None,
    divisor: int,
    cap_bytes: int,
    first_cap_bytes: int = FIRST_BUCKET_BYTES,
) -> list[Bucket]:
    """Buckets over ``params``, in the order given, of at most ``cap_bytes`` (the first one of
    each dtype at most ``first_cap_bytes``, so that communication starts early, as in DDP);
    a parameter larger than the cap gets a bucket of its own.

    Parameters of different dtypes or devices go to different buckets; the order of the
    returned buckets follows the first parameter of each.
    """
    buckets: list[tuple[int, Bucket]] = []
    open_: dict[tuple, tuple[int, list[nn.Parameter], int]] = {}
    closed: set[tuple] = set()

    def close(key: tuple) -> None:
        position, members, _ = open_.pop(key)
        buckets.append((position, Bucket(members, group, divisor)))
        closed.add(key)

    for position, param in enumerate(params):
        key = (param.dtype, param.device)
        nbytes = param.numel() * param.element_size()
        cap = cap_bytes if key in closed else min(cap_bytes, first_cap_bytes)
        if key in open_ and open_[key][2] + nbytes > cap:
            close(key)
        if key not in open_:
            open_[key] = (position, [], 0)
        first, members, size = open_[key]
        members.append(param)
        open_[key] = (first, members, size + nbytes)
    for key in list(open_):
        close(key)
    return [bucket for _, bucket in sorted(buckets, key=lambda item: item[0])]


def _peers(group: dist.ProcessGroup | None) -> list[int]:
    """The other global ranks of ``group`` (None: the world)."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return [rank for rank in ranks if rank != dist.get_rank()]
