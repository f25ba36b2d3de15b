"""The training loader across a transition that adds replicas. keep_epoch_length: an epoch of a
drop_last loader keeps its number of global batches, each holding the samples it held before, for
Lightning's DistributedSampler, the DistributedSamplerWrapper it puts around a user's sampler, and
subclasses. A DistributedSampler of the user's is dealt again to the new replicas; another sampler
of the user's keeps the replicas. A float limit_val_batches keeps layouts that validate a batch.
A replica's stages draw the same random augmentation, seeded or not."""

import contextlib
import functools
import json

import pytest
import torch
from distributed import run_workers
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.fabric.utilities.seed import pl_worker_init_function
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from lightning_pipetx.strategy.autodp import AutoDP
from lightning_pipetx.strategy.dataloading import (
    DealtLoader,
    deal_again,
    deals_to_replicas,
    keep_epoch_length,
    rebatch,
    seed_workers_by_replica,
)
from lightning_pipetx.strategy.topology import Layout

SAMPLES, BATCH = 39, 8  # 4 batches of 8 an epoch on one replica; padded shares give 5 on two


class _Seeded(Sampler[int]):
    """A user's sampler: one fixed permutation."""

    def __iter__(self):
        return iter(torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(1)).tolist())

    def __len__(self):
        return SAMPLES


class _EpochOffset(DistributedSampler):
    """A user's subclass: reseeds by epoch in its own way, and deals through DistributedSampler."""

    def set_epoch(self, epoch):
        super().set_epoch(epoch * 7)


def _sampler(kind, replicas, rank):
    data = list(range(SAMPLES))
    if kind == "wrapped":  # what Lightning builds from DataLoader(sampler=...)
        return DistributedSamplerWrapper(_Seeded(), num_replicas=replicas, rank=rank, shuffle=False, seed=0)
    cls = _EpochOffset if kind == "subclass" else DistributedSampler
    return cls(data, num_replicas=replicas, rank=rank, shuffle=True, seed=0)


def _loader(kind, replicas, rank, batch0):
    """What Lightning builds for ``rank`` of ``replicas``, re-batched for them (shares padded)."""
    loader = DataLoader(
        list(range(SAMPLES)), batch_size=batch0[0], sampler=_sampler(kind, replicas, rank), drop_last=True
    )
    return rebatch(loader, batch0, replicas)


def _at_epoch(loader, epoch=2):
    loader.sampler.set_epoch(epoch)  # as Lightning does, once the epoch's loader is built
    return loader


def _kept(kind, replicas, batch0):
    return [_at_epoch(keep_epoch_length(_loader(kind, replicas, r, batch0), batch0)) for r in range(replicas)]


def _global_batches(loaders):
    shares = [[batch.tolist() for batch in loader] for loader in loaders]
    return [sorted(i for share in shares for i in share[j]) for j in range(len(shares[0]))]


