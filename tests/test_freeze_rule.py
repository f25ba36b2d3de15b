"""The freeze rule as pure functions, against values computed by hand.

``F_T = min(F_{T-1} + ceil(alpha * (L - F_{T-1})), argmin_{l >= F_{T-1}} ||g_l|| + 1, L - min_active)``
and the closed form ``ceil(L * (1 - (1 - alpha) ** T))``.
"""

from __future__ import annotations

import pytest

from lightning_pipetx.callbacks import FreezeDecision
from lightning_pipetx.callbacks.freeze_rule import alpha_bound, decide, schedule_frozen


# ------------------------------------------------------------------------ alpha_bound
@pytest.mark.parametrize(
    ("frozen", "num_blocks", "alpha", "expected"),
    [
        # L = 12, alpha = 1/3: 0 + ceil(12/3) = 4; 4 + ceil(8/3) = 7; 7 + ceil(5/3) = 9;
        # 9 + ceil(3/3) = 10; 10 + ceil(2/3) = 11; 11 + ceil(1/3) = 12.
        (0, 12, 1 / 3, 4),
        (4, 12, 1 / 3, 7),
        (7, 12, 1 / 3, 9),
        (9, 12, 1 / 3, 10),
        (10, 12, 1 / 3, 11),
        (11, 12, 1 / 3, 12),
        # L = 4, alpha = 1/2: 0 + 2 = 2; 2 + 1 = 3; 3 + ceil(1/2) = 4.
        (0, 4, 0.5, 2),
        (2, 4, 0.5, 3),
        (3, 4, 0.5, 4),
        # alpha = 1 freezes everything; a small alpha still moves at least one block.
        (0, 24, 1.0, 24),
        (5, 24, 1.0, 24),
        (0, 24, 0.01, 1),
        (20, 24, 0.01, 21),
        (0, 10, 0.3, 3),
        (0, 10, 0.7, 7),
        (0, 30, 0.1, 3),
        # Products that are whole numbers but come out a hair above in floating point are not
        # rounded up: 0.28 * 25 = 7.000000000000001, 0.56 * 25 = 14.000000000000002.
        (0, 25, 0.28, 7),
        (0, 25, 0.56, 14),
        (3, 28, 0.28, 10),
        # Nothing left to freeze.
        (12, 12, 1 / 3, 12),
    ],
)
def test_alpha_bound(frozen, num_blocks, alpha, expected):
    assert alpha_bound(frozen, num_blocks, alpha) == expected


# --------------------------------------------------------------------- schedule_frozen
def test_schedule_frozen_l12_alpha_third():
    # ceil(12 * (1 - (2/3)^T)): 12*1/3 = 4; 12*5/9 = 6.67; 12*19/27 = 8.44; 12*65/81 = 9.63;
    # 12*211/243 = 10.42; 12*665/729 = 10.95; 12*2059/2187 = 11.30; then 11.53, 11.69, ...
    expected = [0, 4, 7, 9, 10, 11, 11, 12, 12]
    assert [schedule_frozen(t, 12, 1 / 3) for t in range(len(expected))] == expected


@pytest.mark.parametrize(
    ("decisions", "num_blocks", "alpha", "expected"),
    [
        (1, 4, 1 / 3, 2),  # 4/3 = 1.33
        (2, 4, 1 / 3, 3),  # 4 * 5/9 = 2.22
        (3, 4, 1 / 3, 3),  # 4 * 19/27 = 2.81
        (1, 4, 0.25, 1),  # exactly 1
        (2, 4, 0.25, 2),  # 4 * 7/16 = 1.75
        (3, 4, 0.25, 3),  # 4 * 37/64 = 2.31
        (1, 24, 0.5, 12),
        (2, 24, 0.5, 18),
        (3, 24, 0.5, 21),
        (1, 10, 0.1, 1),  # 10 * 0.09999999999999998: not rounded up to 2, not down to 0
        (1, 10, 0.3, 3),  # 10 * (1 - 0.7) = 3.0000000000000004 in floating point: still 3
        (1, 20, 0.3, 6),  # 6.000000000000001
        (1, 10, 1.0, 10),
        (0, 10, 0.5, 0),
    ],
)
def test_schedule_frozen(decisions, num_blocks, alpha, expected):
    assert schedule_frozen(decisions, num_blocks, alpha) == expected


