"""StableShardSampler: every sample once per epoch, shards fixed across epochs and nested
across replica counts, and swapped in only for Lightning's DistributedSampler."""

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler, TensorDataset

from lightning_pipetx.strategy.dataloading import stable_shards
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
