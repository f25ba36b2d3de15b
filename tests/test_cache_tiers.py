"""AutoCache's tiers on CPU: which tier served each hit, budgets, spill and refill, the input
guard's deferred verdict, and a tier dropped when reading it was measured slower than computing."""

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import tiny_models as tm
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

import lightning_pipetx
from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback
from lightning_pipetx.autocache import AutoCache, CacheControl, CacheFeed, CacheSite
from lightning_pipetx.autocache.tiers import ram_room
from lightning_pipetx.strategy.p2p import Activation

ROW_BYTES = tm.SEQ_LEN * tm.HIDDEN * 4  # one sample's hidden state, float32


def _states(value, size):
    return Activation.of_hidden(torch.full((size, 3, 2), float(value)), 0)


def _run(tmp_path):
    """A run token of this test alone: CacheControl's RAM folder is in /dev/shm, shared by every run."""
    return f"{tmp_path.parent.name}-{tmp_path.name}"


def _checked(cache, size):
    indices = torch.arange(size)
    for _ in range(2):  # two epochs saw the same inputs, and the same entered the frozen blocks
        cache.guard.observe(indices, indices.to(torch.float64))
        cache.prefix_guard.observe(indices, indices.to(torch.float64))
        cache.begin_epoch(group_size=1)
    return cache


def test_the_device_tier_serves_first_and_host_ram_the_rest(tmp_path):
    row = 3 * 2 * 4
    cache = _checked(
        AutoCache(tmp_path / "ram", tmp_path / "spill", 8, 2**20, device_budget=3 * row, share_host=False), 8
    )
    cache.store(torch.arange(8), 1, _states(1, 8))
    assert cache.tier_bytes("device") == 3 * row  # the budget, no more
    assert cache.tier_bytes("host") == 8 * row and cache.tier_bytes("disk") == 0
    level, states, _ = cache.lookup(torch.tensor([6, 0, 7, 1]), 1)
    assert level == 1 and torch.equal(states, torch.ones(4, 3, 2))
    counts = cache.take_counts()
    assert (counts.hits, counts.lookups) == (4, 4)
    assert dict(counts.served) == {"device": 2, "host": 2, "disk": 0}
    assert counts.served_bytes["device"] == 2 * row
    cache.close(remove_files=True)


def test_a_sample_drawn_several_times_into_a_batch_takes_one_device_slot(tmp_path):
    row = 3 * 2 * 4
    cache = _checked(AutoCache(tmp_path / "ram", tmp_path / "spill", 4, 2**20, device_budget=2 * row), 4)
    drawn = torch.tensor([3, 3, 1, 3])  # a sampler drawing with replacement
    cache.store(drawn, 1, Activation.of_hidden(drawn.float()[:, None, None].expand(4, 3, 2).clone(), 0))
    assert cache.tier_bytes("device") == 2 * row and cache.tier_bytes("host") == 4 * row
    indices = torch.tensor([1, 3, 3])
    level, states, _ = cache.lookup(indices, 1)
    assert level == 1 and torch.equal(states, indices.float()[:, None, None].expand(3, 3, 2))
    assert dict(cache.take_counts().served) == {"device": 3, "host": 0, "disk": 0}  # 1 and 3 both on the device
    cache.close(remove_files=True)


def test_a_depth_spills_to_disk_beyond_the_ram_budget_and_refills_ram_once_older_depths_go(tmp_path):
    row = 3 * 2 * 4
    cache = _checked(AutoCache(tmp_path / "ram", tmp_path / "spill", 4, ram_budget=4 * row + 4, device_budget=0), 4)
    indices = torch.arange(4)
    for depth in (1, 2):
        cache.store(indices, depth, _states(depth, 4))
    assert cache.tier_bytes("host") == 4 * row and cache.tier_bytes("disk") == 4 * row  # depth 2 spilled
    cache.store(indices, 3, _states(3, 4))
    cache.drop_below(4)  # depths 1 and 2 freed: RAM has room again
    cache.store(indices, 4, _states(4, 4))
    assert cache.tier_bytes("host") == 4 * row and cache.tier_bytes("disk") == 4 * row  # 4 in RAM, 3 on disk
    assert sorted(p.name for p in (tmp_path / "ram").glob("depth?")) == ["depth4"]
    assert sorted(p.name for p in cache.spill_directory.glob("depth?")) == ["depth3"]
    cache.lookup(indices, 4)
    assert dict(cache.take_counts().served) == {"device": 0, "host": 4, "disk": 0}
    cache.close(remove_files=True)


