"""Unit tests of the strategy's parts: layout, partition, micro-batches, schedules, arguments."""

import copy
import itertools
import pickle
import random
import threading
import types
import warnings
from collections import namedtuple
from datetime import timedelta

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from distributed import run_workers
from tiny_models import RandomVectorDataset, TinySequentialRegressor, build_model, build_task, make_trainer, task_loader
from torch.utils.data import DataLoader, DistributedSampler
from transformers import BatchEncoding

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback, Layout, find_blocks
from lightning_pipetx.callbacks.freeze_boundary import FreezeBoundary
from lightning_pipetx.strategy.autopipe import AutoPipe
from lightning_pipetx.strategy.failure import explain_training_outputs
from lightning_pipetx.strategy.installed import InstalledForward, InstalledHook
from lightning_pipetx.strategy.log_replay import LogRecorder
from lightning_pipetx.strategy.metric_sync import LastStageSync
from lightning_pipetx.strategy.microbatch import BatchSplitError, chunk, join_outputs, split_batch, take
from lightning_pipetx.strategy.param_store import ParamStore
from lightning_pipetx.strategy.partition import partition, stage_costs
from lightning_pipetx.strategy.predictions import merge_shards
from lightning_pipetx.strategy.recipe_checks import BlockCopyWatch, WeightAveragingError
from lightning_pipetx.strategy.stage_runner import schedule_actions


# ----------------------------------------------------------------------------- layout
def test_layout_maps_ranks_and_puts_a_last_stage_on_rank_zero():
    layout = Layout(pipeline_length=4, replicas=2)
    coords = [layout.coords(r) for r in range(8)]
    assert coords[0] == (0, 3)  # rank 0: last stage of replica 0
    assert sorted(coords) == [(r, s) for r in range(2) for s in range(4)]
    assert all(layout.rank(*layout.coords(r)) == r for r in range(8))
    assert layout.stage_ranks(3) == [0, 4]
    assert layout.replica_ranks(1) == [7, 6, 5, 4]


def test_layout_rejects_a_pipeline_length_that_does_not_divide_the_world():
    with pytest.raises(ValueError, match=r"does not divide the world size 6.*\[1, 2, 3, 6\]"):
        Layout.for_world(6, 4)
    assert Layout.for_world(6, 3) == Layout(3, 2)


# -------------------------------------------------------------------------- partition
def _brute_force(costs, k):
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = list(zip((0, *cuts), (*cuts, n)))
        best = min(best, max(stage_costs(costs, bounds)))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_partition_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    k = rng.randint(1, n)
    costs = [rng.choice([0.0, rng.random() * 10, float(rng.randint(1, 5))]) for _ in range(n)]
    bounds = partition(costs, k)
    assert len(bounds) == k and bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(start < end for start, end in bounds), "no empty stage"
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert max(stage_costs(costs, bounds)) == pytest.approx(_brute_force(costs, k))


def test_partition_never_leaves_a_stage_empty_on_uneven_costs():
    bounds = partition([100.0, 1.0, 1.0, 1.0], 4)
    assert bounds == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert partition([1.0, 1.0, 1.0, 100.0], 2) == [(0, 3), (3, 4)]


def test_partition_rejects_more_stages_than_blocks():
    with pytest.raises(ValueError, match="at most 3"):
        partition([1.0, 1.0, 1.0], 4)


# ----------------------------------------------------------------------- micro-batches
def test_split_batch_handles_every_structure_and_joins_back():
    pair = namedtuple("pair", "x y")
    x = torch.arange(10).view(5, 2)
    batch = {
        "tensor": x,
        "tuple": (x, x + 1),
        "list": [x],
        "named": pair(x, x),
        "encoding": BatchEncoding({"input_ids": x}),
        "ids": ["a", "b", "c", "d", "e"],
        "scalar": 7,
        "zero_dim": torch.tensor(3.0),
    }
    parts = split_batch(batch, 2)
    assert [p["tensor"].shape[0] for p in parts] == [3, 2]
    assert parts[1]["ids"] == ["d", "e"] and parts[1]["scalar"] == 7
    assert isinstance(parts[0]["named"], pair) and isinstance(parts[0]["encoding"], BatchEncoding)
    joined = join_outputs(parts, [3, 2])
    assert torch.equal(joined["tuple"][1], x + 1) and joined["ids"] == batch["ids"]
    assert torch.equal(split_batch(x, 5)[4], x[4:])


def test_single_numbers_in_step_outputs_are_averaged_by_microbatch_size():
    # What the whole batch of 5 gives: a per-sample mean over 3 + 2 samples, not the last part's.
    parts = [
        {"acc": torch.tensor(1.0), "ratio": 0.0, "name": "a"},
        {"acc": torch.tensor(0.5), "ratio": 1.0, "name": "b"},
    ]
    joined = join_outputs(parts, [3, 2])
    torch.testing.assert_close(joined["acc"], torch.tensor(0.8))
    assert joined["ratio"] == pytest.approx(0.4) and joined["name"] == "b"


