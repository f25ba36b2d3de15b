"""Elastic transitions on 4 CPU processes: the layout follows the plan as blocks freeze, and
training continues exactly as a single process with the same frozen prefix would."""

import csv
import json

import pytest
import torch
from distributed import run_workers
from elastic_cases import EPOCHS, build_module, reference_run
from tiny_models import TASKS

from lightning_pipetx import find_blocks
from lightning_pipetx.strategy.autopipe import block_costs, choose_plan


@pytest.fixture(scope="module", params=["bert", "timm_vit"])
def elastic_run(request, tmp_path_factory):
    # bert's loaders come from a DataModule's hooks, timm_vit's are given to fit
    out = tmp_path_factory.mktemp(f"elastic_{request.param}")
    run_workers("elastic_worker.py", 4, str(out), request.param, *(["datamodule"] if request.param == "bert" else []))
    return request.param, out, json.loads((out / "report.json").read_text())


def test_layout_per_epoch_follows_the_plan(elastic_run):
    model, _, report = elastic_run
    costs = block_costs(find_blocks(build_module(model), TASKS[model].blocks_path))
    assert len(report["epochs"]) == EPOCHS
    for frozen, length, replicas, batch in report["epochs"]:
        # AutoCache is on: the frozen prefix costs nothing.
        plan = choose_plan(costs, frozen, world_size=4, initial_length=4, frozen_time=0.0)
        assert (length, replicas) == (plan.layout.pipeline_length, plan.layout.replicas)
        assert batch * replicas == 8  # the global batch is kept
    layouts = [(e[1], e[2]) for e in report["epochs"]]
    assert layouts == [(4, 1), (2, 2), (1, 4)], layouts


def test_training_continues_as_in_one_process(elastic_run):
    model, out, _ = elastic_run
    result = torch.load(out / "final.pt", weights_only=True)["state"]
    state = reference_run(model)["state"]
    for key, expected in state.items():
        torch.testing.assert_close(result[key], expected, atol=1e-5, rtol=1e-4, msg=key)


def _validation_steps(out):
    with open(out / "csv" / "version_0" / "metrics.csv") as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get("val_batch")]


def test_validation_batches_logged_for_the_step_keep_counting_across_transitions(elastic_run):
    # 8 validation samples in batches of 4: each replica validates 2 batches in 4x1, then 1 in 2x2 and 1x4.
    _, out, report = elastic_run
    assert _validation_steps(out) == [
        0,
        1,
        2,
        3,
    ]  # as DDP counts them; Lightning restarts the count at a rebuilt loader
    assert report["train_reloads"] == [0, 0, 0]  # the loaders rebuilt for the transitions are not the user's reloads
    if report["hook_calls"] is not None:  # ... nor do they call the user's hooks again (which may pick data by epoch)
        assert report["hook_calls"] == {"train": [0], "val": [0]}


def test_reloading_loaders_every_2_epochs_reloads_when_ddp_does_across_transitions(tmp_path):
    # Transitions after epochs 0 and 1; the user's reloads at epochs 0 and 2 restart the count, as under DDP.
    run_workers("elastic_worker.py", 4, str(tmp_path), "bert", "reload2", "datamodule")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["train_reloads"] == [0, 0, 2]
    assert report["hook_calls"] == {"train": [0, 2], "val": [0, 2]}
    assert _validation_steps(tmp_path) == [0, 1, 2, 0]


def test_elastic_false_keeps_the_layout_while_freezing(tmp_path):
    run_workers("elastic_worker.py", 4, str(tmp_path), "bert", "static")
    report = json.loads((tmp_path / "report.json").read_text())
    assert [e[0] for e in report["epochs"]] == [0, 2, 3]  # blocks froze
    assert {(e[1], e[2], e[3]) for e in report["epochs"]} == {(4, 1, 8)}  # the layout did not move
    result = torch.load(tmp_path / "final.pt", weights_only=True)["state"]
    state = reference_run("bert")["state"]
    for key, expected in state.items():
        torch.testing.assert_close(result[key], expected, atol=1e-5, rtol=1e-4, msg=key)


