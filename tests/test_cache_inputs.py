"""AutoCache and what its keys rest on: batch-first hidden states, and one training loader of batches."""

import dataclasses
import json
import random
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import tiny_models as tm
import torch
from distributed import run_workers
from torch import nn
from torch.utils.data import DataLoader

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback
from lightning_pipetx.autocache.random_streams import generators_kept
from lightning_pipetx.autocache.states import RowLayout


class SequenceFirst(pl.LightningModule):
    """Blocks that take ``[length, batch, width]`` (nn.TransformerEncoderLayer's default)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(tm.VOCAB, tm.HIDDEN)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(tm.HIDDEN, 2, 64, dropout=0.0) for _ in range(tm.LAYERS))
        self.head = nn.Linear(tm.HIDDEN, tm.NUM_LABELS)

    def forward(self, ids):
        hidden = self.embed(ids).transpose(0, 1)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.head(hidden.mean(0))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch["input_ids"]), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(cache, module, batch_size, tmp_path, size=32, epochs=4):
    rates = tm.HitRates()
    trainer = tm.cached_trainer(tmp_path, cache, [rates], max_epochs=epochs)
    data = tm.RandomTokenDataset(size=size, seed=1)
    trainer.fit(module, DataLoader(data, batch_size=batch_size, shuffle=True))
    return module.state_dict(), rates.rates


def _same(a, b):
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-5, msg=key)


@pytest.mark.parametrize(
    ("batch_size", "reason"),
    [
        (8, "has shape (16, 8, 32) for a micro-batch of 8 samples"),
        (16, "cannot tell whether the first dimension is the batch"),
    ],
)
def test_sequence_first_blocks_are_not_cached(tmp_path, caplog, batch_size, reason):
    # batch 8, length 16: the rows are positions; batch 16 = length 16: only the shape cannot tell
    uncached, _ = fit(False, SequenceFirst(), batch_size, tmp_path)
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        cached, rates = fit("auto", SequenceFirst(), batch_size, tmp_path)
    _same(cached, uncached)
    assert all(rate in (None, 0.0) for rate in rates)
    messages = [r.message for r in caplog.records if "AutoCache switched off" in r.message]
    assert len(messages) == 1 and reason in messages[0] and "batch_first=True" in messages[0]
    with pytest.raises(ValueError, match=r"cache=True\): the frozen blocks' hidden state.*batch_first=True"):
        fit(True, SequenceFirst(), batch_size, tmp_path)


class _ShorterFromEpoch3(tm.TinyBertClassifier):
    """A sequence-length warm-up in the step: the first 8 of the 16 tokens from epoch 3 on."""

    def __init__(self):
        super().__init__(seed=0, dropout=0.0)

    def training_step(self, batch, batch_idx):
        if self.current_epoch >= 3:
            batch = {key: value if key == "labels" else value[:, :8] for key, value in batch.items()}
        return super().training_step(batch, batch_idx)


def test_a_step_that_changes_its_batch_s_shape_after_states_were_cached_is_not_served_them(tmp_path, caplog):
    # The loader's batches keep their shape; what enters block 0 shrinks from 16 to 8 tokens.
    uncached, _ = fit(False, _ShorterFromEpoch3(), 8, tmp_path, epochs=5)
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        cached, rates = fit("auto", _ShorterFromEpoch3(), 8, tmp_path, epochs=5)
    _same(cached, uncached)
    assert rates[:3] == [None, 0.0, 0.0] and rates[3] == 0.0
    messages = [r.message for r in caplog.records if "AutoCache switched off" in r.message]
    assert (
        len(messages) == 1
        and "entering block 0 has the per-sample shape (8, 32), the run's first (16, 32)" in (messages[0])
    )


def test_a_rank_that_becomes_a_first_stage_compares_the_shape_entering_block_0_with_the_run_s(tmp_path):
    # Rank 0, the last stage of 2x1, first computes block 0 in 1x2, from epoch 2, when the step starts
    # cropping its batch: it must know the shape the first stage saw, and serve none of its states.
    for cache in ("false", "auto"):
        run_workers("shape_change_worker.py", 2, str(tmp_path), cache, "2")
    reports = {cache: json.loads((tmp_path / f"{cache}.json").read_text()) for cache in ("false", "auto")}
    assert reports["auto"]["layouts"] == ["2x1", "2x1", "1x2", "1x2"]
    assert reports["auto"]["rates"][2:] == [0.0, 0.0]
    _same(torch.load(tmp_path / "auto.pt"), torch.load(tmp_path / "false.pt"))


def test_ranks_decide_alike_on_a_cache_one_of_them_switched_off(tmp_path):
    # Rank 1 switches its cache off in epoch 2 (its step crops the batch); at epoch 3's start the
    # inputs' verdict would refuse the cache (cache=True): on no rank, as one already switched it off.
    output = run_workers("cache_agreement_worker.py", 2, str(tmp_path))
    assert "[rank0] fit finished" in output and "[rank1] fit finished" in output
    assert "another rank switched it off" in output


def test_a_run_that_fails_on_one_rank_leaves_no_cache_folder_behind(tmp_path):
    # Rank 1 still validates (and writes its validation cache's folder) after rank 0 failed and
    # removed the node's folders: every rank removes them after a failure.
    shm = Path("/dev/shm")
    before = set(shm.glob("pipetx-*")) if shm.is_dir() else set()
    output = run_workers("failed_cleanup_worker.py", 2, str(tmp_path), expect_failure=True)
    assert "a validation step failed on global rank 0" in output
    assert (set(shm.glob("pipetx-*")) if shm.is_dir() else set()) == before
    assert not list((tmp_path / "spill").glob("pipetx-*"))


def _longest_first(samples):
    """A collate_fn that sorts a batch's samples by length, longest first (as length-bucketing code does)."""
    ordered = sorted(samples, key=lambda sample: -int(sample["attention_mask"].sum()))
    return torch.utils.data.default_collate(ordered)


