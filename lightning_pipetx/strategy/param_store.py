"""Which block weights a rank holds, releasing the rest and bringing them back.

A rank keeps the blocks of its stage (and everything outside the block list). The
parameters of other blocks stay in the module, so the user's optimizer and the module's
``state_dict`` keys are unchanged, but their storage is released: a released parameter is
one element expanded to its full shape, so its ``shape``, ``dim()`` and ``numel()`` stay
true (``configure_optimizers`` may group parameters by shape, and the model summary counts
them) while it holds 0 bytes per element. That element is NaN, so a released weight used by
mistake gives NaN, never a plausible number. Nothing writes through it: it has no gradient,
so the optimizer skips it, and it gets real storage again before its values are received.

Blocks come back whole (parameters and buffers, such as BatchNorm statistics) from the rank
that ran them: at the end of a run, and after an exception that every rank took part in.
Until then a ``state_dict`` of a module holding the block list (the model's, as
``save_pretrained`` or a copy of the weights asks for it) raises :class:`ReleasedWeightsError`
instead of returning NaN weights; the strategy's own checkpoints gather every block first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipetx.strategy.installed import InstalledHook
from lightning_pipetx.strategy.topology import Layout


class ReleasedWeightsError(RuntimeError):
    """A ``state_dict`` of the model was asked for on a rank that does not hold every block's weights."""


def _placeholder(param: nn.Parameter) -> torch.Tensor:
    fill = float("nan") if param.dtype.is_floating_point or param.dtype.is_complex else 0
    return torch.full((), fill, dtype=param.dtype, device=param.device).expand(param.shape)


def collective_device(device: torch.device, group: dist.ProcessGroup | None) -> torch.device:
    """Where a collective over ``group`` takes tensors of ``device``: the host for a gloo group."""
    return torch.device("cpu") if group is not None and dist.get_backend(group) == "gloo" else device


