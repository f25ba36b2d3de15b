"""The freeze rule's gradient-norm term: each active block's gradient norm, measured every step.

One multi-tensor norm over the gradients of every active block (one kernel per device and
dtype on a GPU), then one ``index_add_`` that sums each block's squares: a few operators per
step however many blocks there are, and no host read.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_pipetx.blocks import BlockSplit
from lightning_pipetx.callbacks.freeze_context import all_reduce_max, all_reduce_min, widest_float


class BlockGradientNorms:
    """Writes the L2 norm of the gradients of a split's blocks ``[first, L)`` into a row."""

    def __init__(self) -> None:
        self._owners: tuple[int, ...] = ()
        self._owner_index: torch.Tensor | None = None  # on the row's device: the block of each gradient

    def measure(self, split: BlockSplit, first: int, out: torch.Tensor) -> bool:
        """Set ``out[i]`` to block ``i``'s gradient norm for ``i >= first`` (each gradient's norm
        in float32, whatever its dtype; their squares summed in ``out``'s dtype); whether any of
        those blocks had gradients."""
        grads, owners = [], []
        for index in range(first, split.num_blocks):
            for param in split.block_parameters(index):
                if param.grad is not None:
                    grads.append(param.grad.detach())
                    owners.append(index)
        if not grads:
            return False
        norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))
        out.index_add_(0, self._index_of(tuple(owners), out.device), norms.to(out).square())
        out[first:].sqrt_()
        return True

    def _index_of(self, owners: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The owners as a tensor on ``device``, copied there when the set of gradients changes."""
        index = self._owner_index
        if owners != self._owners or index is None or index.device != device:
            index = self._owner_index = torch.tensor(owners, dtype=torch.long, device=device)
            self._owners = owners
        return index


ROWS_AGREED_AT_ONCE = 1024  # at most this many steps' rows wait on the device for the ranks' agreement


class IntervalNorms:
    """The gradient-norm term's evidence since the last decision.

    One row per optimizer step, kept where the gradients live (no host read per step):
    ``[norm per block..., finite, measured]``. Every rank records every step, with or without
    gradients of its own; the ranks agree on the rows in batches, and a step counts where some
    rank measured it and none saw it overflow, as it counts in one process. :attr:`sums` and
    :attr:`steps` hold the counted steps on the host."""

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None
        self.steps = 0
        self.rows: list[torch.Tensor] = []
        self._norms = BlockGradientNorms()

    def resize(self, num_blocks: int) -> None:
        if self.sums is None or self.sums.numel() != num_blocks:
            self.sums = torch.zeros(num_blocks, dtype=torch.float64)
            self.rows = []

    def record(
        self, split: BlockSplit, first: int, device: torch.device, scale: torch.Tensor | None, finite: torch.Tensor
    ) -> None:
        """One step's row: the norms of blocks ``[first, L)`` divided by the loss ``scale`` the
        gradients still carry, and whether the rest of the step's gradients were ``finite``."""
        row = torch.zeros(split.num_blocks + 2, dtype=widest_float(device), device=device)
        norms = row[: split.num_blocks]
        if self._norms.measure(split, first, norms):
            row[-1] = 1.0  # measured
        if scale is not None:
            norms /= scale
        row[-2] = torch.isfinite(norms).all() & finite
        self.rows.append(row)
        if len(self.rows) >= ROWS_AGREED_AT_ONCE:  # on every rank at once: the same steps
            self.agree()

    def agree(self, stopped: dist.ProcessGroup | None = None) -> None:
        """Add the recorded steps that some rank measured and none saw overflow into the host totals
        (one read of the device, collectives). ``stopped``: the group of ranks that agreed the run
        stopped on an exception, where a rank interrupted in a step recorded one step fewer: the
        steps every rank recorded count, the rest are dropped."""
        width = len(self.sums) + 2
        rows = torch.stack(self.rows).cpu().double() if self.rows else torch.zeros(0, width, dtype=torch.float64)
        self.rows = []
        counts = all_reduce_max(torch.tensor([float(len(rows)), -float(len(rows))]), stopped)
        if counts[0] != -counts[1] and stopped is None:
            raise RuntimeError(
                f"FreezeCallback: the ranks measured different numbers of optimizer steps "
                f"({int(-counts[1])} to {int(counts[0])}); every rank must step its optimizer at every batch."
            )
        rows = rows[: int(-counts[1])]
        if len(rows) == 0:
            return
        # one collective: the minimum over the ranks of (finite, -measured) is (finite everywhere, -measured anywhere)
        agreed = all_reduce_min(rows[:, -2:] * torch.tensor([1.0, -1.0]), stopped)
        counted = (agreed[:, 0] > 0) & (agreed[:, 1] < 0)
        self.sums += torch.where(counted[:, None], rows[:, :-2], 0.0).sum(0)
        self.steps += int(counted.sum())

    def totals(self, stopped: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, int]:
        """The sums per block and the steps they cover, over all ranks (collectives, over ``stopped``
        where given: see :meth:`agree`): under a pipeline each rank measures the blocks it runs only."""
        self.agree(stopped)
        totals = all_reduce_max(torch.cat([self.sums, torch.tensor([float(self.steps)])]), stopped)
        return totals[:-1], int(totals[-1])

    def reset(self) -> None:
        if self.sums is not None:
            self.sums.zero_()
        self.steps = 0

    def load(self, sums: list[float] | None, steps: int) -> None:
        self.sums = None if sums is None else torch.tensor(sums, dtype=torch.float64)
        self.steps, self.rows = steps, []