def _fit_on(cache, make_module, loader, tmp_path, epochs):
    module = make_module()
    tm.cached_trainer(tmp_path, cache, max_epochs=epochs).fit(module, loader)
    return module.state_dict()


def _switched_off(make_module, loader, tmp_path, caplog, epochs):
    """Fit with the cache off, then on (``"auto"``): the same weights, and the one warning that
    switched it off."""
    uncached = _fit_on(False, make_module, loader, tmp_path, epochs)
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        _same(_fit_on("auto", make_module, loader, tmp_path, epochs), uncached)
    messages = [r.message for r in caplog.records if "AutoCache switched off" in r.message]
    assert len(messages) == 1
    return messages[0]


def test_a_collate_fn_that_reorders_a_batch_s_samples_turns_the_cache_off_naming_it(tmp_path, caplog):
    data = tm.RandomTokenDataset(size=32, seed=1)
    loader = DataLoader(data, batch_size=8, shuffle=True, collate_fn=_longest_first)
    message = _switched_off(lambda: tm.TinyBertClassifier(seed=0, dropout=0.0), loader, tmp_path, caplog, 4)
    assert "a collate_fn that reorders the samples of a batch" in message


class _MultipleChoice(pl.LightningModule):
    """BERT's multiple-choice head: it flattens ``[batch, choices, length]`` into ``batch * choices`` rows."""

    def __init__(self):
        super().__init__()
        from transformers import BertForMultipleChoice

        self.model = tm._seeded(0, lambda: BertForMultipleChoice(tm._bert_config(0.0, 1)))

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        return self.model(input_ids=ids, labels=labels).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_a_model_that_gives_its_blocks_several_rows_per_sample_is_not_cached_and_the_error_says_so(tmp_path, caplog):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(2, tm.VOCAB, (24, 3, tm.SEQ_LEN), generator=generator)
    data = torch.utils.data.TensorDataset(ids, torch.randint(0, 3, (24,), generator=generator))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    message = _switched_off(_MultipleChoice, loader, tmp_path, caplog, 3)
    assert "shape (12, 16, 32) for a micro-batch of 4 samples" in message
    assert "3 rows per sample, as a multiple-choice head" in message and "pass cache=False" in message
    with pytest.raises(ValueError, match=r"cache=True\): .* 3 rows per sample.*For several rows per sample, pass"):
        _fit_on(True, _MultipleChoice, loader, tmp_path, 3)


