"""StableShardSampler: every sample once per epoch (none left out every epoch by drop_last),
shards fixed across epochs and nested across replica counts, and swapped in only for
Lightning's DistributedSampler."""

from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler, TensorDataset

from lightning_pipetx.strategy.dataloading import keep_epoch_length, rebatch, stable_shards
from lightning_pipetx.strategy.shard_sampler import StableShardSampler


def _epoch(num_samples, replicas, epoch, **kwargs):
    shards = []
    for rank in range(replicas):
        sampler = StableShardSampler(num_samples, replicas, rank, **kwargs)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return shards


@pytest.mark.parametrize("num_samples", [12, 13])
def test_every_sample_once_per_epoch_padded_like_distributed_sampler(num_samples):
    shards = _epoch(num_samples, 4, epoch=0)
    reference = DistributedSampler(range(num_samples), num_replicas=4, rank=0)
    assert all(len(s) == len(reference) for s in shards)
    seen = sorted(i for s in shards for i in s)
    assert set(seen) == set(range(num_samples)) and len(seen) == len(reference) * 4


def test_shards_stay_and_only_the_order_within_them_changes():
    first, second = _epoch(64, 2, epoch=0), _epoch(64, 2, epoch=1)
    assert [sorted(s) for s in first] == [sorted(s) for s in second]
    assert first != second


def test_more_replicas_split_each_shard_so_samples_stay_on_their_node():
    one_per_node = [set(s) for s in _epoch(64, 2, epoch=0)]
    two_per_node = [set(s) for s in _epoch(64, 4, epoch=3)]  # replicas 0, 1 on node 0; 2, 3 on node 1
    assert two_per_node[0] | two_per_node[1] == one_per_node[0]
    assert two_per_node[2] | two_per_node[3] == one_per_node[1]


@pytest.mark.parametrize("shuffle", [True, False])
def test_with_drop_last_the_samples_left_out_change_so_that_each_is_trained(shuffle):
    # 39 samples on 4 replicas: shards of 9, 10, 10, 10 are cut to 9, three samples out an epoch.
    shards = [set(StableShardSampler(39, 4, rank, shuffle=shuffle).shard().tolist()) for rank in range(4)]
    epochs_seen = Counter()
    for epoch in range(10):
        kept = _epoch(39, 4, epoch, shuffle=shuffle, drop_last=True)
        assert all(len(k) == len(set(k)) == 9 and set(k) <= shard for k, shard in zip(kept, shards))
        epochs_seen.update(i for k in kept for i in k)
    assert sorted(epochs_seen.values()) == [9] * 30 + [10] * 9  # each of a shard of 10 left out once


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("num_samples, replicas", [(10, 2), (999, 2), (1001, 4)])
def test_more_replicas_split_each_shard_whatever_the_dataset_size(num_samples, replicas, drop_last):
    old = [set(StableShardSampler(num_samples, replicas, r).shard().tolist()) for r in range(replicas)]
    for epoch in (0, 1):
        new = _epoch(num_samples, 2 * replicas, epoch, drop_last=drop_last)  # padding included
        assert [set(s) <= old[rank // 2] for rank, s in enumerate(new)] == [True] * 2 * replicas


def test_a_transition_s_cut_loader_keeps_the_epoch_s_steps_and_each_sample_on_its_old_shard():
    # 38 samples, global batch 8 on 2 replicas (4 steps), then on 4, where padded shares of 10
    # would make 5: Lightning's sampler, cut to shares of 9, made stable.
    def loader(replicas, rank):
        data = list(range(38))
        sampler = DistributedSampler(data, num_replicas=replicas, rank=rank, seed=3)
        return DataLoader(data, batch_size=4, sampler=sampler, drop_last=True)

    before = [stable_shards(loader(2, rank)) for rank in range(2)]
    after = [stable_shards(keep_epoch_length(rebatch(loader(4, r), (4, 2), 4), (4, 2))) for r in range(4)]
    assert [len(x) for x in after] == [len(before[0])] * 4 == [4] * 4
    assert all(x.sampler.drop_last for x in after)
    old = [set(x.sampler.shard().tolist()) for x in before]
    for epoch in range(10):
        for rank, x in enumerate(after):
            x.sampler.set_epoch(epoch)
            assert {i for batch in x for i in batch.tolist()} <= old[rank // 2]


def test_an_epoch_s_order_depends_on_the_epoch_alone_so_a_resumed_run_reads_the_same():
    sampler = StableShardSampler(13, 4, 3, drop_last=True)
    for epoch in (0, 1, 2):
        sampler.set_epoch(epoch)
        list(sampler)
    assert list(sampler) == _epoch(13, 4, 2, drop_last=True)[3]


def test_without_shuffle_the_shards_are_contiguous_and_in_order():
    assert _epoch(8, 2, epoch=5, shuffle=False) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_only_lightnings_distributed_sampler_is_replaced():
    data = TensorDataset(torch.arange(10))
    distributed = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=1, seed=3))
    stable = stable_shards(distributed)
    assert isinstance(stable.sampler, StableShardSampler) and stable.batch_size == 2
    assert (stable.sampler.num_replicas, stable.sampler.rank, stable.sampler.seed) == (2, 1, 3)
    own = DataLoader(data, batch_size=2, sampler=SequentialSampler(data))
    assert stable_shards(own) is own