def test_a_batch_smaller_than_the_microbatch_count_uses_one_sample_each():
    assert [p.shape[0] for p in split_batch(torch.zeros(3, 4), 8)] == [1, 1, 1]


def test_batches_that_cannot_be_split_raise_a_clear_error():
    with pytest.raises(BatchSplitError, match="no tensor"):
        split_batch(["just", "strings"], 2)
    with pytest.raises(BatchSplitError, match=r"different first dimensions \[3, 4\]"):
        split_batch((torch.zeros(3), torch.zeros(4)), 2)


class _WeightedRegressor(pl.LightningModule):
    """A batch of ``(x, y, weights)`` or ``{"weights": ..., "x": ..., "y": ...}``: ``weights`` per
    output column (2, not per sample) or one number."""

    def __init__(self):
        super().__init__()
        self.model = build_model("sequential", dropout=0.0)

    def training_step(self, batch, batch_idx):
        x, y, weights = (batch["x"], batch["y"], batch["weights"]) if isinstance(batch, dict) else batch
        loss = ((self.model(x) - y) ** 2 * weights).mean()
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _with_column_weights(samples):
    x, y = torch.utils.data.default_collate(samples)
    return x, y, torch.tensor([1.0, 2.0])


def _scaled_by_one_number(samples):
    x, y = torch.utils.data.default_collate(samples)
    return {"weights": torch.tensor(2.0), "x": x, "y": y}  # Lightning infers a batch size of 1 from it


@pytest.mark.parametrize("collate", [_with_column_weights, _scaled_by_one_number])
@pytest.mark.parametrize("cache", [False, "auto"])
def test_a_batch_with_a_tensor_not_of_the_batch_size_trains_whole_as_under_plain_lightning(collate, cache, caplog):
    # 18 samples in batches of 4: the last batch holds 2, so the epoch's mean depends on the weights
    # Lightning gives each batch's logged value.
    def fit(strategy):
        module, data = _WeightedRegressor(), task_loader("sequential", size=18).dataset
        # The order Lightning's DistributedSampler gives the strategy's one replica.
        order = None if strategy else DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
        loader = DataLoader(data, batch_size=4, sampler=order, collate_fn=collate)
        freeze = FreezeCallback(alpha=0.5, signal="schedule")
        trainer = make_trainer([freeze], max_epochs=4, **({"strategy": strategy} if strategy else {}))
        trainer.fit(module, loader)
        return module.state_dict(), trainer.callback_metrics

    plain_state, plain = fit(None)
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        state, metrics = fit(ElasticPipelineStrategy(cache=cache, profile_steps=0))  # one micro-batch: left whole
    assert float(metrics["train_loss_epoch"]) == pytest.approx(float(plain["train_loss_epoch"]), rel=1e-6)
    for key, value in plain_state.items():
        torch.testing.assert_close(state[key], value, msg=key)
    if cache and collate is _with_column_weights:  # AutoCache keys and fingerprints one row per sample
        assert "holds tensors whose first dimension is not that ([2]: a tensor per batch" in caplog.text
    elif cache:  # a number is not a row: the batch's rows are its samples
        assert float(metrics["pipetx/cache_hit_rate"]) == 1.0


def test_take_and_chunk_reorder_samples():
    data = {"x": torch.arange(6), "names": list("abcdef")}
    picked = take(data, [5, 0, 3])
    assert picked["x"].tolist() == [5, 0, 3] and picked["names"] == ["f", "a", "d"]
    assert [c["x"].tolist() for c in chunk(data, 4)] == [[0, 1, 2, 3], [4, 5]]


