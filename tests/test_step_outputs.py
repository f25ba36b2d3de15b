"""What a step's code sees and returns under a pipeline, collectives inside steps, and what a
failure leaves behind (issue 12, items 4 and 6)."""

import json
import time

import pytest
import torch
from distributed import run_workers
from tiny_models import tiny_bert


def _reports(out, mode, nprocs):
    return [json.loads((out / f"{mode}_rank{rank}.json").read_text()) for rank in range(nprocs)]


@pytest.fixture(scope="module")
def everywhere(tmp_path_factory):
    out = tmp_path_factory.mktemp("everywhere")
    run_workers("outputs_worker.py", 4, str(out), "everywhere")
    return _reports(out, "everywhere", 4)  # ranks 0, 1: replica 0 (last stage first); 2, 3: replica 1


def test_validation_code_after_the_model_call_runs_on_every_stage(everywhere):
    # Lightning's validation_step_outputs recipe: 14 samples, 7 per replica, every epoch.
    assert [r["seen"]["val_rows"] for r in everywhere] == [[7, 7]] * 4
    assert len({r["metrics"]["val_logit_mean"] for r in everywhere}) == 1
    assert len({r["metrics"]["val_loss"] for r in everywhere}) == 1
    # A head outside the model call trains on the last stages; validation runs it on every stage.
    assert len({r["metrics"]["val_head"] for r in everywhere}) == 1


def test_a_metric_updated_on_every_stage_counts_each_replica_once(everywhere):
    assert [r["metrics"]["val_samples"] for r in everywhere] == [14.0] * 4
    # Metrics outside the module's submodules too: one it keeps in a dict, and a callback's.
    assert [r["seen"]["kept_val_samples"] for r in everywhere] == [[14.0, 14.0]] * 4
    assert [r["seen"]["callback_val_samples"] for r in everywhere] == [[14.0, 14.0]] * 4
    # In training: a callback's, updated from every batch on every stage, and one the module keeps in
    # a dict, updated after the model call (the last stages) and synced over the replicas at each call.
    assert [r["seen"]["callback_train_samples"] for r in everywhere] == [[30.0, 30.0]] * 4
    assert [r["seen"]["kept_train_samples"] for r in everywhere] == [[30.0, 30.0]] * 4


def test_a_backward_in_an_evaluation_step_is_refused_under_a_pipeline(tmp_path):
    run_workers("outputs_worker.py", 2, str(tmp_path), "grad_in_eval")
    for report in _reports(tmp_path, "grad_in_eval", 2):
        assert (
            "calls the model with gradients enabled" in report["refused"] and "pipeline_length=1" in report["refused"]
        )


def test_all_gather_in_a_step_gives_one_entry_per_replica(everywhere):
    for report in everywhere:
        assert report["seen"]["val_gather"] == [[2, 4], [2, 3]] * 2
    # In training_step the code after the model call runs on the last stages only (ranks 0 and 2):
    # 4 steps of 2 micro-batches, 2 epochs.
    assert [r["seen"].get("train_gather") for r in everywhere] == [[[2]] * 16, None, [[2]] * 16, None]


def test_single_number_outputs_of_a_training_step_cover_the_whole_batch(everywhere):
    # label0 = the batch's fraction of label 0, computed per micro-batch (the last batch: 2 + 1 samples).
    for rank in (0, 2):
        assert everywhere[rank]["seen"]["label0_matches"] == [True] * 8


def test_log_calls_travel_pickled_only_when_they_change(everywhere):
    # "late" is logged from the third step of each epoch: the calls change twice per epoch, over 8 steps.
    assert [r["seen"]["structure_messages"] for r in everywhere] == [[4]] * 4
    for first, second in ((0, 1), (2, 3)):  # the stages of a replica log the same values
        assert everywhere[first]["metrics"] == everywhere[second]["metrics"]
    assert everywhere[0]["metrics"]["late"] == pytest.approx(2 * everywhere[0]["metrics"]["train_loss"])


