"""Common LightningModule recipes under the strategy, as a new user writes them (issue 12)."""

import functools
import json

import lightning.pytorch as pl
import pytest
import tiny_models as tm
import torch
from distributed import run_workers
from elastic_cases import build_module, reference_run, train_loader
from equivalence_cases import build_case_module
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.profilers import PyTorchProfiler
from recipes_cases import (
    STEPS,
    albert_module,
    block_hooks_module,
    deberta_conv_module,
    fp16_module,
    fp16_reference,
    hidden_states_module,
    hook_counting_module,
    mixed_precision_module,
    mixed_precision_reference,
    reference_model_module,
    scheduled_reference,
    step_synced_metric_reference,
)
from recipes_cases import train_loader as recipes_loader

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback
from lightning_pipetx.strategy.model_checks import (
    UnsupportedOutputsError,
    UnsupportedRecipeError,
    microbatches_for_training,
)


def test_shape_based_parameter_groups_survive_a_transition_and_resume_without_the_strategy(tmp_path):
    # nanoGPT's recipe: weight decay on matrices only. configure_optimizers runs after the
    # blocks a rank does not hold are released: their shapes must still be the true ones.
    run_workers("elastic_worker.py", 2, str(tmp_path), "bert", "groups")
    expected = reference_run("bert", optimizer="adamw_groups")
    final = torch.load(tmp_path / "final.pt", weights_only=True)["state"]
    for key, value in expected["state"].items():
        torch.testing.assert_close(final[key], value, atol=1e-5, rtol=1e-4, msg=key)

    checkpoint = tmp_path / "epoch=2-step=12.ckpt"
    saved = torch.load(checkpoint, weights_only=False)
    assert saved["pipetx"]["layout"] == "1x2"  # trained through the 2x1 -> 1x2 transition
    assert [len(g["params"]) for g in saved["optimizer_states"][0]["param_groups"]] == [
        len(g["params"]) for g in expected["optimizer"]["param_groups"]
    ]
    # The consolidated checkpoint resumes under a plain single-device Trainer.
    module = build_module("bert", "adamw_groups")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, train_loader("bert"), ckpt_path=checkpoint)
    assert trainer.current_epoch == 4 and trainer.global_step == 16


def _raised_on_both_ranks(output, error):
    for rank in (0, 1):
        assert f"[rank{rank}]: {error}: " in output


