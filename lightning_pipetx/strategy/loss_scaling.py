"""Loss scaling (``precision="16-mixed"``) across pipeline stages.

The last stage multiplies its loss by the scale before the schedule's backward, so every
stage's gradients carry the same scale. Each rank unscales its own gradients, and whether
any gradient overflowed is agreed by all ranks, so every rank skips (or takes) the same
optimizer steps and the scale evolves identically everywhere.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class AgreedGradScaler(torch.amp.GradScaler):
    """A ``GradScaler`` whose inf/NaN check is agreed by every rank of the world."""

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler, device: torch.device) -> AgreedGradScaler:
        """A scaler with ``scaler``'s settings and state, initialised on ``device``."""
        agreed = cls(device.type)
        agreed.load_state_dict(scaler.state_dict())
        agreed.scale(torch.zeros((), device=device))  # every rank holds a scale, not only the loss's stage
        return agreed

    def unscale_(self, optimizer: Any) -> None:
        super().unscale_(optimizer)
        state = self._per_optimizer_states[id(optimizer)]
        found = list(state["found_inf_per_device"].values())
        # A rank without gradients (a stage of frozen blocks) still takes part, finding none.
        total = torch.stack([f.float() for f in found]).sum() if found else torch.zeros((), device=self._scale.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
        state["found_inf_per_device"] = {total.device: total}