def test_a_logged_value_is_what_it_held_at_the_call_and_the_last_call_of_a_step_counts(everywhere):
    for report in everywhere:
        assert report["metrics"]["changed_after"] == pytest.approx(report["metrics"]["train_loss"])
        assert report["metrics"]["twice"] == 3.0


def test_per_token_predictions_are_gathered_in_the_documented_order(everywhere):
    # 13 samples of varying length, batch 3: replica 0 reads 3 batches, replica 1 reads 2; the
    # sequence length differs from batch to batch, so rank 0 gets the batches whole, interleaved.
    assert everywhere[0]["token_order_matches"] == [True] * 5
    assert [shape[0] for shape in everywhere[0]["token_shapes"]] == [3, 3, 3, 3, 1]
    assert everywhere[1]["token_shapes"] == everywhere[0]["token_shapes"][0::2]  # its replica's shard
    assert everywhere[3]["token_shapes"] == everywhere[0]["token_shapes"][1::2]


def test_a_replica_without_predict_batches_returns_none_and_the_others_their_own(everywhere):
    # A loader sharded by the user (not by Lightning's sampler): each rank keeps what it predicted, as under DDP.
    assert everywhere[0]["one_sample"][0][0] == 1 and len(everywhere[0]["one_sample"]) == 1
    assert everywhere[1]["one_sample"] == everywhere[0]["one_sample"]  # the first stage of the same replica
    assert [r["one_sample"] for r in everywhere[2:]] == [None, None]  # Lightning skipped their loop


def test_predictions_of_a_loader_lightning_did_not_shard_stay_on_their_rank(everywhere):
    # Trainer(use_distributed_sampler=False): every rank predicted all 13 samples (batches of 3), as under DDP.
    assert [shape[0] for shape in everywhere[0]["unsharded_shapes"]] == [3, 3, 3, 3, 1]  # not each sample twice
    assert all(r["unsharded_shapes"] == everywhere[0]["unsharded_shapes"] for r in everywhere)


def test_outputs_collected_in_training_step_fail_with_an_explanation(tmp_path):
    # Lightning's training_step_outputs recipe: the list stays empty on the first stage.
    output = run_workers("outputs_worker.py", 2, str(tmp_path), "train_list", expect_failure=True, timeout=240)
    assert "stack expects a non-empty TensorList" in output
    assert "the code after the model call runs on the last stage of each pipeline only" in output


