"""AutoCache serves the frozen prefix of the validation loader run during fit, exactly."""

import json

import lightning.pytorch as pl
import pytest
import tiny_models as tm
import torch
from distributed import run_workers
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging
from torch.utils.data import DataLoader

from lightning_pipetx.strategy.lightning_compat import WeightAveragingError


class ValidationRecord(Callback):
    """Every validation's loss; the validation cache's (hits, lookups) in it (None: not serving);
    and its hit rate as logged at the end of every epoch (None: nothing looked up yet)."""

    def __init__(self):
        self.losses, self.served, self.rates = [], [], []

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.losses.append(float(trainer.callback_metrics.get("val_loss", float("nan"))))
            cache = trainer.strategy.engine.eval_cache
            self.served.append(None if cache is None else (cache.counts.hits, cache.counts.lookups))

    def on_train_epoch_end(self, trainer, pl_module):
        rate = trainer.callback_metrics.get("pipetx/val_cache_hit_rate")
        self.rates.append(None if rate is None else float(rate))


def fit(
    cache, tmp_path, val_data=None, module=None, epochs=4, sanity_steps=0, val_loaders=None, callbacks=(), **options
):
    module = module or tm.TinyBertClassifier(seed=0, dropout=0.0)
    record = ValidationRecord()
    trainer = tm.cached_trainer(
        tmp_path, cache, [record, *callbacks], max_epochs=epochs, num_sanity_val_steps=sanity_steps, **options
    )
    train = DataLoader(tm.RandomTokenDataset(size=32, seed=1), batch_size=8, shuffle=True)
    val = val_loaders or DataLoader(val_data or tm.RandomTokenDataset(size=24, seed=2), batch_size=8)
    trainer.fit(module, train, val)
    return module, record, trainer


@pytest.mark.parametrize("sanity_steps", [0, 2])
def test_validation_is_served_from_the_cache_with_the_same_results(tmp_path, sanity_steps):
    uncached, plain, _ = fit(False, tmp_path, sanity_steps=sanity_steps)
    cached, served, trainer = fit(True, tmp_path, sanity_steps=sanity_steps)
    assert served.losses == plain.losses  # bit for bit: a hit returns the stored state
    for key, value in uncached.state_dict().items():
        torch.testing.assert_close(cached.state_dict()[key], value, atol=0, rtol=0, msg=key)
    # Frozen 0, 2, 3, 3 blocks in validations 0-3: the first validation only sees the inputs,
    # the second fills depth 2, the third fills depth 3 (nothing is served before what enters the
    # frozen blocks was compared unchanged), the fourth hits depth 3.
    assert served.served == [(0, 0), (0, 24), (0, 24), (24, 24)]
    assert served.rates == [None, 0.0, 0.0, 1.0]
    assert plain.served == [None] * 4 and plain.rates == [None] * 4
    assert not list((tmp_path / "spill").glob("pipetx-*"))  # removed when fit ended


