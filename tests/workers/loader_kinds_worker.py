"""Freezing on 2 processes with training loaders that cannot be re-batched.

Usage: torchrun --nproc_per_node=2 loader_kinds_worker.py OUT_DIR KIND
KIND: ``per_rank_subset`` (see :func:`per_rank_subsets`), ``iterable`` (an IterableDataset) or ``batch_sampler`` (a DataLoader built with one of the
user's class; Lightning un-batches a loader built with torch's own ``BatchSampler``). The
global batch cannot be kept over 2 replicas, so the 2x1 pipeline must stay 2x1 as blocks freeze.
Every rank writes OUT_DIR/<KIND>_rank<N>.json: the layout each epoch and the frozen blocks.
``combined_hook`` and ``combined_given``: a CombinedLoader from ``train_dataloader`` or given to
fit, which goes 2x1 -> 1x2; the report has the samples each epoch trained on this rank.
``own_distributed`` and ``own_sequential``: a sampler of the user's (see :class:`OwnSampler`).
``val_share``: a float ``limit_val_batches`` that 2 replicas would take no batch of.
``two_loaders``, ``stream_beside`` and ``subclass_reloaded``: see :data:`TRAINING_LOADERS`; the
report has each epoch's batches by loader on this rank.
"""

import json
import os
import sys

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import CombinedLoader
from tiny_models import Layouts, RandomVectorDataset, TinySequentialRegressor, make_trainer
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, SequentialSampler, Subset
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback


class Stream(IterableDataset):
    """The same 16 samples on every rank, in order."""

    def __init__(self):
        self.samples = RandomVectorDataset(size=16)

    def __iter__(self):
        return (self.samples[i] for i in range(len(self.samples)))


class InOrder(BatchSampler):
    """A batch sampler of the user's (Lightning gives it a distributed sampler by its arguments)."""


def per_rank_subsets(out_dir: str) -> None:
    """2 replicas that shard the data themselves (``use_distributed_sampler=False``): index ``i``
    is another sample on each rank. Trained with and without AutoCache; rank N writes
    OUT_DIR/per_rank_subset_rank<N>.json with both runs' weights, the cached run's hit rates and
    the RAM budget its training cache held to."""
    report = {}
    for cache in (False, True):
        rank = int(os.environ["RANK"])
        samples = Subset(RandomVectorDataset(size=32), range(rank, 32, 2))
        freeze = FreezeCallback(alpha=0.5, signal="schedule")
        hits = CacheHits()
        trainer = make_trainer(
            [freeze, hits],
            max_epochs=4,
            devices=2,
            use_distributed_sampler=False,
            strategy=ElasticPipelineStrategy(pipeline_length=1, profile_steps=0, cache=cache),
        )
        module = TinySequentialRegressor(seed=0, dropout=0.0)
        trainer.fit(module, DataLoader(samples, batch_size=4))
        report[f"cache={cache}"] = {
            "weights": {k: v.tolist() for k, v in module.state_dict().items()},
            "hit_rates": hits.rates,
            "ram_budget": hits.ram_budget,
        }
    with open(os.path.join(out_dir, f"per_rank_subset_rank{trainer.global_rank}.json"), "w") as handle:
        json.dump(report, handle)


class CacheHits(Callback):
    def __init__(self):
        self.rates = []
        self.ram_budget = None

    def on_train_epoch_end(self, trainer, pl_module):
        self.rates.append(float(trainer.callback_metrics.get("pipetx/cache_hit_rate", -1.0)))
        cache = trainer.strategy._autocache.cache
        self.ram_budget = cache.ram_budget if cache is not None else None


class IndexedVectors(RandomVectorDataset):
    def __getitem__(self, index):
        return (*super().__getitem__(index), torch.tensor(index))


def combined_loader():
    return CombinedLoader({"a": DataLoader(IndexedVectors(size=16), batch_size=4, shuffle=True)}, "max_size_cycle")


class CombinedRegressor(TinySequentialRegressor):
    """Trains on the batches of a CombinedLoader holding one loader, ``"a"``; records the samples each epoch trained on."""

    def __init__(self):
        super().__init__(seed=0, dropout=0.0)
        self.seen = {}

    def training_step(self, batch, batch_idx):
        x, y, index = batch["a"]
        self.seen.setdefault(self.current_epoch, []).extend(index.tolist())  # on every stage: before the model call
        return super().training_step((x, y), batch_idx)


class CombinedFromHook(CombinedRegressor):
    def train_dataloader(self):
        return combined_loader()


