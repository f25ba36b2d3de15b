"""The dry-run planner, ``python -m lightning_pipetx.plan``: models built on ``meta``, plans as AutoPipe makes them."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, BertConfig

from lightning_pipetx import find_blocks
from lightning_pipetx.plan import build_model, main
from lightning_pipetx.strategy.autopipe import block_costs, choose_plan, make_plan

REPO = Path(__file__).resolve().parents[1]


def _run_json(capsys, *args: str) -> dict:
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def bert_base_costs() -> list[float]:
    """Block costs of BERT-base, computed here without the planner's own model builder."""
    with torch.device("meta"):
        model = AutoModel.from_config(BertConfig())
    return block_costs(find_blocks(model))


def test_bert_base_on_8_devices_prints_a_plan_that_compresses(capsys):
    assert main(["--model", "bert-base", "--devices", "8", "--pipeline-length", "8"]) == 0
    out = capsys.readouterr().out
    assert "12 blocks at 'encoder.layer'" in out
    assert "pipeline_length 8 (given)\nstart     frozen  0: layout 8x1, 16 micro-batches" in out
    assert "fastest predicted" not in out  # the automatic choice's reason, which was not made
    assert "layout 2x4" in out and "[transition]" in out
    assert out.strip().splitlines()[-1] == "2 layout transitions"


def test_vit_b16_json_steps_follow_the_schedule_and_change_layout(capsys):
    result = _run_json(capsys, "--model", "vit-b16", "--devices", "8", "--pipeline-length", "8")
    assert result["num_blocks"] == 12 and result["initial"]["layout"] == "8x1"
    frozen = [step["frozen"] for step in result["steps"]]
    # ceil(12 * (1 - (2/3)^T)) = 4, 7, 9, 10, 11 (capped at L - 1 = 11).
    assert frozen == [4, 7, 9, 10, 11]
    layouts = [result["initial"]["layout"], *(step["layout"] for step in result["steps"])]
    assert len(set(layouts)) >= 2
    assert result["transitions"] == sum(a != b for a, b in zip(layouts, layouts[1:])) >= 1
    for step in result["steps"]:
        assert sum(step["blocks_per_stage"]) == 12 and len(step["blocks_per_stage"]) == step["pipeline_length"]
        assert step["pipeline_length"] * step["replicas"] == 8
        assert step["bounds"][0][1] >= step["frozen"]  # the frozen prefix stays on the first stage


def test_numbers_agree_with_choose_plan(capsys, bert_base_costs):
    result = _run_json(
        capsys,
        "--model",
        "bert-base",
        "--devices",
        "8",
        "--pipeline-length",
        "8",
        "--alpha",
        "0.5",
        "--min-active-blocks",
        "2",
    )
    assert result["block_costs"] == bert_base_costs
    start = make_plan(bert_base_costs, 0, 8, 8, None)
    assert result["initial"]["bounds"] == [list(b) for b in start.bounds]
    expected_frozen = sorted({min(math.ceil(12 * (1 - 0.5**t) - 1e-9), 10) for t in range(1, 10)})
    assert [step["frozen"] for step in result["steps"]] == expected_frozen
    for step in result["steps"]:
        plan = choose_plan(bert_base_costs, step["frozen"], 8, 8)
        assert step["layout"] == str(plan.layout) and step["num_microbatches"] == plan.num_microbatches
        assert step["bounds"] == [list(b) for b in plan.bounds]
        assert step["stage_costs"] == pytest.approx(list(plan.stage_times))
        assert step["relative_throughput"] == pytest.approx(plan.predicted_throughput / start.predicted_throughput)


def test_cached_prefix_is_free_and_the_pipeline_collapses(capsys, bert_base_costs):
    result = _run_json(capsys, "--model", "bert-base", "--devices", "8", "--pipeline-length", "8", "--cached")
    assert result["cached"] and result["steps"][-1]["layout"] == "1x8"
    for step in result["steps"]:
        plan = choose_plan(bert_base_costs, step["frozen"], 8, 8, frozen_time=0.0)
        assert step["layout"] == str(plan.layout) and step["bounds"] == [list(b) for b in plan.bounds]
        assert step["stage_costs"][0] == pytest.approx(sum(bert_base_costs[step["frozen"] : step["bounds"][0][1]]))


def test_automatic_length_is_data_parallel_when_the_model_fits_a_device(capsys):
    # BERT-base: 110 M parameters, about 1.6 GiB of weights, gradients and Adam moments.
    result = _run_json(capsys, "--model", "bert-base", "--devices", "16", "--memory-gb", "16")
    assert result["initial"]["layout"] == "1x16" and result["initial_choice"]["auto"]
    candidates = result["initial_choice"]["candidates"]
    assert [c["layout"] for c in candidates] == ["1x16", "2x8", "4x4", "8x2"]  # at most L = 12 stages
    assert all(c["fits"] for c in candidates)
    assert candidates[0]["peak_gb"] == pytest.approx(110e6 * 16 / 2**30, rel=0.03)
    assert max(c["relative_throughput"] for c in candidates) == 1.0


