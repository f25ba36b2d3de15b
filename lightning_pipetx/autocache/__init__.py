"""AutoCache: the frozen prefix's output per training sample, served instead of recomputed.

:class:`AutoCache` owns keys (the dataset indices of each batch, recorded by
:mod:`.sample_keys`), tiers (:mod:`.tiers`), guards (:mod:`.guards`) and measurements
(:mod:`.stopwatch`); the engine calls it through :class:`CachedPrefix`, the strategy through
:class:`CacheControl` (when to open, refuse and report) and :class:`CacheFeed` (the loaders
that feed it, and each step's keys).
"""

from lightning_pipetx.autocache.cache import AutoCache
from lightning_pipetx.autocache.control import CacheControl, CacheSite, cache_directories
from lightning_pipetx.autocache.feed import CacheFeed
from lightning_pipetx.autocache.frozen_weights import FrozenWeightsChangedError
from lightning_pipetx.autocache.guards import TrainablePrefixError
from lightning_pipetx.autocache.prefix import CachedPrefix

__all__ = [
    "AutoCache",
    "CacheControl",
    "CacheFeed",
    "CacheSite",
    "CachedPrefix",
    "FrozenWeightsChangedError",
    "TrainablePrefixError",
    "cache_directories",
]