def test_fit_validate_and_checkpoints_complete(elastic_run):
    _, _, report = elastic_run
    assert len(report["checkpoints"]) == EPOCHS
    assert "val_loss" in report["validate"]
    assert report["metrics"]["pipetx/pipeline_length"] == 1.0
    assert report["metrics"]["pipetx/replicas"] == 4.0
    # AutoCache ran across the transitions: depth-2 states cached under 2x2, read back at depth 3 under 1x4
    # by every first stage, the two that were last stages under 2x2 included (from the node's shared file).
    assert report["metrics"]["pipetx/cache_ram_bytes"] > 0
    assert report["served"] == [None, 0.0, 1.0]


def test_block_buffers_move_with_their_blocks(tmp_path):
    # A tiny HF ResNet keeps BatchNorm statistics in every block; its layout goes
    # 2x1 (blocks 0-1 | 2-3) -> 2x1 (0-2 | 3) -> 1x2 as blocks freeze.
    run_workers("buffers_worker.py", 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"buffers_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [e["layout"] for e in ranks[0]["epochs"]] == ["2x1", "2x1", "1x2"]
    # Rank 1 (the first stage) takes over block 2 with the statistics rank 0 gathered in epoch 0.
    moved = ranks[1]["epochs"][1]["blocks"][2]
    assert moved == ranks[0]["epochs"][1]["blocks"][2] and moved[2] > 0
    # In 1x2 every rank runs every block, each with the statistics of the rank that ran it
    # (frozen since epoch 0: the batch norms are in eval mode from then on, which allows the 1x2).
    start_1x2 = [r["epochs"][2]["blocks"] for r in ranks]
    assert start_1x2[0] == start_1x2[1] and all(block[2] > 0 for block in start_1x2[0])
    assert ranks[0]["final"] == ranks[1]["final"] == start_1x2[0]
    # The embedder (pre) trains on the first stage (rank 1) and freezes after epoch 0; the last
    # stage runs it with stale weights. Its statistics come from the first stage.
    first_stage, last_stage = ranks[1]["embedder_at_epoch_end"][0], ranks[0]["embedder_at_epoch_end"][0]
    assert first_stage != last_stage
    assert ranks[0]["final_embedder"] == ranks[1]["final_embedder"] == first_stage
    saved = torch.load(tmp_path / "epoch0.ckpt", weights_only=False)["state_dict"]
    embedder = {k: v for k, v in saved.items() if k.startswith("model.resnet.embedder.")}
    sums = [float(sum(v.sum() for k, v in embedder.items() if k.endswith(n))) for n in ("mean", "var", "tracked")]
    assert sums == pytest.approx(first_stage, rel=1e-6)


def test_a_transition_keeps_the_first_stages_statistics_before_the_blocks(tmp_path):
    # 2x1 -> 1x2 after epoch 0, no checkpoint before it: the new layout's rank (0, 0) is the old
    # last stage, which ran the embedder with stale weights; every rank must get the old first stage's.
    run_workers("buffers_worker.py", 2, str(tmp_path), "direct")
    ranks = [json.loads((tmp_path / f"buffers_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [e["layout"] for e in ranks[0]["epochs"]] == ["2x1", "1x2", "1x2"]
    first_stage, last_stage = ranks[1]["embedder_at_epoch_end"][0], ranks[0]["embedder_at_epoch_end"][0]
    assert first_stage != last_stage
    assert ranks[0]["final_embedder"] == ranks[1]["final_embedder"] == first_stage


def test_after_fit_every_replica_holds_replica_0s_batch_norm_statistics(tmp_path):
    # 1x2 from the start: each replica's batch norms gather the statistics of its half of the data.
    run_workers("buffers_worker.py", 2, str(tmp_path), "replicas")
    ranks = [json.loads((tmp_path / f"buffers_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [e["layout"] for e in ranks[0]["epochs"]] == ["1x2", "1x2", "1x2"]
    assert ranks[0]["at_train_end"] != ranks[1]["at_train_end"]
    assert ranks[0]["final"] == ranks[1]["final"] == ranks[0]["at_train_end"]


@pytest.mark.parametrize("kind", ["iterable", "batch_sampler"])
def test_a_loader_that_cannot_be_rebatched_keeps_its_replicas(tmp_path, kind):
    output = run_workers("loader_kinds_worker.py", 2, str(tmp_path), kind)
    assert "layouts keep 1 replicas" in output
    for rank in range(2):
        report = json.loads((tmp_path / f"{kind}_rank{rank}.json").read_text())
        assert report["layouts"] == ["2x1", "2x1", "2x1"] and report["frozen"] == 3


@pytest.mark.parametrize("kind", ["combined_hook", "combined_given"])
def test_a_combined_loader_is_sharded_for_the_new_replicas(tmp_path, kind):
    # Lightning puts the loaders it built (with samplers for 1 replica) into the user's CombinedLoader.
    run_workers("loader_kinds_worker.py", 2, str(tmp_path), kind)
    ranks = [json.loads((tmp_path / f"{kind}_rank{rank}.json").read_text()) for rank in range(2)]
    layouts = ranks[0]["layouts"]
    assert layouts[0] == "2x1" and layouts[-1] == "1x2"
    for epoch, layout in enumerate(layouts):
        first, second = ranks[0]["seen"][str(epoch)], ranks[1]["seen"][str(epoch)]
        if layout == "2x1":  # the two stages of one replica read the same batches
            assert first == second == list(range(16))
        else:  # two replicas: each trains on its half, as under DDP
            assert len(first) == len(second) == 8 and sorted(first + second) == list(range(16))


def _loader_reports(tmp_path, kind):
    run_workers("loader_kinds_worker.py", 2, str(tmp_path), kind)
    return [json.loads((tmp_path / f"{kind}_rank{rank}.json").read_text()) for rank in range(2)]


def _sizes(report, loader):
    return {epoch: [len(batch) for batch in seen[loader]] for epoch, seen in report["batches"].items()}


def test_each_loader_of_a_combined_loader_keeps_its_own_global_batch(tmp_path):
    # Loaders of 4 and 2 samples a batch: on 2 replicas 2 and 1 each, in as many steps an epoch.
    ranks = _loader_reports(tmp_path, "two_loaders")
    assert ranks[0]["layouts"] == ["2x1", "2x1", "1x2"] and ranks[0]["global_step"] == 24
    for rank in ranks:
        assert _sizes(rank, "a") == {"0": [4] * 8, "1": [4] * 8, "2": [2] * 8}
        assert _sizes(rank, "b") == {"0": [2] * 8, "1": [2] * 8, "2": [1] * 8}
    for loader in ("a", "b"):  # two replicas: each trains on its half, as under DDP ("a" cycled twice)
        halves = [set(sum(rank["batches"]["2"][loader], [])) for rank in ranks]
        assert len(halves[0]) == len(halves[1]) == 8 and halves[0] | halves[1] == set(range(16))


def test_a_loader_beside_others_that_cannot_be_dealt_to_more_replicas_keeps_them(tmp_path):
    # An IterableDataset second: two replicas would each train its 16 samples.
    ranks = _loader_reports(tmp_path, "stream_beside")
    assert ranks[0]["layouts"] == ["2x1", "2x1", "2x1"] and ranks[0]["global_step"] == 12
    assert all(sum(rank["batches"]["2"]["b"], []) == list(range(100, 116)) for rank in ranks)


def test_a_users_loader_class_and_a_reloaded_batch_size_are_kept_across_a_transition(tmp_path):
    # The hook's Marking loader: batches of 4, then of 8 from epoch 1 on (4 on each of 2 replicas).
    ranks = _loader_reports(tmp_path, "subclass_reloaded")
    assert ranks[0]["layouts"] == ["2x1", "2x1", "1x2"] and ranks[0]["global_step"] == 16
    for rank in ranks:
        assert rank["loader_class"] == "Marking"
        assert _sizes(rank, "main") == {"0": [4] * 8, "1": [8] * 4, "2": [4] * 4}
        assert all(index >= 1000 for seen in rank["batches"].values() for batch in seen["main"] for index in batch)


def test_ranks_that_shard_the_data_themselves_never_read_each_other_s_cached_states(tmp_path):
    # Without Lightning's sampler index i may be another sample on each rank: the node's shared
    # cache file would serve one rank the states of the other's samples.
    run_workers("loader_kinds_worker.py", 2, str(tmp_path), "per_rank_subset")
    for rank in range(2):
        report = json.loads((tmp_path / f"per_rank_subset_rank{rank}.json").read_text())
        cached, plain = report["cache=True"], report["cache=False"]
        assert max(cached["hit_rates"]) == 1.0  # the frozen prefix was served
        assert cached["ram_budget"] == 8 * 2**30 // 2  # cache_ram_bytes is the node's: each rank holds to half
        for key, value in plain["weights"].items():
            torch.testing.assert_close(torch.tensor(cached["weights"][key]), torch.tensor(value), msg=key)


def test_a_users_distributed_sampler_is_dealt_to_the_new_replicas(tmp_path):
    # Built from trainer.strategy.distributed_sampler_kwargs for 1 replica (2x1) and, as under DDP,
    # not rebuilt by the hook after 2x1 -> 1x2: each replica must train its half, as Lightning's sampler does.
    run_workers("loader_kinds_worker.py", 2, str(tmp_path), "own_distributed")
    ranks = [json.loads((tmp_path / f"own_distributed_rank{rank}.json").read_text()) for rank in range(2)]
    own, lightning = ranks[0]["own"], ranks[0]["lightning"]
    assert own["layouts"][0] == "2x1" and own["layouts"][-1] == "1x2" == lightning["layouts"][-1]
    assert own["global_step"] == lightning["global_step"] == 12
    for epoch, layout in enumerate(own["layouts"]):
        first, second = ranks[0]["own"]["seen"][str(epoch)], ranks[1]["own"]["seen"][str(epoch)]
        assert sorted(first + second) == sorted(list(range(16)) * (2 if layout == "2x1" else 1))
    for key, value in lightning["weights"].items():
        torch.testing.assert_close(torch.tensor(own["weights"][key]), torch.tensor(value), msg=key)


def test_a_users_sampler_that_does_not_deal_to_replicas_keeps_them(tmp_path):
    # Every replica would read all 16 samples: 1x2 would train each twice an epoch, in twice the steps.
    output = run_workers("loader_kinds_worker.py", 2, str(tmp_path), "own_sequential")
    assert "layouts keep 1 replicas" in output
    for rank in range(2):
        run = json.loads((tmp_path / f"own_sequential_rank{rank}.json").read_text())["own"]
        assert run["layouts"] == ["2x1", "2x1", "2x1"] and run["global_step"] == 12
        assert all(seen == list(range(16)) for seen in run["seen"].values())


def test_a_float_val_limit_keeps_the_layout_whose_replicas_validate_a_batch(tmp_path):
    # Lightning would refuse 0.5 of the single validation batch each of two replicas gets.
    run_workers("loader_kinds_worker.py", 2, str(tmp_path), "val_share")
    for rank in range(2):
        report = json.loads((tmp_path / f"val_share_rank{rank}.json").read_text())
        assert report["layouts"] == ["2x1", "2x1", "2x1"] and report["layout_after_fit"] == "2x1"


def test_batch_norms_in_training_keep_the_replicas_through_freezing(tmp_path):
    # Blocks 2 and 3 keep training with their batch norms: on 2 replicas each would normalize half
    # of the batch that the 2-stage pipeline (and one process) normalizes whole.
    run_workers("elastic_worker.py", 2, str(tmp_path), "batchnorm")
    report = json.loads((tmp_path / "report.json").read_text())
    assert [epoch[:3] for epoch in report["epochs"]] == [[0, 2, 1], [2, 2, 1], [3, 2, 1]]
    result = torch.load(tmp_path / "final.pt", weights_only=True)["state"]
    for key, expected in reference_run("batchnorm")["state"].items():
        torch.testing.assert_close(result[key], expected, atol=1e-5, rtol=1e-4, msg=key)