@pytest.mark.parametrize("kind", ["wrapped", "subclass", "distributed"])
@pytest.mark.parametrize("replicas0, replicas", [(1, 2), (1, 4), (2, 4)])
def test_more_replicas_keep_the_epoch_s_global_batches(kind, replicas0, replicas):
    batch0 = (BATCH // replicas0, replicas0)
    before, after = _kept(kind, replicas0, batch0), _kept(kind, replicas, batch0)
    assert [len(loader) for loader in after] == [len(before[0])] * replicas
    assert _global_batches(after) == _global_batches(before)


@pytest.mark.parametrize("kind", ["wrapped", "subclass"])
def test_what_is_kept_is_the_start_of_each_padded_share_in_its_order(kind):
    batch0 = (BATCH, 1)
    for rank, kept in enumerate(_kept(kind, 2, batch0)):
        padded = _at_epoch(_loader(kind, 2, rank, batch0))
        assert type(kept.sampler) is type(padded.sampler) and kept.sampler.drop_last
        assert [b.tolist() for b in kept] == [b.tolist() for b in padded][: SAMPLES // BATCH]


class _OwnBatches(torch.utils.data.BatchSampler):
    """A batch sampler of the user's, over the user's DistributedSampler."""


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(SAMPLES))


def _epoch_of(loader, epoch=2):
    """Set the epoch as Lightning does, on the sampler or the batch sampler's."""
    getattr(loader.batch_sampler, "sampler", loader.sampler).set_epoch(epoch)
    return loader


def _own(replicas, rank, position):
    """What a user builds from ``trainer.strategy.distributed_sampler_kwargs`` (Lightning keeps it)."""
    sampler = DistributedSampler(list(range(SAMPLES)), num_replicas=replicas, rank=rank, shuffle=True, seed=0)
    if position == "sampler":
        return DataLoader(list(range(SAMPLES)), batch_size=4, sampler=sampler)
    return DataLoader(list(range(SAMPLES)), batch_sampler=_OwnBatches(sampler, 4, drop_last=False))


@pytest.mark.parametrize("position", ["sampler", "batch_sampler"])
@pytest.mark.parametrize("replicas0, replicas", [(1, 2), (2, 4)])
def test_a_users_distributed_sampler_is_dealt_again_as_lightning_would_build_it(position, replicas0, replicas):
    dealt = [_epoch_of(deal_again(_own(replicas0, 0, position), replicas, rank)) for rank in range(replicas)]
    built = [_epoch_of(_own(replicas, rank, position)) for rank in range(replicas)]
    assert [[b.tolist() for b in loader] for loader in dealt] == [[b.tolist() for b in loader] for loader in built]
    assert deals_to_replicas(dealt[0])


def test_a_users_distributed_sampler_over_a_data_set_of_the_ranks_own_is_refused_with_the_fix():
    # DistributedSampler(num_replicas=1) shuffling a data set each rank holds alone (Lightning keeps
    # it): dealt to the replicas as one data set, each rank trained half of its own, and the ranks
    # shared a cache of states of other samples under the same indices.
    autodp = AutoDP()
    autodp.reset(world_size=2)
    data = list(range(SAMPLES))
    own = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0))
    message = "deals to num_replicas=1, neither the 2 replicas of the layouts nor the 2 processes.*RandomSampler"
    with pytest.raises(ValueError, match=message):
        autodp.reshard(own, 2, 1)
    assert autodp.reshard(_own(2, 1, "sampler"), 2, 1).sampler.num_replicas == 2  # from distributed_sampler_kwargs


def test_a_sampler_that_does_not_deal_to_replicas_keeps_them():
    data = list(range(SAMPLES))
    assert not deals_to_replicas(DataLoader(data, batch_size=4, shuffle=True))
    assert not deals_to_replicas(DataLoader(_Stream(), batch_size=4))
    autodp = AutoDP()
    autodp.reset(world_size=2)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    assert autodp.reshard(loader, 1, 0) is loader
    assert autodp.accepts(Layout(2, 1)) and not autodp.accepts(Layout(1, 2))


@pytest.mark.parametrize("samples, accepted", [(8, False), (16, True)])
def test_a_float_val_limit_keeps_layouts_whose_replicas_still_validate_a_batch(samples, accepted):
    # limit_val_batches=0.5, batches of 4: one replica checks 1 of 2 (8 samples) or 2 of 4 (16);
    # two replicas 0.5 of 1 (Lightning refuses: none) or 1 of 2.
    autodp = AutoDP()
    autodp.reset(world_size=2)
    sampler = DistributedSampler(list(range(samples)), num_replicas=1, rank=0, shuffle=False)
    autodp.note_validation(DataLoader(list(range(samples)), batch_size=4, sampler=sampler), 0.5)
    train = DataLoader(list(range(32)), batch_size=4, sampler=DistributedSampler(list(range(32)), 1, 0))
    autodp.reshard(train, 1, 0)
    assert autodp.accepts(Layout(2, 1)) and autodp.accepts(Layout(1, 2)) is accepted