def test_a_depth_goes_to_ram_when_only_the_disk_was_measured_slow(tmp_path):
    row = 3 * 2 * 4
    cache = _checked(AutoCache(tmp_path / "ram", tmp_path / "spill", 4, ram_budget=4 * row + 4, device_budget=0), 4)
    indices = torch.arange(4)
    for depth in (1, 2):  # depth 2 spills to disk, whose reads were then measured slower than computing
        cache.store(indices, depth, _states(depth, 4))
    cache.dropped.add("disk")
    cache.drop_below(3)  # depth 1 freed: RAM has room again
    cache.store(indices, 3, _states(3, 4))
    assert cache.tier_bytes("host") == 4 * row
    assert cache.lookup(indices, 3)[0] == 3
    cache.close(remove_files=True)


def test_a_full_disk_switches_the_cache_off_with_a_warning_instead_of_failing_the_step(tmp_path, monkeypatch, caplog):
    def full(fd, offset, length):  # no room in RAM nor on the spill disk
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    cache = _checked(AutoCache(tmp_path / "ram", tmp_path / "spill", 4, ram_budget=2**20, device_budget=0), 4)
    monkeypatch.setattr(os, "posix_fallocate", full)
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        cache.store(torch.arange(4), 1, _states(1, 4))
    assert not cache.enabled
    assert "no room for the states of depth 1" in caplog.text and "cache_dir=" in caplog.text
    assert not list((tmp_path / "spill").glob("depth1*")) and not list((tmp_path / "ram").glob("depth1*"))
    cache.close(remove_files=True)


def test_a_depth_goes_to_ram_only_where_it_leaves_half_the_mounts_free_space_free():
    mib = 2**20
    # Docker's 64 MB /dev/shm, empty: a 40 MiB depth would leave DataLoader workers no room for a batch
    assert ram_room(budget=8 * 2**30, held=0, free=64 * mib) == 32 * mib
    assert ram_room(budget=8 * 2**30, held=20 * mib, free=44 * mib) == 22 * mib  # held bytes are not free
    assert ram_room(budget=30 * mib, held=20 * mib, free=2**40) == 10 * mib  # the budget still bounds


_STORE_40_ROWS = """
import sys, torch
from pathlib import Path
from lightning_pipetx.autocache import AutoCache
from lightning_pipetx.strategy.p2p import Activation
ram = Path(sys.argv[1])
cache = AutoCache(ram, ram.parent / "spill", 40, ram_budget=2**30, device_budget=0)
cache.store(torch.arange(40), 1, Activation.of_hidden(torch.ones(40, 2**14), 0))  # 2.5 MiB
print("host", cache.tier_bytes("host"), "disk", cache.tier_bytes("disk"))
"""


