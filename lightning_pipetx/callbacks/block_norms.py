"""The freeze rule's gradient-norm term: each active block's gradient norm, measured every step.

One multi-tensor norm over the gradients of every active block (one kernel per device and
dtype on a GPU), then one ``index_add_`` that sums each block's squares: a few operators per
step however many blocks there are, and no host read.
"""

from __future__ import annotations

import torch

from lightning_pipetx.blocks import BlockSplit


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