def test_batch_first_blocks_with_the_batch_size_of_the_length_are_served_once_their_rows_compared_unchanged(
    tmp_path,
):
    # batch 16 = length 16 and no other batch size: the shape cannot tell, each sample's row can
    _, rates = fit("auto", tm.TinyBertClassifier(seed=0, dropout=0.0), 16, tmp_path, epochs=5)
    assert rates == [None, 0.0, 0.0, 1.0, 1.0]


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from ({"x": torch.tensor([float(i)])} for i in range(32))


class _TwoLoaders(tm.TinyBertClassifier):
    """Trains on loader "a" (16 samples) cycled against a longer loader "b" (max_size_cycle)."""

    def __init__(self, other):
        super().__init__(seed=0, dropout=0.0)
        self.other = other

    def training_step(self, batch, batch_idx):
        return super().training_step(batch["a"], batch_idx)

    def train_dataloader(self):
        other = tm.RandomTokenDataset(size=32, seed=2) if self.other == "map" else _Stream()
        return {
            "a": DataLoader(tm.RandomTokenDataset(size=16, seed=1), batch_size=8),
            "b": DataLoader(other, batch_size=8),
        }


def _fit_module(cache, module, tmp_path, epochs=4):
    trainer = tm.cached_trainer(tmp_path, cache, max_epochs=epochs, use_distributed_sampler=False)
    trainer.fit(module)
    return module.state_dict()


@pytest.mark.parametrize("other", ["stream", "map"])
def test_several_training_loaders_turn_the_cache_off_with_the_reason(tmp_path, caplog, other):
    # the shorter loader restarts mid-epoch while the next batch is already fetched: keys would be wrong
    uncached = _fit_module(False, _TwoLoaders(other), tmp_path)
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        cached = _fit_module("auto", _TwoLoaders(other), tmp_path)
    _same(cached, uncached)
    messages = [r.message for r in caplog.records if "AutoCache switched off" in r.message]
    assert len(messages) == 1 and "trains from several DataLoaders" in messages[0]
    with pytest.raises(ValueError, match=r"cache=True\): the fit trains from several DataLoaders"):
        _fit_module(True, _TwoLoaders(other), tmp_path)


class _SizedStream(torch.utils.data.IterableDataset):
    """An iterable dataset that tells its length (its sampler yields no indices)."""

    def __init__(self):
        self.base = tm.RandomTokenDataset(size=32, seed=1)

    def __len__(self):
        return len(self.base)

    def __iter__(self):
        yield from (self.base[i] for i in range(len(self.base)))


def test_an_iterable_dataset_with_a_length_is_not_cached(tmp_path):
    rates = tm.HitRates()
    trainer = tm.cached_trainer(tmp_path, "auto", [rates], max_epochs=3)
    trainer.fit(tm.TinyBertClassifier(seed=0, dropout=0.0), DataLoader(_SizedStream(), batch_size=8))
    assert trainer.global_step == 12 and rates.rates == [None, None, None]  # trained, never looked up


class _Growing(torch.utils.data.Dataset):
    """32 samples, then 48 from the third epoch on (a curriculum): one dataset object throughout."""

    def __init__(self):
        self.base, self.size = tm.RandomTokenDataset(size=64, seed=1), 32

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.base[index]


class _GrowingData(tm.TinyBertClassifier):
    def __init__(self):
        super().__init__(seed=0, dropout=0.0)
        self.data = _Growing()

    def on_train_epoch_end(self):
        if self.current_epoch == 1:
            self.data.size = 48

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=8)


def test_a_training_dataset_that_changes_its_length_turns_the_cache_off(tmp_path, caplog):
    def run(cache):
        module = _GrowingData()
        trainer = tm.cached_trainer(tmp_path, cache, reload_dataloaders_every_n_epochs=1)
        trainer.fit(module)
        return module.state_dict()

    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        cached = run("auto")
    assert "the training dataset changed its length between epochs (32 -> 48 samples)" in caplog.text
    _same(cached, run(False))