def test_a_depth_spills_to_disk_before_it_fills_a_small_ram_mount(tmp_path):
    """A real 4 MiB tmpfs (the RAM folder of a container), mounted in a mount namespace of the test's own."""
    ram = tmp_path / "shm"
    ram.mkdir()
    mount = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size=4m tmpfs "{ram}" && exec "$@"', "sh"]
    if shutil.which("unshare") is None or subprocess.run([*mount, "true"], capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs in a mount namespace of its own is not permitted here")
    package = str(Path(lightning_pipetx.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([package, os.environ.get("PYTHONPATH", "")])}
    command = [*mount, sys.executable, "-c", _STORE_40_ROWS, str(ram)]
    run = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path)  # imports ``package``
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.split() == ["host", "0", "disk", str(40 * 2**16)]


def _node_caches(tmp_path):
    """Two first stages of one node: their host tiers share the files of one folder."""
    return [_checked(AutoCache(tmp_path / "ram", tmp_path / "spill", 4, 2**20, device_budget=0), 4) for _ in range(2)]


def test_a_rank_adopts_a_depth_another_rank_of_its_node_cached(tmp_path):
    first, second = _node_caches(tmp_path)
    first.store(torch.arange(4), 1, _states(7, 4))
    first.flush_writes()
    second.begin_epoch(group_size=1)  # adopts depth 1 from the shared file
    level, states, _ = second.lookup(torch.arange(4), 1)
    assert level == 1 and torch.equal(states, torch.full((4, 3, 2), 7.0))
    first.close(remove_files=True)


@pytest.mark.parametrize("damage", ["removed", "truncated"])
def test_a_shared_depth_file_removed_or_of_another_size_is_passed_over_and_left_as_it_is(tmp_path, damage):
    first, second = _node_caches(tmp_path)
    first.store(torch.arange(4), 1, _states(7, 4))
    first.flush_writes()
    valid = tmp_path / "ram" / "depth1.valid"  # the last file a rank maps: it went while the others stayed
    if damage == "removed":
        valid.unlink()
    else:
        valid.write_bytes(b"\x01" * 3)
    second.begin_epoch(group_size=1)
    assert second.lookup(torch.arange(4), 1)[1] is None
    assert valid.exists() == (damage == "truncated")  # neither created again nor extended
    assert damage == "removed" or valid.stat().st_size == 3
    first.close(remove_files=True)


def test_a_rank_that_cannot_map_a_depth_another_rank_of_its_node_cached_leaves_its_files(tmp_path, monkeypatch):
    first, second = _node_caches(tmp_path)
    first.store(torch.arange(4), 1, _states(7, 4))
    first.flush_writes()

    reserve = os.posix_fallocate

    def full_ram(fd, offset, length):  # the RAM file system has no room left for this rank's mapping
        if Path(os.readlink(f"/proc/self/fd/{fd}")).parent == tmp_path / "ram":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        reserve(fd, offset, length)

    with monkeypatch.context() as patch:
        patch.setattr(os, "posix_fallocate", full_ram)
        second.store(torch.arange(4), 1, _states(7, 4))  # to its disk spill instead
    assert second.tier_bytes("host") == 0 and second.tier_bytes("disk") == 4 * 3 * 2 * 4
    assert sorted(p.name for p in (tmp_path / "ram").iterdir()) == ["depth1", "depth1.json", "depth1.valid"]
    third = _node_caches(tmp_path)[0]  # a rank that opens the depth later still reads the first one's states
    level, states, _ = third.lookup(torch.arange(4), 1)
    assert level == 1 and torch.equal(states, torch.full((4, 3, 2), 7.0))
    first.close(remove_files=True)
    second.close(remove_files=True)


def test_a_rank_whose_states_differ_from_those_another_rank_of_its_node_described_switches_its_cache_off(
    tmp_path, caplog
):
    # Dynamic padding across first stages: one rank alone switches off at a shape change, as here.
    first, second = _node_caches(tmp_path)
    first.store(torch.arange(4), 1, _states(7, 4))
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        second.store(torch.arange(4), 1, Activation.of_hidden(torch.zeros(4, 5), 0))
    assert not second.enabled and "dynamic padding" in caplog.text
    assert "shape (3, 2), torch.float32 (a tuple of 0)" in caplog.text and "has (5,), torch.float32" in caplog.text
    first.flush_writes()  # the first rank's files are as they were
    assert first.lookup(torch.arange(4), 1)[0] == 1
    assert (tmp_path / "ram" / "depth1").stat().st_size == 4 * 3 * 2 * 4
    first.close(remove_files=True)


def test_nothing_is_served_before_an_input_check_passed_and_a_changed_input_switches_it_off(tmp_path, caplog):
    cache = AutoCache(tmp_path / "ram", tmp_path / "spill", 4, 2**20)
    indices = torch.arange(4)
    cache.guard.observe(indices, torch.zeros(4, dtype=torch.float64))
    cache.store(indices, 1, _states(1, 4))
    assert cache.lookup(indices, 1)[1] is None  # no epoch compared yet
    cache.begin_epoch(group_size=1)
    assert cache.lookup(indices, 1)[1] is None  # still nothing compared
    cache.guard.observe(indices, torch.tensor([0.0, 0.0, 5.0, 0.0], dtype=torch.float64))  # sample 2 changed
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        cache.begin_epoch(group_size=1)
    assert not cache.enabled and "input changed between epochs" in caplog.text
    assert cache.lookup(indices, 1)[1] is None
    cache.close(remove_files=True)


def test_the_training_and_validation_caches_hold_to_one_device_budget_and_one_ram_budget(tmp_path):
    row = 3 * 2 * 4
    control = CacheControl("auto", str(tmp_path), ram_bytes=6 * row, device_bytes=3 * row)
    cpu = torch.device("cpu")
    site = CacheSite(_run(tmp_path), 0, cpu, share_host=False)
    training = _checked(control.open(site, 4), 4)
    validation = _checked(control.open_eval(site, 4), 4)
    training.store(torch.arange(4), 1, _states(1, 4))  # 3 rows on the device, the depth's file in RAM
    validation.store(torch.arange(4), 1, _states(2, 4))  # no device rows left, no room in RAM: disk
    assert training.tier_bytes("device") == 3 * row and validation.tier_bytes("device") == 0
    assert training.tier_bytes("host") == 4 * row and validation.tier_bytes("host") == 0
    assert validation.tier_bytes("disk") == 4 * row
    level, states, _ = validation.lookup(torch.arange(4), 1)
    assert level == 1 and states.eq(2.0).all()
    stats = control.epoch_stats(cpu, world_size=1)
    held = (stats["cache_device_bytes"], stats["cache_ram_bytes"], stats["cache_disk_bytes"])
    assert held == (3 * row, 4 * row, 4 * row)
    control.close(remove_files=True)


def test_a_tier_measured_slower_than_the_prefix_is_dropped_and_autopipe_stops_counting_it_free(tmp_path, caplog):
    control = CacheControl("auto", str(tmp_path), ram_bytes=2**20, device_bytes=0)
    cache = _checked(control.open(CacheSite(_run(tmp_path), 0, torch.device("cpu"), share_host=False), 4), 4)
    cache.store(torch.arange(4), 2, _states(2, 4))
    # What the stopwatch resolved from the last epoch: a read of a sample from RAM took 1 ms,
    # a frozen block 10 us per sample (a slow file system under a small model).
    cache.watch.seconds["host"] = [1e-3] * 4
    cache.watch.seconds["compute"] = [1e-5] * 4
    assert control.active(torch.device("cpu"), world_size=1)
    with caplog.at_level("INFO", logger="lightning_pipetx"):
        control.begin_epoch(world_size=1)
    assert cache.dropped == {"host", "disk"}
    assert caplog.text.count("stops using its host tier") == 1
    assert not cache.serving and cache.lookup(torch.arange(4), 2)[1] is None
    assert not control.active(torch.device("cpu"), world_size=1)  # AutoPipe costs the prefix again
    control.close(remove_files=True)


def test_the_feed_records_the_loaders_opens_each_cache_once_and_hands_out_keys(tmp_path):
    site = CacheSite(_run(tmp_path), 0, torch.device("cpu"), share_host=False)
    feed = CacheFeed(CacheControl("auto", str(tmp_path), ram_bytes=2**20, device_bytes=0))
    train, opened = feed.training_loader(DataLoader(list(range(6)), batch_size=4), site)
    assert opened is feed.control.cache and opened.num_samples == 6
    assert feed.training_loader(train, site) == (train, None)  # a reload: recorded, the cache stays
    assert [b.tolist() for b in train] == [[0, 1, 2, 3], [4, 5]]
    current, upcoming = feed.training_keys()
    assert current.tolist() == [0, 1, 2, 3] and upcoming.tolist() == [4, 5]
    val = feed.validation_loader(DataLoader(list(range(10, 13)), batch_size=2), site)
    other = DataLoader(list(range(3)), batch_size=2)
    assert feed.validation_loader(other, site) is other  # a second validation loader is not recorded
    assert feed.control.eval_cache.num_samples == 3
    feed.begin_validation([val, other], world_size=1)
    list(val)
    assert feed.validation_keys((None, 0, 1)) == (None, None, None)  # the second loader's step
    cache, current, upcoming = feed.validation_keys((None, 0))
    assert cache is feed.control.eval_cache and current.tolist() == [0, 1] and upcoming.tolist() == [2]
    assert feed.open
    feed.close(remove_files=True)
    assert not feed.open and feed.training_keys() == (None, None)


def test_processes_with_cache_folders_of_their_own_divide_the_nodes_ram_budget(tmp_path):
    row = 3 * 2 * 4
    site = CacheSite(_run(tmp_path), 0, torch.device("cpu"), share_host=False, private_processes=2)
    feed = CacheFeed(CacheControl("auto", str(tmp_path), ram_bytes=6 * row, device_bytes=0))
    feed.training_loader(DataLoader(list(range(4)), batch_size=4), site)
    feed.validation_loader(DataLoader(list(range(4)), batch_size=4), site)
    training, validation = (_checked(cache, 4) for cache in (feed.control.cache, feed.control.eval_cache))
    assert training.ram_budget == validation.ram_budget == 3 * row
    training.store(torch.arange(4), 1, _states(1, 4))  # 4 rows: beyond this process's 3, on disk
    assert training.tier_bytes("host") == 0 and training.tier_bytes("disk") == 4 * row
    feed.close(remove_files=True)


def test_a_validation_loader_rebuilt_over_another_dataset_frees_the_validation_cache_with_the_reason(tmp_path, caplog):
    site = CacheSite(_run(tmp_path), 0, torch.device("cpu"), share_host=False)
    feed = CacheFeed(CacheControl("auto", str(tmp_path), ram_bytes=2**20, device_bytes=0))
    feed.training_loader(DataLoader(list(range(4)), batch_size=4), site)
    val = feed.validation_loader(DataLoader(list(range(4)), batch_size=4), site)
    feed.begin_validation([val], world_size=1)
    cache = _checked(feed.control.eval_cache, 4)
    cache.store(torch.arange(4), 1, _states(1, 4))
    assert cache.tier_bytes("host") > 0 and list(cache.directory.glob("depth1*"))
    rebuilt = feed.validation_loader(
        DataLoader(list(range(10, 14)), batch_size=4), site
    )  # reload_dataloaders_every_n_epochs
    with caplog.at_level("WARNING", logger="lightning_pipetx"):
        feed.begin_validation([rebuilt], world_size=1)
    assert not cache.enabled and "rebuilt over another dataset object" in caplog.text
    assert cache.tier_bytes("host") == 0 and not list(cache.directory.glob("depth1*"))  # memory and files freed
    assert feed.control.cache.enabled  # training keeps its cache
    feed.close(remove_files=True)


def test_the_feed_leaves_alone_what_it_cannot_cache(tmp_path):
    site = CacheSite(_run(tmp_path), 0, torch.device("cpu"), share_host=False)
    endless = DataLoader(_Endless(), batch_size=2)
    feed = CacheFeed(CacheControl("auto", str(tmp_path), ram_bytes=2**20, device_bytes=0))
    assert feed.training_loader(endless, site) == (endless, None) and not feed.open
    off = CacheFeed(CacheControl(False, str(tmp_path), ram_bytes=2**20, device_bytes=0))
    loader = DataLoader(list(range(4)), batch_size=2)
    assert off.training_loader(loader, site) == (loader, None) and off.validation_loader(loader, site) is loader
    assert not off.open and off.training_keys() == (None, None)


class _Endless(torch.utils.data.IterableDataset):
    def __iter__(self):
        while True:
            yield torch.zeros(1)


class Stats(Callback):
    def __init__(self):
        self.epochs = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.epochs.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("pipetx/cache")})