# ---------------------------------------------------------------------------- schedules
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), [(1, 1), (2, 2), (4, 3), (4, 8)])
def test_schedules_run_each_microbatch_forward_then_backward(schedule, stages, microbatches):
    for stage in range(stages):
        actions = schedule_actions(schedule, stages, stage, microbatches)
        assert sorted(actions) == sorted(
            [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
        )
        assert all(actions.index(("F", i)) < actions.index(("B", i)) for i in range(microbatches))
        in_flight = peak = 0
        for kind, _ in actions:
            in_flight += 1 if kind == "F" else -1
            peak = max(peak, in_flight)
        if schedule == "1f1b":
            assert peak <= min(stages - stage, microbatches)
        else:
            assert peak == microbatches


# ---------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pipeline_length": 0}, "pipeline_length=0"),
        ({"num_microbatches": "many"}, "num_microbatches='many'"),
        ({"schedule": "zigzag"}, "schedule='zigzag'"),
        ({"cache": "sometimes"}, "cache='sometimes'"),
        ({"profile_steps": -1}, "profile_steps=-1"),
        ({"memory_budget": 0}, "memory_budget=0"),
        ({"bucket_cap_mb": -1}, "bucket_cap_mb=-1"),
        ({"bucket_cap_mb": True}, "bucket_cap_mb=True"),
        ({"bucket_cap_mb": float("nan")}, "bucket_cap_mb=nan"),
        ({"bucket_cap_mb": float("inf")}, "bucket_cap_mb=inf"),
        ({"blocks": 3}, "blocks=3\\): use the block list's dotted path"),
        ({"elastic": "no"}, "elastic='no'\\): use True or False"),
        ({"keep_global_batch": None}, "keep_global_batch=None\\): use True or False"),
        ({"sampler": "random"}, "sampler='random'"),
        ({"reuse_host_memory": "yes"}, "reuse_host_memory='yes'"),
        ({"cache_ram_bytes": "8GB"}, "cache_ram_bytes='8GB'"),
        ({"cache_ram_bytes": -5}, "cache_ram_bytes=-5"),
        ({"cache_device_bytes": True}, "cache_device_bytes=True"),
        ({"cache_dir": 3}, "cache_dir=3"),
        ({"cache_dir": ""}, "cache_dir=''\\): use a folder's path, or None"),
        ({"blocks": ""}, "blocks=''\\): use the block list's dotted path"),
        ({"cache": 0}, "cache=0\\): use 'auto', True or False"),  # 0 == False, but it cached
        ({"reuse_host_memory": 1}, "reuse_host_memory=1\\): use True, False or 'auto'"),
        ({"ddp_comm_hook": lambda state, bucket: None}, "ddp_comm_hook=...\\): the strategy reduces gradients itself"),
        ({"model_averaging_period": 4}, "model_averaging_period=...\\): .* or train with DDPStrategy"),
    ],
)
def test_invalid_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ElasticPipelineStrategy(**kwargs)


def test_distributed_data_parallel_arguments_are_named_as_without_effect():
    with pytest.warns(
        UserWarning, match="DistributedDataParallel: find_unused_parameters, static_graph have no effect"
    ):
        ElasticPipelineStrategy(find_unused_parameters=True, static_graph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # DDPStrategy's own arguments pass without a word
        ElasticPipelineStrategy(process_group_backend="gloo", start_method="spawn", timeout=timedelta(seconds=60))
        # and so do DistributedDataParallel's at their defaults, as a LightningCLI config lists them
        ElasticPipelineStrategy(find_unused_parameters=False, static_graph=False, broadcast_buffers=None, dim=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"pipline_length": 2}, "unexpected keyword argument 'pipline_length': did you mean 'pipeline_length'\\?"),
        ({"find_unused_parameter": True}, "did you mean 'find_unused_parameters'\\?"),
        ({"zzz": 1}, "unexpected keyword argument 'zzz'\\.$"),
        ({"kwarg": 1}, "unexpected keyword argument 'kwarg'\\.$"),  # not "did you mean 'kwargs'"
    ],
)
def test_a_name_no_strategy_takes_is_refused_as_ddp_refuses_it(kwargs, match):
    # It reached DistributedDataParallel's arguments, and only a warning that it had no effect.
    with pytest.raises(TypeError, match=match):
        ElasticPipelineStrategy(**kwargs)


def test_a_subclass_s_own_argument_is_offered_for_its_misspelling():
    class Subclass(ElasticPipelineStrategy):
        def __init__(self, warmup_layout: str = "2x1", **kwargs):
            super().__init__(**kwargs)

    with pytest.raises(TypeError, match="'warmup_layot': did you mean 'warmup_layout'\\?"):
        Subclass(warmup_layot="1x2")


def test_byte_counts_may_be_whole_floats_and_numpy_integers():
    strategy = ElasticPipelineStrategy(cache_ram_bytes=16e9, cache_device_bytes=np.int64(2**30), memory_budget=8e9)
    assert strategy._autocache.ram_bytes == 16 * 10**9 and strategy._autocache.device_bytes == 2**30
    with pytest.raises(ValueError, match="cache_ram_bytes=1.5"):
        ElasticPipelineStrategy(cache_ram_bytes=1.5)


def test_more_stages_than_blocks_is_refused():
    split = find_blocks(build_model("sequential"))
    with pytest.raises(ValueError, match="at most 4"):
        AutoPipe(pipeline_length=8, num_microbatches="auto").start(split, 8, 8, budget=lambda: 2.0**40, profile=False)


def test_a_world_the_pipeline_length_does_not_divide_is_refused():
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ElasticPipelineStrategy(pipeline_length=2),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    with pytest.raises(ValueError, match="pipeline_length=2 does not divide the world size 1"):
        trainer.fit(build_task("sequential"), task_loader("sequential"))


def test_one_device_is_a_valid_layout():
    model = build_task("sequential", dropout=0.0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ElasticPipelineStrategy(),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, task_loader("sequential"))
    assert trainer.strategy.engine is None  # torn down, every weight back in place
    assert trainer.global_step == 2
    assert all(p.numel() > 0 for p in model.parameters())


class _EmbeddingsNotStepped(pl.LightningModule):
    """The sequential task, its embedding left out of the optimizer (it still gets gradients)."""

    def __init__(self) -> None:
        super().__init__()
        self.task = build_task("sequential", dropout=0.0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.task(x), y)

    def configure_optimizers(self):
        stepped = [p for name, p in self.task.named_parameters() if ".embed." not in name]
        assert len(stepped) < len(list(self.parameters()))
        return torch.optim.SGD(stepped, lr=0.1)


