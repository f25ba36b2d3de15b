"""AutoPipe's plan for a frozen prefix, and the block transfers of a transition."""

import itertools
import json
import random

import frozen_in_place_worker
import pytest
import tiny_models as tm
import torch
from distributed import run_workers
from lightning.pytorch.callbacks import ModelCheckpoint
from tiny_models import build_model

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback, Layout, find_blocks
from lightning_pipetx.strategy.autopipe import (
    FROZEN_MEMORY,
    FROZEN_TIME,
    AutoPipe,
    ModelMemory,
    block_costs,
    choose_initial_plan,
    choose_plan,
    device_fit,
    frozen_in_place,
    frozen_partition,
    make_plan,
    max_stages,
    training_bytes,
)
from lightning_pipetx.strategy.transition import transfers


def _best_with_frozen_prefix(costs, frozen, k):
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        if cuts and cuts[0] < frozen:
            continue  # the frozen prefix must stay on the first stage
        bounds = list(zip((0, *cuts), (*cuts, n)))
        worst = max(sum(costs[i] * (FROZEN_TIME if i < frozen else 1) for i in range(s, e)) for s, e in bounds)
        best = min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(25))
def test_frozen_partition_is_optimal_and_keeps_the_prefix_on_stage_zero(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    frozen = rng.randint(0, n - 1)
    k = rng.randint(1, max_stages(n, frozen))
    costs = [rng.uniform(0.5, 5) for _ in range(n)]
    bounds = frozen_partition(costs, frozen, k)
    assert bounds[0][0] == 0 and bounds[-1][1] == n and len(bounds) == k
    assert bounds[0][1] >= frozen and all(s < e for s, e in bounds)
    worst = max(sum(costs[i] * (FROZEN_TIME if i < frozen else 1) for i in range(s, e)) for s, e in bounds)
    assert worst == pytest.approx(_best_with_frozen_prefix(costs, frozen, k))


def test_nothing_frozen_keeps_the_initial_pipeline():
    plan = choose_plan([1.0] * 8, frozen=0, world_size=8, initial_length=4)
    assert plan.layout == Layout(4, 2) and plan.bounds == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert plan.num_microbatches == 8


def test_the_pipeline_compresses_once_the_memory_bound_allows():
    costs = [1.0] * 8  # initial largest stage: two trainable blocks
    assert choose_plan(costs, 3, 4, 4).layout == Layout(4, 1)  # 2 replicas would need 4.25 units
    plan = choose_plan(costs, 6, 4, 4)
    assert plan.layout == Layout(2, 2) and plan.bounds == ((0, 6), (6, 8))  # frozen prefix costs 2, as 2 blocks


def test_without_a_fitting_layout_the_longest_buildable_pipeline_is_kept():
    plan = choose_plan([1.0] * 4, 2, 4, 4)  # 4 stages cannot be built around a 2-block frozen prefix
    assert plan.layout == Layout(2, 2) and plan.bounds == ((0, 3), (3, 4))


def test_layouts_can_be_ruled_out():
    plan = choose_plan([1.0] * 8, 5, 4, 4, accept=lambda layout: layout.replicas == 1)
    assert plan.layout == Layout(4, 1)


def test_when_no_layout_is_left_the_blocks_freeze_in_place():
    # 4 stages do not fit around 6 frozen blocks of 8, and shorter pipelines are ruled out.
    assert choose_plan([1.0] * 8, 6, 4, 4, accept=lambda layout: layout.replicas == 1) is None
    planner = AutoPipe(4, num_microbatches="auto")
    plan, _ = planner.start(find_blocks(build_model("sequential")), 4, 4, budget=lambda: 0.0, profile=False)
    assert planner.plan(3, 4, accept=lambda layout: layout.replicas == 1) is None
    assert "at most 2 stages fit around the frozen prefix" in planner.kept_reason(3)
    kept, block = frozen_in_place(plan, planner.costs, 3), planner.costs[0]
    assert kept.same_layout(plan) and kept.stage_times == pytest.approx([block * FROZEN_TIME] * 3 + [block])


def _single_process_weights(kind):
    freeze = FreezeCallback(alpha=0.5, signal="schedule")
    module = tm.TinySequentialRegressor(seed=0, dropout=0.0)
    tm.make_trainer([freeze], max_epochs=3).fit(module, frozen_in_place_worker.loader(kind, reference=True))
    assert freeze.frozen_blocks == 3
    return module.state_dict()


def test_a_freeze_that_leaves_no_layout_trains_on_in_place(tmp_path):
    # 3x1 over 4 blocks, a global batch that 3 replicas cannot share: with 3 blocks frozen
    # neither 3 stages nor 1 can be built; the layout stays and training goes on as in one process.
    output = run_workers("frozen_in_place_worker.py", 3, str(tmp_path))
    assert output.count("the layout stays and the blocks freeze in place") == len(frozen_in_place_worker.KINDS)
    for kind in frozen_in_place_worker.KINDS:
        report = json.loads((tmp_path / f"{kind}.json").read_text())
        assert report["layouts"] == ["3x1"] * 3 and report["frozen"] == 3
        for key, expected in _single_process_weights(kind).items():
            torch.testing.assert_close(torch.tensor(report["weights"][key]), expected, msg=key)


def test_transfers_send_each_new_block_once_to_each_rank_that_lacks_it():
    old = make_plan([1.0] * 4, 0, 4, 4, None)
    new = make_plan([1.0] * 4, 2, 4, 2, None)
    assert new.bounds == ((0, 3), (3, 4))
    moves = transfers(old, new, 4)
    # Old: block i on rank 3 - i. New: blocks 0-2 on ranks 1 and 3, block 3 on ranks 0 and 2.
    assert moves == [(0, 3, 1), (1, 2, 1), (1, 2, 3), (2, 1, 3), (3, 0, 2)]
    assert transfers(new, new, 4) == []


def test_a_free_frozen_prefix_compresses_four_stages_to_two_then_one():
    # With the frozen prefix's output cached, frozen blocks cost nothing: the paper's rule
    # (smallest K whose largest stage costs no more than at the start) gives 4 -> 2 -> 1.
    costs = [1.0] * 4
    lengths = [choose_plan(costs, frozen, 4, 4, frozen_time=0.0).layout.pipeline_length for frozen in (0, 2, 3)]
    assert lengths == [4, 2, 1]
    # Computed forward-only (a third of a block) the prefix keeps a second stage.
    assert [choose_plan(costs, f, 4, 4).layout.pipeline_length for f in (0, 2, 3)] == [4, 2, 2]


def test_the_throughput_model_stays_within_the_memory_frozen_blocks_keep():
    costs = [2.0, 2.0, 4.0, 1.0, 1.0]  # at the start (4 stages) the largest stage costs 4, memory 4
    # Three frozen blocks cost 8/3 forward-only. The paper's rule: one stage would cost 4.67 > 4,
    # so 2 stages (2.67). Four replicas without a bubble would be predicted faster (4 / 4.67
    # against 2 * 4 / (5 * 2.67)), but one stage holds the frozen blocks' weights and Adam
    # moments (8 * 3/4) and 2 trainable units: 8 > 4.
    one_stage = make_plan(costs, 3, 4, 1, None)
    assert one_stage.predicted_throughput > make_plan(costs, 3, 4, 2, None).predicted_throughput
    assert one_stage.stage_memory == (8.0,)
    assert choose_plan(costs, 3, 4, 4).layout == Layout(2, 2)


def test_a_frozen_block_keeps_three_quarters_of_its_training_state():
    # FreezeCallback takes frozen blocks out of backward; AdamW keeps their moments, as a
    # checkpoint does: a frozen block holds its weights and two moments, no gradient.
    module = tm.TinySequentialRegressor(seed=0, dropout=0.0)
    trainable = ModelMemory.of(find_blocks(module.model)).blocks  # weights, gradients, two moments
    freeze = FreezeCallback(alpha=0.5, signal="schedule")
    trainer = tm.make_trainer([freeze], max_epochs=1)
    trainer.fit(module, tm.task_loader("sequential", size=16))
    assert freeze.frozen_blocks == 2
    state = trainer.optimizers[0].state
    for block, size in zip(module.model.blocks[:2], trainable):
        held = [t for p in block.parameters() for t in (p, p.grad, *state[p].values()) if t is not None]
        assert sum(t.numel() * t.element_size() for t in held if t.dim() > 0) == FROZEN_MEMORY * size


def test_memory_is_counted_in_parameters_when_costs_are_profiled_times():
    # Blocks of 1, 1, 1 and 4 parameter units timed 1, 1, 1 and 2: the start's largest stage holds
    # block 3, 4 units. Two stages, blocks 0-2 (block 0 frozen) and block 3, hold no more, and are
    # predicted faster: in seconds the stage of blocks 0-2 would have looked too big.
    plan = choose_plan([1.0, 1.0, 1.0, 2.0], 1, 4, 4, sizes=[1.0, 1.0, 1.0, 4.0])
    assert plan.layout == Layout(2, 2) and plan.bounds == ((0, 3), (3, 4))
    assert plan.stage_memory == (2 + FROZEN_MEMORY, 4.0)


def test_the_planner_counts_memory_in_parameters_after_the_profile():
    planner = AutoPipe(4, num_microbatches="auto")
    planner.start(find_blocks(build_model("sequential")), 4, 4, budget=lambda: 1e12, profile=True)
    size = planner.costs[0]  # 4 blocks of 1104 parameters
    planner.take_profile(lambda: [1e-3, 1e-3, 2e-3, 1e-3])
    assert planner.costs == [1e-3, 1e-3, 2e-3, 1e-3] and planner.sizes == [size] * 4
    plan = planner.plan(3, 4)
    assert plan.layout == Layout(2, 2) and plan.stage_memory == pytest.approx((3 * FROZEN_MEMORY * size, size))


# --------------------------------------------------------- initial layout (pipeline_length="auto")
def test_model_memory_counts_weights_gradients_and_adam_moments():
    model = build_model("sequential")  # embed 8->16, 4 residual MLP blocks of width 16, norm, head 16->2
    block = 32 + (16 * 32 + 32) + (32 * 16 + 16)  # LayerNorm, fc1, fc2: 1104 parameters
    memory = ModelMemory.of(find_blocks(model))
    assert memory.blocks == (block * 16.0,) * 4  # float32 weight + gradient + two moments
    assert memory.shared_weights == (8 * 16 + 16 + 32 + 16 * 2 + 2) * 4.0
    assert memory.pre_training == (8 * 16 + 16) * 12.0 and memory.post_training == (32 + 34) * 12.0
    assert memory.stage_bytes([(0, 2), (2, 4)]) == [
        2 * block * 16 + memory.shared_weights + memory.pre_training,
        2 * block * 16 + memory.shared_weights + memory.post_training,
    ]
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)  # frozen: the weight alone
    assert ModelMemory.of(find_blocks(model)).blocks[0] == block * 4.0


