"""Lightning features under ElasticPipelineStrategy: an unchanged LightningModule with
torchmetrics, sync_dist, ModelCheckpoint, EarlyStopping, an LR scheduler, validate, test and
predict; the learning-rate finder; a model compiled with torch.compile; the registered strategy
names; bf16-mixed; fast_dev_run; a dead peer."""

import json
import subprocess
import sys
import time

import pytest
import torch
from compiled_worker import EPOCHS, CompiledRegressor
from distributed import REPO, TESTS_DIR, run_workers
from features_worker import Classifier
from generate_worker import generated
from step_randomness_worker import train as train_batch_changing_step
from tiny_models import RandomVectorDataset, make_trainer
from torch.utils.data import DataLoader, DistributedSampler
from tuner_worker import GLOBAL_BATCH, tune_and_fit

from lightning_pipetx import FreezeCallback


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("features")
    run_workers("features_worker.py", 4, str(out), "torchrun")
    return out, [json.loads((out / f"torchrun_rank{r}.json").read_text()) for r in range(4)]


def test_every_rank_sees_the_same_metrics(four_ranks):
    _, reports = four_ranks
    for key in ("val_acc", "val_loss"):
        assert len({r["fit"][key] for r in reports}) == 1, key
    for phase in ("validate", "test"):
        assert all(r[phase] == reports[0][phase] for r in reports)
    assert set(reports[0]["test"]) == {"test_acc", "test_loss"}
    # Ranks 0, 1 are replica 0 and ranks 2, 3 replica 1: a replica's stages agree on its own loss.
    assert reports[0]["fit"]["train_loss"] == reports[1]["fit"]["train_loss"]
    assert reports[2]["fit"]["train_loss"] == reports[3]["fit"]["train_loss"]


def test_callbacks_decide_alike_on_every_rank(four_ranks):
    out, reports = four_ranks
    assert {r["stopped"] for r in reports} == {1}  # EarlyStopping(min_delta=10) after epoch 1
    assert {r["epochs"] for r in reports} == {2}
    assert {r["best_model_path"] for r in reports} == {reports[0]["best_model_path"]}
    assert {r["lr"] for r in reports} == {1.5e-3}  # StepLR halved it after 2 epochs
    assert (out / "lightning_logs").exists()


def test_checkpoint_is_consolidated(four_ranks):
    _, reports = four_ranks
    model = Classifier.load_from_checkpoint(reports[0]["best_model_path"], map_location="cpu")
    reference = Classifier()
    for name, tensor in model.state_dict().items():
        assert tensor.shape == reference.state_dict()[name].shape, name


def test_on_save_checkpoint_reads_the_whole_model_on_the_rank_that_writes(four_ranks):
    # Global rank 0, a last stage, does not run the first stage's blocks: the hook reads them too.
    _, reports = four_ranks
    checkpoint = torch.load(reports[0]["best_model_path"], map_location="cpu", weights_only=False)
    copy, state = checkpoint["encoder_copy"], checkpoint["state_dict"]
    assert len(copy) == len([k for k in state if k.startswith("model.bert.encoder.")]) > 0
    for name, tensor in copy.items():
        assert torch.equal(tensor, state[f"model.bert.encoder.{name}"]), name
    # ... and only while it is saved: after the save at epoch 0's end they read NaN again.
    counts = reports[0]["released_nan"]
    assert len(counts) == 2 and counts[0] == counts[1] > 0
    # Every rank's hook gets the checkpoint's keys, as under DDP (the values are written by rank 0).
    assert all(r["saved_keys"] == sorted(state) for r in reports)


def test_a_checkpoint_keeps_the_gradient_norms_of_every_stage(four_ranks):
    # Each rank measures the blocks it runs; global rank 0 (a last stage) writes the file.
    _, reports = four_ranks
    checkpoint = torch.load(reports[0]["best_model_path"], map_location="cpu", weights_only=False)
    (state,) = [v for k, v in checkpoint["callbacks"].items() if k.startswith("FreezeCallback")]
    assert state["frozen_blocks"] == 0 and state["norm_steps"] > 0
    assert len(state["norm_sums"]) == 4 and all(s > 0 for s in state["norm_sums"])


def test_a_prediction_writer_writes_each_sample_once(four_ranks):
    # 2 stages x 2 replicas: the last stage of each replica (global ranks 0 and 2) writes its shard.
    out, _ = four_ranks
    written = {path.name: json.loads(path.read_text()) for path in out.glob("written_rank*.json")}
    assert sorted(written) == ["written_rank0.json", "written_rank2.json"]
    indices = [i for shard in written.values() for i in shard]
    assert sorted(indices) == list(range(14))