@pytest.mark.parametrize("strategy", ["auto", "pipetx"])
def test_clipping_by_norm_counts_the_optimizer_s_parameters_only(strategy):
    # Lightning clips the gradients of the optimizer's parameters; a gradient the optimizer does
    # not step must neither count in the norm nor be scaled.
    norms = []

    class StepNorm(pl.Callback):
        def on_before_zero_grad(self, trainer, pl_module, optimizer):  # after clipping and the step
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            norms.append(float(torch.nn.utils.get_total_norm(grads)))

    chosen = ElasticPipelineStrategy(cache=False) if strategy == "pipetx" else "auto"
    trainer = make_trainer([StepNorm()], strategy=chosen, max_steps=3, gradient_clip_val=0.05)
    trainer.fit(_EmbeddingsNotStepped(), task_loader("sequential", size=24))
    assert norms[1:] == pytest.approx([0.05, 0.05], rel=1e-5)


class _ManualRegressor(_EmbeddingsNotStepped):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()


def test_manual_optimization_is_refused_naming_the_alternatives():
    trainer = make_trainer([], strategy=ElasticPipelineStrategy(), max_steps=1)
    with pytest.raises(ValueError, match="manual optimization .* cannot run under it.*DDPStrategy"):
        trainer.fit(_ManualRegressor(), task_loader("sequential"))


