"""AutoCache on one device: exact, hits once warm, incremental, guarded, and bounded in RAM."""

import errno
import json
import os
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import tiny_models as tm
import torch
from distributed import run_workers
from elastic_cases import reference_run
from lightning.pytorch.callbacks import ModelCheckpoint, ModelPruning
from torch import nn
from torch.utils.data import DataLoader

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback
from lightning_pipetx.autocache import AutoCache, CacheControl, CacheFeed, CacheSite, TrainablePrefixError
from lightning_pipetx.autocache.frozen_weights import FrozenWeightsChangedError, FrozenWeightsGuard, exact_fingerprint
from lightning_pipetx.autocache.guards import InputGuard, agreed_fingerprints
from lightning_pipetx.blocks import find_blocks
from lightning_pipetx.strategy.fingerprint import batch_fingerprint, sample_fingerprints
from lightning_pipetx.strategy.p2p import Activation


def fit(
    cache,
    dataset,
    tmp_path,
    epochs=4,
    freeze_interval=1,
    collate_fn=None,
    module=None,
    drop_last=False,
    watch=(),
    max_steps=-1,
    trainer_kwargs=None,
    ckpt_path=None,
    **strategy_kwargs,
):
    module = module or tm.TinyBertClassifier(seed=0, dropout=0.0)
    freeze = FreezeCallback(alpha=1 / 2, signal="schedule", freeze_interval=freeze_interval)
    rates = tm.HitRates()
    strategy = ElasticPipelineStrategy(
        cache=cache, profile_steps=0, cache_dir=str(tmp_path / "spill"), **strategy_kwargs
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_epochs=epochs,
        max_steps=max_steps,
        callbacks=[freeze, rates, *watch],
        **{"enable_checkpointing": False, **(trainer_kwargs or {})},
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    loader = DataLoader(dataset, batch_size=8, shuffle=True, collate_fn=collate_fn, drop_last=drop_last)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return module.state_dict(), rates.rates, trainer


def _same(a, b):
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-5, msg=key)


def test_cached_and_uncached_runs_agree_and_the_cache_warms_up(tmp_path):
    data = tm.RandomTokenDataset(size=32, seed=1)
    uncached, _, _ = fit(False, data, tmp_path, freeze_interval=2)
    cached, rates, trainer = fit(True, data, tmp_path, freeze_interval=2)
    _same(cached, uncached)
    assert rates == [None, None, 0.0, 1.0]  # frozen after epoch 1: all misses, then all hits
    assert trainer.callback_metrics["pipetx/cache_ram_bytes"] > 0


def test_incremental_deepening_is_exact(tmp_path):
    data = tm.RandomTokenDataset(size=32, seed=1)
    uncached, _, _ = fit(False, data, tmp_path)
    cached, rates, _ = fit(True, data, tmp_path)  # 2 blocks frozen after epoch 0, 3 after epoch 1
    _same(cached, uncached)
    assert rates == [None, 0.0, 0.0, 1.0]  # epoch 2 reads depth 2 and runs block 2 only


class _ServedShares(pl.Callback):
    """Per epoch, the share of training samples whose frozen prefix was read from the cache
    (at the epoch's depth or a shallower one)."""

    def __init__(self):
        self.shares = []

    def on_train_epoch_end(self, trainer, pl_module):
        metrics = trainer.callback_metrics
        served = [v for k, v in metrics.items() if k.startswith("pipetx/cache_served_") and not k.endswith("_bytes")]
        self.shares.append(sum(float(v) for v in served))


class _CountedSteps(tm.TinyBertClassifier):
    """Counts the calls of its training_step in each epoch."""

    def __init__(self):
        super().__init__(seed=0, dropout=0.0)
        self.calls = {}

    def training_step(self, batch, batch_idx):
        self.calls[self.current_epoch] = self.calls.get(self.current_epoch, 0) + 1
        return super().training_step(batch, batch_idx)


def test_samples_left_out_by_drop_last_are_cached_too_and_training_stays_exact(tmp_path):
    data = tm.RandomTokenDataset(size=36, seed=1)  # 4 batches of 8 an epoch, 4 samples left out
    uncached, _, _ = fit(False, data, tmp_path, drop_last=True)
    shares = _ServedShares()
    module = _CountedSteps()
    cached, rates, _ = fit(True, data, tmp_path, drop_last=True, module=module, watch=[shares])
    _same(cached, uncached)
    # 2 blocks frozen after epoch 0, 3 after epoch 1: epoch 2 reads every sample at depth 2 (the 4
    # left out of epoch 1 included), epoch 3 every one at depth 3 (those left out of epoch 2 included).
    assert rates == [None, 0.0, 0.0, 1.0]
    assert shares.shares[2:] == [1.0, 1.0]
    # The left-out samples run through training_step (up to the frozen prefix) after the last batch
    # of epochs 1 and 2; not after epoch 0 (nothing frozen) nor after epoch 3 (each is cached at its depth).
    assert module.calls == {0: 4, 1: 5, 2: 5, 3: 4}


class _FullBatchesOnly(_CountedSteps):
    """A training_step written for batches of 8 only (drop_last=True promises it those)."""

    def training_step(self, batch, batch_idx):
        self.calls[self.current_epoch] = self.calls.get(self.current_epoch, 0) + 1
        batch = {key: value.view(8, *value.shape[1:]) for key, value in batch.items()}
        return tm.TinyBertClassifier.training_step(self, batch, batch_idx)


def test_a_step_that_fails_on_the_left_out_samples_trains_as_before(tmp_path, caplog):
    data = tm.RandomTokenDataset(size=36, seed=1)
    uncached, _, _ = fit(False, data, tmp_path, drop_last=True)
    module = _FullBatchesOnly()
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        cached, rates, _ = fit(True, data, tmp_path, drop_last=True, module=module)
    _same(cached, uncached)
    failures = [r.message for r in caplog.records if "drop_last left out" in r.message]
    assert len(failures) == 1 and "RuntimeError" in failures[0]
    assert module.calls == {0: 4, 1: 5, 2: 4, 3: 4}  # tried once, after epoch 1, then no more
    assert rates[-1] > 0  # the states of what the epochs' batches held are still served


@pytest.mark.parametrize("limit", [{"epochs": 3}, {"epochs": 9, "max_steps": 12}])
def test_samples_left_out_of_the_last_epoch_are_not_cached(tmp_path, limit):
    module = _CountedSteps()
    fit(True, tm.RandomTokenDataset(size=36, seed=1), tmp_path, drop_last=True, module=module, **limit)
    # Epoch 2, the last, is the first at depth 3: its left-out samples are not at that depth, but no
    # epoch follows to read them.
    assert module.calls == {0: 4, 1: 5, 2: 4}