class _EpochBatches(torch.utils.data.BatchSampler):
    """A batch sampler of the user's whose order the module sets each epoch."""

    def __init__(self, size, batch_size):
        super().__init__(torch.utils.data.SequentialSampler(range(size)), batch_size, False)
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(len(self.sampler), generator=torch.Generator().manual_seed(self.epoch)).tolist()
        yield from (order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size))


class _SetsEpoch(tm.TinyBertClassifier):
    def on_train_epoch_start(self):
        self.trainer.train_dataloader.batch_sampler.set_epoch(self.current_epoch)


def test_the_users_batch_sampler_keeps_its_attributes_under_the_cache(tmp_path):
    rates = tm.HitRates()
    trainer = tm.cached_trainer(tmp_path, "auto", [rates], use_distributed_sampler=False)
    data = tm.RandomTokenDataset(size=32, seed=1)
    trainer.fit(_SetsEpoch(seed=0, dropout=0.0), DataLoader(data, batch_sampler=_EpochBatches(32, 8)))
    assert trainer.train_dataloader.batch_sampler.epoch == 3 and trainer.train_dataloader.batch_sampler.batch_size == 8
    assert rates.rates[-1] == 1.0


def _collate_full_batches(samples):
    """A collate_fn written for batches of 8 (drop_last=True promises it those)."""
    if len(samples) != 8:
        raise RuntimeError(f"a batch of {len(samples)} samples")
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def test_left_out_samples_that_fail_to_load_are_not_cached_and_training_goes_on(tmp_path, caplog):
    def run(cache):
        module = tm.TinyBertClassifier(seed=0, dropout=0.0)
        trainer = tm.cached_trainer(tmp_path, cache)
        data = tm.RandomTokenDataset(size=36, seed=1)
        trainer.fit(module, DataLoader(data, batch_size=8, drop_last=True, collate_fn=_collate_full_batches))
        return module.state_dict()

    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        cached = run("auto")
    failures = [r.message for r in caplog.records if "drop_last left out" in r.message]
    assert len(failures) == 1 and "RuntimeError: a batch of 4 samples" in failures[0]
    _same(cached, run(False))


class _AllHiddenStates(tm.TinyBertClassifier):
    def training_step(self, batch, batch_idx):
        return self.model(**batch, output_hidden_states=True).loss


def test_a_refusal_ends_with_its_fit(tmp_path):
    rates = tm.HitRates()
    trainer = tm.cached_trainer(tmp_path, "auto", [rates], max_epochs=3)
    data = tm.RandomTokenDataset(size=32, seed=1)
    trainer.fit(_AllHiddenStates(seed=0, dropout=0.0), DataLoader(data, batch_size=8))  # every block's output
    assert all(rate in (None, 0.0) for rate in rates.rates)
    trainer.fit_loop.max_epochs = 7
    trainer.fit(tm.TinyBertClassifier(seed=0, dropout=0.0), DataLoader(data, batch_size=8))
    assert rates.rates[-1] == 1.0


def test_every_rank_takes_what_any_rank_saw_of_the_rows_layout():
    # A rank that becomes a first stage after a transition may read states another rank kept
    # while their shape could not tell the batch dimension: it must not serve them either.
    kept, fresh = RowLayout(), RowLayout()
    assert kept.check(4, (4, 4, 8))  # batch 4, length 4: ambiguous
    summed = [a + b for a, b in zip(kept.flags(), fresh.flags())]
    for layout in (kept, fresh):
        layout.agree(summed)
    assert kept.unproven and fresh.unproven and "cannot tell" in fresh.suspect()
    shown = RowLayout()
    assert shown.check(3, (3, 4, 8))  # another micro-batch size shows dimension 0 is the batch
    summed = [a + b for a, b in zip(shown.flags(), fresh.flags())]
    fresh.agree(summed)
    assert not fresh.unproven


class _LazyGlobalSampler(torch.utils.data.Sampler):
    """Draws each index as it is asked for, from torch's global random stream."""

    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __iter__(self):
        return (int(torch.randint(self.size, ())) for _ in range(self.size))


