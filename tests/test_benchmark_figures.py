"""How the benchmarks print and summarise their figures: never rounded in our favour, the ideal
from every seed's schedule, and only for the run that freezes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _launch import ratio_figure, ratio_verdict, unfavourable  # noqa: E402
from finetune import ideal_speedup, summarize  # noqa: E402


def test_figures_are_rounded_toward_the_unfavourable_side():
    assert ratio_figure(1.996) == "1.99x" and ratio_figure(0.9951) == "0.99x" and ratio_figure(None) == "-"
    assert unfavourable(-0.545, 2) == "-0.55"  # an accuracy difference: more negative
    assert unfavourable(0.201, 2, higher_is_better=False) == "0.21"  # a time ratio: up
    # float noise: 0.29 * 100 is 28.999999999999996, 1.1 * 100 is 110.00000000000001
    assert unfavourable(0.29, 2) == "0.29" and unfavourable(1.1, 2, higher_is_better=False) == "1.10"
    assert unfavourable(1e10 + 0.29, 2) == "10000000000.29"  # the noise allowed grows with the value
    assert unfavourable(float("nan"), 2) == "nan" and ratio_figure(float("inf")) == "infx"


def test_the_verdict_prints_the_median_round_and_ends_on_its_side_of_the_target():
    below = [0.98, 0.985, 0.99, 0.992, 0.995, 0.997, 0.999, 0.99996]
    verdict = ratio_verdict(below)
    assert verdict.startswith("median round 0.993, its 92% interval 0.985-0.999") and verdict.endswith("below 1.0")
    assert "1.000" not in verdict and "93%" not in verdict  # 1 - 18/256 = 92.97%


def _run(seed: int, frozen: list[int], wall: float, accs: list[float]) -> dict:
    epochs = [
        {"seconds": wall * (i + 1) / len(frozen), "val_acc": a, "frozen": f, "layout": "1x2"}
        for i, (f, a) in enumerate(zip(frozen, accs))
    ]
    return {"seed": seed, "wall_seconds": wall, "epochs": epochs, "test_acc": 0.5, "blocks": 6, "global_batch": 32}


def test_the_ideal_is_the_mean_of_every_seeds_schedule_and_only_for_the_full_system():
    first, second = [0, 2, 4], [0, 4, 5]
    runs = {
        "ddp": [_run(0, [0, 0, 0], 30.0, [0.6, 0.7, 0.8]), _run(1, [0, 0, 0], 30.0, [0.6, 0.7, 0.8])],
        "full": [_run(0, first, 15.0, [0.6, 0.7, 0.75]), _run(1, second, 10.0, [0.6, 0.8, 0.8])],
    }
    table = summarize(runs)
    full = table["full"]
    expected = (ideal_speedup(first, 6) + ideal_speedup(second, 6)) / 2
    assert full["ideal_speedup_vs_unfrozen"] == pytest.approx(expected)
    assert full["frozen_per_epoch_per_seed"] == [first, second] and full["frozen_per_epoch"] == first
    assert table["ddp"]["ideal_speedup_vs_unfrozen"] is None  # nothing froze: no model to set beside it
    assert full["speedup_vs_ddp"] == pytest.approx(30.0 / 12.5)  # the ratio of the mean wall times
    assert full["seeds_reaching_ddp_acc"] == 1 and full["seconds_to_ddp_acc"] == pytest.approx(20 / 3)