@pytest.mark.parametrize("samples, replicas", [(7, 2), (8, 3), (9, 4), (16, 2)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_the_batches_a_dealt_loader_gives_a_replica_are_what_torch_gives(samples, replicas, drop_last):
    data = list(range(samples))
    for sampler_drop_last in (False, True):
        sampler = DistributedSampler(data, num_replicas=replicas, rank=0, drop_last=sampler_drop_last)
        loader = DataLoader(data, batch_size=2, sampler=sampler, drop_last=drop_last)
        one = DistributedSampler(data, num_replicas=1, rank=0, drop_last=sampler_drop_last)
        assert DealtLoader.of(DataLoader(data, batch_size=2, sampler=one, drop_last=drop_last)).batches(
            replicas
        ) == len(loader)


def test_more_replicas_without_keeping_the_global_batch_warn_that_epochs_change_length():
    autodp = AutoDP(keep_global_batch=False)
    autodp.reset(world_size=2)
    train = DataLoader(list(range(32)), batch_size=4, sampler=DistributedSampler(list(range(32)), 1, 0))
    autodp.reshard(train, 1, 0)
    with pytest.warns(UserWarning, match="another number of optimizer steps than trainer.estimated_stepping_batches"):
        dealt = autodp.reshard(train, 2, 0)
    assert len(dealt) == 4  # 16 of the 32 samples, in batches of 4


class _Marking(DataLoader):
    """A DataLoader subclass of the user's, with an argument of its own."""

    def __init__(self, dataset, offset, *args, **kwargs):
        super().__init__(dataset, *args, **kwargs)
        self.offset = offset


class _Fixed(DataLoader):
    """A DataLoader subclass that sets its own batch size and does not keep its argument."""

    def __init__(self, dataset, hidden):
        super().__init__(dataset, batch_size=4)


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_rebatched_loader_keeps_the_users_class_and_arguments(wrapped):
    from lightning.fabric.utilities.data import _replace_dunder_methods

    data = list(range(SAMPLES))
    with _replace_dunder_methods(DataLoader, "dataset") if wrapped else contextlib.nullcontext():
        # As Lightning records a loader built in a *_dataloader hook, batch_size given by position.
        loader = _Marking(data, 7, BATCH, sampler=DistributedSampler(data, 1, 0), num_workers=0)
    dealt = rebatch(deal_again(loader, 2, 1), (BATCH, 1), 2)
    assert type(dealt) is _Marking and dealt.offset == 7 and dealt.batch_size == BATCH // 2
    assert (dealt.sampler.num_replicas, dealt.sampler.rank) == (2, 1)
    assert [len(batch) for batch in dealt] == [4] * 5


def test_a_loader_class_that_cannot_be_built_again_is_refused_with_the_fix():
    loader = _Fixed(list(range(SAMPLES)), hidden=1)
    with pytest.raises(ValueError, match="cannot build the training _Fixed again.*train_dataloader hook"):
        rebatch(loader, (4, 1), 2)


@pytest.mark.parametrize("mode", ["seeded_workers", "unseeded"])
def test_random_augmentation_draws_the_same_noise_on_a_replica_s_stages(mode, tmp_path):
    # Both stopped on a BatchMismatchError: Lightning seeds each loader worker by the global rank
    # (seeded_workers), and an unseeded process draws from a random state of its own (unseeded).
    output = run_workers("augmentation_worker.py", 2, str(tmp_path), mode)
    assert ("every rank starts from rank 0's random states" in output) == (mode == "unseeded")
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert ranks[0]["layouts"] == ranks[1]["layouts"] == ["2x1", "2x1", "1x2"]
    for epoch in ("0", "1"):
        assert len(ranks[0]["noise"][epoch]) == 32 and ranks[0]["noise"][epoch] == ranks[1]["noise"][epoch]
    assert set(ranks[0]["noise"]["2"]).isdisjoint(ranks[1]["noise"]["2"])
    seeded_as = [report["workers_seeded_as_rank"] for report in ranks]
    assert seeded_as == ([0, 1] if mode == "seeded_workers" else [None, None])  # a stage a replica: DDP's seeding


def test_workers_are_seeded_by_replica_only_where_lightning_would_seed_them(monkeypatch):
    def own(worker_id):
        pass

    loaders = [DataLoader(range(4)), DataLoader(range(4), worker_init_fn=own)]
    seed_workers_by_replica(loaders[0], 1)
    assert loaders[0].worker_init_fn is None  # no seed_everything(workers=True)
    monkeypatch.setenv("PL_SEED_WORKERS", "1")
    loaders.append(DataLoader(range(4), worker_init_fn=functools.partial(pl_worker_init_function, rank=3)))
    for loader in loaders:
        seed_workers_by_replica(loader, 1)
    assert [getattr(loader.worker_init_fn, "keywords", None) for loader in loaders] == [{"rank": 1}, None, {"rank": 1}]
    assert loaders[1].worker_init_fn is own