def _whole_trained_model_on_both_ranks(out):
    """The weights both ranks saved after the failure: finite, equal, and trained."""
    weights = [torch.load(out / f"weights_rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    _assert_whole_and_trained(weights[0])
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=0, atol=0, msg=name)
    return weights[0]


@pytest.mark.parametrize("exception", ["ValueError", "KeyboardInterrupt"])
def test_an_exception_on_every_rank_leaves_the_whole_model_on_every_rank(exception, tmp_path):
    run_workers("outputs_worker.py", 2, str(tmp_path), "fail_all", exception, timeout=240)
    assert [r["stopped_by"] for r in _reports(tmp_path, "fail_all", 2)] == [
        "SystemExit" if exception == "KeyboardInterrupt" else exception
    ] * 2
    weights = _whole_trained_model_on_both_ranks(tmp_path)
    # The user saves the weights, then everything: the optimizer state is gathered over the
    # group the ranks agreed in (under a KeyboardInterrupt the world's group is closed).
    saved = torch.load(tmp_path / "after_failure.ckpt", weights_only=True)["state_dict"]
    assert saved.keys() == weights.keys()
    full = torch.load(tmp_path / "full_after_failure.ckpt", weights_only=True)
    for name, value in weights.items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(full["state_dict"][name], value, rtol=0, atol=0, msg=name)
    # Lightning's OnExceptionCheckpoint saved the whole model as the run stopped on every rank.
    caught = torch.load(tmp_path / "on_exception.ckpt", weights_only=True)
    assert caught["state_dict"].keys() == weights.keys()
    for name, value in weights.items():
        torch.testing.assert_close(caught["state_dict"][name], value, rtol=0, atol=0, msg=name)
    # Both hold every weight's optimizer state, the same.
    assert len(caught["optimizer_states"][0]["state"]) == len(weights)
    torch.testing.assert_close(full["optimizer_states"], caught["optimizer_states"], rtol=0, atol=0)


def test_fits_in_the_same_processes_leave_nothing_behind(tmp_path):
    # Each fit's process groups (gloo: threads and connections of their own) go with its teardown,
    # not at some later garbage collection: a sweep of many trials does not pile them up. Nor does a
    # model trained by several fits gather the strategy's state_dict guards (one a fit, before).
    run_workers("outputs_worker.py", 2, str(tmp_path), "repeated_fits", timeout=240)
    for report in _reports(tmp_path, "repeated_fits", 2):
        threads = report["threads_after_fit"]
        assert threads[-1] <= threads[0], threads
        assert report["state_dict_hooks_after_fit"] == [0] * 4


@pytest.mark.parametrize("pipeline_length", ["2", "1"])
def test_a_ctrl_c_while_a_rank_waits_inside_gloo_still_saves_and_restores_the_whole_model(pipeline_length, tmp_path):
    # Rank 1, running Python, is interrupted at once; rank 0 waits inside gloo for it (2x1: for the
    # hidden state; 1x2: in the gradient all-reduce), where the signal reaches it only when the wait
    # ends (the 90 s timeout): longer than the failure agreement waits (30 s), unless rank 1 wakes it.
    run_workers("outputs_worker.py", 2, str(tmp_path), "ctrl_c", pipeline_length, timeout=240)
    reports = _reports(tmp_path, "ctrl_c", 2)
    assert [r["stopped_by"] for r in reports] == ["SystemExit"] * 2
    assert all(r["seconds"] < 60 for r in reports)
    weights = _whole_trained_model_on_both_ranks(tmp_path)
    # OnExceptionCheckpoint wrote the whole model, and every weight's optimizer state.
    caught = torch.load(tmp_path / "on_exception.ckpt", weights_only=True)
    assert caught["state_dict"].keys() == weights.keys()
    for name, value in weights.items():
        torch.testing.assert_close(caught["state_dict"][name], value, rtol=0, atol=0, msg=name)
    assert len(caught["optimizer_states"][0]["state"]) == len(weights)
    # ModelCheckpoint(save_on_exception=True, save_last=True) saved too: its file_exists vote and
    # broadcasts went over the group the ranks agreed in.
    assert sorted(path.name for path in (tmp_path / "saved").iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    last = torch.load(tmp_path / "saved" / "last.ckpt", weights_only=True)
    torch.testing.assert_close(last["state_dict"], caught["state_dict"], rtol=0, atol=0)


def test_a_ctrl_c_while_a_rank_waits_in_the_old_layouts_group_after_a_transition_still_saves(tmp_path):
    # A transition (2x2 -> 1x4) at the end of epoch 0: the epoch's values are reduced over the old
    # layout's stage groups. Rank 1, running Python, is interrupted at once; its replica of the old
    # stage waits for it there, where the signal reaches it only at the 90 s timeout, unless rank 1
    # closes its connections in that group too. Every rank must join the failure agreement (30 s) in time.
    run_workers("outputs_worker.py", 4, str(tmp_path), "ctrl_c_after_transition", timeout=300)
    reports = _reports(tmp_path, "ctrl_c_after_transition", 4)
    assert [r["layout_at_ctrl_c"] for r in reports] == ["1x4"] * 4
    assert [r["stopped_by"] for r in reports] == ["SystemExit"] * 4
    assert all(r["seconds"] < 80 for r in reports)
    _assert_whole_and_trained(torch.load(tmp_path / "on_exception.ckpt", weights_only=True)["state_dict"])


def test_a_ctrl_c_during_a_transition_is_held_until_it_ends_and_the_whole_model_is_saved(tmp_path):
    # Interrupted half-way through moving blocks (2x1 -> 1x2), no rank could tell which blocks
    # arrived: both ranks finish the move first, then stop in the new layout.
    run_workers("outputs_worker.py", 2, str(tmp_path), "ctrl_c_in_transition", timeout=240)
    reports = _reports(tmp_path, "ctrl_c_in_transition", 2)
    assert [r["stopped_by"] for r in reports] == ["SystemExit"] * 2
    assert [r["layout_at_stop"] for r in reports] == ["1x2"] * 2
    weights = _whole_trained_model_on_both_ranks(tmp_path)
    caught = torch.load(tmp_path / "on_exception.ckpt", weights_only=True)
    for name, value in weights.items():
        torch.testing.assert_close(caught["state_dict"][name], value, rtol=0, atol=0, msg=name)


def test_an_exception_on_one_rank_wakes_the_other_and_the_whole_model_is_checkpointed(tmp_path):
    # OnExceptionCheckpoint saves before the strategy hears of the exception, on the rank that raised
    # it (the last stage, after the model call) while the other waits for it inside the pipeline:
    # the raising rank closes its connections, the waiting one stops too, and they agree in time.
    start = time.monotonic()
    output = run_workers(
        "outputs_worker.py", 2, str(tmp_path), "fail_one_checkpointed", expect_failure=True, timeout=240
    )
    assert time.monotonic() - start < 200
    assert "[rank0] fit failed: RuntimeError: the user's step failed on one rank" in output
    assert "[rank1] fit failed: PeerError: rank 1 lost global rank 0" in output
    assert "could not get the blocks" not in output
    caught = torch.load(tmp_path / "on_exception.ckpt", weights_only=True)["state_dict"]
    _assert_whole_and_trained(caught)


def test_an_exception_on_one_rank_ends_every_rank_with_the_whole_model(tmp_path):
    start = time.monotonic()
    output = run_workers("outputs_worker.py", 2, str(tmp_path), "fail_one", expect_failure=True, timeout=240)
    assert time.monotonic() - start < 200
    assert "the user's step failed on one rank" in output and "lost global rank 0" in output
    assert "save refused" not in output and "could not get the blocks" not in output
    saved = torch.load(tmp_path / "after_failure.ckpt", weights_only=True)["state_dict"]
    _assert_whole_and_trained(saved)


def test_a_second_fit_whose_set_up_fails_saves_the_whole_weights_and_no_partial_optimizer_state(tmp_path):
    # The first fit left each rank the optimizer state of its own stage's blocks; the second stops
    # before building its engine: its weights are whole, its optimizers may still be the first fit's.
    run_workers("outputs_worker.py", 2, str(tmp_path), "second_set_up_fails")
    for rank in (0, 1):
        report = json.loads((tmp_path / f"second_set_up_fails_rank{rank}.json").read_text())
        assert report["second_fit"] == "the second fit's configure_optimizers failed"
        assert (
            "the optimizers may still be the last fit's" in report["refused"]
            and "weights_only=True" in report["refused"]
        )
    assert not (tmp_path / "with_optimizer.ckpt").exists()
    saved = torch.load(tmp_path / "weights.ckpt", weights_only=True)["state_dict"]
    _assert_whole_and_trained(saved)
    for rank in (0, 1):  # every rank holds the whole model, as saved
        for name, value in torch.load(tmp_path / f"weights_rank{rank}.pt", weights_only=True).items():
            assert torch.equal(value, saved[name]), name


def test_a_return_of_the_blocks_that_breaks_off_half_way_leaves_saves_refused(tmp_path):
    # After an exception on every rank the ranks give each other back their blocks; where that breaks
    # off (a peer lost in it), a rank's other-stage blocks are unfilled memory: no save may write them.
    run_workers("outputs_worker.py", 2, str(tmp_path), "restore_raises")
    for rank in (0, 1):
        report = json.loads((tmp_path / f"restore_raises_rank{rank}.json").read_text())
        assert report["fit"] == "a peer was lost while the blocks were given back"
        assert "the model is incomplete" in report["refused"]
        assert "its last run stopped on an error before this rank got back the blocks" in report["no_layout"]
    assert not (tmp_path / "weights.ckpt").exists()


def _assert_whole_and_trained(state):
    """Every weight of ``state`` finite and moved from its initial value."""
    initial = tiny_bert(seed=0, dropout=0.0).state_dict()
    for name, value in state.items():
        assert torch.isfinite(value.float()).all(), name
        assert not torch.equal(value, initial[name.removeprefix("model.")]), f"{name} was not trained"


class _LoggingModule:
    """The ``self.log`` calls of Lightning's documentation and of common fine-tuning scripts."""

    @staticmethod
    def build():
        import lightning.pytorch as pl

        class Module(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.model = tiny_bert(seed=0, dropout=0.0)

            def training_step(self, batch, batch_idx):
                loss = self.model(**batch).loss
                samples = len(batch["labels"])
                lengths = batch["attention_mask"].sum(1).float()
                self.log("loss_loader_batch", loss, batch_size=8, on_step=True, on_epoch=True)  # hparams-style
                self.log("loss_own_batch", loss, batch_size=samples, on_step=True, on_epoch=True)
                self.log("samples_sum", float(samples), reduce_fx=sum, on_step=True, on_epoch=True)
                self.log("samples_torch_sum", float(samples), reduce_fx=torch.sum, on_step=True, on_epoch=True)
                tokens = batch["attention_mask"].sum()
                token_mean = (batch["input_ids"] * batch["attention_mask"]).sum() / tokens
                self.log(
                    "loss_padded_tokens", loss, batch_size=int(batch["input_ids"].numel()), on_step=True, on_epoch=True
                )
                self.log("id_token_mean", token_mean.float(), batch_size=int(tokens), on_step=True, on_epoch=True)
                self.log("longest_max", lengths.max(), reduce_fx=max, on_step=True, on_epoch=True)
                self.log("shortest_min", lengths.min(), reduce_fx=min, on_step=True, on_epoch=True)
                return loss

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.0)

        return Module()


def _logged_by(strategy):
    import lightning.pytorch as pl
    from tiny_models import RandomTokenDataset
    from torch.utils.data import DataLoader, DistributedSampler

    dataset = RandomTokenDataset(size=14, seed=1)  # batches of 8 and 6
    loader = DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset, 1, 0, shuffle=False))
    seen = []

    class Steps(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            seen.append({k: float(v) for k, v in trainer.logged_metrics.items() if k.endswith("_step")})

    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, logger=False, callbacks=[Steps()],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(_LoggingModule.build(), loader)
    return seen, {k: float(v) for k, v in trainer.logged_metrics.items() if k.endswith("_epoch")}


def test_log_calls_merged_over_uneven_microbatches_log_what_one_process_logs():
    # 3 micro-batches split the batches 3/3/2 and 2/2/2. The same batch_size on every micro-batch,
    # the batch's size (or the earlier batches': the loader's), is the whole batch's; a count of
    # tokens, the micro-batch's. Python's sum, max and min reduce as torch's do.
    from lightning_pipetx import ElasticPipelineStrategy

    plain_steps, plain_epoch = _logged_by("auto")
    ours_steps, ours_epoch = _logged_by(ElasticPipelineStrategy(num_microbatches=3, profile_steps=0, cache=False))
    assert [step["samples_sum_step"] for step in plain_steps] == [8.0, 6.0]
    assert len(ours_steps) == len(plain_steps) == 2 and len(plain_epoch) == 8 and len(plain_steps[0]) == 8
    for ours, plain in zip(ours_steps + [ours_epoch], plain_steps + [plain_epoch]):
        assert ours.keys() == plain.keys()
        for name in plain:
            assert ours[name] == pytest.approx(plain[name], rel=1e-6, abs=1e-7), name