def test_profiled_forward_times_become_the_block_costs():
    from lightning_pipetx import FreezeCallback

    model = build_task("sequential", dropout=0.0)
    strategy = ElasticPipelineStrategy(profile_steps=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_epochs=2,
        callbacks=[FreezeCallback(signal="schedule")],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    param_counts = [float(sum(p.numel() for p in block.parameters())) for block in model.model.blocks]
    trainer.fit(model, task_loader("sequential"))
    costs = strategy.autopipe.costs
    assert len(costs) == 4 and costs != param_counts
    assert all(0 < seconds < 1 for seconds in costs)  # seconds per forward, not parameter counts


def test_a_recorded_loader_is_not_wrapped_twice():
    from torch.utils.data import DataLoader

    from lightning_pipetx.autocache.sample_keys import recording

    loader, recorder = recording(DataLoader(list(range(10)), batch_size=4))
    again, same = recording(loader)
    assert again is loader and same is recorder
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert list(recorder.yielded) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.parametrize("drop_last", [True, False])
def test_a_recorded_batch_sampler_yields_torchs_batches_and_keeps_what_drop_last_leaves_out(drop_last):
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    from lightning_pipetx.autocache.sample_keys import recording

    def shuffled_loader():
        sampler = RandomSampler(range(10), generator=torch.Generator().manual_seed(3))
        return DataLoader(list(range(10)), batch_size=4, sampler=sampler, drop_last=drop_last)

    order = list(RandomSampler(range(10), generator=torch.Generator().manual_seed(3)))
    plain = [b.tolist() for b in shuffled_loader()]
    loader, recorder = recording(shuffled_loader())
    assert [b.tolist() for b in loader] == plain  # the same batches, from the same draws
    assert [recorder.pop()[0] for _ in plain[:-1]] == plain[:-1]
    assert recorder.take_dropped() == []  # not before the epoch's last batch is trained
    assert recorder.pop()[0] == plain[-1]
    assert recorder.take_dropped() == (order[8:] if drop_last else [])  # the tail torch's sampler cut off
    assert recorder.take_dropped() == []  # once

    class OwnBatchSampler(BatchSampler):  # a batch sampler of the user's own is left as it is
        pass

    own = DataLoader(list(range(10)), batch_sampler=OwnBatchSampler(range(10), batch_size=4, drop_last=True))
    own, recorder = recording(own)
    assert [b.tolist() for b in own] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    recorder.pop(), recorder.pop()
    assert recorder.take_dropped() == []


@pytest.mark.parametrize("freezing", ["none", "freeze"])
def test_a_seeded_run_trains_as_lightning_ddp_to_the_bit(tmp_path, freezing):
    # Data parallel from the same seed: the same data order, dropout masks and schedule as
    # Lightning's DDP, so the same weights to the bit; with FreezeCallback too (frozen blocks served
    # by AutoCache). The strategy must not draw from the user's random stream, nor have Lightning
    # build the training loader twice (each build draws a seed).
    for which in ("ddp", "pipetx"):
        run_workers("seeded_dropout_worker.py", 2, which, freezing, str(tmp_path / f"{which}.pt"))
    ddp, ours = (torch.load(tmp_path / f"{which}.pt") for which in ("ddp", "pipetx"))
    assert ddp.keys() == ours.keys()
    for name, value in ddp.items():
        assert torch.equal(value, ours[name]), name


def _layer_stacked(samples):
    """A prediction whose first dimension is not the batch: 3 layers x samples x 1."""
    return torch.stack([torch.tensor(samples, dtype=torch.float).unsqueeze(-1) + 100 * layer for layer in range(3)])


def test_predictions_whose_first_dimension_is_not_the_batch_are_returned_as_produced():
    # 2 replicas of 2-sample batches; replica r predicts samples r, r + 2, ...
    shards = [[_layer_stacked([0, 2]), _layer_stacked([4, 6])], [_layer_stacked([1, 3]), _layer_stacked([5, 7])]]
    merged = merge_shards(shards, [[2, 2], [2, 2]])
    assert [m.tolist() for m in merged] == [
        b.tolist() for b in (shards[0][0], shards[1][0], shards[0][1], shards[1][1])
    ]
    # per-sample predictions of the same batches are joined back into dataset order
    rows = [[torch.tensor([0.0, 2.0]), torch.tensor([4.0, 6.0])], [torch.tensor([1.0, 3.0]), torch.tensor([5.0, 7.0])]]
    assert [m.tolist() for m in merge_shards(rows, [[2, 2], [2, 2]])] == [
        [0.0, 1.0],
        [2.0, 3.0],
        [4.0, 5.0],
        [6.0, 7.0],
    ]


def test_predictions_holding_a_number_per_batch_are_returned_as_produced():
    # A float (or int) describes its batch: dealing it to re-batched samples would average it away.
    def prediction(samples, mean):
        return {"pred": torch.tensor(samples, dtype=torch.float), "mean": mean, "names": [str(i) for i in samples]}

    shards = [[prediction([0, 2], 0.5), prediction([4, 6], 1.5)], [prediction([1, 3], 2.5), prediction([5, 7], 3.5)]]
    merged = merge_shards(shards, [[2, 2], [2, 2]])
    produced = [shards[0][0], shards[1][0], shards[0][1], shards[1][1]]
    assert len(merged) == 4 and all(m is p for m, p in zip(merged, produced))
    # per-sample values (tensors and strings) and nothing (None) are joined back into dataset order
    for shard in shards:
        for batch in shard:
            batch["mean"] = None
    merged = merge_shards(shards, [[2, 2], [2, 2]])
    assert [m["names"] for m in merged] == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
    assert [m["pred"].tolist() for m in merged] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
    assert [m["mean"] for m in merged] == [None] * 4


def test_predict_without_batches_returns_what_plain_lightning_returns():
    # limit_predict_batches=0: Lightning skips the loop, and gathering its predictions must not fail.
    class Predictor(TinySequentialRegressor):
        def predict_step(self, batch, batch_idx):
            return self(batch[0])

    loader = DataLoader(RandomVectorDataset(size=8, seed=1), batch_size=4)
    plain, ours = (
        make_trainer([], strategy=strategy, limit_predict_batches=0).predict(Predictor(seed=0), loader)
        for strategy in ("auto", ElasticPipelineStrategy())
    )
    assert ours == plain


def test_released_blocks_are_lent_their_values_and_taken_back():
    blocks = torch.nn.Sequential(torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3))
    store = ParamStore(blocks)
    store.release(range(0, 1))  # this rank runs block 0
    assert torch.isnan(blocks[1].weight).all() and blocks[1].weight.stride() == (0,)
    values = {f"m.1.{k}": torch.full_like(v, 7.0) for k, v in blocks[1].state_dict().items() if v.is_floating_point()}
    store.lend(values, "m.")
    assert all(torch.equal(v, values[f"m.1.{k}"]) for k, v in blocks[1].state_dict().items() if v.is_floating_point())
    store.take_back()
    assert torch.isnan(blocks[1].weight).all() and blocks[1].weight.stride() == (0,)
    store.take_back()  # nothing lent: nothing to do
    assert torch.isnan(blocks[1].weight).all()
    assert blocks[1].weight.shape == (3,) and store.released_blocks() == [1]
    assert not torch.isnan(blocks[0].weight).any()  # the block it runs is untouched
    assert torch.equal(blocks[1].running_mean, torch.full((3,), 7.0))  # buffers keep the values lent


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_log_call_naming_a_process_group_is_refused_under_a_pipeline(pipelined):
    # Replayed on every stage, where the group's ranks hold other stages (and a group cannot be pickled).
    recorder = LogRecorder(build_task("bert", seed=0), pipelined=pipelined)
    with recorder.capture():
        if pipelined:
            with pytest.raises(ValueError, match="Leave sync_dist_group unset"):
                recorder.module.log("loss", 1.0, sync_dist_group=object())
        else:  # one stage: nothing is replayed, the call reaches Lightning as written
            recorder.module.log("loss", 1.0, sync_dist_group=object())


