"""What :class:`~lightning_pipetx.FreezeCallback` reads of the Trainer and its strategy, and the
collectives through which every rank takes the same decision."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from lightning_pipetx.blocks import BlockSplit
from lightning_pipetx.strategy.elastic_pipeline import ElasticPipelineStrategy
from lightning_pipetx.strategy.loss_scaling import unscales_in_own_step


def loss_scale_left_in(
    trainer: pl.Trainer, optimizer: torch.optim.Optimizer, device: torch.device
) -> torch.Tensor | None:
    """The loss scale the gradients still carry in ``on_before_optimizer_step``, on ``device``
    (no host read), or None. Lightning unscales them before the hook, except for an optimizer
    that unscales inside its own step (a fused AdamW under ``precision="16-mixed"``)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    if not unscales_in_own_step(optimizer):
        return None
    return scaler.scale(torch.ones((), device=device)).to(widest_float(device))


def widest_float(device: torch.device) -> torch.dtype:
    """float64, or float32 on Apple's MPS, which holds no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def skips_overflowed_steps(trainer: pl.Trainer) -> bool:
    """Whether a loss scaler skips the optimizer step of gradients that overflowed (``precision="16-mixed"``)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler is not None and scaler.is_enabled()


def gradients_outside_blocks_finite(optimizer: torch.optim.Optimizer, split: BlockSplit) -> torch.Tensor:
    """Whether every gradient ``optimizer`` steps outside ``split``'s blocks (embeddings, head) is
    finite, on the device (no host read)."""
    in_blocks = {id(p) for p in split.blocks.parameters()}
    grads = [
        p.grad
        for group in optimizer.param_groups
        for p in group["params"]
        if p.grad is not None and id(p) not in in_blocks
    ]
    if not grads:
        return torch.tensor(True)
    return torch.isfinite(torch.nn.utils.get_total_norm(grads, error_if_nonfinite=False))


def ran_every_batch(trainer: pl.Trainer) -> bool:
    """Whether the training epoch that ends ran all its batches: one that ``max_steps`` or a stop
    cut short is decided when a resumed run completes it, as an uninterrupted run decides it."""
    progress = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "batch_progress", None)
    if progress is None:  # a Lightning without it: decide, as before
        return True
    return progress.is_last_batch or progress.current.ready >= trainer.num_training_batches


def num_replicas(trainer: pl.Trainer) -> int:
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", 1))


def stopped_group(strategy: Any) -> dist.ProcessGroup | None:
    """The group collectives over every rank go over once ElasticPipelineStrategy's ranks agreed
    that the run stopped on an exception (the world's may be out of step then); else None, the world's."""
    return strategy.failure_group if isinstance(strategy, ElasticPipelineStrategy) else None


def _all_reduce(values: torch.Tensor, op: Any, group: dist.ProcessGroup | None) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
        buffer = values.to(device=device or values.device, dtype=torch.float64)
        dist.all_reduce(buffer, op=op, group=group)
        return buffer.to(values.device, torch.float64)
    return values.to(torch.float64)


def all_reduce_max(values: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The maximum over the ranks of what each saw (the norms of the blocks it trains, zeros
    elsewhere; the weights the first step read)."""
    return _all_reduce(values, dist.ReduceOp.MAX, group)


def all_reduce_min(values: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The minimum over the ranks (a step's "no overflow" flags: one rank's overflow is everyone's)."""
    return _all_reduce(values, dist.ReduceOp.MIN, group)


def all_reduce_mean(values: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The mean over the ranks (every stage holds its replica's logged values: the mean over
    the ranks is the mean over the replicas)."""
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    return _all_reduce(values, dist.ReduceOp.SUM, group) / world


def agreed_block_path(own: str | None, strategy: Any) -> str | None:
    """The block list to freeze: the one given to this callback or to ElasticPipelineStrategy
    (both, if given, must name the same); None: found automatically, as the strategy finds it."""
    pipelined = strategy.blocks if isinstance(strategy, ElasticPipelineStrategy) else None
    if own is not None and pipelined is not None and own != pipelined:
        raise ValueError(
            f"FreezeCallback(blocks={own!r}) and ElasticPipelineStrategy(blocks={pipelined!r}) name different "
            f"block lists: the strategy pipelines the blocks that freeze. Pass the same path to both, or to one."
        )
    return own if own is not None else pipelined


def rewrap_ddp(strategy: DDPStrategy) -> None:
    """DDP fixes its set of trainable parameters when it wraps the module: wrap again."""
    if not isinstance(strategy.model, DistributedDataParallel):
        return
    strategy.model = strategy.lightning_module
    strategy.configure_ddp()