def test_predict_returns_all_samples_in_order_on_rank_zero(four_ranks):
    _, reports = four_ranks
    assert len(reports[0]["predictions"]) == 14
    assert reports[0]["predictions"] == reports[0]["direct"]
    # Other ranks hold their replica's shard, as under DDP.
    assert [len(r["predictions"]) for r in reports[1:]] == [7, 7, 7]
    assert reports[1]["predictions"] == reports[0]["predictions"][0::2]


@pytest.mark.parametrize("mode", ["spawn", "popen"])
def test_registered_names_launch(mode, tmp_path):
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": f"{TESTS_DIR / 'workers'}:{TESTS_DIR}:{REPO}"}
    proc = subprocess.run(
        [sys.executable, str(TESTS_DIR / "workers" / "features_worker.py"), str(tmp_path), mode],
        env={**__import__("os").environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    report = json.loads((tmp_path / f"{mode}_rank0.json").read_text())
    assert "train_loss" in report["fit"]
    if mode == "popen":
        assert report["strategy"] == "ElasticPipelineStrategy"


@pytest.mark.parametrize(
    "mode, waiting_for",
    [
        ("deadpeer", "a hidden state"),
        ("deadreplica", "a gradient all-reduce"),
        ("deadmover", "blocks and their optimizer state moving to the new layout"),
    ],
)
def test_dead_peer_ends_the_run_with_a_clear_error(mode, waiting_for, tmp_path):
    start = time.monotonic()
    output = run_workers("features_worker.py", 2, str(tmp_path), mode, expect_failure=True, timeout=240)
    assert time.monotonic() - start < 200
    assert f"lost global rank 1 while waiting for {waiting_for}" in output, output[-4000:]
    if mode == "deadpeer":  # rank 0 cannot get back the blocks rank 1 ran, and says so
        assert "global rank 0 could not get the blocks it does not run back" in output
        assert "lacks blocks [0, 1] of 'model.bert.encoder.layer'" in output and "load the last checkpoint" in output
        assert "[rank0] no layout: ElasticPipelineStrategy is not running: its last run stopped on an error" in output


def test_weights_are_whole_after_the_run(four_ranks):
    _, reports = four_ranks
    assert all(isinstance(p, int) for p in reports[0]["direct"])
    assert torch.tensor(reports[3]["predictions"]).numel() == 7


def test_the_learning_rate_finder_restores_the_module_under_a_pipeline(tmp_path):
    # Lightning's finder saves the module, runs its trial steps and loads the module back while
    # each rank holds only its stage's blocks; the fit after it freezes blocks (2x1 -> 1x2).
    run_workers("tuner_worker.py", 2, str(tmp_path))
    dataset = RandomVectorDataset(size=64)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer = make_trainer([FreezeCallback(alpha=0.5, signal="schedule")], default_root_dir=tmp_path / "reference")
    module, expected = tune_and_fit(trainer, DataLoader(dataset, batch_size=GLOBAL_BATCH, sampler=sampler))
    assert expected["restored"]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["restored"] and report["lr"] == expected["lr"]
        assert report["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        assert report["layouts"] == ["2x1", "2x1", "1x2"]
    fitted = torch.load(tmp_path / "fitted.pt", weights_only=True)
    for name, value in module.state_dict().items():  # float rounding, grown by the chosen learning rate (0.1)
        torch.testing.assert_close(fitted[name], value, atol=1e-4, rtol=1e-4, msg=name)


def test_a_compiled_model_trains_as_one_process_under_a_pipeline(tmp_path):
    # The stage's first micro-batch runs a fused backward, which torch compiles to donate its
    # buffers; the split of the step's last backward then failed (it retains the graph).
    run_workers("compiled_worker.py", 2, str(tmp_path))
    dataset = RandomVectorDataset(size=32)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer = make_trainer(
        [FreezeCallback(alpha=0.5, signal="schedule")], max_epochs=EPOCHS, default_root_dir=tmp_path / "reference"
    )
    module = CompiledRegressor(compile=False)
    trainer.fit(module, DataLoader(dataset, batch_size=GLOBAL_BATCH, sampler=sampler))
    assert json.loads((tmp_path / "layouts.json").read_text()) == ["2x1", "2x1", "1x2"]
    fitted = torch.load(tmp_path / "fitted.pt", weights_only=True)
    for name, value in module.state_dict().items():
        torch.testing.assert_close(fitted[name.replace("model.", "model._orig_mod.")], value, atol=1e-6, rtol=1e-5)


def test_each_stage_draws_dropout_from_a_stream_of_its_own(tmp_path):
    # GPT-2's stage 1 runs the embeddings' dropout and two blocks, as stage 0 does: drawing from
    # the same seeded stream, block 2 would drop exactly what block 0 dropped (and 3 what 1 did).
    run_workers("dropout_streams_worker.py", 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"masks_rank{rank}.json").read_text()) for rank in (0, 1)]
    masks = {int(block): calls for rank in ranks for block, calls in rank["masks"].items()}
    assert sorted(masks) == [0, 1, 2, 3] and all(len(calls) == 4 for calls in masks.values())  # 2 steps x 2
    for early, late in ((0, 2), (1, 3)):
        for call_early, call_late in zip(masks[early], masks[late]):
            agree = sum(a == b for a, b in zip(call_early, call_late)) / len(call_early)
            assert 0.35 < agree < 0.65  # independent masks of rate 0.5 agree on about half
    # The schedule drew from the stages' streams: the processes' own are alike, for what draws next.
    assert ranks[0]["random_state"] == ranks[1]["random_state"]


def test_callbacks_decide_on_what_the_last_stage_saw(tmp_path):
    # The count rises every epoch on the last stage and stays 0 on the first, which never runs the
    # code after the model call: the decisions are the last stage's, on both ranks.
    run_workers("decisions_worker.py", 2, str(tmp_path))
    for rank in (0, 1):
        report = json.loads((tmp_path / f"decisions_rank{rank}.json").read_text())
        assert report == {"best": "epoch=2-step=6.ckpt", "epochs": 3}


@pytest.mark.parametrize("recipe", ["mixup", "in_place"])
def test_a_step_that_changes_its_batch_before_the_model_call_trains_as_one_process(tmp_path, recipe):
    # mixup: the first stage mixes the inputs, the last the targets. Each stage drew from a random
    # stream of its own, so the targets were mixed otherwise than the inputs.
    # in_place: micro-batches were views of one batch, sharing its autograd version counter, so
    # changing the second in place failed the first's backward ("modified by an inplace operation").
    run_workers("step_randomness_worker.py", 2, str(tmp_path), recipe)
    expected = train_batch_changing_step(devices=1, recipe=recipe)
    for rank in range(2):
        weights = torch.load(tmp_path / f"rank{rank}.pt")["state"]
        for name, value in expected.items():
            torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-6, msg=f"rank {rank}: {name}")