def test_schedule_equals_iterated_alpha_bound_for_l12():
    # For L = 12, alpha = 1/3 the closed form and the iterated bound agree (checked by hand above).
    frozen, iterated = 0, []
    for _ in range(5):
        frozen = alpha_bound(frozen, 12, 1 / 3)
        iterated.append(frozen)
    assert iterated == [schedule_frozen(t, 12, 1 / 3) for t in range(1, 6)] == [4, 7, 9, 10, 11]


# ------------------------------------------------------------------------------ decide
def test_decide_schedule_mode_l12_alpha_third_with_cap():
    frozen, seen = 0, []
    for t in range(1, 9):
        decision = decide(frozen, 12, 1 / 3, min_active_blocks=1, decisions=t)
        assert decision.previous == frozen
        frozen = decision.frozen
        seen.append(frozen)
    # The closed form reaches 12 at T = 7; the cap L - 1 = 11 holds it at 11.
    assert seen == [4, 7, 9, 10, 11, 11, 11, 11]


def test_decide_schedule_reason():
    assert decide(0, 12, 1 / 3, 1, decisions=1).reason == "bound by schedule"
    # T = 5 gives 11, which is also the cap.
    assert decide(10, 12, 1 / 3, 1, decisions=5).reason == "bound by schedule and cap (min_active_blocks=1)"
    capped = decide(11, 12, 1 / 3, 1, decisions=6)
    assert not capped.changed and capped.reason == "cap reached (min_active_blocks=1)"


def test_decide_schedule_never_goes_back():
    # Already 6 frozen (say, from an earlier rule); the closed form at T = 1 is only 4.
    decision = decide(6, 12, 1 / 3, 1, decisions=1)
    assert decision.frozen == 6
    assert not decision.changed


def test_gradient_term_binds():
    # L = 12, F = 0, alpha = 1/3 -> alpha term 4; smallest norm at block 1 -> gradient term 2.
    norms = [5.0, 0.5, 3.0, 2.0, 1.0, 4.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0]
    decision = decide(0, 12, 1 / 3, 1, grad_norms=norms)
    assert decision == FreezeDecision(0, 2, "bound by gradient norm (smallest at block 1)")
    assert decision.changed


