"""Where a forward runs inside torch's reentrant activation checkpoint.

``torch.utils.checkpoint(fn, ..., use_reentrant=True)`` (torch's default when ``use_reentrant``
is not passed) runs ``fn`` without autograd, and its output requires a gradient only where one of
its tensor inputs does. A segment whose input does not (a frozen prefix before it, or a pipeline
stage's output crossing to the next stage) gives the weights inside it no gradient, silently.
"""

from __future__ import annotations

import sys

from torch.utils.checkpoint import CheckpointFunction

_REENTRANT_FORWARD = CheckpointFunction.forward.__code__
_FRAMES_SEARCHED = 64


def in_reentrant_checkpoint() -> bool:
    """Whether the caller runs inside a reentrant checkpoint's forward (its first run, without
    autograd; the recompute in the backward runs from ``CheckpointFunction.backward``)."""
    frame = sys._getframe(1)
    for _ in range(_FRAMES_SEARCHED):
        if frame is None:
            return False
        if frame.f_code is _REENTRANT_FORWARD:
            return True
        frame = frame.f_back
    return False
