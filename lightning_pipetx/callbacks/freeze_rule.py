"""The freeze rule of PipeTransformer (ICML 2021, section 3.1), as pure functions.

``F_T = min(F_{T-1} + alpha * (L - F_{T-1}), argmin_{l active} ||g_l(T)||)``

* The alpha term bounds how fast freezing progresses; it is rounded up, so each decision
  may freeze at least one more block.
* The gradient-norm term stops freezing at the active block whose accumulated gradient norm
  is smallest: that block and all blocks before it are frozen. A block whose norm is 0 (it has
  no trainable weight, or no gradient reached it) measured nothing and is left out; where no
  active block measured anything, the term does not bind.
* ``min_active_blocks`` caps the result at ``L - min_active_blocks``; the rule never unfreezes.

``signal="schedule"`` uses the closed form of the alpha term alone,
``F(T) = ceil(L * (1 - (1 - alpha) ** T))`` after ``T`` decisions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

_EPS = 1e-9


@dataclass(frozen=True)
class FreezeDecision:
    """The outcome of one decision: how many leading blocks are frozen, and why."""

    previous: int
    frozen: int
    reason: str

    @property
    def changed(self) -> bool:
        return self.frozen != self.previous


def _ceil(x: float) -> int:
    return math.ceil(x - _EPS)


def alpha_bound(frozen: int, num_blocks: int, alpha: float) -> int:
    """The progression bound ``F + ceil(alpha * (L - F))``."""
    return frozen + _ceil(alpha * (num_blocks - frozen))


def schedule_frozen(decisions: int, num_blocks: int, alpha: float) -> int:
    """The closed form ``ceil(L * (1 - (1 - alpha) ** decisions))``."""
    return _ceil(num_blocks * (1.0 - (1.0 - alpha) ** decisions))


def decide(
    previous: int,
    num_blocks: int,
    alpha: float,
    min_active_blocks: int,
    grad_norms: Sequence[float] | None = None,
    decisions: int | None = None,
) -> FreezeDecision:
    """Compute the next frozen-prefix length.

    Args:
        previous: blocks frozen so far (``F_{T-1}``).
        num_blocks: ``L``.
        alpha: the progression bound, in (0, 1].
        min_active_blocks: never freeze more than ``L - min_active_blocks`` blocks.
        grad_norms: accumulated gradient norm per block (length ``L``; 0 where a block measured
            nothing); the gradient term is used when given, the closed-form schedule otherwise.
        decisions: number of decisions including this one; required for the schedule form.
    """
    cap = num_blocks - min_active_blocks
    if previous >= cap:
        return FreezeDecision(previous, previous, f"cap reached (min_active_blocks={min_active_blocks})")

    if grad_norms is None:
        if decisions is None:
            raise ValueError("the schedule form needs the number of decisions")
        target = max(previous, schedule_frozen(decisions, num_blocks, alpha))
        terms = {"schedule": target}
    else:
        if len(grad_norms) != num_blocks:
            raise ValueError(f"expected {num_blocks} gradient norms, got {len(grad_norms)}")
        terms = {"alpha": alpha_bound(previous, num_blocks, alpha)}
        measured = [i for i in range(previous, num_blocks) if grad_norms[i] > 0]
        if measured:
            smallest = min(measured, key=lambda i: grad_norms[i])
            terms[f"gradient norm (smallest at block {smallest})"] = smallest + 1
    terms[f"cap (min_active_blocks={min_active_blocks})"] = cap

    frozen = min(terms.values())
    binding = " and ".join(name for name, value in terms.items() if value == frozen)
    return FreezeDecision(previous, frozen, f"bound by {binding}")