def _reports(out, mode):
    return [json.loads((out / f"{mode}_rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("mode", ["hooks", "hooks_profiled"])
def test_backward_hooks_fire_on_every_rank_and_the_summary_counts_every_weight(mode, tmp_path):
    # hooks_profiled: under Lightning's PyTorchProfiler, whose forward hooks on every module time them
    run_workers("recipes_worker.py", 2, str(tmp_path), mode)
    full_size = sum(p.numel() for p in hook_counting_module().parameters())
    for report in _reports(tmp_path, mode):
        assert report["hook_calls"] == {"on_before_backward": STEPS, "on_after_backward": STEPS, "grads_seen": STEPS}
        assert report["summary_parameters"] == full_size  # released blocks keep their sizes


@pytest.mark.parametrize("mode", ["fp16", "fp16_fused_replicas"])
def test_fp16_loss_scaling_agrees_across_stages(mode, tmp_path):
    # The first gradient of a block overflows: every rank must skip that step. fp16: a 2-stage
    # pipeline, AdamW; fp16_fused_replicas: a fused AdamW (it unscales inside its own step) on 2
    # replicas, whose reduced gradients overflow together.
    run_workers("recipes_worker.py", 2, str(tmp_path), mode)
    # the pipeline's 2 micro-batches round as one process accumulating them does; the replicas
    # (interleaved halves, as DDP's) as one process's whole batch, to fp16's precision
    pipelined = mode == "fp16"
    expected = fp16_reference("adamw" if pipelined else "adamw_fused", microbatches=2 if pipelined else 1)
    reports = _reports(tmp_path, mode)
    assert [r["scale"] for r in reports] == [expected["scale"]] * 2
    # FreezeCallback leaves out the overflowed step on every rank, as one process does, though
    # under the pipeline the other stage's gradients of that step were finite
    assert expected["freeze"]["norm_steps"] == STEPS - 1
    for report in reports:
        assert report["freeze"]["norm_steps"] == STEPS - 1
        torch.testing.assert_close(report["freeze"]["norm_sums"], expected["freeze"]["norm_sums"], rtol=1e-2, atol=0)
    state = torch.load(tmp_path / f"{mode}.pt", weights_only=True)["state"]
    tolerance = {"atol": 1e-6, "rtol": 1e-5} if pipelined else {"atol": 2e-3, "rtol": 1e-2}
    for key, value in expected["state"].items():
        torch.testing.assert_close(state[key], value, **tolerance, msg=key)


@pytest.mark.parametrize(
    "mode", ["reference_model", "reference_model_hidden_states", "reference_model_at_fit_start_replicas"]
)
def test_a_frozen_copy_of_the_model_that_the_loss_reads_trains_as_one_process(mode, tmp_path):
    # A reference model (a KL term to a frozen copy's predictions) is built as the model is, as an
    # EMA's copy is, but nothing writes it: it is not refused, and every rank reads its own whole copy.
    # reference_model_hidden_states: asked for its hidden states after the model call (the last stage
    # only), which the pipelined model could not give; the teacher runs whole.
    # reference_model_at_fit_start_replicas: copied in on_fit_start on 1x2, as under DDP; the copy
    # took the strategy's forward and hooks along (their process groups cannot be copied: TypeError).
    run_workers("recipes_worker.py", 2, str(tmp_path), mode)
    pipelined = not mode.endswith("replicas")
    module = reference_model_module(at_fit_start=not pipelined, hidden_states=mode.endswith("hidden_states"))
    expected = mixed_precision_reference(module, {}, microbatches=2 if pipelined else 1)["state"]
    state = torch.load(tmp_path / f"{mode}.pt", weights_only=True)["state"]
    assert any(key.startswith("reference.") for key in expected)
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, atol=1e-6, rtol=1e-5, msg=key)


def test_bf16_mixed_pipeline_trains_as_one_process_accumulating_its_microbatches(tmp_path):
    run_workers("recipes_worker.py", 2, str(tmp_path), "bf16")
    expected = mixed_precision_reference(mixed_precision_module(), {"precision": "bf16-mixed"}, microbatches=2)
    for report in _reports(tmp_path, "bf16"):
        assert report["freeze"]["norm_steps"] == STEPS
        torch.testing.assert_close(report["freeze"]["norm_sums"], expected["freeze"]["norm_sums"], rtol=1e-5, atol=0)
    state = torch.load(tmp_path / "bf16.pt", weights_only=True)["state"]
    for key, value in expected["state"].items():
        torch.testing.assert_close(state[key], value, atol=1e-6, rtol=1e-5, msg=key)


def test_fp16_with_a_fused_optimizer_under_a_pipeline_is_refused(tmp_path):
    # Each stage would check only its own gradients for an overflow inside the fused step.
    output = run_workers("recipes_worker.py", 2, str(tmp_path), "fp16_fused", expect_failure=True)
    _raised_on_both_ranks(output, "lightning_pipetx.strategy.loss_scaling.OverflowAgreementError")
    assert "AdamW(fused=True) under a 2-stage pipeline" in output and "precision='bf16-mixed'" in output


@pytest.mark.parametrize("strategy", ["auto", "elastic"])
def test_clipping_by_norm_with_a_fused_optimizer_under_fp16_is_refused_as_plain_lightning_refuses_it(strategy):
    # The fused step unscales the gradients itself: clipped before it, they still carry the scale.
    trainer = tm.make_trainer(
        [],
        strategy=ElasticPipelineStrategy() if strategy == "elastic" else "auto",
        plugins=[MixedPrecision("16-mixed", "cpu")],
        gradient_clip_val=1.0,
        max_steps=1,
    )
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        trainer.fit(fp16_module("adamw_fused"), recipes_loader(8))


def test_validation_on_a_clock_is_refused_on_several_processes(tmp_path):
    # Lightning decides on each rank's clock: the ranks would validate after different steps.
    output = run_workers("recipes_worker.py", 2, str(tmp_path), "timed_validation", expect_failure=True)
    _raised_on_both_ranks(output, "lightning_pipetx.strategy.model_checks.UnsupportedRecipeError")
    assert "val_check_interval=<a time>, 1 s) on 2 processes" in output and "Pass an int" in output


def test_learning_rates_that_differ_between_ranks_stop_the_run(tmp_path):
    # A plateau schedule reading a value each rank logged on its own: the ranks would train apart.
    output = run_workers("recipes_worker.py", 2, str(tmp_path), "plateau", expect_failure=True)
    _raised_on_both_ranks(output, "lightning_pipetx.strategy.model_checks.UnsupportedRecipeError")
    assert "learning rate of parameter group 0 differs between ranks (0.0001 to 0.001)" in output
    assert "sync_dist=True" in output


def test_a_model_that_drops_blocks_at_random_is_refused_under_a_pipeline(tmp_path):
    output = run_workers("recipes_worker.py", 2, str(tmp_path), "layerdrop", expect_failure=True)
    _raised_on_both_ranks(output, "lightning_pipetx.strategy.model_checks.UnsupportedRecipeError")
    assert "BertForSequenceClassification.config.layerdrop=0.1 under a 2-stage pipeline" in output


@pytest.mark.parametrize("cache", [True, "auto"])
def test_a_model_that_drops_blocks_at_random_is_not_cached(cache, caplog):
    module = hook_counting_module()
    module.model.config.layerdrop = 0.1
    freeze, rates = FreezeCallback(alpha=1 / 2, signal="schedule"), tm.HitRates()
    trainer = tm.make_trainer([freeze, rates], max_epochs=3, strategy=ElasticPipelineStrategy(cache=cache))
    if cache is True:
        with pytest.raises(UnsupportedRecipeError, match="layerdrop=0.1 skips frozen blocks at random"):
            trainer.fit(module, recipes_loader(8))
        return
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        trainer.fit(module, recipes_loader(8))
    assert freeze.frozen_blocks > 0 and not any(rates.rates)  # nothing served
    assert "layerdrop=0.1 skips frozen blocks at random" in caplog.text


def test_albert_sharing_its_layers_weights_is_refused_under_a_pipeline(tmp_path):
    # 4 layers run 2 layer groups twice each: a stage would run its group for both.
    output = run_workers("recipes_worker.py", 2, str(tmp_path), "albert", expect_failure=True)
    _raised_on_both_ranks(output, "lightning_pipetx.strategy.model_checks.UnsupportedRecipeError")
    assert "AlbertForSequenceClassification with num_hidden_groups=2 for 4 layers" in output


def test_a_block_list_holding_one_module_several_times_is_refused_under_a_pipeline(tmp_path):
    output = run_workers("recipes_worker.py", 2, str(tmp_path), "shared_list", expect_failure=True)
    _raised_on_both_ranks(output, "lightning_pipetx.strategy.model_checks.UnsupportedRecipeError")
    assert "the weight 'model.bert.encoder.layer.1.attention.self.query.weight' is shared with block 0" in output


def _fit_repeating_blocks(module, cache, caplog, epochs):
    """Fit a module whose training step runs a block twice: refused with cache=True, else trained
    without the cache (turned off with a warning under "auto"); the trainer, or None if refused."""
    freeze, rates = FreezeCallback(alpha=1 / 2, signal="schedule"), tm.HitRates()
    trainer = tm.make_trainer([freeze, rates], max_epochs=epochs, strategy=ElasticPipelineStrategy(cache=cache))
    if cache is True:
        with pytest.raises(ValueError, match="block 0 ran twice in one training_step"):
            trainer.fit(module, recipes_loader(8))
        return None
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        trainer.fit(module, recipes_loader(8))
    assert freeze.frozen_blocks > 0 and not any(rates.rates)
    assert ("block 0 ran twice in one training_step" in caplog.text) == (cache == "auto")
    return trainer


@pytest.mark.parametrize("cache", [False, True, "auto"])
def test_blocks_that_run_more_than_once_per_step_are_not_cached(cache, caplog):
    # One device: freezing alone is exact; a cached prefix would stand for every run of a block.
    trainer = _fit_repeating_blocks(albert_module(), cache, caplog, epochs=3)
    if trainer is not None:
        assert trainer.global_step == 12


def test_checkpointing_around_the_blocks_fails_with_an_explanation_under_a_pipeline(tmp_path):
    # timm recomputes segments of its blocks in the backward, beyond what a stage holds.
    output = run_workers("recipes_worker.py", 2, str(tmp_path), "timm_checkpointing", expect_failure=True, timeout=120)
    assert "activation checkpointing wraps several blocks from outside them" in output


def test_reentrant_checkpointing_of_a_stage_s_last_block_is_refused_under_a_pipeline(tmp_path):
    # The stage's output, computed without autograd inside the segment, would carry no gradient
    # back: the first stage's weights would never train.
    output = run_workers("recipes_worker.py", 2, str(tmp_path), "reentrant", expect_failure=True, timeout=120)
    assert "the last block of a pipeline stage, ran inside a reentrant activation checkpoint" in output
    assert "checkpoint inside each block's forward" in output


def test_reentrant_checkpointing_that_freezing_leaves_without_gradient_stops_every_stage(tmp_path):
    # Blocks 0 and 1 (the first stage) freeze after epoch 0: the last stage's input needs no gradient,
    # and its first block, checkpointed reentrantly, gets none. Only that stage sees it; both stop.
    output = run_workers("recipes_worker.py", 2, str(tmp_path), "reentrant_after_freeze", expect_failure=True)
    _raised_on_both_ranks(output, "RuntimeError: FreezeCallback")
    assert "block 2, the first block still training, got no gradient" in output


def test_weight_averaging_under_a_pipeline_is_refused(tmp_path):
    # EMA averages every weight after each step; a rank holds only its stage's blocks.
    output = run_workers("recipes_worker.py", 2, str(tmp_path), "ema", expect_failure=True)
    _raised_on_both_ranks(output, "lightning_pipetx.strategy.lightning_compat.WeightAveragingError")
    assert "EMAWeightAveraging under a 2-stage pipeline" in output and "pipeline_length=1" in output


def test_exporting_the_model_during_fit_under_a_pipeline_is_refused_and_works_at_fit_end(tmp_path):
    # save_pretrained (and torch.save of its state_dict) from a callback on rank 0, the last stage,
    # whose released copies of the first stage's blocks read NaN until fit ends
    run_workers("recipes_worker.py", 2, str(tmp_path), "exports")
    report = json.loads((tmp_path / "exports_rank0.json").read_text())
    assert len(report["refusals"]) == 2  # at batch 1, and in on_train_end
    assert all("does not hold blocks [0, 1]" in text and "on_fit_end" in text for text in report["refusals"])
    assert report["exported_at_fit_end"]
    # a checkpoint's hooks read the whole model on rank 0, which writes it, and every key on rank 1
    assert report["saved_finite"] == [True]
    assert _reports(tmp_path, "exports")[1]["saved_finite"] == [False]
    final = torch.load(tmp_path / "exports.pt", weights_only=True)["state"]
    assert all(torch.isfinite(value).all() for value in final.values() if value.is_floating_point())


def test_model_pruning_under_a_pipeline_is_refused(tmp_path):
    # Its masks are computed from the values of every weight it prunes; a rank holds only its stage's blocks.
    output = run_workers("recipes_worker.py", 2, str(tmp_path), "pruning", expect_failure=True)
    _raised_on_both_ranks(output, "lightning_pipetx.strategy.model_checks.UnsupportedRecipeError")
    assert "ModelPruning under a 2-stage pipeline" in output and "pipeline_length=1" in output


def test_pruning_frozen_blocks_of_replicas_switches_their_cache_off_together(tmp_path):
    # 2 replicas (1x2), each with a cache: the blocks pruned again after they froze outdate its
    # states on both ranks, which agree to switch it off before epoch 2 would serve them.
    output = run_workers("recipes_worker.py", 2, str(tmp_path), "pruning_replicas")
    assert output.count("AutoCache switched off for this run: the frozen prefix changed") == 2  # each rank's cache
    assert "'model.bert.encoder.layer.0.attention.output.dense.weight_mask'" in output
    assert [r["cache_hit_rate"] for r in _reports(tmp_path, "pruning_replicas")] == [0.0, 0.0]


def test_a_metric_synced_on_every_step_syncs_over_its_stage_s_ranks_under_a_pipeline(tmp_path):
    # The last stage alone runs the code after the model call: the accuracy's sync on each update
    # (dist_sync_on_step=True) must not wait for the first stage, which waits for gradients. Every
    # stage runs the code before it: the labels' mean syncs there on each stage alike.
    run_workers("recipes_worker.py", 2, str(tmp_path), "step_synced_metric")
    expected = step_synced_metric_reference()
    assert [r["values"] for r in _reports(tmp_path, "step_synced_metric")] == [pytest.approx(expected)] * 2


@pytest.mark.parametrize("batch_norm", [True, False])
def test_sync_batchnorm_is_refused_for_a_model_with_batch_norms(batch_norm):
    module = hook_counting_module()
    if batch_norm:
        module.norm = torch.nn.BatchNorm1d(4)
    trainer = tm.make_trainer([], strategy=ElasticPipelineStrategy(), sync_batchnorm=True, max_steps=1)
    if batch_norm:
        with pytest.raises(UnsupportedRecipeError, match="sync_batchnorm=False"):
            trainer.fit(module, recipes_loader(8))
    else:  # nothing to sync: it trains
        trainer.fit(module, recipes_loader(8))
        assert trainer.global_step == 1


def test_a_model_with_batch_norms_trains_on_whole_batches_unless_asked_otherwise(caplog):
    # In training a batch norm normalizes by the statistics of the batch it sees: a micro-batch's
    # gives other gradients than one process's.
    module = hook_counting_module()
    assert microbatches_for_training("auto", module) == "auto"  # 2 * pipeline_length under a pipeline
    module.norm = torch.nn.BatchNorm1d(4)
    assert microbatches_for_training("auto", module) == 1
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        assert microbatches_for_training(4, module) == 4
    assert "num_microbatches=4 with batch norms (norm, ...)" in caplog.text
    trainer = tm.make_trainer([], max_steps=1, strategy=ElasticPipelineStrategy(pipeline_length=1))
    trainer.fit(module, recipes_loader(8))
    assert trainer.strategy.autopipe.microbatches == 1


@pytest.mark.parametrize("mode", ["random_collate", "own_sampler", "random_collate_popped"])
def test_stages_reading_different_batches_is_an_error(mode, tmp_path):
    # random_collate_popped: the step takes every field out of its batch before the model call; the
    # stages compare the batches as the loader gave them.
    output = run_workers("recipes_worker.py", 2, str(tmp_path), mode, expect_failure=True)
    assert "must read the same batches" in output
    assert "(seed_everything(seed + rank))" in output and "(random_split without a generator)" in output
    for rank in (0, 1):  # every rank stops on the error, so every rank gets its whole model back
        assert f"[rank{rank}]: lightning_pipetx.strategy.stage_runner.BatchMismatchError: " in output
    assert "could not get the blocks" not in output


@pytest.mark.parametrize(
    "mode, error, text",
    [
        (
            "hidden_states",
            "UnsupportedOutputsError",
            "BertForSequenceClassification was asked for output_hidden_states",
        ),
        ("intermediates", "UnsupportedOutputsError", "VisionTransformer was asked for forward_intermediates"),
        # DeBERTa-v2's conv between blocks 0 and 1, deep supervision through block hooks, an L2 penalty in the loss.
        ("between_blocks", "UnsupportedRecipeError", "changes the hidden state between blocks 0 and 1, outside"),
        ("block_hooks", "UnsupportedRecipeError", "has a forward hook (register_forward_hook) under a pipeline"),
        ("block_hooks_inside", "UnsupportedRecipeError", "make a hook that changes its module's output (an adapter)"),
        ("weight_penalty", "UnsupportedRecipeError", "reads the blocks' weights after the model call"),
        ("averaged_model", "WeightAveragingError", "ema is an average of the model's weights (torch's AveragedModel)"),
        ("timm_ema", "WeightAveragingError", "ema is an average of the model's weights (timm's ModelEmaV3)"),
        # A deepcopy moved towards the model after each batch: its copies of the other stage's blocks turned NaN.
        ("copied_ema", "WeightAveragingError", "ema.bert.encoder.layer is a copy of the model's blocks whose weights"),
        # The same moved in training_step after the model call: on the last stage alone, found on both.
        ("copied_ema_in_step", "WeightAveragingError", "ema.bert.encoder.layer is a copy of the model's blocks"),
        # The same from the last step on: found as fit ends.
        ("late_copied_ema", "WeightAveragingError", "ema.bert.encoder.layer is a copy of the model's blocks"),
        # Made by a deepcopy at its first update, in the last step: found as fit ends.
        ("lazy_ema", "WeightAveragingError", "ema.bert.encoder.layer is a copy of the model's blocks"),
        # A copy made after the set-up copies the other stage's blocks as they read there: NaN.
        (
            "reference_model_at_fit_start",
            "WeightAveragingError",
            "reference.bert.encoder.layer is a copy of the model's blocks",
        ),
        ("clamping", "RuntimeError", "writes every weight in place (an average copied into the model"),
        ("lbfgs", "UnsupportedRecipeError", "torch.optim.LBFGS under a 2-stage pipeline"),
        ("sam", "UnsupportedRecipeError", "called the closure (training_step and the backward) a second time"),
    ],
)
def test_a_step_that_needs_what_other_stages_hold_is_refused_under_a_pipeline(mode, error, text, tmp_path):
    output = run_workers("recipes_worker.py", 2, str(tmp_path), mode, expect_failure=True)
    assert error in output and text in output
    assert "pipeline_length=1" in output
    if "ema" in mode:  # every rank stops with it (under NCCL a peer would wait for the others until the timeout)
        _raised_on_both_ranks(output, f"lightning_pipetx.strategy.lightning_compat.{error}")


def test_an_optimizer_that_calls_the_closure_again_in_an_accumulation_window_is_refused(tmp_path):
    # On 1x2, where SAM without accumulation trains as under DDP.
    output = run_workers("recipes_worker.py", 2, str(tmp_path), "sam_accumulated", expect_failure=True)
    assert "UnsupportedRecipeError: the optimizer's step called the closure" in output
    assert "accumulate_grad_batches=2" in output and "was not zeroed" not in output


def test_a_step_that_skips_its_batch_by_returning_none_is_refused(tmp_path):
    # As Lightning's DDP refuses it; the first stage returns before reaching its blocks.
    output = run_workers("recipes_worker.py", 2, str(tmp_path), "none_step", expect_failure=True)
    assert "UnsupportedRecipeError: training_step returned None for a micro-batch" in output
    assert "without reaching block" not in output


@pytest.mark.parametrize("mode", ["occasional_head", "occasional_head_in_window"])
def test_a_weight_outside_the_blocks_trained_in_some_batches_only_is_refused(mode, tmp_path):
    # occasional_head: 2x1, the head first in the second step. occasional_head_in_window: 1x2,
    # accumulating 2 batches, the head in the first batch of the second window only: its gradient
    # comes from a batch that does not synchronise, and each replica would step with its own.
    output = run_workers("recipes_worker.py", 2, str(tmp_path), mode, expect_failure=True)
    assert "UnexpectedGradientError: ElasticPipelineStrategy: parameter #" in output
    assert "a weight used only in some steps is not supported" in output


def test_a_forward_that_skips_a_stage_s_last_block_in_some_steps_is_refused_naming_the_fix(tmp_path):
    output = run_workers("recipes_worker.py", 2, str(tmp_path), "skipped_block", expect_failure=True)
    assert "block 2 was called on a stage that runs blocks [0, 2)" in output
    assert "pass pipeline_length=1 (data parallel)" in output


def _fit_with_cache(module, cache, tmp_path, caplog, **trainer_args):
    from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ElasticPipelineStrategy(cache=cache, cache_dir=str(tmp_path)),
        callbacks=[FreezeCallback(alpha=1 / 2, signal="schedule")],
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **trainer_args,
    )
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        trainer.fit(module, train_loader("bert"))
    return trainer


def test_hidden_states_of_every_layer_switch_the_cache_off_on_one_device(tmp_path, caplog):
    trainer = _fit_with_cache(hidden_states_module(), "auto", tmp_path, caplog)
    assert any("asked for output_hidden_states" in r.message and "switched off" in r.message for r in caplog.records)
    assert trainer.callback_metrics["pipetx/frozen_blocks"] > 0
    assert trainer.callback_metrics.get("pipetx/cache_hit_rate", 0.0) == 0.0
    with pytest.raises(UnsupportedOutputsError, match="Pass cache=False"):
        _fit_with_cache(hidden_states_module(), True, tmp_path, caplog)


@pytest.mark.parametrize(
    "build, reason",
    [
        (deberta_conv_module, "the model changes the hidden state between blocks 0 and 1"),
        (block_hooks_module, "block 0 of the frozen prefix, or a module inside it, has a forward hook"),
        (functools.partial(block_hooks_module, inside=True), "or a module inside it, has a forward hook"),
    ],
)
def test_a_prefix_whose_cached_output_would_leave_something_out_is_not_cached(build, reason, tmp_path, caplog):
    # Served, DeBERTa-v2's conv after block 0 and the hooks' auxiliary loss would be left out.
    runs = _with_and_without_cache(build, tmp_path, caplog)
    for trainer in runs.values():
        assert trainer.callback_metrics["pipetx/frozen_blocks"] > 0
        assert _served_fraction(trainer) == 0.0
    assert any(reason in r.message and "switched off" in r.message for r in caplog.records), caplog.text
    with pytest.raises(ValueError, match="Pass cache=False"):
        _fit_with_cache(build(), True, tmp_path / "forced", caplog)


def test_hugging_face_checkpointing_without_its_input_hook_is_cached(tmp_path, caplog):
    # gradient_checkpointing_enable installs enable_input_require_grads, which keeps the frozen
    # prefix's output requiring a gradient (the cache is off); non-reentrant checkpointing needs no hook.
    def build():
        module = build_case_module({"model": "bert", "lr": 1e-3})
        module.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        module.model.disable_input_require_grads()
        return module

    runs = _with_and_without_cache(build, tmp_path, caplog)
    assert runs["auto"].callback_metrics["pipetx/frozen_blocks"] > 0 and _served_fraction(runs["auto"]) == 1.0
    hooked = build_case_module({"model": "bert", "lr": 1e-3})
    hooked.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    caplog.clear()
    trainer = _fit_with_cache(hooked, "auto", tmp_path / "hooked", caplog)
    assert _served_fraction(trainer) == 0.0
    fix = "and then call model.disable_input_require_grads(); or pass cache=False"
    assert any("switched off" in r.message and fix in r.message for r in caplog.records), caplog.text


@pytest.mark.parametrize("hooks", ["composable_checkpoint", "pytorch_profiler"])
def test_blocks_under_hooks_that_leave_their_outputs_alone_are_cached(hooks, tmp_path, caplog):
    # torch's composable activation checkpoint puts forward hooks on the blocks, Lightning's
    # PyTorchProfiler on every module: the cache serves, and trains as without it.
    from torch.distributed._composable import checkpoint

    def build():
        module = build_case_module({"model": "bert", "lr": 1e-3})
        for block in module.model.bert.encoder.layer if hooks == "composable_checkpoint" else []:
            checkpoint(block)
        return module

    profiler = PyTorchProfiler(dirpath=str(tmp_path), filename="profile") if hooks == "pytorch_profiler" else None
    runs = _with_and_without_cache(build, tmp_path, caplog, profiler=profiler)
    assert runs["auto"].callback_metrics["pipetx/frozen_blocks"] > 0 and "switched off" not in caplog.text
    assert _served_fraction(runs["auto"]) > 0  # the last epoch's samples came from the cache (a shallower depth)


def _served_fraction(trainer):
    """The fraction of the last epoch's training samples AutoCache served, from any depth and tier."""
    metrics = trainer.callback_metrics
    return sum(float(v) for k, v in metrics.items() if k.startswith("pipetx/cache_served_") and "bytes" not in k)


def _with_and_without_cache(build, tmp_path, caplog, **trainer_args):
    """Fit ``build()`` with ``cache="auto"`` and with ``cache=False``, from the same random state;
    the weights and the values the step logged must be equal to the bit. The trainers, by cache setting."""
    runs, states = {}, {}
    for cache in ("auto", False):
        module = build()
        torch.manual_seed(1)
        runs[cache] = _fit_with_cache(module, cache, tmp_path / str(cache), caplog, **trainer_args)
        states[cache] = module.state_dict()
    for key, expected in states[False].items():
        torch.testing.assert_close(states["auto"][key], expected, atol=0, rtol=0, msg=key)
    logged = {k: v for k, v in runs[False].callback_metrics.items() if not k.startswith("pipetx/")}
    for key, expected in logged.items():
        torch.testing.assert_close(runs["auto"].callback_metrics[key], expected, atol=0, rtol=0, msg=key)
    return runs


def test_an_lr_schedule_sized_in_configure_optimizers_sees_the_pipeline_s_batches(tmp_path):
    # trainer.estimated_stepping_batches builds the training DataLoader inside configure_optimizers,
    # before the pipeline exists: its sampler must already shard by replica (one here), or the two
    # stages read different batches and the schedule counts half the steps.
    run_workers("recipes_worker.py", 2, str(tmp_path), "scheduled")
    expected = scheduled_reference()
    reports = _reports(tmp_path, "scheduled")
    assert [r["estimated_steps"] for r in reports] == [expected["estimated_steps"]] * 2 == [8, 8]
    assert [r["global_step"] for r in reports] == [8, 8]
    final = torch.load(tmp_path / "scheduled.pt", weights_only=True)["state"]
    for key, value in expected["state"].items():
        torch.testing.assert_close(final[key], value, atol=1e-5, rtol=1e-4, msg=key)


@pytest.mark.parametrize("mode", ["scheduled_uneven", "scheduled_uneven_sampler"])
def test_a_transition_keeps_the_steps_of_an_epoch_where_more_replicas_would_pad_one_more_batch(tmp_path, mode):
    # 39 samples, global batch 8, drop_last: 4 batches an epoch on one replica. On two, Lightning's
    # sampler pads each share to 20 samples, 5 batches of 4: the schedule, sized for 12 steps at the
    # start, would run 14 and end at a negative learning rate. A sampler of the user's is padded
    # the same way by the DistributedSamplerWrapper Lightning puts around it.
    run_workers("recipes_worker.py", 2, str(tmp_path), mode)
    for report in _reports(tmp_path, mode):
        assert [e["layout"] for e in report["epochs"]] == ["2x1", "1x2", "1x2"]
        assert [e["batches"] for e in report["epochs"]] == [4, 4, 4]
        assert report["estimated_steps"] == report["global_step"] == 12
        assert report["last_lr"] == 0.0


@pytest.fixture(scope="module")
def summed_count_run(tmp_path_factory):
    """2x1 -> 1x2 after epoch 0, 3 epochs of 4 steps, a checkpoint every 6 steps (mid-epoch 1)."""
    out = tmp_path_factory.mktemp("summed_count")
    run_workers("recipes_worker.py", 2, str(out), "summed_count")
    return out


def test_a_sum_over_the_replicas_counts_every_sample_once_in_the_epoch_a_transition_ends(summed_count_run):
    # The epoch's values are reduced after the transition that ends it (2x1 -> 1x2): logged under
    # the old layout, each on both stages, they would be summed twice over the new replicas.
    for report in _reports(summed_count_run, "summed_count"):
        assert [e["layout"] for e in report["epochs"]] == ["2x1", "1x2", "1x2"]
        assert report["values"]["count"] == [32.0, 32.0, 32.0]


def test_values_each_stage_logs_of_its_own_are_reduced_after_a_transition(tmp_path):
    # Gradient norms logged for the epoch from on_before_optimizer_step: each stage logs the norms
    # of the weights it holds, keys the other stage does not log. Reduced over the world after the
    # transition (2x1 -> 1x2) that ends epoch 0, the ranks' reductions paired unlike keys, and hung.
    run_workers("recipes_worker.py", 2, str(tmp_path), "stage_norms")
    reports = _reports(tmp_path, "stage_norms")
    for report in reports:
        assert [e["layout"] for e in report["epochs"]] == ["2x1", "1x2"]
    totals = [report["values"]["grad_2.0_norm_total"] for report in reports]
    assert totals[0][0] != totals[1][0]  # each stage's own weights (a documented limitation under a pipeline)
    assert totals[0][1] == totals[1][1]  # two replicas of the whole model, reduced over both


def test_a_sum_over_the_replicas_counts_every_sample_once_after_a_resume_in_mid_epoch(summed_count_run, tmp_path):
    # Resuming re-applies the frozen prefix before the first step (a move 2x1 -> 1x2 that ends
    # no epoch): what the resumed epoch logs is summed over the layout it trains on.
    checkpoint = summed_count_run / "epoch=1-step=6.ckpt"
    run_workers("recipes_worker.py", 2, str(tmp_path), "summed_count", "resume", str(checkpoint))
    for report in _reports(tmp_path, "summed_count"):
        assert [e["layout"] for e in report["epochs"]] == ["1x2", "1x2"]
        assert report["values"]["count"] == [16.0, 32.0]  # the 2 batches left of epoch 1, then epoch 2
        assert report["values"]["pipetx/pipeline_length"] == [1.0, 1.0]


def test_training_metrics_of_any_state_give_the_epoch_value_of_every_replicas_samples(tmp_path):
    # Under a pipeline only the last stage updates a metric in training_step; the other stages'
    # copies keep their initial states (empty lists, zeros). The epoch's sync reads the last
    # stages of the layout the epoch trained under: 2x1, then 1x2 after the transition. So does
    # a compute() in on_validation_epoch_end (validation ends the epoch, before the transition),
    # where a validation metric, updated on every stage, counts each validation sample once.
    from torchmetrics.functional.classification import multiclass_auroc

    run_workers("recipes_worker.py", 2, str(tmp_path), "epoch_metrics")
    reports = _reports(tmp_path, "epoch_metrics")
    assert [e["layout"] for e in reports[0]["epochs"]] == ["2x1", "1x2"]
    for report in reports:  # 2 batches of 8; a metric the validation made counts each sample once
        assert report["sanity_checked"]["val_samples"] == report["sanity_checked"]["made_in_validation"] == 16
    losses_so_far = []
    for epoch, replicas in enumerate((1, 2)):
        seen = [report["epochs"][epoch]["seen"] for report in reports]
        losses_so_far += [loss for s in seen for loss in s["losses"]]
        assert sum(bool(s["losses"]) for s in seen) == replicas  # the last stages alone ran the code
        probs = torch.tensor([p for s in seen for p in s["probs"]])
        labels = torch.tensor([label for s in seen for label in s["labels"]])
        assert len(labels) == 32  # every sample of the epoch, once
        auroc = float(multiclass_auroc(probs, labels, num_classes=tm.NUM_LABELS))
        summed_loss = sum(sum(s["losses"]) for s in seen) / replicas
        for report in reports:
            assert report["values"]["train_auroc"][epoch] == pytest.approx(auroc, abs=1e-6)
            assert report["values"]["summed_loss"][epoch] == pytest.approx(summed_loss, rel=1e-6)
            validated = report["validated"][epoch]
            assert validated["train_auroc"] == pytest.approx(auroc, abs=1e-6)
            assert validated["summed_loss"] == pytest.approx(summed_loss, rel=1e-6)
            assert validated["val_samples"] == validated["made_in_validation"] == 32
            assert validated["running_loss"] == pytest.approx(sum(losses_so_far) / len(losses_so_far), rel=1e-6)


@pytest.mark.parametrize("cache", ["auto", True])
@pytest.mark.parametrize("second_input", ["same", "shifted"])
def test_a_model_called_twice_per_step_is_not_cached(second_input, cache, caplog):
    # Two views of a batch, or a bi-encoder: a cached state stands for one run of each block.
    module = hook_counting_module()

    def training_step(batch, batch_idx):
        shift = 1 if second_input == "shifted" else 0
        other = {**batch, "input_ids": (batch["input_ids"] + shift) % tm.VOCAB}
        return (module.model(**batch).loss + module.model(**other).loss) / 2

    module.training_step = training_step
    _fit_repeating_blocks(module, cache, caplog, epochs=4)


def test_a_second_model_call_from_a_later_epoch_is_not_served_a_cached_state():
    # The cache serves from epoch 2; from epoch 3 the step adds a call on other inputs.
    def run(cache):
        module, losses = hook_counting_module(), []

        def training_step(batch, batch_idx):
            loss = module.model(**batch).loss
            if module.current_epoch >= 3:
                shifted = {**batch, "input_ids": (batch["input_ids"] + 1) % tm.VOCAB}
                loss = loss + module.model(**shifted).loss
            losses.append(float(loss))
            return loss

        module.training_step = training_step
        freeze = FreezeCallback(alpha=1 / 2, signal="schedule")
        trainer = tm.make_trainer([freeze], max_epochs=5, strategy=ElasticPipelineStrategy(cache=cache))
        trainer.fit(module, recipes_loader(8))
        return losses

    assert run("auto") == pytest.approx(run(False), rel=1e-6)


def test_two_calls_on_one_input_with_different_masks_are_not_cached():
    # Block 0 gets the same hidden state twice, but another mask: not the same computation.
    module = hook_counting_module()

    def training_step(batch, batch_idx):
        half = batch["attention_mask"].clone()
        half[:, half.shape[1] // 2 :] = 0
        return (module.model(**batch).loss + module.model(**{**batch, "attention_mask": half}).loss) / 2

    module.training_step = training_step
    freeze = FreezeCallback(alpha=1 / 2, signal="schedule")
    trainer = tm.make_trainer([freeze], max_epochs=3, strategy=ElasticPipelineStrategy(cache=True))
    with pytest.raises(ValueError, match="block 0 ran twice in one training_step"):
        trainer.fit(module, recipes_loader(8))


class ValidationLosses(pl.Callback):
    def __init__(self):
        self.values = []

    def on_validation_epoch_end(self, trainer, pl_module):
        self.values.append(float(trainer.callback_metrics["two_view_loss"]))


def test_a_validation_step_calling_the_model_on_two_inputs_is_not_served_from_the_cache():
    # Training calls the model once (its cache serves); validation encodes two inputs.
    def run(cache):
        module, losses = hook_counting_module(), ValidationLosses()

        def validation_step(batch, batch_idx):
            shifted = {**batch, "input_ids": (batch["input_ids"] + 1) % tm.VOCAB}
            module.log("two_view_loss", module.model(**batch).loss + 10 * module.model(**shifted).loss)

        module.validation_step = validation_step
        freeze = FreezeCallback(alpha=1 / 2, signal="schedule")
        trainer = tm.make_trainer([freeze, losses], max_epochs=5, strategy=ElasticPipelineStrategy(cache=cache))
        trainer.fit(module, recipes_loader(8), recipes_loader(8))
        return losses.values

    assert run("auto") == pytest.approx(run(False), rel=1e-6)


def test_a_step_that_calls_the_model_twice_is_refused_under_a_pipeline(tmp_path):
    # The first stage leaves at its boundary in the first call: the second never crosses.
    output = run_workers("recipes_worker.py", 2, str(tmp_path), "two_calls", expect_failure=True, timeout=120)
    assert "block 0 ran twice in one micro-batch's training_step: the step calls the model more than once" in output


def test_a_loss_that_does_not_require_grad_stops_training_as_in_one_process():
    # A detached loss trained nothing, silently; Lightning's backward raises on it.
    module = hook_counting_module()
    step = module.training_step
    module.training_step = lambda batch, batch_idx: step(batch, batch_idx).detach()
    trainer = tm.make_trainer([], max_epochs=1, strategy=ElasticPipelineStrategy())
    with pytest.raises(RuntimeError, match="training_step returned a loss that does not require grad"):
        trainer.fit(module, recipes_loader(8))


def test_a_micro_batch_whose_loss_does_not_require_grad_trains_where_another_s_does():
    # A step that starts from a zero and adds the loss of the labelled samples: a micro-batch of
    # unlabelled ones returns the zero alone, and the batch still trains, as in one process.
    module = hook_counting_module()

    def training_step(batch, batch_idx):
        labelled = batch.pop("labelled")
        loss = torch.zeros(())
        if labelled.any():
            loss = loss + module.model(**{k: v[labelled] for k, v in batch.items()}).loss
        return loss

    def first_half_labelled(samples):
        batch = torch.utils.data.default_collate(samples)
        return {**batch, "labelled": torch.arange(len(samples)) < len(samples) // 2}

    module.training_step = training_step
    loader = torch.utils.data.DataLoader(recipes_loader(8).dataset, batch_size=8, collate_fn=first_half_labelled)
    before = [p.detach().clone() for p in module.parameters()]
    trainer = tm.make_trainer([], max_steps=2, strategy=ElasticPipelineStrategy(num_microbatches=2))
    trainer.fit(module, loader)
    assert any(not torch.equal(b, p) for b, p in zip(before, module.parameters()))


def test_an_optimizer_without_a_learning_rate_trains():
    # Hugging Face's Adafactor with relative steps keeps lr=None in its groups.
    from transformers.optimization import Adafactor

    module = hook_counting_module()
    module.configure_optimizers = lambda: Adafactor(module.parameters(), lr=None, relative_step=True, warmup_init=True)
    trainer = tm.make_trainer([], max_epochs=2, strategy=ElasticPipelineStrategy())
    trainer.fit(module, recipes_loader(8))
    assert trainer.global_step == 8


def _fit_vit_bf16(strategy):
    pl.seed_everything(0, verbose=False)
    module = tm.TinyViTClassifier(seed=0, dropout=0.1)  # timm's attention: scaled_dot_product_attention
    data = tm.RandomImageDataset(size=32, seed=1)
    order = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)  # DDP's
    trainer = tm.make_trainer([], max_epochs=1, strategy=strategy, precision="bf16-mixed")
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8, sampler=order))
    return module.state_dict()


def test_backwards_run_outside_autocast_as_lightning_runs_them():
    # Under autocast the backward of attention with dropout computes in bfloat16 what Lightning's computes in float32.
    plain = _fit_vit_bf16("auto")
    ours = _fit_vit_bf16(ElasticPipelineStrategy(cache=False))
    for key, expected in plain.items():
        torch.testing.assert_close(ours[key], expected, atol=0, rtol=0, msg=key)