def _fit(tmp_path, cache, **strategy_kwargs):
    module = tm.TinyBertClassifier(seed=0, dropout=0.0)
    stats = Stats()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ElasticPipelineStrategy(cache=cache, profile_steps=0, cache_dir=str(tmp_path), **strategy_kwargs),
        max_epochs=4,
        callbacks=[FreezeCallback(alpha=1 / 2, signal="schedule", freeze_interval=2), stats],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    data = tm.RandomTokenDataset(size=32, seed=1)
    trainer.fit(module, DataLoader(data, batch_size=8, shuffle=True))
    return module.state_dict(), stats.epochs


def test_a_warm_epoch_is_served_from_the_device_tier_a_step_ahead_and_trains_as_without_cache(tmp_path):
    uncached, _ = _fit(tmp_path, False)
    cached, epochs = _fit(tmp_path, True, cache_device_bytes=32 * ROW_BYTES)
    for key in uncached:
        torch.testing.assert_close(cached[key], uncached[key], atol=1e-6, rtol=1e-5, msg=key)
    last = epochs[-1]
    assert last["pipetx/cache_hit_rate"] == 1.0 and last["pipetx/cache_served_device"] == 1.0
    assert last["pipetx/cache_device_bytes"] == 32 * ROW_BYTES and last["pipetx/cache_ram_bytes"] == 0


def test_host_ram_reads_are_prefetched_a_step_ahead(tmp_path):
    _, epochs = _fit(tmp_path, True, cache_device_bytes=0)
    last = epochs[-1]
    assert last["pipetx/cache_hit_rate"] == 1.0 and last["pipetx/cache_served_host"] == 1.0
    assert last["pipetx/cache_served_host_bytes"] == 32 * ROW_BYTES
    assert last["pipetx/cache_prefetched"] == 0.75  # every batch but an epoch's first