def broadcast_(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    """Broadcast ``tensor`` in place from global rank ``src``; through the host when ``group``
    is a gloo group and the tensor is on a GPU."""
    if collective_device(tensor.device, group) != tensor.device:
        staged = tensor.cpu()
        dist.broadcast(staged, src=src, group=group)
        tensor.copy_(staged)
    else:
        dist.broadcast(tensor, src=src, group=group)


def broadcast_all(tensors: Iterable[torch.Tensor], src: int, group: dist.ProcessGroup | None = None) -> None:
    for tensor in tensors:
        broadcast_(tensor, src, group)


class ParamStore:
    """Releases and restores the storage of block parameters on one rank."""

    def __init__(self, blocks: nn.Module, path: str = "the block list") -> None:
        self.blocks, self.path = blocks, path
        self._shapes: dict[int, torch.Size] = {}
        self._lent = False
        self._reading = False
        self._guard = blocks.register_state_dict_post_hook(InstalledHook(self._refuse_released))

    def close(self) -> None:
        """Stop guarding the model's ``state_dict`` (the run left it whole, or a later run has a store of its own)."""
        self._guard.remove()

    def permit_reads(self) -> None:
        """Let ``state_dict`` read the released weights as NaN until :meth:`take_back`: a checkpoint's
        hooks (``on_save_checkpoint``) on the ranks that do not write it, as under DDP."""
        self._reading = True

    def _refuse_released(self, module: nn.Module, state: Any, prefix: str, metadata: Any) -> None:
        if self._lent or self._reading:
            return
        released = self.released_blocks()
        if released:
            raise ReleasedWeightsError(
                f"state_dict() of a module holding {self.path} on a rank that does not hold blocks {released}: "
                f"under a pipeline another stage runs them, and their weights read NaN here until the run (fit, "
                f"validate, test or predict) ends, so an export (save_pretrained, torch.save of the weights, a copy "
                f"of them) would hold NaN. Save through a checkpoint (ModelCheckpoint or trainer.save_checkpoint "
                f"gather every block), or after the run (a callback's on_fit_end, or once trainer.fit returned), "
                f"when every rank holds the whole model again; or pass pipeline_length=1"
            )

    def shape(self, param: nn.Parameter) -> torch.Size:
        return self._shapes.get(id(param), param.shape)

    def is_released(self, param: nn.Parameter) -> bool:
        """Whether this rank released ``param`` (another stage's)."""
        return id(param) in self._shapes

    def has_released(self, module: nn.Module) -> bool:
        """Whether this rank released a weight of ``module``."""
        return any(self.is_released(p) for p in module.parameters())

    def released_blocks(self) -> list[int]:
        """Blocks whose weights this rank does not hold."""
        return [i for i, block in enumerate(self.blocks) if self.has_released(block)]

    def release(self, keep: range) -> None:
        """Free the storage of every block outside ``keep``."""
        for index, block in enumerate(self.blocks):
            if index in keep:
                continue
            for param in block.parameters():
                if id(param) not in self._shapes:
                    self._shapes[id(param)] = param.shape
                    param.data = _placeholder(param)

    def lend(self, state: Mapping[str, torch.Tensor], prefix: str) -> None:
        """Let the blocks this rank released read their values in ``state`` (the module's
        ``state_dict`` keys, the block list's under ``prefix``) until :meth:`take_back`: the
        hooks of a checkpoint being saved read the whole model. Their buffers take the values."""
        self._lent = True
        for index in self.released_blocks():
            for name, tensor in self.blocks[index].state_dict(keep_vars=True).items():
                value = state.get(f"{prefix}{index}.{name}")
                if value is None:
                    continue
                if isinstance(tensor, nn.Parameter) and self.is_released(tensor):
                    tensor.data = value
                else:
                    tensor.data.copy_(value)

    def take_back(self) -> None:
        """Release again the weights :meth:`lend` lent (a released weight reads NaN), and end
        :meth:`permit_reads`."""
        self._reading = False
        if not self._lent:
            return
        self._lent = False
        for param in self.blocks.parameters():
            if self.is_released(param):
                param.data = _placeholder(param)

    def materialize(self, param: nn.Parameter) -> None:
        """Give a released parameter storage again (its values are to be filled in)."""
        shape = self._shapes.pop(id(param), None)
        if shape is not None:
            param.data = torch.empty(shape, dtype=param.dtype, device=param.device)

    def restore_all(
        self, layout: Layout, bounds: list[tuple[int, int]], group: dist.ProcessGroup | None = None
    ) -> None:
        """Bring back every block, parameters and buffers, on every rank, broadcast from replica
        0's owner of each stage over ``group`` (the world by default)."""
        for stage, (start, end) in enumerate(bounds):
            owner = layout.rank(0, stage)
            for index in range(start, end):
                block = self.blocks[index]
                for param in block.parameters():
                    self.materialize(param)
                if layout.world_size > 1:
                    broadcast_all([p.data for p in block.parameters()], owner, group)
                    broadcast_all(block.buffers(), owner, group)


def gather_block_state(
    blocks: nn.Module,
    prefix: str,
    store: ParamStore,
    layout: Layout,
    bounds: list[tuple[int, int]],
    rank: int,
) -> dict[str, torch.Tensor]:
    """The state of every block, gathered on global rank 0 (an empty dict elsewhere).

    Replica 0's owner of each stage sends its blocks' tensors point-to-point to rank 0.
    """
    state: dict[str, torch.Tensor] = {}
    for stage, (start, end) in enumerate(bounds):
        owner = layout.rank(0, stage)
        if rank not in (0, owner):
            continue
        for index in range(start, end):
            for name, tensor in blocks[index].state_dict(keep_vars=True).items():
                key = f"{prefix}{index}.{name}"
                if owner == 0:
                    state[key] = tensor.detach()
                elif rank == owner:
                    dist.send(tensor.detach().contiguous(), dst=0)
                else:
                    received = torch.empty(store.shape(tensor), dtype=tensor.dtype, device=tensor.device)
                    dist.recv(received, src=owner)
                    state[key] = received
    return state
