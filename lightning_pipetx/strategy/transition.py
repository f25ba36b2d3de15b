"""Move blocks (weights, buffers) and their optimizer state to the ranks of a new layout.

Every replica holds identical copies of its stage's blocks and their optimizer state (the
gradients were all-reduced before every step), so a rank that needs a block it does not
hold can take it from any old holder. Transfers are point-to-point, in one global order
that every rank derives from the two plans: first a small description of each block's
optimizer state (blocking, in that order, so no rank waits on another out of turn), then
every tensor of every transfer in one batch (:func:`torch.distributed.batch_isend_irecv`),
received straight into the parameters' storage.
Blocks a rank no longer runs are released, with their optimizer state. A block's buffers
(BatchNorm statistics, for example) travel with its weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_pipetx.strategy.autopipe import Plan
from lightning_pipetx.strategy.p2p import waiting_on
from lightning_pipetx.strategy.param_store import ParamStore, collective_device

MOVING = "blocks and their optimizer state moving to the new layout"


def _stage_of(plan: Plan) -> dict[int, int]:
    return {i: stage for stage, (start, end) in enumerate(plan.bounds) for i in range(start, end)}


def transfers(old: Plan, new: Plan, num_blocks: int) -> list[tuple[int, int, int]]:
    """``(block, src, dst)`` for every block a rank of ``new`` runs but did not hold in ``old``."""
    old_stage, new_stage = _stage_of(old), _stage_of(new)
    moves = []
    for block in range(num_blocks):
        holders = old.layout.stage_ranks(old_stage[block])
        for dst in new.layout.stage_ranks(new_stage[block]):
            if dst not in holders:
                moves.append((block, holders[dst % len(holders)], dst))
    return moves


def _state_meta(state: dict[str, Any] | None, param: nn.Parameter) -> dict[str, tuple] | None:
    if state is None:
        return None
    meta = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            meta[key] = ("tensor", tuple(value.shape), value.dtype, value.device == param.device)
        else:
            meta[key] = ("value", value)
    return meta


class BlockMover:
    """Moves whole blocks (weights with their optimizer state, then buffers) in two rounds: a
    description of each block's optimizer state, point to point in the transfers' order, then
    every tensor of every transfer posted at once (:meth:`transfer`), so that messages in both
    directions and to several peers are in flight together."""

    def __init__(self, blocks: nn.Module, optimizers: list[Optimizer], store: ParamStore, device: torch.device):
        self.blocks = blocks
        self.store = store
        self.device = device
        self._owner = {id(p): opt for opt in optimizers for group in opt.param_groups for p in group["params"]}
        self._ops: list[dist.P2POp] = []
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, staging) after a receive
        self.bytes_received = 0

    def _optimizer(self, param: nn.Parameter) -> Optimizer | None:
        return self._owner.get(id(param))

    def send(self, block: int, dst: int) -> None:
        """Describe ``block`` to ``dst`` now; its tensors go in :meth:`transfer`."""
        params = list(self.blocks[block].parameters())
        states = [self._optimizer(p).state.get(p) if self._optimizer(p) else None for p in params]
        with waiting_on(dst, MOVING):
            dist.send_object_list([[_state_meta(s, p) for s, p in zip(states, params)]], dst=dst, device=self.device)
        for param, state in zip(params, states):
            self._send(param.data, dst)
            for value in (state or {}).values():
                if isinstance(value, torch.Tensor):
                    self._send(value, dst)
        for buffer in self.blocks[block].buffers():
            self._send(buffer, dst)

    def recv(self, block: int, src: int) -> None:
        """Take ``block``'s description from ``src`` and give its weights, optimizer state and
        buffers storage to be filled by :meth:`transfer`."""
        params = list(self.blocks[block].parameters())
        message: list[Any] = [None]
        with waiting_on(src, MOVING):
            dist.recv_object_list(message, src=src, device=self.device)
        for param, meta in zip(params, message[0]):
            self.store.materialize(param)
            self._recv(param.data, src)
            optimizer = self._optimizer(param)
            if meta is None or optimizer is None:
                continue
            state = {}
            for key, spec in meta.items():
                if spec[0] == "value":
                    state[key] = spec[1]
                    continue
                _, shape, dtype, on_param_device = spec
                device = param.device if on_param_device else torch.device("cpu")
                state[key] = self._recv(torch.empty(shape, dtype=dtype, device=device), src)
            optimizer.state[param] = state
        for buffer in self.blocks[block].buffers():
            self._recv(buffer, src)

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        self._ops.append(dist.P2POp(dist.isend, tensor.to(self.device).contiguous(), dst))

    def _recv(self, target: torch.Tensor, src: int) -> torch.Tensor:
        self.bytes_received += target.numel() * target.element_size()
        if target.device == self.device and target.is_contiguous():
            self._ops.append(dist.P2POp(dist.irecv, target, src))
        else:  # a CPU scalar of the optimizer state under NCCL, for example
            staging = torch.empty(target.shape, dtype=target.dtype, device=self.device)
            self._ops.append(dist.P2POp(dist.irecv, staging, src))
            self._copies.append((target, staging))
        return target

    def transfer(self) -> None:
        """Post every send and receive described so far together, and wait for them."""
        if self._ops:
            peers = [op.peer for op in self._ops]
            for work in dist.batch_isend_irecv(self._ops):
                with waiting_on(peers, MOVING):
                    work.wait()
        for target, staging in self._copies:
            target.copy_(staging)
        self._ops, self._copies = [], []


def broadcast_shared(
    params: list[nn.Parameter],
    owners: dict[int, int],
    optimizers: list[Optimizer],
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Give every rank the up-to-date copy of the shared parameters that only some ranks
    update (``owners``: parameter id -> the global rank to copy from), with their optimizer
    state. A collective over ``group`` (the world's by default; through the host for a gloo
    group); every rank passes the same ``params`` and ``owners``."""
    device = collective_device(device, group)
    optimizer_of = {id(p): opt for opt in optimizers for param_group in opt.param_groups for p in param_group["params"]}
    rank = dist.get_rank()
    for param in params:
        src = owners.get(id(param))
        if src is None:
            continue
        optimizer = optimizer_of.get(id(param))
        state = optimizer.state.get(param) if optimizer is not None and rank == src else None
        message: list[Any] = [_state_meta(state, param) if rank == src else None]
        dist.broadcast_object_list(message, src=src, group=group, device=device)
        value = param.data.to(device)
        dist.broadcast(value, src=src, group=group)
        if rank != src:
            param.data.copy_(value)
        meta = message[0]
        if meta is None or optimizer is None:
            continue
        received = {}
        for key, spec in meta.items():
            if spec[0] == "value":
                received[key] = spec[1]
                continue
            _, shape, dtype, on_param_device = spec
            tensor = state[key].to(device) if rank == src else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, src=src, group=group)
            received[key] = tensor.to(param.device if on_param_device else torch.device("cpu"))
        if rank != src:
            optimizer.state[param] = received


def drop_optimizer_state(blocks: nn.Module, optimizers: list[Optimizer], keep: range) -> None:
    """Forget the optimizer state of every block outside ``keep``."""
    for index, block in enumerate(blocks):
        if index not in keep:
            for param in block.parameters():
                for optimizer in optimizers:
                    optimizer.state.pop(param, None)


def move_blocks(
    blocks: nn.Module,
    optimizers: list[Optimizer],
    store: ParamStore,
    old: Plan,
    new: Plan,
    rank: int,
    device: torch.device,
) -> tuple[int, int]:
    """Give this rank the blocks of its stage in ``new``; release the rest.

    Returns the blocks and the bytes (weights, optimizer state, buffers) this rank received."""
    mover = BlockMover(blocks, optimizers, store, device)
    received = 0
    for block, src, dst in transfers(old, new, len(blocks)):
        if rank == src:
            mover.send(block, dst)
        elif rank == dst:
            mover.recv(block, src)
            received += 1
    mover.transfer()
    start, end = new.bounds[new.layout.coords(rank)[1]]
    keep = range(start, end)
    store.release(keep)
    drop_optimizer_state(blocks, optimizers, keep)
    return received, mover.bytes_received
