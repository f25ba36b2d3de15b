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
        self._filled: list[bool] = []
        self._buffers: list[torch.Tensor] = []  # this step's first

    def reset(self) -> None:
        """Take the buffer the previous synchronised step did not use (its gradients stay intact)."""
        if len(self._buffers) < 2:
            first = self.params[0]
            self._buffers.insert(0, torch.empty(self.size + len(self.params), dtype=first.dtype, device=first.device))
        else:
            self._buffers.reverse()
        self.buffer = self._buffers[0]
        self.buffer[self.size :].zero_()  # the presence flags; every slice is written by fill
        self.work = None
        self._filled = [False] * len(self.params)

    def is_filled(self, index: int) -> bool:
        return self._filled[index]

    @property
    def complete(self) -> bool:
        return all(self._filled)

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
        parts = [g.detach().reshape(-1) for g in (grad, earlier) if g is not None]
        start = self.offsets[index]
        view = self.buffer[start : start + self.numels[index]]
        if not parts:
            view.zero_()
            return
        if len(parts) == 2:
            torch.add(parts[0], parts[1], out=view)
            if self.divisor != 1:
                view.div_(self.divisor)
        elif self.divisor != 1:
            torch.div(parts[0], self.divisor, out=view)  # one pass over the gradient
        else:
            view.copy_(parts[0])
        self.buffer[self.size + index] = 1

    def fill_missing(self, grads: Sequence[torch.Tensor | None], earlier: Sequence[torch.Tensor | None]) -> None:
        """Fill every parameter not filled yet, from ``grads`` and ``earlier`` (aligned with ``params``)."""
        for index in range(len(self.params)):
            if not self._filled[index]:
                self.fill(index, grads[index], earlier[index])

    def launch(self) -> None:
        self.work = dist.all_reduce(self.buffer, group=self.group, async_op=True)

    def flags(self) -> torch.Tensor:
        return self.buffer[self.size :]

    def install(self, present: Sequence[float]) -> None:
        """Hand the reduced slices to ``.grad`` (``present``: the reduced flags, as floats)."""
        for index, param in enumerate(self.params):
            if present[index] > 0:
                start = self.offsets[index]
                param.grad = self.buffer[start : start + self.numels[index]].view_as(param)
            else:
                param.grad = None
        self.buffer, self.work = None, None


def wait_and_install(buckets: Iterable[Bucket]) -> None:
    """Wait for every bucket's all-reduce, then set the gradients (one host copy of all flags)."""
    buckets = [b for b in buckets if b.work is not None]
    for bucket in buckets:
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