@pytest.mark.parametrize("recipe", ["draws_after_call", "draws_after_call_pcg64"])
def test_python_and_numpy_draws_after_the_model_call_keep_the_stages_reading_the_same_batches(tmp_path, recipe):
    # Only the last stage runs the step after the model call: its draws from Python's and NumPy's
    # random advanced its process's streams alone, so the data set's noise, drawn in the main
    # process, differed between the stages (BatchMismatchError). They come from the stage's streams,
    # NumPy's in the format of its global bit generator (pcg64: MT19937's state was refused).
    run_workers("step_randomness_worker.py", 2, str(tmp_path), recipe)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert ranks[0]["drawn"] == ranks[1]["drawn"]
    for name, value in ranks[0]["state"].items():
        assert torch.equal(ranks[1]["state"][name], value), name


def test_generate_decodes_as_one_process_without_a_cache_and_is_refused_with_one(tmp_path):
    # With generate's default use_cache=True each stage filled only its own blocks' layers of the
    # key/value cache: from the second new token on the stages decoded from a cache with holes,
    # and the tokens were wrong on every rank without a word.
    output = run_workers("generate_worker.py", 2, str(tmp_path), "cached", expect_failure=True)
    assert "UnsupportedRecipeError: ElasticPipelineStrategy: an evaluation step's model call reads the key" in output
    assert "Pass use_cache=False to generate()" in output
    run_workers("generate_worker.py", 2, str(tmp_path), "uncached")
    expected = generated(devices=1, use_cache=True)
    for rank in range(2):
        assert torch.equal(torch.load(tmp_path / f"rank{rank}.pt"), expected)


def test_a_model_call_outside_a_step_is_explained_on_every_stage(tmp_path):
    # A sample generated in on_validation_epoch_end: the last stage lacks the hidden state it would
    # receive, the first stage stopped after its blocks (a bare "stage boundary" escaped to the user).
    output = run_workers("generate_worker.py", 2, str(tmp_path), "epoch_end", expect_failure=True)
    for rank in (0, 1):
        lines = [line for line in output.splitlines() if line.startswith(f"[rank{rank}]:")]
        assert any("model was called outside a pipelined step" in line for line in lines), rank
