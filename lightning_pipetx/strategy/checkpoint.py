"""Consolidated checkpoints: what a single-device run would have written, gathered on rank 0.

Model weights come from :func:`~lightning_pipetx.strategy.param_store.gather_block_state`;
the optimizer state of each block comes from replica 0's owner of its stage, keyed by the
parameter's position in the optimizer, exactly as ``optimizer.state_dict()`` of one process
numbers it. Files are written to a temporary name and renamed, so a crash while writing
leaves the previous checkpoint whole.
"""

from __future__ import annotations

import os
from typing import Any

import fsspec
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.optim import Optimizer

from lightning_pipetx.strategy.autopipe import Plan


def _param_indices(optimizer: Optimizer) -> dict[int, int]:
    """Position of each parameter in ``optimizer.state_dict()``'s numbering."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {id(p): index for index, p in enumerate(params)}


def gather_optimizer_state(
    optimizer: Optimizer, blocks: nn.Module, plan: Plan, rank: int, device: torch.device
) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every block's state, on global rank 0 (``{}`` elsewhere)."""
    state = optimizer.state_dict()
    layout = plan.layout
    if layout.world_size == 1:
        return state
    indices = _param_indices(optimizer)
    for stage, (start, end) in enumerate(plan.bounds):
        owner = layout.rank(0, stage)
        if owner == 0 or rank not in (0, owner):
            continue
        if rank == owner:
            wanted = [indices[id(p)] for i in range(start, end) for p in blocks[i].parameters() if id(p) in indices]
            entries = {i: {k: _to_cpu(v) for k, v in state["state"][i].items()} for i in wanted if i in state["state"]}
            dist.send_object_list([entries], dst=0, device=device)
        else:
            message: list[Any] = [None]
            dist.recv_object_list(message, src=owner, device=device)
            state["state"].update(message[0])
    if rank != 0:
        return {}
    state["state"] = dict(sorted(state["state"].items()))
    return state


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if hasattr(value, "detach") else value


def atomic_save(checkpoint_io: CheckpointIO, checkpoint: dict[str, Any], filepath: str) -> None:
    """Write through ``checkpoint_io`` to a temporary file, then rename it into place: for
    Lightning's ``TorchCheckpointIO`` writing to a local file (a path or ``file://``), which
    writes exactly where it is told. Other stores and IOs (subclasses too; Lightning's
    ``AsyncCheckpointIO`` writes after it returns) write to ``filepath`` themselves."""
    path = os.fspath(filepath)
    if isinstance(checkpoint_io, AsyncCheckpointIO):  # its thread writes later: copy what training changes meanwhile
        checkpoint = apply_to_collection(checkpoint, torch.Tensor, lambda t: t.detach().clone())
    if type(checkpoint_io) is not TorchCheckpointIO or fsspec.utils.get_protocol(path) != "file":
        checkpoint_io.save_checkpoint(checkpoint, path)
        return
    path = fsspec.core.strip_protocol(path) if "://" in path else path
    partial = f"{path}.partial"
    try:
        checkpoint_io.save_checkpoint(checkpoint, partial)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
