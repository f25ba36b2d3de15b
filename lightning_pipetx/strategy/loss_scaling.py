"""Loss scaling (``precision="16-mixed"``) with one scale and one overflow decision on every rank.

The last stage multiplies its loss by the scale before the schedule's backward, so every
stage's gradients carry the same scale. Each rank holds the gradients of its own stage only,
so a plain ``GradScaler`` would see an overflow on one stage and not on the others: that
stage would skip its step and halve its scale while the rest stepped. torch's
``ShardedGradScaler`` (written for FSDP, where each rank also holds a part of the gradients)
all-reduces the overflow flag over the world in ``unscale_`` and records one even on a rank
without any gradient, so every rank steps or skips together and the scales stay equal.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


def agreeing_scaler(scaler: torch.amp.GradScaler, device: torch.device) -> ShardedGradScaler:
    """A scaler with ``scaler``'s settings and state whose overflow checks all ranks agree on,
    with its scale already on ``device`` (ranks that never scale a loss unscale too)."""
    if not isinstance(scaler, ShardedGradScaler):
        agreeing = ShardedGradScaler(
            device.type,
            init_scale=scaler.get_scale(),
            growth_factor=scaler.get_growth_factor(),
            backoff_factor=scaler.get_backoff_factor(),
            growth_interval=scaler.get_growth_interval(),
            enabled=scaler.is_enabled(),
        )
        if scaler.is_enabled():
            agreeing.load_state_dict(scaler.state_dict())  # the growth tracker too
        scaler = agreeing
    scaler.scale(torch.zeros((), device=device))
    return scaler