def _fit_loader(cache, make_loader, tmp_path, dropout=0.0, **trainer_kwargs):
    torch.manual_seed(0)  # the global stream each run starts from (the sampler's, augmentation's, dropout's)
    module, rates = tm.TinyBertClassifier(seed=0, dropout=dropout), tm.HitRates()
    trainer = tm.cached_trainer(tmp_path, cache, [rates], use_distributed_sampler=False, **trainer_kwargs)
    trainer.fit(module, make_loader())
    return module.state_dict(), rates.rates


def _seeded_shuffle(data, **kwargs):
    return DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0), **kwargs)


@pytest.mark.parametrize(("cache", "workers"), [("auto", 0), (True, 0), ("auto", 2)])
def test_a_shuffle_with_the_users_generator_draws_as_without_the_cache(tmp_path, cache, workers):
    # Sampling a batch ahead exhausted torch's RandomSampler, which then drew from the user's
    # generator once more each epoch: every later epoch was shuffled otherwise. A loader's workers
    # ask past the last batch, and there it must run out as in a plain run.
    def make_loader():
        data = tm.RandomTokenDataset(size=32, seed=1)
        return _seeded_shuffle(data, num_workers=workers, persistent_workers=workers > 0)

    cached, rates = _fit_loader(cache, make_loader, tmp_path)
    _same(cached, _fit_loader(False, make_loader, tmp_path)[0])
    assert rates[-1] == 1.0


@pytest.mark.parametrize("limit", [3, 4, 5])
def test_a_short_last_batch_runs_the_users_generator_out_only_when_it_is_taken(tmp_path, limit):
    # 36 samples in batches of 8: torch runs the sampler out (RandomSampler draws again) to cut the
    # fifth batch, which a run of 4 batches an epoch never takes.
    def make_loader():
        return _seeded_shuffle(tm.RandomTokenDataset(size=36, seed=1))

    cached, _ = _fit_loader("auto", make_loader, tmp_path, limit_train_batches=limit)
    _same(cached, _fit_loader(False, make_loader, tmp_path, limit_train_batches=limit)[0])


class _OwnGeneratorAugmented(torch.utils.data.Dataset):
    """Augmentation drawn from a generator the dataset keeps (NumPy's, as ``self.rng`` often is)."""

    def __init__(self, size):
        self.base = tm.RandomTokenDataset(size=size, seed=1)
        self.rng = np.random.default_rng(0)

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        sample = dict(self.base[index])
        sample["input_ids"] = sample["input_ids"].clone()
        sample["input_ids"][1] = int(self.rng.integers(2, 100))
        return sample


def test_loading_the_left_out_samples_leaves_the_datasets_own_generator_as_it_was(tmp_path):
    def make_loader():
        return _seeded_shuffle(_OwnGeneratorAugmented(36), drop_last=True)

    cached, _ = _fit_loader("auto", make_loader, tmp_path)
    _same(cached, _fit_loader(False, make_loader, tmp_path)[0])


def test_a_sampler_drawing_as_it_goes_from_the_global_stream_keeps_the_dropout_masks(tmp_path):
    # Dropout draws from the same stream: a sampler asked earlier than in a plain run moves every mask.
    def make_loader():
        return DataLoader(tm.RandomTokenDataset(size=32, seed=1), batch_size=8, sampler=_LazyGlobalSampler(32))

    cached, _ = _fit_loader("auto", make_loader, tmp_path, dropout=0.1)
    _same(cached, _fit_loader(False, make_loader, tmp_path, dropout=0.1)[0])


def test_loading_the_samples_drop_last_left_out_draws_nothing_from_the_random_streams(tmp_path, caplog):
    # The cache loads them after the epoch, which a plain run never does; augmentation there draws.
    def make_loader():
        return _seeded_shuffle(tm.AugmentedTokenDataset(size=36, seed=1), drop_last=True)

    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        cached, _ = _fit_loader("auto", make_loader, tmp_path)
    assert any("input changed between epochs" in r.message for r in caplog.records)
    _same(cached, _fit_loader(False, make_loader, tmp_path)[0])


@dataclasses.dataclass
class _Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor


class _DataclassBatches(tm.TinyBertClassifier):
    def training_step(self, batch, batch_idx):
        return self.model(**dataclasses.asdict(batch)).loss