def test_validation_inputs_that_change_keep_only_the_validation_cache_off(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        _, record, trainer = fit(True, tmp_path, val_data=tm.AugmentedTokenDataset(size=24, seed=2))
    messages = [r.message for r in caplog.records]
    assert any("validation cache switched off" in m and "input changed" in m for m in messages)
    assert not any(m.startswith("pipetx: AutoCache switched off") for m in messages)
    assert record.served == [(0, 0), (0, 24), None, None]  # off once the second validation compared them
    assert trainer.callback_metrics["pipetx/cache_hit_rate"] == 1.0  # training still cached


def _pad_to_longest(samples):
    batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    length = int(batch["attention_mask"].sum(1).max())
    return {k: (v[:, :length] if v.dim() == 2 else v) for k, v in batch.items()}


def test_validation_batches_padded_to_other_lengths_are_never_served(tmp_path, caplog):
    # Padded to each batch's longest, the validation batches differ in length: the training cache serves.
    val = DataLoader(tm.RandomTokenDataset(size=24, seed=2), batch_size=4, collate_fn=_pad_to_longest)
    _, plain, _ = fit(False, tmp_path, val_loaders=val)
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        _, served, trainer = fit("auto", tmp_path, val_loaders=val)
    assert served.losses == plain.losses and served.served == [None] * 4
    assert "validation cache switched off" in caplog.text and "the run's first batch's" in caplog.text
    assert trainer.callback_metrics["pipetx/cache_hit_rate"] == 1.0


class _Resizable(torch.utils.data.Dataset):
    """The first ``size`` of 40 samples: one dataset object whose length a run may change."""

    def __init__(self, size):
        self.base, self.size = tm.RandomTokenDataset(size=40, seed=2), size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.base[index]


class GrowingValidation(tm.TinyBertClassifier):
    """Validates on 24 samples, then on 40 from the fourth epoch on (reloading its loaders)."""

    def __init__(self, data):
        super().__init__(seed=0, dropout=0.0)
        self.data = data

    def on_validation_epoch_end(self):
        if self.current_epoch == 2:
            self.data.size = 40


def test_a_validation_dataset_that_changes_its_length_turns_the_validation_cache_off(tmp_path, caplog):
    def run(cache):
        data = _Resizable(24)
        val = DataLoader(data, batch_size=8)
        module = GrowingValidation(data)
        return fit(cache, tmp_path, module=module, val_loaders=val, epochs=5, reload_dataloaders_every_n_epochs=1)

    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        cached, record, _ = run(True)
    assert "the validation dataset changed its length between epochs (24 -> 40 samples)" in caplog.text
    assert record.served == [(0, 0), (0, 24), (0, 24), None, None]  # before: an index past the cache's 24 samples
    uncached, plain, _ = run(False)
    assert record.losses == plain.losses
    for key, value in uncached.state_dict().items():
        torch.testing.assert_close(cached.state_dict()[key], value, atol=0, rtol=0, msg=key)


class SwappedValidation(tm.TinyBertClassifier):
    """Validates on 24 samples it replaces in place (same object, same length) after the validation of ``epoch``."""

    def __init__(self, data, epoch):
        super().__init__(seed=0, dropout=0.0)
        self.data, self.epoch = data, epoch

    def on_validation_epoch_end(self):
        if self.current_epoch == self.epoch:
            self.data.base = tm.RandomTokenDataset(size=24, seed=3)


def _fit_swapped(cache, tmp_path, epoch, reload_every):
    data = tm.SwappableDataset(tm.RandomTokenDataset(size=24, seed=2))
    module = SwappedValidation(data, epoch)
    val = DataLoader(data, batch_size=8)
    return fit(
        cache, tmp_path, module=module, val_loaders=val, epochs=6, reload_dataloaders_every_n_epochs=reload_every
    )


@pytest.mark.parametrize("epoch, reload_every", [(2, 1), (3, 2)])
def test_a_validation_dataset_a_reload_changed_in_place_is_never_served_stale(tmp_path, caplog, epoch, reload_every):
    # The validation after a reload is computed, and compared with the earlier inputs, before any is served.
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        _, record, _ = _fit_swapped(True, tmp_path, epoch, reload_every)
    _, plain, _ = _fit_swapped(False, tmp_path, epoch, reload_every)
    assert record.losses == plain.losses  # before: the validation after the change was served the old samples' states
    assert "validation cache switched off" in caplog.text and "a dataset a reload changed in place" in caplog.text
    assert "may have used states cached" not in caplog.text
    assert record.served[epoch + 1] == (0, 24) and record.served[epoch + 2 :] == [None] * (4 - epoch)


def test_a_validation_dataset_changed_in_place_without_a_reload_is_found_at_the_next_validation(tmp_path, caplog):
    # Nothing tells the cache of a change made between two validations without a reload: the
    # validation after it is served the earlier states, and the next one finds the change and says so.
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        _, record, _ = _fit_swapped(True, tmp_path, 3, 0)
    _, plain, _ = _fit_swapped(False, tmp_path, 3, 0)
    assert record.served[3:] == [(24, 24), (24, 24), None]
    assert record.losses[:4] == plain.losses[:4] and record.losses[5] == plain.losses[5]
    assert record.losses[4] != plain.losses[4]
    assert "a dataset a reload changed in place" in caplog.text and "may have used states cached" in caplog.text


class MaskedValidation(tm.TinyBertClassifier):
    """A validation step that masks tokens at random before the model call, anew each epoch."""

    def validation_step(self, batch, batch_idx):
        generator = torch.Generator().manual_seed(1000 * self.trainer.current_epoch + batch_idx)
        masked = torch.rand(batch["input_ids"].shape, generator=generator) < 0.3
        return super().validation_step({**batch, "input_ids": batch["input_ids"].masked_fill(masked, 1)}, batch_idx)


def test_validation_that_changes_its_batch_before_the_model_call_is_never_served(tmp_path, caplog):
    # The loaded batches stay the same; what enters the frozen blocks does not.
    _, plain, _ = fit(False, tmp_path, module=MaskedValidation(seed=0, dropout=0.0), epochs=5)
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        _, record, _ = fit(True, tmp_path, module=MaskedValidation(seed=0, dropout=0.0), epochs=5)
    assert record.losses == plain.losses
    assert all(served is None or served[0] == 0 for served in record.served)
    assert any("validation cache switched off" in r.message for r in caplog.records)


def test_validation_with_ema_weights_is_never_served_and_stays_exact(tmp_path, caplog):
    """EMA swaps its averages, which keep moving in the frozen prefix, into the model for each validation."""
    ema = getattr(pl.callbacks, "EMAWeightAveraging", None)
    if ema is None:
        pytest.skip("this Lightning has no EMAWeightAveraging (added in 2.6)")
    _, plain, _ = fit(False, tmp_path, callbacks=[ema(decay=0.5)])
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        _, record, trainer = fit(True, tmp_path, callbacks=[ema(decay=0.5)])
    assert record.losses == plain.losses
    assert record.served == [None] * 4
    assert any(
        "validation cache switched off" in r.message and "EMAWeightAveraging" in r.message for r in caplog.records
    )
    assert trainer.callback_metrics["pipetx/cache_hit_rate"] == 1.0  # training never sees the averages


class BatchNormHead(tm.TinyBertClassifier):
    """A batch norm before the classifier: SWA then adds an epoch trained with its averaged weights."""

    def __init__(self):
        super().__init__(seed=0, dropout=0.0)
        self.model.classifier = torch.nn.Sequential(torch.nn.BatchNorm1d(tm.HIDDEN), self.model.classifier)


@pytest.mark.parametrize("module", [BatchNormHead, None], ids=["batch_norm", "no_batch_norm"])
def test_swa_that_trains_on_its_averages_is_refused_by_a_forced_cache(tmp_path, module):
    swa = StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=2)
    if module is None:  # SWA copies its averages in after the last epoch only: both caches serve
        _, record, trainer = fit(True, tmp_path, callbacks=[swa])
        assert trainer.callback_metrics["pipetx/cache_hit_rate"] == 1.0
        assert record.served[-1] == (24, 24)
        return
    with pytest.raises(WeightAveragingError, match=r"cache=True\): StochasticWeightAveraging copies averaged"):
        fit(True, tmp_path, module=module(), callbacks=[swa])