def combined(out_dir: str, kind: str) -> None:
    module = CombinedFromHook() if kind == "combined_hook" else CombinedRegressor()
    layouts = Layouts()
    strategy = ElasticPipelineStrategy(pipeline_length=2, num_microbatches=2, profile_steps=0, cache=False)
    trainer = make_trainer([FreezeCallback(alpha=0.5, signal="schedule"), layouts], devices=2, strategy=strategy)
    trainer.fit(module, None if kind == "combined_hook" else combined_loader())
    report = {"layouts": layouts.layouts, "seen": {epoch: sorted(set(seen)) for epoch, seen in module.seen.items()}}
    with open(os.path.join(out_dir, f"{kind}_rank{trainer.global_rank}.json"), "w") as handle:
        json.dump(report, handle)


class Marking(DataLoader):
    """A DataLoader subclass of the user's, with an argument of its own: adds ``offset`` to each index it yields."""

    def __init__(self, dataset, offset, **kwargs):
        super().__init__(dataset, **kwargs)
        self.offset = offset

    def __iter__(self):
        for x, y, index in super().__iter__():
            yield x, y, index + self.offset


class IndexedStream(IterableDataset):
    """16 samples, the same on every rank, in order, indexed 100-115."""

    def __iter__(self):
        samples = IndexedVectors(size=16, seed=1)
        return ((x, y, index + 100) for x, y, index in (samples[i] for i in range(16)))


# What train_dataloader returns in an epoch, and reload_dataloaders_every_n_epochs.
TRAINING_LOADERS = {
    # Two loaders of their own batch sizes: each keeps its global batch.
    "two_loaders": (
        lambda epoch: CombinedLoader(
            {
                "a": DataLoader(IndexedVectors(size=16), batch_size=4, shuffle=True),
                "b": DataLoader(IndexedVectors(size=16, seed=1), batch_size=2, shuffle=True),
            },
            "max_size_cycle",
        ),
        0,
    ),
    # A second loader that cannot be dealt to more replicas: the layout keeps its one.
    "stream_beside": (
        lambda epoch: CombinedLoader(
            {
                "a": DataLoader(IndexedVectors(size=16), batch_size=4, shuffle=True),
                "b": DataLoader(IndexedStream(), batch_size=4),
            },
            "max_size_cycle",
        ),
        0,
    ),
    # A loader of the user's class, reloaded every epoch with another batch size from epoch 1 on.
    "subclass_reloaded": (
        lambda epoch: Marking(IndexedVectors(size=32), offset=1000, batch_size=4 if epoch == 0 else 8, shuffle=True),
        1,
    ),
}


class BatchRecorder(TinySequentialRegressor):
    """Trains on every loader's batch at once; records each epoch's batches (sample indices) by loader."""

    def __init__(self, loaders):
        super().__init__(seed=0, dropout=0.0)
        self.loaders = loaders
        self.seen = {}

    def train_dataloader(self):
        return self.loaders(self.current_epoch)

    def training_step(self, batch, batch_idx):
        parts = batch if isinstance(batch, dict) else {"main": batch}
        for key, (_, _, index) in parts.items():  # on every stage: before the model call
            self.seen.setdefault(self.current_epoch, {}).setdefault(key, []).append(index.tolist())
        x = torch.cat([parts[key][0] for key in sorted(parts)])
        y = torch.cat([parts[key][1] for key in sorted(parts)])
        return super().training_step((x, y), batch_idx)


def training_loaders(out_dir: str, kind: str) -> None:
    loaders, reload_every = TRAINING_LOADERS[kind]
    module, layouts = BatchRecorder(loaders), Layouts()
    strategy = ElasticPipelineStrategy(pipeline_length=2, num_microbatches=1, profile_steps=0, cache=False)
    trainer = make_trainer(
        [FreezeCallback(alpha=0.5, signal="schedule"), layouts],
        devices=2,
        strategy=strategy,
        reload_dataloaders_every_n_epochs=reload_every,
    )
    trainer.fit(module)
    loader = trainer.train_dataloader
    report = {
        "layouts": layouts.layouts,
        "global_step": trainer.global_step,
        "batches": module.seen,
        "loader_class": type(loader).__name__,
    }
    with open(os.path.join(out_dir, f"{kind}_rank{trainer.global_rank}.json"), "w") as handle:
        json.dump(report, handle)