def test_a_weight_tied_between_pre_and_post_counts_once_on_one_stage():
    model = tm.tiny_gpt2(dropout=0.0)  # the token embedding is the LM head's weight
    memory = ModelMemory.of(find_blocks(model))
    everything = (0, len(memory.blocks))
    assert memory.stage_bytes([everything]) == [pytest.approx(training_bytes(model.parameters()))]
    # On two stages the first trains it as pre, the last as post: each holds its gradient and moments.
    tied = model.transformer.wte.weight.numel() * 12.0
    assert memory.tied_training == tied and min(memory.pre_training, memory.post_training) >= tied


def test_a_model_that_fits_one_device_trains_data_parallel():
    # One stage holds 8 blocks (1 each), the shared weights (0.5), pre's and post's training state (0.25 each).
    memory = ModelMemory((1.0,) * 8, 0.5, 0.25, 0.25)
    plan, candidates = choose_initial_plan([1.0] * 8, memory, 8, 8, budget_bytes=20.0)
    assert plan.layout == Layout(1, 8) and plan.num_microbatches == 1
    assert [c.plan.layout.pipeline_length for c in candidates] == [1, 2, 4, 8]
    assert [c.peak_bytes for c in candidates] == [9.0, 4.75, 2.75, 1.75]
    assert all(c.fits for c in candidates)


