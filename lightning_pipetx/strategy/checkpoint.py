"""Consolidated checkpoints: what a single-device run would have written, gathered on rank 0.

Model weights come from :func:`~lightning_pipetx.strategy.param_store.gather_block_state`;
the optimizer state of each block comes from replica 0's owner of its stage, keyed by the
parameter's position in the optimizer, exactly as ``optimizer.state_dict()`` of one process
numbers it. Files are written to a temporary name and renamed, so a crash while writing
leaves the previous checkpoint whole.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
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
from lightning_pipetx.strategy.model_checks import UnsupportedRecipeError
from lightning_pipetx.strategy.param_store import ParamStore, collective_device


def _param_indices(optimizer: Optimizer) -> dict[int, int]:
    """Position of each parameter in ``optimizer.state_dict()``'s numbering."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {id(p): index for index, p in enumerate(params)}


def gather_optimizer_state(
    optimizer: Optimizer,
    blocks: nn.Module,
    plan: Plan,
    rank: int,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every block's state, on global rank 0 (``{}`` elsewhere),
    over ``group`` (the world's by default; a gloo group sends through the host)."""
    device = collective_device(device, group)
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
            dist.send_object_list([entries], dst=0, group=group, device=device)
        else:
            message: list[Any] = [None]
            dist.recv_object_list(message, src=owner, group=group, device=device)
            state["state"].update(message[0])
    if rank != 0:
        return {}
    state["state"] = dict(sorted(state["state"].items()))
    return state


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if hasattr(value, "detach") else value


def atomic_save(
    checkpoint_io: CheckpointIO, checkpoint: dict[str, Any], filepath: str, storage_options: Any | None = None
) -> None:
    """Write through ``checkpoint_io`` to a temporary file, then rename it into place: for
    Lightning's ``TorchCheckpointIO`` writing to a local file (a path or ``file://``), which
    writes exactly where it is told. Other stores and IOs (subclasses too; Lightning's
    ``AsyncCheckpointIO`` writes after it returns) write to ``filepath`` themselves.
    ``storage_options`` go to the IO, as under DDP (``TorchCheckpointIO`` refuses them)."""
    path = os.fspath(filepath)
    if isinstance(checkpoint_io, AsyncCheckpointIO):  # its thread writes later: copy what training changes meanwhile
        checkpoint = apply_to_collection(checkpoint, torch.Tensor, lambda t: t.detach().clone())
    if type(checkpoint_io) is not TorchCheckpointIO or fsspec.utils.get_protocol(path) != "file":
        checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
        return
    path = fsspec.core.strip_protocol(path) if "://" in path else path
    partial = f"{path}.partial"
    try:
        checkpoint_io.save_checkpoint(checkpoint, partial, storage_options=storage_options)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def refuse_other_plan(saved: Mapping[str, Any] | None, plan: Plan, frozen: int) -> None:
    """A checkpoint loaded into a running fit must be of the running plan: the ranks hold its stages."""
    running = {"layout": str(plan.layout), "bounds": [list(b) for b in plan.bounds], "frozen_blocks": frozen}
    if saved is not None:
        saved = {key: saved.get(key) for key in running}
        saved["bounds"] = [list(b) for b in saved["bounds"] or ()]
    if saved != running:
        raise UnsupportedRecipeError(
            f"a checkpoint loaded into the running fit (as Lightning's learning-rate finder loads the one it saved "
            f"before its trial steps) must be of the running pipeline, whose blocks the ranks hold: saved {saved}, "
            f"running {running}. Load it when a fit starts instead, Trainer.fit(ckpt_path=...), which places the "
            f"blocks as the checkpoint needs."
        )


def load_held_weights(module: nn.Module, state: Mapping[str, Any], store: ParamStore, strict: bool) -> None:
    """Load ``state`` into the weights this rank holds while a run goes on: the blocks it released
    stay released (the ranks that run them load theirs from the same file)."""
    released = {name for name, param in module.named_parameters(remove_duplicate=False) if store.is_released(param)}
    missing, unexpected = module.load_state_dict({k: v for k, v in state.items() if k not in released}, strict=False)
    missing = [key for key in missing if key not in released]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}: missing keys {missing}, "
            f"unexpected keys {unexpected}"
        )


class ClosedRun:
    """What a run left for ``trainer.save_checkpoint`` after it: its last plan once the engine
    closed (every rank then holds every block), whether it was fit's (each rank then still holds
    the optimizer state of the blocks it ran), whether it stopped on an error, and whether that
    stop left this rank without some blocks (``incomplete``; a set-up that stopped before the
    engine was built leaves the model whole, and no plan)."""

    def __init__(self) -> None:
        self.plan: Plan | None = None
        self.fit = False
        self.failed = False
        self.incomplete = False

    def plan_after_run(self, running: bool) -> Plan | None:
        """The closed run's plan, or None while an engine runs or where none was built."""
        if running:
            return None
        if self.incomplete:
            raise RuntimeError(
                "trainer.save_checkpoint after a run that stopped on an error not every rank stopped with: the "
                "ranks could not give each other back the blocks they did not run, so the model is incomplete "
                "(see the error logged at teardown). Load the last checkpoint instead."
            )
        return self.plan

    def check_optimizer_state_without_plan(self, world_size: int) -> None:
        """Refuse optimizer state after a set-up that stopped on an error on several processes (no
        engine, so no plan): its optimizers may still be an earlier fit's, each rank holding the state
        of its own blocks only. The weights are whole."""
        if self.failed and world_size > 1:
            raise RuntimeError(
                "trainer.save_checkpoint after a set-up that stopped on an error under ElasticPipelineStrategy on "
                "several processes: the optimizers may still be the last fit's, each rank holding the state of its "
                "own blocks only. Pass weights_only=True (the weights are whole)."
            )

    def check_optimizer_state(self, fitting: bool) -> None:
        """Refuse to save optimizer state that no rank holds whole: after validate, test, predict or a failed fit."""
        if not (fitting or self.fit):
            after = "a fit that stopped on an error" if self.failed else "trainer.validate, test or predict"
            raise RuntimeError(
                f"trainer.save_checkpoint after {after} under ElasticPipelineStrategy: each rank now holds the "
                f"optimizer state of its own blocks only. Save right after fit, or pass weights_only=True."
            )