class HiddenStatesInValidation(tm.TinyBertClassifier):
    def validation_step(self, batch, batch_idx):
        out = self.model(**batch, output_hidden_states=True)
        self.log("val_loss", out.loss + 0 * out.hidden_states[0].sum())


def test_validation_asking_for_every_blocks_output_is_never_served(tmp_path, caplog):
    uncached, plain, _ = fit(False, tmp_path, module=HiddenStatesInValidation(seed=0, dropout=0.0))
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        _, record, trainer = fit("auto", tmp_path, module=HiddenStatesInValidation(seed=0, dropout=0.0))
    assert record.losses == plain.losses
    assert any(
        "validation cache switched off" in r.message and "output_hidden_states" in r.message for r in caplog.records
    )
    assert record.served == [None] * 4
    assert trainer.callback_metrics["pipetx/cache_hit_rate"] == 1.0


class BiasPenalty(tm.TinyMPNetClassifier):
    """MPNet whose loss also penalises the relative position bias's weight: read after the blocks
    too, that weight is not part of the frozen prefix and keeps training."""

    def training_step(self, batch, batch_idx):
        bias = self.model.mpnet.encoder.relative_attention_bias.weight
        return super().training_step(batch, batch_idx) + 1e-3 * bias.square().sum()


def test_a_weight_the_frozen_blocks_read_from_outside_keeps_validation_uncached(tmp_path):
    _, plain, _ = fit(False, tmp_path, module=BiasPenalty(seed=0, dropout=0.0))
    _, record, trainer = fit("auto", tmp_path, module=BiasPenalty(seed=0, dropout=0.0))
    assert trainer.lightning_module.model.mpnet.encoder.relative_attention_bias.weight.requires_grad
    assert record.losses == plain.losses
    assert all(counts is None or counts[0] == 0 for counts in record.served)


