"""keep_epoch_length: after a transition adds replicas, an epoch of a drop_last loader keeps its
number of global batches, each holding the samples it held before, for Lightning's
DistributedSampler, the DistributedSamplerWrapper it puts around a user's sampler, and subclasses."""

import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from lightning_pipetx.strategy.dataloading import keep_epoch_length, rebatch

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