def test_automatic_length_is_the_fastest_layout_that_fits(capsys):
    # BERT-large, 335 M parameters: 5 GiB on one device; with 4 GiB devices half of it (2 GiB)
    # holds the training state of a quarter of the model, not of a half.
    result = _run_json(capsys, "--model", "bert-large", "--devices", "8", "--memory-gb", "4")
    assert result["initial"]["layout"] == "4x2"
    fits = {c["layout"]: c["fits"] for c in result["initial_choice"]["candidates"]}
    assert fits == {"1x8": False, "2x4": False, "4x2": True, "8x1": True}
    assert main(["--model", "bert-large", "--devices", "8", "--memory-gb", "4"]) == 0
    out = capsys.readouterr().out
    assert "pipeline_length auto: layout 4x2: the fastest predicted whose largest stage's" in out
    assert "1x8 4.99 GiB x1.37 too big" in out
    # None fits: the layout that needs the least memory.
    result = _run_json(capsys, "--model", "bert-large", "--devices", "8", "--memory-gb", "1")
    assert result["initial"]["layout"] == "8x1" and "none fits" in result["initial_choice"]["reason"]
    assert "GiB, more than 0.50 GiB" in result["initial_choice"]["reason"]  # what the least needs, said as such


def test_automatic_length_keeps_a_pipeline_inside_one_node(capsys):
    # As the strategy: at most the devices of one node (and the number of blocks) per pipeline.
    result = _run_json(capsys, "--model", "bert-base", "--devices", "16", "--num-nodes", "4", "--memory-gb", "1")
    assert [c["layout"] for c in result["initial_choice"]["candidates"]] == ["1x16", "2x8", "4x4"]
    assert result["initial"]["layout"] == "4x4" and "none fits" in result["initial_choice"]["reason"]
    with pytest.raises(SystemExit):
        main(["--model", "bert-base", "--devices", "16", "--num-nodes", "3"])
    assert "--num-nodes 3 does not divide --devices 16" in capsys.readouterr().err


def test_batch_size_rules_out_layouts_the_global_batch_does_not_split_over(capsys):
    args = ["--model", "bert-base", "--devices", "8", "--pipeline-length", "4", "--min-active-blocks", "3"]
    free = _run_json(capsys, *args)
    assert [step["layout"] for step in free["steps"]] == ["4x2", "4x2", "2x4"]
    # Global batch 3 x 2 replicas = 6: neither 4 nor 8 replicas can share it evenly.
    held = _run_json(capsys, *args, "--batch-size", "3")
    assert [step["layout"] for step in held["steps"]] == ["4x2", "4x2", "4x2"] and held["transitions"] == 0
    # With 10 blocks frozen 4 stages cannot be built, and 4 replicas cannot share the batch: the
    # layout stays and the blocks freeze in place, as the strategy does.
    kept = _run_json(capsys, *args[:-2], "--batch-size", "3")
    assert [step["frozen"] for step in kept["steps"]] == [4, 7, 9, 10, 11]
    assert [step["change"] for step in kept["steps"][3:]] == ["kept", "kept"]
    assert {tuple(map(tuple, step["bounds"])) for step in kept["steps"][2:]} == {((0, 9), (9, 10), (10, 11), (11, 12))}
    assert main([*args[:-2], "--batch-size", "3"]) == 0
    out = capsys.readouterr().out
    assert "frozen 10: layout 4x2" in out and "with 10 of 12 blocks frozen at most 3 stages fit" in out


def test_models_are_built_without_weights():
    for name in ("gpt2", "deit_tiny_patch16_224"):
        params = list(build_model(name).parameters())
        assert params and all(p.is_meta for p in params)


def test_a_timm_model_name_works_from_the_command_line():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "lightning_pipetx.plan", "--model", "deit_tiny_patch16_224", "--devices", "4"]
    command += ["--pipeline-length", "4"]
    proc = subprocess.run([*command, "--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["model_class"] == "VisionTransformer" and result["blocks_path"] == "blocks"
    assert result["num_blocks"] == 12 and result["initial"]["layout"] == "4x1"
    assert result["block_costs"] == [444864.0] * 12  # 12 * 192^2 weights + biases and norms per block


def test_bad_arguments_give_clear_errors(capsys):
    assert main(["--model", "no-such-model", "--devices", "8"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and "bert-base" in err and "timm model name" in err
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "bert-base", "--devices", "8", "--pipeline-length", "3"])
    assert exit_info.value.code == 2
    assert "--pipeline-length 3 does not divide --devices 8" in capsys.readouterr().err
    for memory in ("nan", "inf", "0"):
        with pytest.raises(SystemExit):
            main(["--model", "bert-base", "--devices", "8", "--memory-gb", memory])
        assert f"--memory-gb must be a number > 0, got {float(memory)}" in capsys.readouterr().err


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    options = (
        "--model",
        "--devices",
        "--pipeline-length",
        "--memory-gb",
        "--alpha",
        "--min-active-blocks",
        "--microbatches",
        "--num-nodes",
    )
    for option in options:
        assert option in out