def test_validation_of_a_model_with_a_bias_computed_before_the_blocks_is_served(tmp_path):
    # MPNet's relative position bias comes from a weight registered after the blocks but read
    # only before them: it freezes with the prefix, and validation is served exactly.
    _, plain, _ = fit(False, tmp_path, module=tm.TinyMPNetClassifier(seed=0, dropout=0.0))
    _, record, _ = fit("auto", tmp_path, module=tm.TinyMPNetClassifier(seed=0, dropout=0.0))
    assert record.losses == plain.losses
    assert record.served == [(0, 0), (0, 24), (0, 24), (24, 24)]


@pytest.mark.parametrize("pipeline_length", [2, 1])
def test_validation_on_two_processes_is_served_exactly(tmp_path, pipeline_length):
    run_workers("eval_cache_worker.py", 2, str(tmp_path), str(pipeline_length))
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for report in ranks:
        assert report["True"]["losses"] == report["False"]["losses"]
        assert report["False"]["served"] == [None] * 4
    first_stage = [r["True"] for r in ranks if r["True"]["stage"] == 0]
    assert len(first_stage) == 3 - pipeline_length  # a 2-stage pipeline, or two replicas
    samples = 24 // len(first_stage)  # each replica validates its shard
    # Frozen 0, 2, 3, 3: see the inputs, fill depth 2, fill depth 3 (nothing is served before what
    # enters the frozen blocks was compared unchanged, here with the second's), then hit depth 3.
    for report in first_stage:
        assert report["served"] == [[0, 0], [0, samples], [0, samples], [samples, samples]]
    assert not list((tmp_path / "spill").glob("pipetx-*"))


class TwoValidationLoaders(tm.TinyBertClassifier):
    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("val_loss", self(batch).loss)


def test_the_first_of_two_validation_loaders_is_cached_and_both_stay_exact(tmp_path):
    def run(cache):
        datasets = [tm.RandomTokenDataset(size=24, seed=2), tm.RandomTokenDataset(size=16, seed=3)]
        loaders = [DataLoader(data, batch_size=8) for data in datasets]
        _, _, trainer = fit(cache, tmp_path, module=TwoValidationLoaders(seed=0, dropout=0.0), val_loaders=loaders)
        return {k: float(v) for k, v in trainer.callback_metrics.items()}

    plain, cached = run(False), run(True)
    for key in ("val_loss/dataloader_idx_0", "val_loss/dataloader_idx_1"):
        assert cached[key] == plain[key]
    assert cached["pipetx/val_cache_hit_rate"] == 1.0  # the last validation: loader 0 hit at depth 3