def test_the_last_stage_sync_stays_with_the_run_and_leaves_metrics_as_they_were():
    from torchmetrics.classification import MulticlassAccuracy
    from torchmetrics.utilities.distributed import gather_all_tensors

    module = torch.nn.Module()
    module.acc, module.own = MulticlassAccuracy(3), MulticlassAccuracy(3, dist_sync_fn=gather_all_tensors)
    sync = LastStageSync(_no_sources)
    assert pickle.loads(pickle.dumps(sync)).sources is _no_sources  # spawn pickles the strategy
    sync.install([module.acc, module.own])
    installed = module.acc.dist_sync_fn
    assert callable(installed) and module.own.dist_sync_fn is gather_all_tensors
    assert copy.deepcopy(module).acc.dist_sync_fn is installed  # a copy made during fit shares it, no strategy copy
    assert pickle.loads(pickle.dumps(module.acc)).dist_sync_fn is gather_all_tensors
    sync.remove()
    assert module.acc.dist_sync_fn is None and module.own.dist_sync_fn is gather_all_tensors


def _no_sources():
    return None


def test_a_block_weight_tied_to_the_head_is_refused_under_a_pipeline_only():
    from lightning_pipetx.strategy.model_checks import UnsupportedRecipeError, refuse_shared_block_weights

    module = build_model("bert")
    last = module.bert.encoder.layer[-1].output.dense
    module.tied_head = torch.nn.Linear(last.in_features, last.out_features)
    module.tied_head.weight = last.weight
    blocks = module.bert.encoder.layer
    refuse_shared_block_weights(module, "bert.encoder.layer", blocks, pipeline_length=1)
    with pytest.raises(
        UnsupportedRecipeError, match="'tied_head.weight' is shared with block 3 of 'bert.encoder.layer'"
    ):
        refuse_shared_block_weights(module, "bert.encoder.layer", blocks, pipeline_length=2)


def test_a_second_name_for_the_backbone_is_not_a_shared_weight():
    # self.encoder = self.model.bert.encoder, say for layer-wise learning rates.
    from lightning_pipetx.strategy.model_checks import refuse_shared_block_weights

    module = torch.nn.Module()
    module.model = build_model("bert")
    module.encoder = module.model.bert.encoder
    refuse_shared_block_weights(module, "model.bert.encoder.layer", module.model.bert.encoder.layer, pipeline_length=2)


def test_only_the_model_holding_the_blocks_is_checked_for_dropping_blocks():
    from lightning_pipetx.strategy.model_checks import block_dropping

    module = torch.nn.Module()
    module.student, module.teacher = build_model("bert"), build_model("bert")
    module.teacher.config.layerdrop = 0.1  # a frozen teacher in eval mode never drops blocks
    assert block_dropping(module, module.student.bert.encoder.layer) == []
    assert block_dropping(module, module.teacher.bert.encoder.layer) == [
        ("BertForSequenceClassification", "layerdrop", 0.1)
    ]


def test_a_composite_model_is_checked_for_dropping_blocks_by_its_parts_configs():
    # An encoder-decoder nests its encoder's config: the encoder holding the blocks drops layers.
    from transformers import BertConfig, BertLMHeadModel, BertModel, EncoderDecoderModel

    from lightning_pipetx.strategy.model_checks import block_dropping

    sizes = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    encoder = BertModel(BertConfig(**sizes, layerdrop=0.1))
    decoder = BertLMHeadModel(BertConfig(**sizes, is_decoder=True, add_cross_attention=True))
    model = EncoderDecoderModel(encoder=encoder, decoder=decoder)
    assert block_dropping(model, model.encoder.encoder.layer) == [("BertModel", "layerdrop", 0.1)]


def test_a_run_that_failed_in_validation_leaves_no_evaluation_state_behind():
    # The next fit on the same strategy reads a training metric from the layout its epoch trained under.
    from lightning_pipetx.strategy.metric_sync import PipelineMetrics

    metrics = PipelineMetrics(running_layout=lambda: Layout(1, 2))
    metrics.evaluation_starts(torch.nn.Module(), namedtuple("OneStage", "pipeline_length")(1))
    metrics.remove()  # teardown after the exception
    metrics.logged_under(Layout(2, 1), None, lambda: None)  # a transition 2x1 -> 1x2 ended the epoch
    assert metrics.state_ranks() == Layout(2, 1).stage_ranks(1) == [0]  # global rank 0 is the last stage


def _tiny_vit_mae():
    """A tiny ViT-MAE masking half of its patches at random (mask_ratio=0.5)."""
    from transformers import ViTMAEConfig, ViTMAEForPreTraining

    config = ViTMAEConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=16,
        patch_size=8, decoder_hidden_size=16, decoder_num_hidden_layers=1, decoder_num_attention_heads=2,
        decoder_intermediate_size=32, mask_ratio=0.5,
    )  # fmt: skip
    return ViTMAEForPreTraining(config)


