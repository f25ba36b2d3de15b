"""The strategy's side of AutoCache: when to open it, when to refuse it, and what it reports."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipetx.autocache.cache import AutoCache
from lightning_pipetx.autocache.frozen_weights import FrozenWeightsChangedError, FrozenWeightsGuard
from lightning_pipetx.autocache.guards import (
    TrainablePrefixError,
    agreed_fingerprints,
    shown_names,
    trainable_prefix_reason,
    trainable_prefix_weights,
)
from lightning_pipetx.autocache.tiers import TIER_NAMES
from lightning_pipetx.blocks import BlockSplit
from lightning_pipetx.strategy.options import bool_or_auto, byte_count

_SHM = Path("/dev/shm")


@dataclass(frozen=True)
class CacheSite:
    """Where this rank's caches live: the run, the node, the training device, whether several
    first stages of the node read the host tier, and how many processes of the node keep caches
    in folders of their own (each then holds to its share of the node's RAM budget)."""

    run_token: str
    node_rank: int
    device: torch.device
    share_host: bool
    private_processes: int = 1


def cache_directories(run_token: str, node_rank: int, spill_root: str | None) -> tuple[Path, Path]:
    """RAM folder (``/dev/shm`` when there is one) and disk folder for one run on one node."""
    name = f"pipetx-{run_token}-node{node_rank}"
    spill = Path(spill_root or os.environ.get("TMPDIR", "/tmp")) / name
    ram = _SHM / name if _SHM.is_dir() and os.access(_SHM, os.W_OK) else spill / "ram"
    return ram, spill


class CacheControl:
    """``ElasticPipelineStrategy(cache=...)``: ``"auto"`` caches when it can run exactly and
    turns itself off otherwise; ``True`` refuses what it cannot cache; ``False`` never caches.

    Two caches: :attr:`cache` for the training samples and :attr:`eval_cache` for the samples
    of the validation loader run during fit (every epoch, through the same frozen prefix).
    The validation cache serves only while the training cache is on: a prefix whose output
    cannot be cached in training (it still reads a trainable weight) is not cached for
    validation either. The two share one device budget and one RAM budget; where the node's
    processes keep caches in folders of their own, each holds to its share of the RAM budget."""

    def __init__(self, mode: bool | str, cache_dir: str | None, ram_bytes: int, device_bytes: int | str) -> None:
        if not bool_or_auto(mode):
            raise ValueError(f"ElasticPipelineStrategy(cache={mode!r}): use 'auto', True or False.")
        if not (device_bytes == "auto" or byte_count(device_bytes) is not None):
            raise ValueError(
                f"ElasticPipelineStrategy(cache_device_bytes={device_bytes!r}): use 'auto' or a number of bytes >= 0."
            )
        if byte_count(ram_bytes) is None:
            raise ValueError(f"ElasticPipelineStrategy(cache_ram_bytes={ram_bytes!r}): use a number of bytes >= 0.")
        if cache_dir is not None and not (isinstance(cache_dir, (str, os.PathLike)) and os.fspath(cache_dir)):
            raise ValueError(f"ElasticPipelineStrategy(cache_dir={cache_dir!r}): use a folder's path, or None.")
        self.mode = mode
        self.cache_dir = cache_dir
        self.ram_bytes = byte_count(ram_bytes)
        self.device_bytes = device_bytes if device_bytes == "auto" else byte_count(device_bytes)
        self.cache: AutoCache | None = None
        self.eval_cache: AutoCache | None = None
        self._refusal: str | None = None
        self._validation_refusal: str | None = None
        self._frozen_weights = FrozenWeightsGuard()
        self._device = torch.device("cpu")  # the training device, where collectives run (NCCL: CUDA only)
        self._restored_fingerprints: dict[str, Any] | None = None  # from the checkpoint a fit resumes from

    def open(self, site: CacheSite, num_samples: int) -> AutoCache:
        """The run's training cache on this rank (created once)."""
        if self.cache is None:
            self._device = site.device
            self.cache = self._new(site.run_token, site, num_samples, training=True)
            restored, self._restored_fingerprints = self._restored_fingerprints, None
            if restored is not None and restored.get("samples") == num_samples:
                self.cache.guard.restore(*restored["inputs"])
                self.cache.prefix_guard.restore(*restored["prefix_inputs"])
        return self.cache

    def fingerprints(self, world_size: int) -> dict[str, Any] | None:
        """The training cache's input fingerprints over every rank, for a checkpoint (a collective
        where the training cache exists): a fit resumed from it compares the batches it loads first
        with them and can serve an epoch sooner (its cached states themselves are not saved)."""
        cache = self.cache
        if cache is None:
            return None
        state = {
            "samples": cache.num_samples,
            "inputs": agreed_fingerprints(cache.guard, world_size),
            "prefix_inputs": agreed_fingerprints(cache.prefix_guard, world_size),
        }
        return state if cache.enabled else None

    def restore_fingerprints(self, state: dict[str, Any] | None) -> None:
        """Keep :meth:`fingerprints` from a checkpoint for the training cache this fit opens (if its
        dataset has as many samples); None forgets them."""
        self._restored_fingerprints = state

    def open_eval(self, site: CacheSite, num_samples: int) -> AutoCache:
        """The run's validation cache on this rank (created once)."""
        if self.eval_cache is None:
            self._device = site.device
            self.eval_cache = self._new(f"{site.run_token}-val", site, num_samples, training=False)
        return self.eval_cache

    def _new(self, token: str, site: CacheSite, num_samples: int, training: bool) -> AutoCache:
        ram, spill = cache_directories(token, site.node_rank, self.cache_dir)
        label = "AutoCache" if training else "AutoCache's validation cache"
        ram_bytes = self.ram_bytes // site.private_processes
        cache = AutoCache(ram, spill, num_samples, ram_bytes, site.device, self.device_bytes, site.share_host, label)
        cache.force = self.mode is True and training  # validation is never served a state its input outdated
        cache.strict = not training
        for other in self._caches():  # the budgets hold for both caches together
            other.budget_sharers.append(cache)
            cache.budget_sharers.append(other)
        if self._refusal is not None:
            cache.disable(self._refusal + ".", warn=training)  # the training cache says why
        elif self._validation_refusal is not None and not training:
            cache.disable(self._validation_refusal + ".")
        return cache

    def _caches(self) -> list[AutoCache]:
        return [c for c in (self.cache, self.eval_cache) if c is not None]

    def refuse(self, reason: str, error: type[Exception], fix: str) -> None:
        """The cache cannot serve this run: an error under ``cache=True``, else off with a warning."""
        if self.mode is True:
            raise error(f"ElasticPipelineStrategy(cache=True): {reason}. {fix}")
        self._refusal = reason
        for cache in self._caches():
            if cache.enabled:
                cache.disable(reason + ".", warn=cache is self.cache)

    def refuse_validation(self, reason: str) -> None:
        """The validation cache cannot serve this run: off with a warning; validation computes
        every block from now on (training keeps its cache)."""
        self._validation_refusal = reason
        if self.eval_cache is not None and self.eval_cache.enabled:
            self.eval_cache.disable(reason + ".")

    def on_freeze(
        self,
        root: torch.nn.Module,
        split: BlockSplit,
        frozen_blocks: int,
        computes: Callable[[torch.nn.Module], bool] = lambda module: True,
    ) -> None:
        """Refuse a frozen prefix that still trains; free the depths no longer needed; watch the
        prefix's weights (``computes(module)``: whether this rank computes the module's output for
        the cache)."""
        if self.mode is False:
            return
        self._frozen_weights.watch(root, split, frozen_blocks, computes)
        names = trainable_prefix_weights(root, split, frozen_blocks)
        if names:
            self.refuse(
                trainable_prefix_reason(names),
                TrainablePrefixError,
                "Pass cache=False (or cache='auto', which turns the cache off for such a model), or freeze or untie "
                "those weights.",
            )
        for cache in self._caches():
            cache.drop_below(frozen_blocks)

    def active(self, device: torch.device, world_size: int) -> bool:
        """Whether the cache serves the frozen prefix on every rank (a collective)."""
        flag = torch.tensor(int(self.cache is not None and self.cache.paying), device=device)
        if world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag)

    def begin_fit(self) -> None:
        """A fit starts: no prefix is frozen yet (an earlier fit's watch is dropped)."""
        self._frozen_weights.reset()

    def check_training_batch(self, batch: Any) -> None:
        """Before a training batch whose samples are recorded, on every rank (a rank that is a
        first stage only after a transition knows the run's shapes too): the shapes of its samples."""
        if self.cache is not None and self.cache.enabled:
            self.cache.check_input_shapes(batch)

    def begin_epoch(self, world_size: int) -> None:
        """A training epoch starts (a collective where the cache exists): the verdicts on the frozen
        prefix's weights and on the inputs the last epoch saw."""
        if self.cache is not None:
            self._check_frozen_weights(world_size)
            self.cache.begin_epoch(world_size)

    def _check_frozen_weights(self, world_size: int) -> None:
        """Refuse the cache once a weight of the frozen prefix changed after states were cached
        from it (a collective: every rank calls it where the training cache exists)."""
        changed = self._frozen_weights.changed() if self.cache is not None and self.cache.enabled else []
        flag = torch.tensor(float(bool(changed)), device=self._device)
        if world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag:
            return
        seen = [changed]
        if world_size > 1:
            seen = [None] * world_size
            dist.all_gather_object(seen, changed)
        names = sorted({name for names in seen for name in names})
        shown = shown_names([repr(name) for name in names])
        self.refuse(
            f"the frozen prefix changed after states were cached from it ({shown}): a callback such as Lightning's "
            f"ModelPruning, code writing to frozen weights, or a block's forward updating a buffer (a running mean) "
            f"outdates every cached state",
            FrozenWeightsChangedError,
            "Pass cache=False (or cache='auto', which turns the cache off when this happens), or leave the frozen "
            "weights as they are (prune only what trains).",
        )

    def begin_validation(self, world_size: int) -> None:
        """Before a validation run in fit (a collective where the validation cache exists): the
        verdict on the inputs it saw, and off for good once the training cache is off."""
        cache = self.eval_cache
        if cache is None:
            return
        self._check_frozen_weights(world_size)  # a change within the epoch, before validation serves
        if cache.enabled and self.cache is not None and not self.cache.enabled:
            cache.disable("the training cache is off.", warn=False)
        cache.begin_epoch(world_size)

    def serving_eval(self) -> AutoCache | None:
        """The validation cache, while it and the training cache (which finds a prefix whose
        output cannot be cached) are both on."""
        training, cache = self.cache, self.eval_cache
        on = cache is not None and cache.enabled and training is not None and training.enabled
        return cache if on else None

    def epoch_stats(self, device: torch.device, world_size: int) -> dict[str, float]:
        """Hit rate, share and bytes served by each tier over every rank since the last call,
        and the bytes cached per tier on the fullest rank (collective)."""
        cache = self.cache
        counts = cache.take_counts() if cache is not None else None
        sums = [float(counts.hits), float(counts.lookups)] if counts else [0.0, 0.0]
        sums += [float(counts.served[n]) if counts else 0.0 for n in TIER_NAMES]
        sums += [float(counts.served_bytes[n]) if counts else 0.0 for n in TIER_NAMES]
        sums.append(float(counts.prefetched) if counts else 0.0)
        evals = self.eval_cache.take_counts() if self.eval_cache is not None else None
        sums += [float(evals.hits), float(evals.lookups)] if evals else [0.0, 0.0]
        sizes = [float(sum(c.tier_bytes(n) for c in self._caches())) for n in TIER_NAMES]
        sizes += [float(c is not None and not c.enabled) for c in (cache, self.eval_cache)]  # off on some rank
        sums_t = torch.tensor(sums, dtype=torch.float64, device=device)
        sizes_t = torch.tensor(sizes, dtype=torch.float64, device=device)
        if world_size > 1:
            dist.all_reduce(sums_t)
            dist.all_reduce(sizes_t, op=dist.ReduceOp.MAX)  # the ranks of a node share the same files
        sums, sizes = sums_t.tolist(), sizes_t.tolist()
        *sizes, training_off, validation_off = sizes
        stats = {f"cache_{name}_bytes": size for name, size in zip(("device", "ram", "disk"), sizes)}
        # A cache switched off serves nothing: its rates read 0 (a value no longer logged would stay as it was).
        eval_hits, eval_lookups = sums[-2:]
        if eval_lookups > 0 or validation_off:
            stats["val_cache_hit_rate"] = eval_hits / max(eval_lookups, 1.0)
        hits, lookups = sums[:2]
        if lookups > 0 or training_off:
            stats["cache_hit_rate"] = hits / max(lookups, 1.0)
            stats["cache_prefetched"] = sums[-3] / max(lookups, 1.0)
            for i, name in enumerate(TIER_NAMES):
                stats[f"cache_served_{name}"] = sums[2 + i] / max(lookups, 1.0)
                stats[f"cache_served_{name}_bytes"] = sums[2 + len(TIER_NAMES) + i]
        return stats

    @property
    def refused(self) -> bool:
        """A refusal of this fit is held (to be forgotten by :meth:`close`, with or without a cache)."""
        return self._refusal is not None or self._validation_refusal is not None

    def close(self, remove_files: bool) -> None:
        """Close both caches and forget the fit's refusals: the next fit decides again."""
        for cache in self._caches():
            cache.close(remove_files)
        self.cache = self.eval_cache = None
        self._refusal = self._validation_refusal = None
        self._frozen_weights.reset()