def test_gradient_term_ignores_frozen_blocks():
    # F = 4: blocks 0..3 are frozen; their (tiny) norms must not count. Active minimum: block 5.
    norms = [0.0, 0.0, 0.1, 0.1, 3.0, 0.2, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    decision = decide(4, 12, 1 / 3, 1, grad_norms=norms)
    # alpha term 4 + ceil(8/3) = 7; gradient term 5 + 1 = 6.
    assert decision.frozen == 6
    assert decision.reason == "bound by gradient norm (smallest at block 5)"


def test_gradient_term_leaves_out_blocks_that_measured_nothing():
    # Blocks 0 and 1 have no trainable weight (frozen by the user): their norm of 0 is no evidence
    # that they converged, nor is block 3's a brake on the blocks before it.
    decision = decide(0, 4, 1 / 2, 1, grad_norms=[0.0, 0.0, 0.5, 0.3])
    assert decision == FreezeDecision(0, 2, "bound by alpha")
    decision = decide(0, 4, 1 / 2, 1, grad_norms=[0.2, 0.4, 0.0, 0.0])
    assert decision == FreezeDecision(0, 1, "bound by gradient norm (smallest at block 0)")
    decision = decide(2, 4, 1 / 2, 1, grad_norms=[0.2, 0.4, 0.0, 0.0])
    assert decision == FreezeDecision(2, 3, "bound by alpha and cap (min_active_blocks=1)")


def test_gradient_term_at_first_active_block_freezes_exactly_one_more():
    norms = [9.0, 9.0, 9.0, 0.1, 5.0, 5.0, 5.0, 5.0]
    decision = decide(3, 8, 1.0, 1, grad_norms=norms)
    assert decision.frozen == 4
    assert "smallest at block 3" in decision.reason


def test_gradient_term_ties_take_the_first_block():
    decision = decide(2, 8, 1.0, 1, grad_norms=[1.0] * 8)
    assert decision.frozen == 3
    assert "smallest at block 2" in decision.reason


def test_alpha_term_binds():
    # Smallest norm at block 10 -> gradient term 11; alpha term 0 + ceil(12/3) = 4.
    norms = [float(12 - i) for i in range(12)]
    norms[10], norms[11] = 0.05, 0.5
    decision = decide(0, 12, 1 / 3, 1, grad_norms=norms)
    assert decision == FreezeDecision(0, 4, "bound by alpha")


def test_alpha_and_gradient_terms_tie():
    norms = [4.0, 3.0, 2.0, 1.0, 2.0, 3.0]  # smallest at block 3 -> 4; alpha: ceil(6 * 2/3) = 4
    decision = decide(0, 6, 2 / 3, 1, grad_norms=norms)
    assert decision.frozen == 4
    assert decision.reason == "bound by alpha and gradient norm (smallest at block 3)"


def test_cap_binds():
    # alpha = 1 -> 8; smallest norm at the last block -> 8; cap 8 - 1 = 7.
    norms = [8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]
    decision = decide(0, 8, 1.0, 1, grad_norms=norms)
    assert decision.frozen == 7
    assert decision.reason == "bound by cap (min_active_blocks=1)"


def test_cap_with_larger_min_active_blocks():
    norms = [8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]
    assert decide(0, 8, 1.0, 3, grad_norms=norms).frozen == 5
    assert decide(4, 8, 1.0, 3, grad_norms=norms).frozen == 5
    assert decide(0, 8, 1.0, 3, decisions=1).frozen == 5


def test_cap_and_alpha_tie_reason_names_both():
    # L = 12, F = 10, alpha = 1/3: 10 + ceil(2/3) = 11 = cap; smallest norm at block 11 -> 12.
    norms = [1.0] * 11 + [0.5]
    decision = decide(10, 12, 1 / 3, 1, grad_norms=norms)
    assert decision.frozen == 11
    assert decision.reason == "bound by alpha and cap (min_active_blocks=1)"


@pytest.mark.parametrize("previous", [7, 8])
def test_at_or_past_cap_nothing_changes(previous):
    norms = [1.0] * 8
    decision = decide(previous, 8, 1 / 3, 1, grad_norms=norms)
    assert decision.frozen == previous and decision.previous == previous
    assert not decision.changed
    assert "cap reached" in decision.reason
    # The schedule form does not even need a decision count there.
    assert decide(previous, 8, 1 / 3, 1).frozen == previous


def test_never_unfreezes_over_many_decisions():
    # Gradient norms that would point backwards (smallest at block 0) never reduce F.
    frozen = 0
    history = []
    for t in range(1, 12):
        norms = [0.5] + [float(i) for i in range(1, 10)]
        decision = decide(frozen, 10, 0.2, 2, grad_norms=norms)
        assert decision.frozen >= frozen
        assert decision.frozen <= 8
        frozen = decision.frozen
        history.append(frozen)
        schedule = decide(frozen, 10, 0.2, 2, decisions=t)
        assert schedule.frozen >= frozen
    # Each decision adds exactly one block (gradient term = first active block + 1) until the cap.
    assert history == [1, 2, 3, 4, 5, 6, 7, 8, 8, 8, 8]


def test_decision_changed_property():
    assert FreezeDecision(2, 3, "x").changed
    assert not FreezeDecision(3, 3, "x").changed


# ---------------------------------------------------------------------- invalid inputs
@pytest.mark.parametrize("norms", [[1.0, 2.0], [1.0] * 5, []])
def test_wrong_number_of_gradient_norms(norms):
    with pytest.raises(ValueError, match="expected 4 gradient norms"):
        decide(0, 4, 1 / 3, 1, grad_norms=norms)


def test_schedule_form_needs_the_decision_count():
    with pytest.raises(ValueError, match="number of decisions"):
        decide(0, 4, 1 / 3, 1)


def test_decision_is_immutable():
    decision = decide(0, 4, 1 / 3, 1, decisions=1)
    with pytest.raises(AttributeError):
        decision.frozen = 0  # type: ignore[misc]
