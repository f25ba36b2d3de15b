"""Strict point-to-point (every send waits until its receive is taken, as NCCL may): the
pipeline's schedules finish and stay exact under it, and it is not vacuous."""

import json

import pytest
import torch
from distributed import run_workers
from equivalence_cases import reference_run

STRICT = {"PIPETX_STRICT_P2P": "1"}
# NCCL's answer to a batch: one work for all of it, whose receives land only when it is waited on.
# (Not combined with STRICT, whose acknowledgements would add waits that NCCL does not have.)
COALESCED = {"PIPETX_COALESCED_P2P": "1"}


def test_strict_mode_turns_an_unpaired_exchange_into_an_error():
    output = run_workers("p2p_worker.py", 2, "unpaired", expect_failure=True, env=STRICT, timeout=120)
    assert "lost global rank" in output
    output = run_workers("p2p_worker.py", 2, "paired", env=STRICT, timeout=120)
    assert output.count("exchanged") == 2


def test_a_batch_answered_with_one_work_as_nccl_does_completes_its_receives():
    output = run_workers("p2p_worker.py", 2, "coalesced", env=COALESCED, timeout=120)
    assert output.count("exchanged") == 2


def _case(name, pipeline_length, schedule, microbatches, **extra):
    # 44 samples in global batches of 8: the last batch has 4 samples; with "pad" every batch is
    # padded to its longest sequence, so hidden-state shapes change from batch to batch.
    case = {
        "name": name,
        "model": "bert",
        "pipeline_length": pipeline_length,
        "schedule": schedule,
        "clip": 0.0,
        "accumulate": 1,
        "microbatches": microbatches,
        "global_batch": 8,
        "steps": 6,
        "train_size": 44,
        "pad": True,
    }
    case.update(extra)
    return case


# RoFormer's blocks return attention probabilities that no stage reads: each boundary's answer
# travels back with a gradient, and the later activations go without them.
STRICT_CASES = {
    2: [_case("k2_gpipe", 2, "gpipe", 3), _case("k2_1f1b", 2, "1f1b", 4, model="roformer")],
    3: [_case("k3_gpipe", 3, "gpipe", 2, model="roformer"), _case("k3_1f1b", 3, "1f1b", 4)],
    4: [
        _case("k4_1f1b", 4, "1f1b", 2, model="roformer"),
        _case("k4_gpipe", 4, "gpipe", 5),
        # 2 replicas of 2 stages: a stage's bucket all-reduces start while its last gradient send is under way
        _case("k2_d2_1f1b", 2, "1f1b", 2),
    ],
}


@pytest.mark.parametrize("rules", [STRICT, COALESCED], ids=["strict", "coalesced"])
@pytest.mark.parametrize("nprocs", sorted(STRICT_CASES))
def test_schedules_finish_and_stay_exact_under_nccls_rules(nprocs, rules, tmp_path):
    cases = STRICT_CASES[nprocs]
    run_workers("equivalence_worker.py", nprocs, str(tmp_path), *(json.dumps(c) for c in cases), env=rules)
    for case in cases:
        result = torch.load(tmp_path / f"{case['name']}.pt", weights_only=True)
        state, predictions = reference_run(case)
        for key, expected in state.items():
            torch.testing.assert_close(
                result["state"][key], expected, atol=1e-5, rtol=1e-4, msg=f"{case['name']}: {key}"
            )
        torch.testing.assert_close(result["predictions"], predictions, atol=1e-5, rtol=1e-4)
        if case["model"] == "roformer":  # every stage but the last was answered: nothing reads them
            answers = [json.loads((tmp_path / f"{case['name']}_rank{r}.json").read_text()) for r in range(nprocs)]
            assert sorted((a["next_reads"] for a in answers), key=str) == [False] * (nprocs - 1) + [None]