def test_the_drop_last_fill_converts_its_batch_to_the_precision(tmp_path):
    shares = _ServedShares()
    module = tm.TinySequentialRegressor(seed=0, dropout=0.0)
    data = tm.RandomVectorDataset(size=36)  # float inputs: "64-true" makes them float64
    _, rates, _ = fit(
        True, data, tmp_path, drop_last=True, module=module, watch=[shares], trainer_kwargs={"precision": "64-true"}
    )
    assert rates == [None, 0.0, 0.0, 1.0] and shares.shares[2:] == [1.0, 1.0]


class _ShiftedTokens(torch.utils.data.Dataset):
    """Token ids stored out of the vocabulary, shifted back by the DataModule's batch hook."""

    def __init__(self):
        self.inner = tm.RandomTokenDataset(size=36, seed=1)

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        sample = dict(self.inner[index])
        return {**sample, "input_ids": sample["input_ids"] + 1000}


class _ShiftingDataModule(pl.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(_ShiftedTokens(), batch_size=8, shuffle=True, drop_last=True)

    def on_before_batch_transfer(self, batch, dataloader_idx):
        return {**batch, "input_ids": batch["input_ids"] - 1000}


def test_the_drop_last_fill_calls_the_datamodules_batch_hook(tmp_path):
    shares = _ServedShares()
    trainer = tm.cached_trainer(tmp_path, True, [shares])
    module = _CountedSteps()
    trainer.fit(module, datamodule=_ShiftingDataModule())
    assert module.calls == {0: 4, 1: 5, 2: 5, 3: 4} and shares.shares[2:] == [1.0, 1.0]


class _PaddedTokens(torch.utils.data.Dataset):
    """17 samples of full length and 16 of half length, padded per batch by :func:`_pad`."""

    def __init__(self):
        self.ids = torch.randint(2, tm.VOCAB, (33, tm.SEQ_LEN), generator=torch.Generator().manual_seed(0))
        self.lengths = [tm.SEQ_LEN] * 17 + [tm.SEQ_LEN // 2] * 16

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        ids = self.ids[index, : self.lengths[index]]
        return {"input_ids": ids, "labels": ids[0] % tm.NUM_LABELS}


def _pad(samples):
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, sample in enumerate(samples):
        ids[row, : len(sample["input_ids"])] = sample["input_ids"]
        mask[row, : len(sample["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.stack([s["labels"] for s in samples])}


def test_a_left_out_sample_padded_shorter_than_the_batches_is_not_cached(tmp_path, caplog):
    # Batches of 16 always hold a sample of full length (17 of the 33): every batch is as wide in
    # every epoch, and the cache serves them. The sample drop_last leaves out is padded to its own
    # length, often shorter: it is left uncached rather than taken for dynamic padding.
    loader = DataLoader(_PaddedTokens(), batch_size=16, shuffle=True, drop_last=True, collate_fn=_pad)
    rates = tm.HitRates()
    trainer = tm.cached_trainer(tmp_path, "auto", [rates], alpha=1 / 4, max_epochs=6)
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        trainer.fit(tm.TinyBertClassifier(seed=0, dropout=0.0), loader)
    assert not [r.message for r in caplog.records if "switched off" in r.message]
    assert rates.rates[-1] == 1.0


def test_augmentation_switches_the_cache_off_with_a_warning(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        _, rates, trainer = fit("auto", tm.AugmentedTokenDataset(size=32, seed=1), tmp_path)
    assert any("input changed between epochs" in r.message for r in caplog.records)
    assert sum("AutoCache switched off" in r.message for r in caplog.records) == 1
    assert all(rate in (None, 0.0) for rate in rates)
    assert trainer.callback_metrics["pipetx/cache_ram_bytes"] == 0  # its states are freed once off


class _MaskedInStep(tm.TinyBertClassifier):
    """Replaces random tokens of its batch inside training_step, before the model call."""

    def training_step(self, batch, batch_idx):
        generator = torch.Generator().manual_seed(1000 * self.current_epoch + batch_idx)
        masked = torch.rand(batch["input_ids"].shape, generator=generator) < 0.3
        batch = {**batch, "input_ids": batch["input_ids"].masked_fill(masked, 1)}
        return super().training_step(batch, batch_idx)


def test_a_batch_changed_inside_the_step_switches_the_cache_off_after_one_epoch_with_a_warning(tmp_path, caplog):
    # The loader yields the same batches every epoch, so only what enters the frozen blocks shows
    # the change: epoch 2 serves states cached in epoch 1 (the loaded batches passed their check),
    # and the comparison at the start of epoch 3 switches the cache off.
    data = tm.RandomTokenDataset(size=32, seed=1)
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        _, rates, trainer = fit("auto", data, tmp_path, epochs=5, module=_MaskedInStep(seed=0, dropout=0.0))
    messages = [r.message for r in caplog.records if "AutoCache switched off" in r.message]
    assert len(messages) == 1 and "what enters the frozen blocks changed" in messages[0]
    assert "cache=False" in messages[0]
    assert rates == [None, 0.0, 0.0, 0.0, 0.0]  # epoch 2 read depth 2 (stale) and filled depth 3


def test_a_training_loader_rebuilt_over_another_dataset_switches_the_cache_off(tmp_path, caplog):
    pool = tm.RandomTokenDataset(size=64, seed=1)

    class Reloading(tm.TinyBertClassifier):
        def train_dataloader(self):
            start = 0 if self.current_epoch < 2 else 32  # other samples under the same indices
            return DataLoader(torch.utils.data.Subset(pool, range(start, start + 32)), batch_size=8)

    def run(cache):
        module = Reloading(seed=0, dropout=0.0)
        trainer = tm.cached_trainer(tmp_path, cache, reload_dataloaders_every_n_epochs=1)
        trainer.fit(module)
        return module.state_dict()

    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        cached = run("auto")
    assert any("rebuilt over another dataset object" in r.message for r in caplog.records)
    _same(cached, run(False))


class _ReloadsInPlace(tm.TinyBertClassifier):
    """Its train_dataloader() returns the same dataset object every time, with other samples from ``change_at`` on."""

    def __init__(self, change_at):
        super().__init__(seed=0, dropout=0.0)
        self.change_at = change_at
        self.data = tm.SwappableDataset(tm.RandomTokenDataset(size=32, seed=1))

    def train_dataloader(self):
        if self.current_epoch == self.change_at:
            self.data.base = tm.RandomTokenDataset(size=32, seed=2)
        return DataLoader(self.data, batch_size=8)


@pytest.mark.parametrize("change_at", [None, 4])
def test_a_reloaded_training_dataset_is_checked_before_the_cache_serves_it_again(tmp_path, caplog, change_at):
    # Reloads at epochs 2 and 4 over the same dataset object: each epoch after one computes the
    # prefix, and the cache serves again only once that epoch's inputs were compared unchanged with
    # the earlier ones. Samples changed in place at a reload switch it off, before a stale state is read.
    def run(cache):
        rates = tm.HitRates()
        module = _ReloadsInPlace(change_at)
        trainer = tm.cached_trainer(tmp_path, cache, [rates], max_epochs=6, reload_dataloaders_every_n_epochs=2)
        trainer.fit(module)
        return module.state_dict(), rates.rates

    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        cached, rates = run("auto")
    _same(cached, run(False)[0])
    switched_off = [r.message for r in caplog.records if "AutoCache switched off" in r.message]
    if change_at is None:
        assert rates == [None, 0.0, 0.0, 1.0, 0.0, 1.0] and not switched_off
    else:
        assert rates == [None, 0.0, 0.0, 1.0, 0.0, 0.0]
        assert len(switched_off) == 1 and "a dataset a reload changed in place" in switched_off[0]


def pad_to_longest(samples):
    batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    length = int(batch["attention_mask"].sum(1).max())
    return {k: (v[:, :length] if v.dim() == 2 else v) for k, v in batch.items()}


def test_a_resume_that_moves_to_another_layout_keeps_the_cache(tmp_path):
    # The resumed fit moves 2x1 -> 1x2 before its first step: Lightning builds the training loader
    # again, which is the recorded loader reloaded, not a second loader (cache=True refused it).
    run_workers("resume_cache_worker.py", 2, str(tmp_path / "full"), timeout=300)
    run_workers("resume_cache_worker.py", 2, str(tmp_path / "resumed"), str(tmp_path / "full" / "epoch=1.ckpt"))
    full = json.loads((tmp_path / "full" / "report.json").read_text())
    resumed = json.loads((tmp_path / "resumed" / "report.json").read_text())
    # The states are not checkpointed, the inputs' fingerprints are: the resumed fit fills in epoch 2,
    # whose batches compare unchanged with the checkpoint's, and serves from epoch 3, to the same weights.
    assert full["4"] == 1.0 and resumed == {"2": 0.0, "3": 1.0, "4": 1.0}
    for name, value in torch.load(tmp_path / "full" / "final.pt").items():
        assert torch.equal(torch.load(tmp_path / "resumed" / "final.pt")[name], value), name
    # Resumed over other data of the same size: no trust from the checkpoint, and no change of this
    # run's either (the cache stays on): it compares epoch 3 with epoch 2 and serves from epoch 4.
    other = tmp_path / "other_data"
    run_workers("resume_cache_worker.py", 2, str(other), str(tmp_path / "full" / "epoch=1.ckpt"), "other_data")
    assert json.loads((other / "report.json").read_text()) == {"2": 0.0, "3": 0.0, "4": 1.0}


def test_a_resume_after_an_epochs_last_batch_keeps_the_cache_beside_a_validation_loader(tmp_path):
    # Resumed from a checkpoint written after the epoch's last batch, Lightning's validation loop builds
    # its loader while trainer.training is still set: it is not a second training loader (cache=True refused).
    run_workers("resume_cache_worker.py", 2, str(tmp_path / "full"), "-", "validate", timeout=300)
    resumed = tmp_path / "resumed"
    run_workers("resume_cache_worker.py", 2, str(resumed), str(tmp_path / "full" / "epoch=1.ckpt"), "validate")
    assert json.loads((resumed / "report.json").read_text()) == {"2": 0.0, "3": 1.0, "4": 1.0}


def test_dynamic_padding_is_refused_with_a_clear_message(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        _, rates, _ = fit("auto", tm.RandomTokenDataset(size=32, seed=1), tmp_path, collate_fn=pad_to_longest)
    messages = " ".join(r.message for r in caplog.records)
    assert "AutoCache switched off" in messages and "padding" in messages
    assert all(rate in (None, 0.0) for rate in rates)


def _padded_short_in_epoch_3(size=32, batch=8):
    """Token samples of 12-16 tokens but for the third batch of epoch 3 (in the loader's seed-0
    order), whose samples have 6: padded to a multiple of 8, every batch is 16 wide but that one, 8."""
    data = tm.RandomTokenDataset(size=size, seq_len=16, seed=1)
    short = torch.randperm(size, generator=torch.Generator().manual_seed(3))[2 * batch : 3 * batch]
    lengths = 12 + torch.arange(size) % 5
    lengths[short] = 6
    data.attention_mask = (torch.arange(16)[None] < lengths[:, None]).long()
    data.input_ids = data.input_ids * data.attention_mask
    return data


def pad_to_multiple_of_8(samples):
    """What transformers' DataCollatorWithPadding(pad_to_multiple_of=8) does to the batch's longest."""
    batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    length = -(-int(batch["attention_mask"].sum(1).max()) // 8) * 8
    return {k: (v[:, :length] if v.dim() == 2 else v) for k, v in batch.items()}


@pytest.mark.parametrize("cache", ["auto", True])
def test_a_batch_padded_otherwise_after_the_cache_served_switches_it_off_before_serving(cache, tmp_path, caplog):
    # Every batch is 16 wide until the third of epoch 3; the cache served 16-wide states before it.
    data = _padded_short_in_epoch_3()
    uncached, _, _ = fit(False, data, tmp_path, freeze_interval=2, collate_fn=pad_to_multiple_of_8)
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        cached, rates, _ = fit(cache, data, tmp_path, freeze_interval=2, collate_fn=pad_to_multiple_of_8)
    _same(cached, uncached)
    messages = [r.message for r in caplog.records if "AutoCache switched off" in r.message]
    assert len(messages) == 1 and "shapes [(8,), (8,), ()], the run's first batch's [(16,), (16,), ()]" in messages[0]
    # Frozen after epoch 1; epoch 3 served its first two batches (every lookup a hit), and looked up no more.
    assert rates == [None, None, 0.0, 1.0]


class _SharpnessAwareClassifier(tm.TinyBertClassifier):
    def configure_optimizers(self):
        return tm.SharpnessAware(self.parameters())


def test_an_optimizer_that_calls_the_closure_twice_is_served_from_the_cache(tmp_path, caplog):
    # The loader's worker reads ahead: each call of the closure must take this batch's samples.
    def run(cache):
        module = _SharpnessAwareClassifier(seed=0, dropout=0.0)
        loader = DataLoader(tm.RandomTokenDataset(size=32, seed=1), batch_size=8, shuffle=True, num_workers=1)
        trainer = tm.cached_trainer(tmp_path / str(cache), cache, [rates := tm.HitRates()], alpha=1 / 2, max_epochs=4)
        trainer.fit(module, loader)
        return module.state_dict(), rates.rates

    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        cached, rates = run(True)
    assert "input changed" not in caplog.text and rates[-1] == 1.0
    _same(cached, run(False)[0])


class _SkippingEveryFourth:
    """A collate_fn that yields None for every fourth batch (as one that skips unreadable batches): Lightning skips it."""

    def __init__(self):
        self.calls = 0

    def __call__(self, samples):
        self.calls += 1
        return None if self.calls % 4 == 2 else torch.utils.data.default_collate(samples)


def test_a_batch_lightning_skips_leaves_the_cache_on_the_next_batches_samples(tmp_path, caplog):
    # The samples of a skipped batch are not taken for the next batch's (whose inputs would then
    # seem to change between epochs): they are cached once another epoch trains on them.
    data = tm.RandomTokenDataset(size=32, seed=1)
    uncached, _, _ = fit(False, data, tmp_path, epochs=8, collate_fn=_SkippingEveryFourth())
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        cached, rates, _ = fit("auto", data, tmp_path, epochs=8, collate_fn=_SkippingEveryFourth())
    _same(cached, uncached)
    assert "input changed" not in caplog.text and rates[-3:] == [1.0, 1.0, 1.0]


def _barebones_warnings(run):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return len([w for w in caught if "barebones" in str(w.message)])


def test_a_barebones_trainer_warns_only_of_the_module_s_own_logs(tmp_path):
    # Trainer(barebones=True) logs nothing and warns at every self.log: the strategy and the callback log none.
    data = tm.RandomTokenDataset(size=32, seed=1)
    ours = _barebones_warnings(lambda: fit("auto", data, tmp_path, trainer_kwargs={"barebones": True}))
    plain = tm.make_trainer([], max_epochs=4, barebones=True)
    module = tm.TinyBertClassifier(seed=0, dropout=0.0)
    lightnings = _barebones_warnings(lambda: plain.fit(module, DataLoader(data, batch_size=8, shuffle=True)))
    assert ours == lightnings > 0  # the module's train_loss, every step


def drop_first_row(samples):
    """A collate_fn that filters a sample out of every batch (as one that skips unreadable samples)."""
    return {k: torch.stack([s[k] for s in samples[1:]]) for k in samples[0]}


def test_a_collate_fn_that_drops_rows_switches_the_cache_off_and_stays_exact(tmp_path, caplog):
    data = tm.RandomTokenDataset(size=32, seed=1)
    uncached, _, _ = fit(False, data, tmp_path, collate_fn=drop_first_row)
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        cached, rates, _ = fit("auto", data, tmp_path, collate_fn=drop_first_row)
    _same(cached, uncached)
    messages = " ".join(r.message for r in caplog.records)
    assert "AutoCache switched off" in messages and "a batch of 7 rows was made of 8 samples" in messages
    assert all(rate in (None, 0.0) for rate in rates)
    with pytest.raises(ValueError, match=r"cache=True\): a batch of 7 rows was made of 8 samples"):
        fit(True, data, tmp_path, collate_fn=drop_first_row)


def test_beyond_the_ram_budget_the_cache_spills_to_disk(tmp_path):
    data = tm.RandomTokenDataset(size=32, seed=1)
    uncached, _, _ = fit(False, data, tmp_path, freeze_interval=2)
    cached, rates, trainer = fit(True, data, tmp_path, freeze_interval=2, cache_ram_bytes=0)
    _same(cached, uncached)
    assert rates[-1] == 1.0
    assert trainer.callback_metrics["pipetx/cache_ram_bytes"] == 0
    assert trainer.callback_metrics["pipetx/cache_disk_bytes"] > 0
    assert not list((tmp_path / "spill").glob("pipetx-*"))  # removed when fit ended


class _SwapsAfterEpoch(tm.TinyBertClassifier):
    """Replaces its training samples in place after epoch 2, with no reload: nothing tells the cache."""

    def __init__(self, data):
        super().__init__(seed=0, dropout=0.0)
        self.data = data

    def on_train_epoch_end(self):
        if self.current_epoch == 2:
            self.data.base = tm.RandomTokenDataset(size=32, seed=2)


def test_a_dataset_changed_in_place_is_found_an_epoch_later_and_the_hit_rate_then_reads_zero(tmp_path, caplog):
    data = tm.SwappableDataset(tm.RandomTokenDataset(size=32, seed=1))
    rates = tm.HitRates()
    trainer = tm.cached_trainer(tmp_path, "auto", [rates], max_epochs=6)
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        trainer.fit(_SwapsAfterEpoch(data), DataLoader(data, batch_size=8))
    messages = [r.message for r in caplog.records if "AutoCache switched off" in r.message]
    assert len(messages) == 1 and "input changed between epochs" in messages[0]
    assert "may have used states cached from an earlier one" in messages[0]  # epoch 3 was served the old samples'
    assert rates.rates == [None, 0.0, 0.0, 1.0, 0.0, 0.0]  # before: 1.0 kept in the logs once off


def test_cache_false_records_nothing(tmp_path):
    _, _, trainer = fit(False, tm.RandomTokenDataset(size=32, seed=1), tmp_path, epochs=2)
    assert "pipetx/cache_hit_rate" not in trainer.callback_metrics
    assert trainer.callback_metrics["pipetx/frozen_blocks"] == 2


def test_a_tied_input_embedding_that_still_trains_keeps_the_cache_off(tmp_path, caplog):
    # GPT-2's input embedding is its LM head's weight: it trains after the blocks freeze.
    data = tm.RandomTokenDataset(size=32, seed=1)
    uncached, _, _ = fit(False, data, tmp_path, module=tm.TinyGPT2LM(seed=0, dropout=0.0))
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        auto, rates, _ = fit("auto", data, tmp_path, module=tm.TinyGPT2LM(seed=0, dropout=0.0))
    _same(auto, uncached)
    assert all(rate in (None, 0.0) for rate in rates)
    messages = " ".join(r.message for r in caplog.records)
    assert "AutoCache switched off" in messages and "model.transformer.wte.weight" in messages
    with pytest.raises(TrainablePrefixError, match="cache=False"):
        fit(True, data, tmp_path, module=tm.TinyGPT2LM(seed=0, dropout=0.0))


class BiasedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(tm.HIDDEN, tm.HIDDEN)

    def forward(self, hidden, bias):
        return hidden + torch.tanh(self.linear(hidden) + bias)


class Encoder(nn.Module):
    """Every block reads ``relative.weight``, registered after the blocks (as DeBERTa's relative
    embeddings are): it is not part of the frozen prefix and keeps training."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(BiasedBlock() for _ in range(tm.LAYERS))
        self.relative = nn.Linear(1, tm.HIDDEN, bias=False)

    def forward(self, hidden):
        for layer in self.layers:
            hidden = layer(hidden, self.relative.weight[:, 0])
        return hidden


class RelativeBiasNet(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, tm.HIDDEN)
        self.encoder = Encoder()
        self.head = nn.Linear(tm.HIDDEN, 2)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("cache", [True, "auto"])
def test_a_weight_the_frozen_blocks_read_from_outside_keeps_the_cache_off(tmp_path, caplog, cache):
    data = tm.RandomVectorDataset(size=32, seed=1)
    uncached, _, _ = fit(False, data, tmp_path, module=RelativeBiasNet())
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        cached, rates, _ = fit(cache, data, tmp_path, module=RelativeBiasNet())
    _same(cached, uncached)
    assert all(rate in (None, 0.0) for rate in rates)
    messages = " ".join(r.message for r in caplog.records)
    assert "AutoCache switched off" in messages and "requires a gradient" in messages


def test_a_weight_read_only_before_the_blocks_freezes_with_them_and_the_cache_serves(tmp_path, caplog):
    # MPNet's encoder computes its relative position bias, before the blocks, from a weight
    # registered after them: the first step's trace counts it as pre.
    data = tm.RandomTokenDataset(size=32, seed=1)
    uncached, _, _ = fit(False, data, tmp_path, module=tm.TinyMPNetClassifier(seed=0, dropout=0.0))
    with caplog.at_level("INFO", logger="lightning_pipetx"):
        cached, rates, trainer = fit(True, data, tmp_path, module=tm.TinyMPNetClassifier(seed=0, dropout=0.0))
    _same(cached, uncached)
    assert rates == [None, 0.0, 0.0, 1.0]  # frozen 2, 3, 3: fill depth 2, fill depth 3, then hits
    bias = trainer.lightning_module.model.mpnet.encoder.relative_attention_bias.weight
    assert not bias.requires_grad
    messages = " ".join(r.message for r in caplog.records)
    assert "relative_attention_bias.weight, read only before the blocks, freeze with them" in messages
    assert "AutoCache switched off" not in messages


def _states(depth, size=4):
    return Activation.of_hidden(torch.full((size, 3, 2), float(depth)), 0)


def _checked(cache, size=4):
    """The cache after an input check passed: two epochs saw the same inputs."""
    indices = torch.arange(size)
    for _ in range(2):
        cache.guard.observe(indices, indices.to(torch.float64))
        cache.begin_epoch(group_size=1)
    assert cache.guard.trusted
    return cache


def test_the_input_guard_compares_each_sample_with_the_last_epoch_that_saw_it():
    guard = InputGuard(num_samples=4, device=torch.device("cpu"))
    guard.observe(torch.arange(4), torch.zeros(4, dtype=torch.float64))
    assert guard.take_counts().tolist() == [0, 0, 0, 0]  # nothing seen before
    guard.observe(torch.tensor([0, 1]), torch.zeros(2, dtype=torch.float64))
    assert guard.take_counts().tolist() == [2, 0, 0, 0]
    guard.observe(torch.tensor([2, 3]), torch.tensor([0.0, 7.0], dtype=torch.float64))  # 3 changed since epoch 0
    assert guard.take_counts().tolist() == [2, 1, 0, 0]
    guard.observe(torch.tensor([3]), torch.tensor([7.0], dtype=torch.float64))  # as last seen: unchanged
    assert guard.take_counts().tolist() == [1, 0, 0, 0]


def test_fingerprints_restored_from_a_checkpoint_grant_trust_at_the_first_comparison_and_only_trust():
    def guard_after(*epochs):
        guard = InputGuard(num_samples=4, device=torch.device("cpu"))
        for number, loaded in enumerate(epochs):
            if number:
                guard.judge(*guard.take_counts().tolist())
            guard.observe(torch.arange(len(loaded)), torch.tensor(loaded, dtype=torch.float64))
        return guard

    # Kept where the saving run showed its inputs unchanged from one epoch to the next (here: half of
    # epoch 1 as epoch 0, its verdict still to come); not where it had compared nothing yet, or changed.
    fingerprints, seen = agreed_fingerprints(guard_after([0.0, 1.0, 2.0, 3.0], [0.0, 1.0]), world_size=1)
    assert fingerprints.tolist() == [0.0, 1.0, 2.0, 3.0] and seen.all()
    assert not agreed_fingerprints(guard_after([0.0, 1.0, 2.0, 3.0]), world_size=1)[1].any()
    assert not agreed_fingerprints(guard_after([0.0, 1.0, 2.0, 3.0], [0.0, 5.0]), world_size=1)[1].any()

    def resumed(loaded, restored=(fingerprints, seen)):
        guard = InputGuard(num_samples=4, device=torch.device("cpu"))
        guard.restore(*restored)
        assert not guard.judge(*guard.take_counts().tolist())  # the resumed epoch's start: nothing loaded yet
        guard.observe(torch.arange(len(loaded)), torch.tensor(loaded, dtype=torch.float64))
        counts = guard.take_counts().tolist()
        return guard, counts, guard.judge(*counts)

    def next_epoch(guard, loaded):
        guard.observe(torch.arange(4), torch.tensor(loaded, dtype=torch.float64))
        counts = guard.take_counts().tolist()
        return counts, guard.judge(*counts)

    guard, counts, changed = resumed([0.0, 1.0])  # a partial first epoch (a resume mid-epoch)
    assert counts == [0, 0, 2, 0] and guard.trusted and not changed
    # Samples 2 and 3 hold other data than the checkpoint's run's: the first comparison ended the
    # checkpoint's use, so they are compared within this run from their first load here on.
    assert next_epoch(guard, [0.0, 1.0, 9.0, 9.0]) == ([2, 0, 0, 0], False)
    # Other data than the saving run's: no trust, and no change of this run's to switch the cache off for.
    guard, counts, changed = resumed([0.0, 6.0, 9.0, 9.0])
    assert counts == [0, 0, 4, 3] and not guard.trusted and not changed
    assert next_epoch(guard, [0.0, 6.0, 9.0, 9.0]) == ([4, 0, 0, 0], False) and guard.trusted
    assert next_epoch(guard, [0.0, 7.0, 9.0, 9.0]) == ([4, 1, 0, 0], True)  # within this run: a change
    # A checkpoint written before anything was recorded (the prefix guard's, before the first freeze):
    # this run's own comparisons count as without it, a change found in them included.
    nothing = (torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.bool))
    guard, counts, changed = resumed([0.0, 0.0, 0.0, 0.0], restored=nothing)
    assert counts == [0, 0, 0, 0] and next_epoch(guard, [1.0, 0.0, 0.0, 0.0]) == ([4, 1, 0, 0], True)


class _ChangesTokenFromEpoch3(tm.TinyBertClassifier):
    """A ``training_step`` that changes what enters the frozen blocks from epoch 3 on (the loader's batches stay)."""

    def training_step(self, batch, batch_idx):
        if self.current_epoch >= 3:
            input_ids = batch["input_ids"].clone()
            input_ids[:, 1] = 1
            batch = {**batch, "input_ids": input_ids}
        return super().training_step(batch, batch_idx)


def test_a_fit_resumed_before_the_prefix_was_compared_finds_a_step_that_changes_it_as_one_run_does(tmp_path, caplog):
    # The checkpoint of epoch 1, written as the first blocks froze, holds the inputs' fingerprints and
    # none of the prefix's (recorded from then on): the resumed fit compares the prefix within its own
    # epochs, and switches the cache off when the step changes it, with the warning, as one run does.
    data = tm.RandomTokenDataset(size=32, seed=1)
    saving = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    _, uninterrupted, _ = fit(
        "auto", data, tmp_path, epochs=6, freeze_interval=2, module=_ChangesTokenFromEpoch3(seed=0, dropout=0.0),
        watch=[saving], trainer_kwargs={"enable_checkpointing": True},
    )  # fmt: skip
    saved = torch.load(tmp_path / "epoch=1.ckpt", weights_only=True)["pipetx"]["input_fingerprints"]
    assert saved["inputs"][1].all() and not saved["prefix_inputs"][1].any()
    caplog.clear()
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        _, resumed, _ = fit(
            "auto", data, tmp_path / "resumed", epochs=6, freeze_interval=2,
            module=_ChangesTokenFromEpoch3(seed=0, dropout=0.0), ckpt_path=tmp_path / "epoch=1.ckpt",
        )  # fmt: skip
    assert "what enters the frozen blocks changed between epochs" in caplog.text
    assert "The last epoch may have used states cached from an earlier one" in caplog.text
    assert uninterrupted == [None, None, 0.0, 1.0, 0.0, 0.0] and resumed == uninterrupted[2:]


class _NoisedPerLoad(torch.utils.data.Dataset):
    """Every load of a sample differs from its last: one token drawn from (index, how often this
    process loaded it), so a process that starts again replays the first epoch's inputs."""

    def __init__(self):
        self.base, self.loads = tm.RandomTokenDataset(size=32, seed=1), [0] * 32

    def __len__(self):
        return 32

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(1000 * index + self.loads[index])
        self.loads[index] += 1
        sample = dict(self.base[index])
        sample["input_ids"] = sample["input_ids"].clone()
        position, token = (
            torch.randint(1, 16, (1,), generator=generator),
            torch.randint(1, 100, (1,), generator=generator),
        )
        sample["input_ids"][position] = token
        return sample


def test_a_checkpoint_keeps_no_fingerprints_of_inputs_its_run_had_not_shown_unchanged(tmp_path):
    # Written after epoch 0 (blocks froze), before any two epochs were compared: a resumed fit's first
    # epoch replays epoch 0's inputs here, and trusting it would serve epoch-1 states to other inputs.
    saving = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    fit("auto", _NoisedPerLoad(), tmp_path, watch=[saving], trainer_kwargs={"enable_checkpointing": True})
    checkpoint = tmp_path / "epoch=0.ckpt"
    saved = torch.load(checkpoint, weights_only=True)["pipetx"]
    assert saved["frozen_blocks"] > 0 and not saved["input_fingerprints"]["inputs"][1].any()
    uncached, _, _ = fit(False, _NoisedPerLoad(), tmp_path / "uncached", ckpt_path=checkpoint)
    cached, _, _ = fit("auto", _NoisedPerLoad(), tmp_path / "cached", ckpt_path=checkpoint)
    _same(cached, uncached)


def _block_pruning(module):
    """Lightning's ModelPruning of the block list's linear layers: 20% more at each epoch's end."""
    layers = [(m, "weight") for m in module.model.bert.encoder.layer.modules() if isinstance(m, nn.Linear)]
    return ModelPruning(
        "l1_unstructured", parameters_to_prune=layers, amount=0.2, use_global_unstructured=False, verbose=0
    )


def test_pruning_frozen_blocks_switches_the_cache_off_before_it_serves_a_stale_state(tmp_path, caplog):
    # The blocks frozen after epoch 0 are pruned again after epoch 1: the states cached in epoch 1
    # no longer stand for them, so epoch 2 computes them (it would have served them).
    data = tm.RandomTokenDataset(size=32, seed=1)
    module = tm.TinyBertClassifier(seed=0, dropout=0.0)
    uncached, _, _ = fit(False, data, tmp_path, module=module, watch=[_block_pruning(module)])
    module = tm.TinyBertClassifier(seed=0, dropout=0.0)
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        cached, rates, _ = fit("auto", data, tmp_path, module=module, watch=[_block_pruning(module)])
    _same(cached, uncached)
    messages = [r.message for r in caplog.records if "AutoCache switched off" in r.message]
    assert len(messages) == 1 and "the frozen prefix changed after states were cached" in messages[0]
    assert "'model.bert.encoder.layer.0.attention.output.dense.weight_mask'" in messages[0]
    assert all(rate in (None, 0.0) for rate in rates)
    module = tm.TinyBertClassifier(seed=0, dropout=0.0)
    with pytest.raises(FrozenWeightsChangedError, match=r"cache=True\): the frozen prefix changed .* ModelPruning"):
        fit(True, data, tmp_path, module=module, watch=[_block_pruning(module)])


def test_the_frozen_weights_guard_compares_what_this_rank_computed_at_both_checks():
    module = tm.TinyBertClassifier(seed=0, dropout=0.0)
    split = find_blocks(module)
    query = split.blocks[0].attention.self.query
    name = "model.bert.encoder.layer.0.attention.self.query.weight"
    guard = FrozenWeightsGuard()
    assert guard.changed() == []  # nothing watched yet
    computed_here = lambda m: True  # noqa: E731
    guard.watch(module, split, 1, computed_here)
    assert guard.changed() == []  # the first check takes the reference
    guard.watch(module, split, 2, computed_here)
    assert guard.changed() == []  # the prefix grew; nothing changed
    with torch.no_grad():
        query.weight[0, 0] += 1e-3
    assert guard.changed() == [name]
    torch.nn.utils.prune.l1_unstructured(query, "weight", amount=0.5)  # weight -> weight_orig, weight_mask
    assert guard.changed() == [name, name + "_mask", name + "_orig"]
    with torch.no_grad():  # a mask that moves, as many zeros as before
        query.weight_mask.copy_(query.weight_mask.flip(1))
    assert guard.changed() == [name + "_mask"]
    running = "model.bert.encoder.layer.0.running"
    split.blocks[0].register_buffer("running", torch.zeros(3), persistent=False)  # not in the state dict
    assert guard.changed() == [running]  # it appeared, as a pruning mask does
    split.blocks[0].running.add_(1.0)  # a forward that updates a running mean of its input
    assert guard.changed() == [running] and guard.changed() == []
    elsewhere = lambda m: m is not split.blocks[1]  # noqa: E731 - another rank computes block 1
    guard.watch(module, split, 2, elsewhere)
    guard.changed()
    with torch.no_grad():
        split.blocks[1].output.dense.weight.mul_(2)  # its values arrive with a transition
    guard.watch(module, split, 2, computed_here)
    assert guard.changed() == []
    guard.watch(module, split, 2, elsewhere)
    assert guard.changed() == []  # and leave with the next


def test_an_exact_fingerprint_sees_one_value_and_not_the_order_of_summation():
    tensors = [torch.randn(5, 3), torch.randn(4).to(torch.bfloat16), torch.rand(6) > 0.5, torch.randn(3, 2).double()]
    tensors += [torch.randn(7).to(torch.float16), torch.randn(4, 8)[:, 1:4]]  # odd byte count; a strided view
    for tensor in tensors:
        base = exact_fingerprint(tensor)
        assert base.dtype == torch.int64 and base.shape == (2,)
        changed = tensor.clone()
        flat = changed.view(-1)
        flat[1] = ~flat[1] if tensor.dtype == torch.bool else flat[1] * 0.5 + 1
        assert not torch.equal(exact_fingerprint(changed), base), tensor.dtype
        assert torch.equal(exact_fingerprint(tensor.clone()), base)
    assert exact_fingerprint(torch.zeros(0)).tolist() == [0, 0]


def test_a_batch_fingerprint_sees_every_tensor_of_the_batch():
    # Every stage of a replica compares it: a per-batch value (a 0-dim tensor) must count too.
    batch = {"input_ids": torch.arange(12).view(3, 4), "labels": torch.tensor([0, 1, 0]), "scale": torch.tensor(0.5)}
    base = batch_fingerprint(batch)
    assert torch.equal(batch_fingerprint(dict(batch)), base)
    for key, changed in [
        ("scale", torch.tensor(0.25)),
        ("labels", torch.tensor([0, 0, 1])),
        ("scale", torch.tensor(1)),
    ]:
        assert not torch.equal(batch_fingerprint({**batch, key: changed}), base), (key, changed)
    two = {"first": torch.tensor(0.5), "second": torch.tensor(0.25)}
    assert not torch.equal(batch_fingerprint(two), batch_fingerprint({"first": two["second"], "second": two["first"]}))


def test_a_samples_fingerprint_does_not_depend_on_the_batch_it_is_in():
    # A float matrix product rounds a row's sum by the number of rows: a sample in a short batch (the
    # last one, or the samples drop_last left out) would read as changed in a full batch next epoch.
    generator = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, 30_000, (32, 64), generator=generator),
        "attention_mask": torch.ones(32, 64, dtype=torch.long),
        "pixels": torch.randn(32, 3, 16, 16, generator=generator),
        "bf16": torch.randn(32, 5, generator=generator).to(torch.bfloat16),
        "flags": torch.rand(32, 4, generator=generator) > 0.5,
        "labels": torch.randint(0, 2, (32,), generator=generator),
    }
    full = sample_fingerprints(batch, 32)
    for size in range(1, 32):
        part = sample_fingerprints({k: v[:size] for k, v in batch.items()}, size)
        assert torch.equal(part, full[:size]), size
    for key, value in batch.items():  # a change of one value, by one unit in its last place, is seen
        changed = value.clone()
        row = changed[7].view(-1)
        if value.dtype == torch.bool:
            row[0] = ~row[0]
        elif value.is_floating_point():
            row[0] = torch.nextafter(row[0], torch.tensor(1e4, dtype=value.dtype))
        else:
            row[0] += 1
        differs = sample_fingerprints({**batch, key: changed}, 32) != full
        assert differs.nonzero().flatten().tolist() == [7], key
    swapped = batch["input_ids"].clone()
    swapped[3, [5, 6]] = swapped[3, [6, 5]]
    assert (sample_fingerprints({**batch, "input_ids": swapped}, 32) != full).nonzero().flatten().tolist() == [3]
    for position in range(62):  # +1, -2, +1 on three neighbouring tokens (a second difference)
        edited = batch["input_ids"].clone()
        edited[9, position : position + 3] += torch.tensor([1, -2, 1])
        assert (sample_fingerprints({**batch, "input_ids": edited}, 32) != full).nonzero().flatten().tolist() == [9]


def test_the_prefix_guard_tolerates_a_relative_difference_below_its_tolerance():
    guard = InputGuard(num_samples=2, device=torch.device("cpu"), tolerance=1e-4)
    guard.observe(torch.arange(2), torch.tensor([1000.0, 1000.0], dtype=torch.float64))
    guard.take_counts()
    guard.observe(torch.arange(2), torch.tensor([1000.05, 1000.5], dtype=torch.float64))
    assert guard.take_counts().tolist() == [2, 1, 0, 0]


def test_old_depths_files_are_freed_when_the_depth_grows(tmp_path):
    cache = _checked(AutoCache(tmp_path / "ram", tmp_path / "spill", num_samples=4, ram_budget=2**20))
    indices = torch.arange(4)
    for depth in (1, 2, 3):
        cache.store(indices, depth, _states(depth))
    cache.drop_below(3)  # depth 2 stays: samples cached there only need block 2 to reach depth 3
    assert sorted(p.name for p in (tmp_path / "ram").glob("depth*")) == [
        "depth2",
        "depth2.json",  # where a depth is and what it holds, for the node's other ranks
        "depth2.valid",
        "depth3",
        "depth3.json",
        "depth3.valid",
    ]
    level, states, _ = cache.lookup(indices, 3)
    assert level == 3 and torch.equal(states, torch.full((4, 3, 2), 3.0))
    cache.close(remove_files=True)


def test_a_full_ram_file_system_sends_the_depth_to_disk_instead_of_crashing(tmp_path, monkeypatch, caplog):
    # A container's 64 MB /dev/shm: reserving the file's blocks fails (ENOSPC) where a write
    # into a sparse shared mapping would have raised SIGBUS later.
    ram = tmp_path / "ram"
    cache = _checked(AutoCache(ram, tmp_path / "spill", num_samples=4, ram_budget=2**30))
    reserve = os.posix_fallocate

    def full_ram(fd, offset, length):
        if Path(os.readlink(f"/proc/self/fd/{fd}")).parent == ram:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        reserve(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", full_ram)
    with caplog.at_level("INFO", logger="lightning_pipetx"):
        cache.store(torch.arange(4), 1, _states(1))
    assert "has no room for depth 1" in caplog.text
    assert cache.tier_bytes("host") == 0 and cache.tier_bytes("disk") == 4 * 3 * 2 * 4
    assert not list(ram.glob("depth1*"))
    assert cache.lookup(torch.arange(4), 1)[0] == 1
    cache.close(remove_files=True)


def test_a_loader_without_automatic_batching_is_not_recorded(tmp_path):
    # What Lightning makes of DataLoader(batch_sampler=BatchSampler(...)) when it adds its sampler.
    feed = CacheFeed(CacheControl(True, str(tmp_path), 2**20, 0))
    loader = DataLoader(tm.RandomTokenDataset(size=4), batch_size=None)
    returned, opened = feed.training_loader(
        loader, CacheSite(f"{tmp_path.parent.name}-{tmp_path.name}", 0, torch.device("cpu"), share_host=False)
    )
    assert returned is loader and opened is None and loader.batch_sampler is None


class TinySwinV2Classifier(tm.TinyViTClassifier):
    """HF Swin-v2: each stage (a block of its block list) returns its output's dimensions as ints."""

    def __init__(self):
        pl.LightningModule.__init__(self)
        from transformers import Swinv2Config, Swinv2ForImageClassification

        config = Swinv2Config(
            image_size=tm.IMG_SIZE, patch_size=4, embed_dim=16, depths=[1, 1, 2, 1], num_heads=[1, 1, 2, 2],
            window_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0,
            num_labels=tm.NUM_CLASSES,
        )  # fmt: skip
        torch.manual_seed(0)
        self.model = Swinv2ForImageClassification(config)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.hparams.lr = 1e-3

    def forward(self, images):
        return self.model(pixel_values=images).logits


@pytest.mark.parametrize("cache", ["auto", True])
def test_a_prefix_whose_output_cannot_be_kept_is_not_cached(cache, caplog):
    # One device, the README's recipe: the model trains on, without the cache.
    freeze = FreezeCallback(alpha=1 / 2, signal="schedule")
    trainer = tm.make_trainer([freeze], max_epochs=3, strategy=ElasticPipelineStrategy(cache=cache))
    loader = tm.task_loader("timm_vit", size=16)
    if cache is True:
        with pytest.raises(ValueError, match="cache=True.*last block returns what cannot be kept"):
            trainer.fit(TinySwinV2Classifier(), loader)
        return
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        trainer.fit(TinySwinV2Classifier(), loader)
    assert freeze.frozen_blocks == 3 and trainer.global_step == 6
    assert "last block returns what cannot be kept" in caplog.text


@pytest.mark.parametrize("cache", [True, "auto"])
def test_blocks_returning_what_nothing_reads_beside_their_hidden_state_are_cached(cache, tmp_path):
    data = tm.RandomTokenDataset(size=16, seed=1)
    uncached, _, _ = fit(False, data, tmp_path, epochs=4, module=tm.TinyRoFormerClassifier(dropout=0.0))
    cached, rates, _ = fit(cache, data, tmp_path, epochs=4, module=tm.TinyRoFormerClassifier(dropout=0.0))
    _same(cached, uncached)
    assert rates == [None, 0.0, 0.0, 1.0]  # depth 2 cached in epoch 1, depth 3 in epoch 2, served in epoch 3


@pytest.mark.parametrize("cache", [True, "auto"])
def test_blocks_passing_more_than_their_hidden_state_on_are_not_cached(cache, tmp_path):
    # T5's decoder blocks hand their position biases on to the next block.
    def t5():
        module = tm.build_task("t5", dropout=0.0)
        module.model.lm_head.weight = torch.nn.Parameter(module.model.lm_head.weight.detach().clone())  # untied
        return module

    data = tm.TASKS["t5"].dataset(size=16, seed=1)
    if cache is True:
        with pytest.raises(ValueError, match=r"cache=True\): the frozen blocks return more than their hidden"):
            fit(True, data, tmp_path, epochs=3, module=t5())
        return
    uncached, _, _ = fit(False, data, tmp_path, epochs=4, module=t5())
    cached, rates, _ = fit(cache, data, tmp_path, epochs=4, module=t5())
    _same(cached, uncached)
    assert all(rate in (None, 0.0) for rate in rates)


def test_such_blocks_are_cached_once_a_transition_ends_the_forward_on_the_caching_stage(tmp_path):
    # 2x1 -> 1x2: on the first of 2 stages the rest of the forward is not seen, and nothing is kept;
    # on 1x2 it is, and the states are kept and served.
    run_workers("elastic_worker.py", 2, str(tmp_path), "roformer")
    report = json.loads((tmp_path / "report.json").read_text())
    assert [epoch[:3] for epoch in report["epochs"]] == [[0, 2, 1], [2, 1, 2], [3, 1, 2]]
    assert report["served"] == [None, 0.0, 1.0]
    result = torch.load(tmp_path / "final.pt", weights_only=True)["state"]
    for key, expected in reference_run("roformer")["state"].items():
        torch.testing.assert_close(result[key], expected, atol=1e-5, rtol=1e-4, msg=key)