def test_a_model_masking_its_input_at_random_is_heard_of_unless_the_mask_is_given():
    # ViT-MAE draws its mask before the blocks; its decoder and loss, on the last stage, use it too.
    from lightning_pipetx.strategy.model_checks import (
        CollectedOutputChecks,
        UnsupportedRecipeError,
        refuse_random_input_mask,
    )

    model = _tiny_vit_mae()
    heard = []
    checks = CollectedOutputChecks(model, lambda *a: None, lambda name, switch: heard.append((name, switch)))
    checks.install()
    pixels = torch.randn(2, 3, 16, 16)
    model(pixels)
    assert heard[0] == ("ViTMAEForPreTraining", "mask_ratio=0.5")
    heard.clear()
    model(pixels, torch.rand(2, 4))  # the noise given positionally: every stage draws the same mask
    model.eval()
    model(pixels)
    assert heard == []
    checks.remove()
    # wav2vec2's time masks change block 0's input only, which only the first stage uses.
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    speech = Wav2Vec2ForCTC(
        Wav2Vec2Config(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
            conv_stride=(4, 4), conv_kernel=(8, 8), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
            vocab_size=8, mask_time_prob=0.3, mask_time_length=2,
        )
    )  # fmt: skip
    checks = CollectedOutputChecks(speech, lambda *a: None, lambda name, switch: heard.append((name, switch)))
    checks.install()
    speech.train()
    speech(torch.randn(2, 400))
    checks.remove()
    assert heard == []
    with pytest.raises(UnsupportedRecipeError, match="pass noise= from the batch"):
        refuse_random_input_mask("ViTMAEForPreTraining", "mask_ratio=0.5", 2)


def test_a_model_returning_every_block_s_input_as_memory_is_heard_of():
    # XLNet's mems: on by default in evaluation (use_mems_eval), off in training unless asked for.
    from transformers import XLNetConfig, XLNetForSequenceClassification

    from lightning_pipetx.strategy.model_checks import CollectedOutputChecks

    config = XLNetConfig(vocab_size=32, d_model=16, n_layer=2, n_head=2, d_inner=32, num_labels=2)
    model = XLNetForSequenceClassification(config)
    heard = []
    checks = CollectedOutputChecks(model, lambda name, what: heard.append((name, what)))
    checks.install()
    tokens = torch.randint(0, 32, (2, 6))
    model.train()
    model(tokens)
    assert heard == []
    model(tokens, use_mems=True)
    assert heard[0] == ("XLNetForSequenceClassification", "use_mems")
    heard.clear()
    model.eval()
    model(tokens, use_mems=False)
    assert heard == []
    model(tokens)
    checks.remove()
    assert heard[0] == ("XLNetForSequenceClassification", "use_mems_eval")


def test_a_speech_classifier_asking_its_encoder_for_hidden_states_it_drops_is_not_heard_of():
    # transformers' filter_output_hidden_states makes Wav2Vec2ForSequenceClassification ask its inner
    # model for every layer's hidden state in every call; it reads them only under use_weighted_layer_sum.
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    from lightning_pipetx.strategy.model_checks import CollectedOutputChecks

    config = Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
        conv_stride=(4, 4), conv_kernel=(8, 8), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
        num_labels=2, classifier_proj_size=8, layerdrop=0.0,  # LayerDrop would drop a layer's hidden state at random
    )  # fmt: skip
    model = Wav2Vec2ForSequenceClassification(config)
    heard = []
    checks = CollectedOutputChecks(model, lambda name, what: heard.append((name, what)))
    checks.install()
    speech = torch.randn(2, 400)
    model(speech)
    assert heard == []
    model(speech, output_hidden_states=True)
    assert heard == [("Wav2Vec2ForSequenceClassification", "output_hidden_states")]
    checks.remove()
    config.use_weighted_layer_sum = True
    model, heard = Wav2Vec2ForSequenceClassification(config), []
    checks = CollectedOutputChecks(model, lambda name, what: heard.append((name, what)))
    checks.install()
    model(speech)
    checks.remove()
    assert heard == [("Wav2Vec2ForSequenceClassification", "use_weighted_layer_sum")]


def test_a_model_masking_its_input_at_random_is_not_heard_of_when_given_the_noise_under_a_wrapped_forward():
    # Under a pipeline the output relay wraps the forward of the models on the path to the blocks.
    from lightning_pipetx.strategy.model_checks import CollectedOutputChecks

    model = _tiny_vit_mae()
    original = model.forward
    model.forward = lambda *args, **kwargs: original(*args, **kwargs)
    heard = []
    checks = CollectedOutputChecks(model, lambda *a: None, lambda name, switch: heard.append((name, switch)))
    checks.install()
    model(pixel_values=torch.randn(2, 3, 16, 16), noise=torch.rand(2, 4))
    checks.remove()
    assert heard == []


def test_outputs_of_every_block_are_heard_of_for_the_model_running_the_blocks_only():
    # A second list over the model's layers (the block list found) still has the model checked; a
    # frozen teacher, a copy of the model, runs whole on every rank and is not.
    from lightning_pipetx.strategy.model_checks import CollectedOutputChecks

    module = build_task("bert")
    module.layers = torch.nn.ModuleList(list(module.model.bert.encoder.layer))
    module.teacher = copy.deepcopy(module.model)
    heard = []
    checks = CollectedOutputChecks(module, lambda name, what: heard.append((name, what)), blocks=module.layers)
    checks.install()
    tokens = torch.randint(2, 100, (2, 6))
    module.teacher(tokens, output_hidden_states=True)
    assert heard == []
    module.model(tokens, output_hidden_states=True)
    checks.remove()
    assert heard[0] == ("BertForSequenceClassification", "output_hidden_states")