def test_a_model_that_does_not_fit_gets_the_shortest_pipeline_that_does():
    memory = ModelMemory((1.0,) * 8, 0.5, 0.25, 0.25)
    # Half of the budget (the rest is kept for activations) must hold the largest stage.
    plan, candidates = choose_initial_plan([1.0] * 8, memory, 8, 8, budget_bytes=6.0)
    assert plan.layout == Layout(4, 2) and [c.fits for c in candidates] == [False, False, True, True]
    assert choose_initial_plan([1.0] * 8, memory, 8, 8, budget_bytes=10.0)[0].layout == Layout(2, 4)
    # Nothing fits: the layout needing the least memory; never more stages than allowed.
    assert choose_initial_plan([1.0] * 8, memory, 8, 8, budget_bytes=1.0)[0].layout == Layout(8, 1)
    assert choose_initial_plan([1.0] * 8, memory, 8, 4, budget_bytes=1.0)[0].layout == Layout(4, 2)


def test_the_planner_starts_within_its_budget_and_takes_the_profile_once():
    split = find_blocks(build_model("sequential"))  # 37,896 bytes on the larger of two stages, 74,016 on one
    asked = []
    planner = AutoPipe("auto", num_microbatches="auto")
    plan, why = planner.start(split, 2, 2, budget=lambda: asked.append(1) or 100_000.0, profile=True)
    assert plan.layout == Layout(2, 1) and planner.initial_length == 2 and asked == [1]
    assert why.startswith("layout 2x1: the fastest predicted")
    counts = list(planner.costs)
    assert planner.take_profile(lambda: None) is None and planner.costs == counts  # nothing timed: counts stay
    assert planner.take_profile(lambda: [1.0, 2.0, 3.0, 4.0]) is None  # one profile per run, at the first freeze
    assert planner.costs == counts
    planner, asked = AutoPipe(2, num_microbatches=3), []
    plan, why = planner.start(split, 2, 2, budget=lambda: asked.append(1) or 100_000.0, profile=True)
    assert why is None and plan.layout == Layout(2, 1) and plan.num_microbatches == 3
    assert asked == [1]  # a fixed length still bounds what its transitions may hold
    planner.restore_profile(None)  # a checkpoint saved before the first freeze: the profile is still to take
    planner.restore_profile([1.0, 2.0])  # another model's: ignored
    assert not planner.profiled
    assert planner.take_profile(lambda: [1.0, 1.0, 1.0, 5.0]) == [1.0, 1.0, 1.0, 5.0]
    assert plan.bounds == ((0, 2), (2, 4)) and planner.plan(0, 2).bounds == ((0, 3), (3, 4))  # the profiled costs