def test_a_batch_the_cache_cannot_read_is_refused_for_what_it_is(tmp_path):
    def collate(samples):
        return _Batch(*(torch.stack([s[k] for s in samples]) for k in ("input_ids", "attention_mask", "labels")))

    trainer = tm.cached_trainer(tmp_path, True)
    data = DataLoader(tm.RandomTokenDataset(size=32, seed=1), batch_size=8, collate_fn=collate)
    with pytest.raises(ValueError, match="a batch of type _Batch holds no tensor with a batch dimension"):
        trainer.fit(_DataclassBatches(seed=0, dropout=0.0), data)


@dataclasses.dataclass
class _Inputs:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


def _collate_inputs_apart(samples):
    stacked = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    return {"inputs": _Inputs(stacked["input_ids"], stacked["attention_mask"]), "labels": stacked["labels"]}


class _InputsApart(tm.TinyBertClassifier):
    def training_step(self, batch, batch_idx):
        return self.model(**dataclasses.asdict(batch["inputs"]), labels=batch["labels"]).loss


def test_a_batch_holding_an_object_the_cache_cannot_read_is_refused_for_what_it_is(tmp_path):
    # Its other tensors were found, and the dataclass's inputs were neither fingerprinted nor refused.
    data = DataLoader(tm.RandomTokenDataset(size=32, seed=1), batch_size=8, collate_fn=_collate_inputs_apart)
    with pytest.raises(ValueError, match="a batch holds a _Inputs, whose tensors the cache cannot read"):
        tm.cached_trainer(tmp_path, True).fit(_InputsApart(seed=0, dropout=0.0), data)


def test_a_training_loader_that_yields_batches_out_of_order_is_not_cached(tmp_path):
    data = DataLoader(tm.RandomTokenDataset(size=32, seed=1), batch_size=8, num_workers=2, in_order=False)
    with pytest.raises(ValueError, match=r"as its workers finish them \(DataLoader\(in_order=False\)\)"):
        tm.cached_trainer(tmp_path, True).fit(tm.TinyBertClassifier(seed=0, dropout=0.0), data)


def test_a_validation_loader_that_yields_batches_out_of_order_is_not_cached(tmp_path, caplog):
    train = DataLoader(tm.RandomTokenDataset(size=32, seed=1), batch_size=8)
    val = DataLoader(tm.RandomTokenDataset(size=24, seed=2), batch_size=8, num_workers=2, in_order=False)
    rates = tm.HitRates()
    trainer = tm.cached_trainer(tmp_path, True, [rates], num_sanity_val_steps=0)
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        trainer.fit(tm.TinyBertClassifier(seed=0, dropout=0.0), train, val)
    assert "validation cache switched off for this run: the validation loader yields its batches as" in caplog.text
    assert trainer.callback_metrics["pipetx/val_cache_hit_rate"] == 0.0 and rates.rates[-1] == 1.0