def test_every_error_of_the_package_and_of_the_readme_imports_from_the_package():
    import builtins
    import importlib
    import inspect
    import pkgutil
    import re
    from pathlib import Path

    import lightning_pipetx

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    named = set(re.findall(r"`(\w+Error)`", readme)) - set(dir(builtins))
    defined = {
        name
        for info in pkgutil.walk_packages(lightning_pipetx.__path__, "lightning_pipetx.")
        for name, value in vars(importlib.import_module(info.name)).items()
        if inspect.isclass(value) and issubclass(value, Exception) and name.endswith("Error")
        if value.__module__.startswith("lightning_pipetx")
    }
    assert named and named <= defined <= set(lightning_pipetx.__all__), (named, defined)


def test_numpy_integers_are_whole_numbers_for_the_strategy():
    import numpy as np

    strategy = ElasticPipelineStrategy(pipeline_length=np.int64(2), num_microbatches=np.int64(4))
    assert (strategy.pipeline_length, strategy.num_microbatches) == (2, 4)


def _raised(action) -> Exception:
    try:
        action()
    except Exception as error:
        return error
    raise AssertionError("nothing was raised")


def test_a_first_stage_s_error_is_explained_by_collected_outputs_unless_a_backward_raised_it():
    # The note (values collected after the model call stay empty off the last stage) is about the
    # user's code; an error of autograd's (a saved tensor changed in place) is not explained by it.
    user_error = _raised(lambda: [][0])
    x = torch.ones(3, requires_grad=True)
    y = x.exp()
    y.mul_(2)  # exp saved its output for the backward
    backward_error = _raised(lambda: y.sum().backward())
    explain_training_outputs(user_error, stage=0, num_stages=2)
    explain_training_outputs(backward_error, stage=0, num_stages=2)
    assert "stay empty on this rank" in " ".join(getattr(user_error, "__notes__", []))
    assert "modified by an inplace operation" in str(backward_error)
    assert not getattr(backward_error, "__notes__", [])


class _KeepsAnAverage(pl.Callback):
    def __init__(self, model: torch.nn.Module) -> None:
        self.average = copy.deepcopy(model)


def test_copies_of_the_block_list_are_watched_in_the_module_and_in_callbacks_and_aliases_are_not():
    # A second list of the same block objects (for layer-wise learning rates) is no copy: its blocks
    # are the model's own, which read NaN on the ranks that do not hold them.
    module = build_task("bert")
    blocks = find_blocks(module).blocks
    module.layers = torch.nn.ModuleList(list(blocks))
    module.reference = copy.deepcopy(module.model)
    trainer = types.SimpleNamespace(lightning_module=module, callbacks=[])
    watch = BlockCopyWatch(trainer, blocks, pipeline_length=2)
    with torch.no_grad():
        for param in blocks.parameters():
            param.fill_(float("nan"))  # as another stage's blocks read
    watch.check()
    callback = _KeepsAnAverage(module.model)  # copies are looked for at each check
    trainer.callbacks.append(callback)
    with torch.no_grad():
        for param in callback.average.bert.encoder.layer[1].parameters():  # an average of NaN
            param.fill_(float("nan"))
    with pytest.raises(WeightAveragingError, match=r"_KeepsAnAverage.average.bert.encoder.layer is a copy"):
        watch.check()
    BlockCopyWatch(trainer, blocks, pipeline_length=1).check()  # replicas hold every block


def test_a_model_copied_or_pickled_during_fit_leaves_the_strategy_s_forwards_and_hooks_behind():
    # copy.deepcopy(self.model) for an EMA, torch.save(self.model): the copy took the installed
    # callables along, whose state (process groups, here a lock) cannot be copied or pickled, and
    # whose forward ran the original blocks.
    model = build_model("bert", dropout=0.0)
    blocks = find_blocks(model).blocks
    lock, calls = threading.Lock(), []

    def relayed(original, *args, **kwargs):
        calls.append(lock)
        return original(*args, **kwargs)

    for block in blocks:
        block.forward = InstalledForward(block.forward, relayed, block.forward)
    blocks[1].register_forward_pre_hook(InstalledHook(lambda module, args: calls.append(lock)))
    FreezeBoundary().install(find_blocks(model), 1)  # block 0 kept in eval mode
    inputs = torch.randint(1, 50, (2, 6))
    expected = model(input_ids=inputs).logits
    assert len(calls) == len(blocks) + 1
    calls.clear()
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        copied.train()
        weight = copied.bert.encoder.layer[-1].output.dense.weight
        with torch.no_grad():
            weight.mul_(3.0)  # its own weights, not the original's
        assert not torch.allclose(copied(input_ids=inputs).logits, expected)
        assert not calls and copied.bert.encoder.layer[0].training
        with torch.no_grad():
            weight.div_(3.0)
        torch.testing.assert_close(copied.eval()(input_ids=inputs).logits, expected)