def _profiled_fit(tmp_path, saver, epochs, ckpt_path=None):
    """A one-device fit timing 2 steps, freezing by schedule, with checkpoints by ``saver``; its planner."""
    strategy = ElasticPipelineStrategy(profile_steps=2, cache_dir=str(tmp_path / "cache"))
    freeze = FreezeCallback(alpha=0.5, signal="schedule")
    trainer = tm.make_trainer([freeze, saver], max_epochs=epochs, strategy=strategy, enable_checkpointing=True)
    module, data = tm.TinySequentialRegressor(seed=0, dropout=0.0), tm.task_loader("sequential", size=32)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return strategy.autopipe


def test_a_resumed_run_plans_with_the_block_costs_its_checkpoint_measured(tmp_path):
    def fit(epochs, ckpt_path=None):
        saver = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_top_k=-1, filename="{epoch}")
        return _profiled_fit(tmp_path, saver, epochs, ckpt_path)

    measured = fit(2)
    assert measured.profiled
    saved = torch.load(tmp_path / "checkpoints" / "epoch=0.ckpt", weights_only=False)["pipetx"]["block_costs"]
    assert saved == measured.costs  # taken at the first freeze, after epoch 0
    # The resumed run runs its frozen blocks from the cache: it could not time them again.
    resumed = fit(3, str(tmp_path / "checkpoints" / "epoch=1.ckpt"))
    assert resumed.profiled and resumed.costs == saved