class _Transform(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rng = np.random.default_rng(1)


class _HoldsGenerators:
    def __init__(self):
        self.transform = _Transform()  # torchvision's v2 transforms are modules
        self.python = random.Random(0)
        self.torch = torch.Generator().manual_seed(0)
        self.entropy = random.SystemRandom()  # no state: left alone
        self.samples = list(range(1000))  # too large to search

    def draw(self):
        return (
            int(self.transform.rng.integers(0, 1000)),
            self.python.random(),
            int(torch.randint(1000, (), generator=self.torch)),
        )


def test_the_generators_a_dataset_holds_read_as_before_after_the_fill():
    expected, held = _HoldsGenerators().draw(), _HoldsGenerators()
    with generators_kept(held):
        held.draw(), held.entropy.random()
    assert held.draw() == expected


class _WeightingCollate:
    """Draws a weight for each batch's loss from a generator of its own."""

    def __init__(self):
        self.generator = torch.Generator().manual_seed(123)

    def __call__(self, samples):
        batch = torch.utils.data.default_collate(samples)
        batch["weight"] = torch.rand((), generator=self.generator) + 0.5
        return batch


def _weighting_closure():
    """A collate_fn drawing each batch's weight from a generator it closes over."""
    generator = torch.Generator().manual_seed(123)

    def collate(samples):
        batch = torch.utils.data.default_collate(samples)
        batch["weight"] = torch.rand((), generator=generator) + 0.5
        return batch

    return collate


class _WeightedLoss(tm.TinyBertClassifier):
    def training_step(self, batch, batch_idx):
        weight = batch.pop("weight")
        return self(batch).loss * weight


@pytest.mark.parametrize("make_collate", [_WeightingCollate, _weighting_closure])
def test_the_fill_leaves_the_generator_of_a_collate_fn_as_it_was(tmp_path, make_collate):
    # drop_last leaves samples out of every epoch, which the fill loads through the collate_fn
    # after the epoch: before, that drew from its generator, and every later batch had another weight.
    def run(cache):
        data = tm.RandomTokenDataset(size=36, seed=1)
        loader = _seeded_shuffle(data, drop_last=True, collate_fn=make_collate())
        module, rates = _WeightedLoss(seed=0, dropout=0.0), tm.HitRates()
        trainer = tm.cached_trainer(tmp_path, cache, [rates], use_distributed_sampler=False, max_epochs=5)
        trainer.fit(module, loader)
        return module.state_dict(), rates.rates

    cached, rates = run("auto")
    assert rates[-2:] == [1.0, 1.0]
    _same(cached, run(False)[0])


class _KeyedByIds(torch.utils.data.Dataset):
    """A map-style dataset keyed by ids, not positions (torch allows any key its sampler yields)."""

    def __init__(self, data, ids):
        self.data, self.ids = data, list(ids)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, key):
        return self.data[self.ids.index(key)]


def _by_ids(ids, size, seed):
    return DataLoader(_KeyedByIds(tm.RandomTokenDataset(size=size, seed=seed), ids), batch_size=8, sampler=ids)


@pytest.mark.parametrize("ids", [range(1000, 1032), [f"id{i}" for i in range(32)]], ids=["numbers", "strings"])
def test_training_samples_keyed_by_ids_turn_the_cache_off_or_are_refused(tmp_path, caplog, ids):
    def run(cache):
        module = tm.TinyBertClassifier(seed=0, dropout=0.0)
        tm.cached_trainer(tmp_path, cache).fit(module, _by_ids(list(ids), 32, 1))
        return module.state_dict()

    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        cached = run("auto")
    # Lightning deals the sampler's keys in its own shuffled order: the first batch's first is the 13th.
    assert f"the training loader's sampler yields {list(ids)[12]!r}, which is not a position 0-31" in caplog.text
    _same(cached, run(False))
    with pytest.raises(ValueError, match="cache=True.*not a position 0-31.*Index its dataset by position"):
        run(True)


def test_validation_samples_keyed_by_ids_turn_the_validation_cache_off(tmp_path, caplog):
    def run(cache):
        module, rates = tm.TinyBertClassifier(seed=0, dropout=0.0), tm.HitRates()
        train = DataLoader(tm.RandomTokenDataset(size=32, seed=1), batch_size=8)
        tm.cached_trainer(tmp_path, cache, [rates]).fit(module, train, _by_ids(list(range(500, 516)), 16, 2))
        return module.state_dict(), rates

    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        (cached, rates), (plain, _) = run("auto"), run(False)
    assert "the validation loader's sampler yields 500, which is not a position 0-15" in caplog.text
    assert rates.rates[-1] == 1.0  # training keeps its cache
    _same(cached, plain)


def test_a_cache_dir_that_cannot_be_made_leaves_the_states_in_ram(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    rates = tm.HitRates()
    strategy = ElasticPipelineStrategy(cache="auto", profile_steps=0, cache_dir=str(tmp_path / "file" / "cache"))
    trainer = tm.make_trainer([FreezeCallback(alpha=1 / 2, signal="schedule"), rates], max_epochs=4, strategy=strategy)
    trainer.fit(
        tm.TinyBertClassifier(seed=0, dropout=0.0), DataLoader(tm.RandomTokenDataset(size=32, seed=1), batch_size=8)
    )
    assert rates.rates[-1] == 1.0