class OwnSampler(TinySequentialRegressor):
    """Shards the data itself (``use_distributed_sampler=False``): with a DistributedSampler built
    from ``trainer.strategy.distributed_sampler_kwargs`` (``own_distributed``), what Lightning's
    sampler would do, or with none (``own_sequential``): every replica reads every sample.
    Records the samples each epoch trained on."""

    def __init__(self, distributed):
        super().__init__(seed=0, dropout=0.0)
        self.distributed = distributed
        self.seen = {}

    def train_dataloader(self):
        samples = IndexedVectors(size=16)
        if not self.distributed:
            return DataLoader(samples, batch_size=4)
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        return DataLoader(samples, batch_size=4, sampler=DistributedSampler(samples, shuffle=True, seed=0, **kwargs))

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.seen.setdefault(self.current_epoch, []).extend(index.tolist())  # on every stage: before the model call
        return super().training_step((x, y), batch_idx)


def own_sampler(out_dir: str, kind: str) -> None:
    """``own_distributed`` also trains with Lightning's sampler: the weights must be the same."""
    report = {}
    runs = {"own": False, "lightning": True} if kind == "own_distributed" else {"own": False}
    for run, lightning_sampler in runs.items():
        module = OwnSampler(distributed=kind == "own_distributed")
        if lightning_sampler:
            module.train_dataloader = lambda: DataLoader(IndexedVectors(size=16), batch_size=4, shuffle=True)
        layouts = Layouts()
        strategy = ElasticPipelineStrategy(pipeline_length=2, num_microbatches=2, profile_steps=0, cache=False)
        trainer = make_trainer(
            [FreezeCallback(alpha=0.5, signal="schedule"), layouts],
            devices=2,
            strategy=strategy,
            use_distributed_sampler=lightning_sampler,
        )
        trainer.fit(module)
        report[run] = {
            "layouts": layouts.layouts,
            "seen": {epoch: sorted(seen) for epoch, seen in module.seen.items()},
            "global_step": trainer.global_step,
            "weights": {k: v.tolist() for k, v in module.state_dict().items()},
        }
    with open(os.path.join(out_dir, f"{kind}_rank{trainer.global_rank}.json"), "w") as handle:
        json.dump(report, handle)


def val_share(out_dir: str) -> None:
    """``limit_val_batches=0.5`` of 8 validation samples in batches of 4: one replica checks 1 of its
    2 batches, each of two would check half of 1, which Lightning refuses."""
    layouts = Layouts()
    strategy = ElasticPipelineStrategy(pipeline_length=2, num_microbatches=2, profile_steps=0, cache=False)
    trainer = make_trainer(
        [FreezeCallback(alpha=0.5, signal="schedule"), layouts], devices=2, strategy=strategy, limit_val_batches=0.5
    )
    samples = RandomVectorDataset(size=16)
    trainer.fit(
        TinySequentialRegressor(seed=0, dropout=0.0),
        DataLoader(samples, batch_size=4),
        DataLoader(Subset(samples, range(8)), batch_size=4),
    )
    report = {"layouts": layouts.layouts, "layout_after_fit": str(trainer.strategy.layout)}
    with open(os.path.join(out_dir, f"val_share_rank{trainer.global_rank}.json"), "w") as handle:
        json.dump(report, handle)


def main():
    out_dir, kind = sys.argv[1], sys.argv[2]
    if kind == "per_rank_subset":
        per_rank_subsets(out_dir)
        return
    if kind.startswith("own_"):
        own_sampler(out_dir, kind)
        return
    if kind == "val_share":
        val_share(out_dir)
        return
    if kind.startswith("combined"):
        combined(out_dir, kind)
        return
    if kind in TRAINING_LOADERS:
        training_loaders(out_dir, kind)
        return
    if kind == "iterable":
        loader = DataLoader(Stream(), batch_size=4)
    else:
        samples = RandomVectorDataset(size=16)
        loader = DataLoader(samples, batch_sampler=InOrder(SequentialSampler(samples), 4, drop_last=False))
    freeze = FreezeCallback(alpha=0.5, signal="schedule")
    layouts = Layouts()
    trainer = make_trainer(
        [freeze, layouts], max_epochs=3, devices=2, strategy=ElasticPipelineStrategy(pipeline_length=2, profile_steps=0)
    )
    trainer.fit(TinySequentialRegressor(seed=0, dropout=0.0), loader)
    report = {"layouts": layouts.layouts, "frozen": freeze.frozen_blocks}
    with open(os.path.join(out_dir, f"{kind}_rank{trainer.global_rank}.json"), "w") as handle:
        json.dump(report, handle)


if __name__ == "__main__":
    run_worker(main)