def test_a_checkpoint_before_the_first_freeze_keeps_the_costs_measured(tmp_path):
    # Saved at step 3 of epoch 0 (4 batches an epoch): after the warm-up and 2 profiled steps,
    # before the first freeze took the profile.
    def fit(epochs, ckpt_path=None):
        saver = ModelCheckpoint(tmp_path / "checkpoints", save_top_k=-1, every_n_train_steps=3, filename="{step}")
        return _profiled_fit(tmp_path, saver, epochs, ckpt_path)

    measured = fit(2)
    saved = torch.load(tmp_path / "checkpoints" / "step=3.ckpt", weights_only=False)["pipetx"]["block_costs"]
    assert measured.profiled and saved == measured.costs  # before: None, and the resumed run planned by counts
    resumed = fit(2, str(tmp_path / "checkpoints" / "step=3.ckpt"))
    assert resumed.profiled and resumed.costs == saved


def test_the_strategy_chooses_its_initial_layout_by_memory(tmp_path):
    # The tiny sequential model needs 74,016 bytes on one stage, 37,896 on the larger of two
    # (test_model_memory_counts_weights_gradients_and_adam_moments): 100,000 bytes per device
    # keep 50,000 for it, which two stages fit and one does not.
    out = tmp_path / "layouts.json"
    run_workers("auto_layout_worker.py", 2, str(out), "default", "100000")
    assert json.loads(out.read_text()) == {"default": "1x2", "100000": "2x1"}


def test_a_transition_needs_a_layout_that_fits_the_device():
    # 4 blocks of 1104 parameters on 4 ranks, 4x1 at the start; with 3 frozen the paper's rule
    # (and the throughput model) would pack them onto 1x4 or 2x2, whose stage 0 holds 3 frozen blocks.
    split = find_blocks(build_model("sequential"))
    memory = ModelMemory.of(split)
    start_peak = max(memory.stage_bytes(make_plan(block_costs(split), 0, 4, 4, None).bounds))
    roomy, tight = AutoPipe(4, num_microbatches="auto"), AutoPipe(4, num_microbatches="auto")
    roomy.start(split, 4, 4, budget=lambda: 1e12, profile=False)
    tight.start(split, 4, 4, budget=lambda: 0.0, profile=False)  # no more than the start needed
    assert tight.memory_limit == start_peak
    assert roomy.plan(3, 4).layout.pipeline_length < 4
    assert tight.plan(3, 4) is None and tight.kept_by_memory
    assert "fits the device's memory" in tight.kept_reason(3)
    one_frozen = tight.plan(1, 4)  # block 0 frozen on stage 0 beside nothing: the start's stages fit
    assert one_frozen is not None and one_frozen.layout == Layout(4, 1)
    fits = device_fit(memory, 3, start_peak)
    assert all(fits(p) for p in [one_frozen]) and not fits(roomy.plan(3, 4))


def test_every_rank_takes_global_rank_0s_plan(tmp_path):
    # Rank 1's planner keeps 2x1 at every freeze; rank 0's moves to 1x2: both move.
    run_workers("plan_broadcast_worker.py", 2, str(tmp_path), timeout=300)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert reports[0] == reports[1] == {"layouts": ["2x1", "2x1", "1x2"], "frozen": 3}
