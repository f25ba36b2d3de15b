"""Pipelined and replicated training gives the weights of single-process training.

For each layout (pipeline_length x replicas) the same tiny model is trained for a few
AdamW steps on the same global batches, under ElasticPipelineStrategy on 2 or 4 gloo
processes and in one plain process; weights and predictions must agree (fp32, 1e-5).
"""

import json

import pytest
import torch
from distributed import run_workers
from equivalence_cases import reference_run


def _case(
    name, model, pipeline_length, schedule="gpipe", clip=0.0, accumulate=1, microbatches=2, optimizer="adamw", **extra
):
    return {
        **extra,
        "optimizer": optimizer,
        "name": name,
        "model": model,
        "pipeline_length": pipeline_length,
        "schedule": schedule,
        "clip": clip,
        "accumulate": accumulate,
        "microbatches": microbatches,
        "global_batch": 8,
        "steps": 3,
    }


TWO_PROCESS_CASES = [
    _case("bert_k2_gpipe_clip", "bert", 2, "gpipe", clip=0.05),
    _case("bert_k2_1f1b_accum", "bert", 2, "1f1b", accumulate=2, microbatches=4),
    _case("bert_k1_d2_accum_clip", "bert", 1, "gpipe", clip=0.05, accumulate=2),
    _case("bert_k2_sgd", "bert", 2, "gpipe", optimizer="sgd", microbatches=3),
    _case("bert_k2_sgd_clip_in_hook", "bert", 2, "1f1b", optimizer="sgd", clip_in_hook=0.05),  # self.clip_gradients
    _case("bert_k1_d2_sgd_accum", "bert", 1, "1f1b", optimizer="sgd", accumulate=2),
    _case("vit_k2_1f1b_clip", "timm_vit", 2, "1f1b", clip=0.05),
    _case("vit_k2_gpipe_accum", "timm_vit", 2, "gpipe", accumulate=2, microbatches=3),
    _case("vit_k1_d2_1f1b", "timm_vit", 1, "1f1b"),
    _case("gpt2_k2_gpipe_clip", "gpt2", 2, "gpipe", clip=0.05),  # embedding tied to the head: stages 0 and 1
    _case("t5_k2_1f1b", "t5", 2, "1f1b", microbatches=3),  # position bias passed from block to block
    _case("roformer_k2_gpipe", "roformer", 2, "gpipe"),  # attention probabilities returned, read by none
    _case("roformer_k2_1f1b", "roformer", 2, "1f1b", microbatches=3),
    _case("mpnet_k2_1f1b", "mpnet", 2, "1f1b", microbatches=3),  # position bias from a weight every stage uses
    _case("bert_k2_1f1b_pops_labels", "bert", 2, "1f1b", pops_labels=True),  # the batch changes before the model call
]
FOUR_PROCESS_CASES = [
    _case("bert_k2_d2_gpipe_clip_accum", "bert", 2, "gpipe", clip=0.05, accumulate=2),
    _case("vit_k2_d2_1f1b_clip", "timm_vit", 2, "1f1b", clip=0.05),
    _case("bert_k4_d1_1f1b", "bert", 4, "1f1b", microbatches=4),
    _case("vit_k2_d2_sgd_accum", "timm_vit", 2, "gpipe", optimizer="sgd", accumulate=2),
    _case("gpt2_k2_d2_1f1b_sgd_accum", "gpt2", 2, "1f1b", optimizer="sgd", accumulate=2, microbatches=4),
]


def _check(case, result_file):
    result = torch.load(result_file, weights_only=True)
    state, predictions = reference_run(case)
    assert result["state"].keys() == state.keys()
    for key, expected in state.items():
        torch.testing.assert_close(result["state"][key], expected, atol=1e-5, rtol=1e-4, msg=f"{case['name']}: {key}")
    torch.testing.assert_close(result["predictions"], predictions, atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("equiv2")
    run_workers("equivalence_worker.py", 2, str(out), *(json.dumps(c) for c in TWO_PROCESS_CASES))
    return out


@pytest.fixture(scope="module")
def four_process_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("equiv4")
    run_workers("equivalence_worker.py", 4, str(out), *(json.dumps(c) for c in FOUR_PROCESS_CASES))
    return out


@pytest.mark.parametrize("case", TWO_PROCESS_CASES, ids=lambda c: c["name"])
def test_two_processes_match_single_process(case, two_process_results):
    _check(case, two_process_results / f"{case['name']}.pt")


@pytest.mark.parametrize("case", FOUR_PROCESS_CASES, ids=lambda c: c["name"])
def test_four_processes_match_single_process(case, four_process_results):
    _check(case, four_process_results / f"{case['name']}.pt")


def test_gradients_are_reduced_during_the_backward(two_process_results):
    # K=1 x D=2 (pure data parallelism): from the second step on, every bucket's all-reduce
    # starts inside the last micro-batch's backward.
    sync = torch.load(two_process_results / "vit_k1_d2_1f1b.pt", weights_only=False)["sync"]
    assert sync["launched_during_backward"] >= 2  # steps 2 and 3 (step 1 discovers which parameters are used)


def test_shared_parameters_are_reduced_only_where_they_are_used(four_process_results):
    sync = torch.load(four_process_results / "gpt2_k2_d2_1f1b_sgd_accum.pt", weights_only=False)["sync"]
    stages = sync["shared_stages"]
    assert stages["model.transformer.wte.weight"] == [0, 1]  # tied to the LM head on the last stage
    assert stages["model.transformer.wpe.weight"] == [0]
    assert stages["model.transformer.ln_f.weight"] == [1]


@pytest.mark.parametrize(
    "name, reads",
    [("roformer_k2_gpipe", False), ("roformer_k2_1f1b", False), ("t5_k2_1f1b", True), ("bert_k2_sgd", None)],
)
def test_a_stage_sends_extra_block_outputs_only_where_the_next_stage_reads_them(two_process_results, name, reads):
    # RoFormer's blocks return their attention probabilities, which nothing reads: after the first
    # step's answer stage 0 sends the hidden state alone (and the weights above still match).
    # T5's next block reads the position bias; BERT's blocks return the hidden state only.
    records = [json.loads((two_process_results / f"{name}_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert sorted((r["next_reads"] for r in records), key=str) == sorted([reads, None], key=str)
    for record in records:  # the first stage sends activations, the last their gradients
        first_step, *later_steps = record["bytes_sent"]
        if reads is False:  # here the probabilities weigh about as much as the hidden state
            assert all(step < 0.6 * first_step for step in later_steps)
        else:
            assert all(abs(step - first_step) <= 8 for step in later_steps)  # the answer's 8 bytes
