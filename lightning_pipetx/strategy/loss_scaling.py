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

from typing import Any

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


def unscales_in_own_step(optimizer: Any) -> bool:
    """Whether ``optimizer`` unscales the gradients inside its own step (a fused AdamW): what
    torch's GradScaler and Lightning check; such an optimizer's gradients stay scaled until then."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


class OverflowAgreementError(ValueError):
    """``precision="16-mixed"`` with an optimizer whose step checks the gradients for an
    overflow by itself, under a pipeline: the stages could not agree on skipping a step."""


def refuse_unagreed_overflow(optimizers: list[torch.optim.Optimizer], scaler: Any, pipeline_length: int) -> None:
    """Refuse a loss scaler with an optimizer that unscales inside its own step (a fused AdamW,
    for example) when more than one stage holds the gradients.

    Lightning leaves such an optimizer's overflow check to ``scaler.step``, where each rank sees
    its own stage's gradients only: a stage that overflowed would skip a step the others take.
    The agreeing scaler cannot decide for it (torch's sharded scaler does not work with fused
    optimizers). Replicas hold the same reduced gradients, so ``pipeline_length=1`` is safe."""
    if scaler is None or pipeline_length <= 1:
        return
    for optimizer in optimizers:
        if unscales_in_own_step(optimizer):
            name = type(optimizer).__name__
            raise OverflowAgreementError(
                f"precision='16-mixed' with {name}(fused=True) under a {pipeline_length}-stage pipeline: the "
                f"optimizer checks the gradients for an overflow inside its own step, where each stage sees only "
                f"its own gradients, so one stage could skip a step that the others take. Create the optimizer "
                f"without fused=True, use precision='bf16-mixed', or pass "
                f"ElasticPipelineStrategy(pipeline_length=1)."
            )
