"""The training DataLoader, re-batched when the number of replicas changes (the global batch
stays the user's), and sharded so that samples stay on their replica (:func:`stable_shards`)."""

from __future__ import annotations

import copy
import functools
import math
import os
from dataclasses import dataclass
from typing import Any

from lightning.fabric.utilities import data as fabric_data
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning.pytorch.utilities import data as lightning_data
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from lightning_pipetx.strategy.shard_sampler import StableShardSampler


def global_batch_fits(batch0: tuple[int | None, int] | None, replicas: int) -> bool:
    """Whether the global batch of ``batch0 = (batch_size, replicas)`` splits over ``replicas``
    (a loader that cannot be re-batched, ``batch_size`` None: only over as many replicas)."""
    if batch0 is None:
        return True
    size, replicas0 = batch0
    if size is None:
        return replicas == replicas0
    return (size * replicas0) % replicas == 0


def deals_to_replicas(loader: DataLoader) -> bool:
    """Whether a ``DistributedSampler`` deals ``loader``'s samples to the replicas (Lightning's, the
    wrapper it puts around a sampler of the user's, or one of the user's), so that they can be
    dealt to another number of replicas. Another sampler of the user's
    (``use_distributed_sampler=False``), or an ``IterableDataset``, gives each replica what it
    gives on any number of them: more replicas would train the same samples more than once."""
    if isinstance(loader.dataset, IterableDataset):
        return False
    return _distributed_sampler(loader) is not None


def foreign_dealing(loader: DataLoader, replicas: tuple[int, ...], world_size: int) -> str | None:
    """Why a ``DistributedSampler`` of the user's in ``loader`` cannot be taken to deal one data set
    to the replicas (None: it deals to one of the layouts' ``replicas`` or to all ``world_size``
    processes, as one built from ``distributed_sampler_kwargs``, or with its defaults, does)."""
    sampler = _distributed_sampler(loader)
    if sampler is None or sampler.num_replicas in (*replicas, world_size):
        return None
    shown = " or ".join(str(r) for r in sorted(set(replicas)))
    return (
        f"the training DataLoader's DistributedSampler deals to num_replicas={sampler.num_replicas}, neither the "
        f"{shown} replicas of the layouts nor the {world_size} processes: ElasticPipelineStrategy takes a "
        f"DistributedSampler to deal one data set to the replicas, and deals it again when they change, which "
        f"would change what each rank trains on. Build it from trainer.strategy.distributed_sampler_kwargs; for a "
        f"data set of each rank's own, draw from it with another sampler (RandomSampler, with a generator of yours)"
    )


def deal_again(loader: DataLoader, replicas: int, rank: int) -> DataLoader:
    """``loader`` with a ``DistributedSampler`` of the user's that deals to other replicas (built
    from ``trainer.strategy.distributed_sampler_kwargs`` of the run's first layout) dealing to
    replica ``rank`` of ``replicas``, as Lightning deals its own sampler again when it rebuilds."""
    sampler = _distributed_sampler(loader)
    if sampler is None or (sampler.num_replicas, sampler.rank) == (replicas, rank):
        return loader
    dealt = _dealing(sampler, replicas, rank, sampler.drop_last)
    if loader.sampler is sampler:
        return like(loader, sampler=dealt)
    batches = copy.copy(loader.batch_sampler)
    batches.sampler = dealt
    return like(loader, batch_sampler=batches)


def seed_workers_by_replica(loader: Any, replica: int) -> Any:
    """Under ``seed_everything(workers=True)`` seed ``loader``'s workers by the rank's replica, where
    Lightning (after the strategy's hook) seeds them by the global rank: a replica's stages read the
    same batches, so their workers draw the same random augmentation. One stage a replica is DDP's
    seeding. A ``worker_init_fn`` of the user's is kept. Returns ``loader``."""
    init = getattr(loader, "worker_init_fn", False)
    lightnings = init is None or (isinstance(init, functools.partial) and init.func is pl_worker_init_function)
    if int(os.environ.get("PL_SEED_WORKERS", 0)) and lightnings:
        loader.worker_init_fn = functools.partial(pl_worker_init_function, rank=replica)
    return loader


def share_length(samples: int, replicas: int, drop_last: bool) -> int:
    """The samples ``DistributedSampler`` deals each of ``replicas``: shares cut or padded to one length."""
    return samples // replicas if drop_last else math.ceil(samples / replicas)


def _distributed_sampler(loader: DataLoader) -> DistributedSampler | None:
    for sampler in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if isinstance(sampler, DistributedSampler):
            return sampler
    return None


@dataclass(frozen=True)
class DealtLoader:
    """What sets the number of batches a loader dealt by a ``DistributedSampler`` gives a replica."""

    samples: int
    batch_size: int
    sampler_drop_last: bool
    drop_last: bool

    @classmethod
    def of(cls, loader: DataLoader) -> DealtLoader | None:
        sampler = loader.sampler
        if not isinstance(sampler, DistributedSampler) or loader.batch_size is None:
            return None
        return cls(len(sampler.dataset), loader.batch_size, sampler.drop_last, loader.drop_last)

    def batches(self, replicas: int) -> int:
        share = share_length(self.samples, replicas, self.sampler_drop_last)
        return share // self.batch_size if self.drop_last else math.ceil(share / self.batch_size)


def batch_size_to_keep(loader: DataLoader) -> int | None:
    """The batch size :func:`rebatch` can change: None for a ``batch_sampler`` of the user's or
    an ``IterableDataset`` (which yields its own samples, without a sampler to re-shard)."""
    return None if isinstance(loader.dataset, IterableDataset) else loader.batch_size


def rebatch(loader: DataLoader, batch0: tuple[int | None, int], replicas: int) -> DataLoader:
    """The same loader with ``batch_size`` set so that ``batch_size * replicas`` stays the
    global batch the user chose (``batch0 = (batch_size, replicas)`` at the start)."""
    size0, replicas0 = batch0
    if replicas == replicas0:
        return loader
    if size0 is None or loader.batch_size is None:
        raise ValueError(
            "ElasticPipelineStrategy(keep_global_batch=True) needs a DataLoader with batch_size set "
            "(not a batch_sampler) to keep the global batch as replicas change; pass keep_global_batch=False."
        )
    if not global_batch_fits(batch0, replicas):
        raise ValueError(
            f"the global batch {size0 * replicas0} does not split over {replicas} replicas: choose a batch size "
            f"that {replicas} divides, or pass keep_global_batch=False."
        )
    size = size0 * replicas0 // replicas
    if loader.batch_size == size:
        return loader
    return like(loader, batch_size=size)


def keep_epoch_length(loader: DataLoader, batch0: tuple[int | None, int]) -> DataLoader:
    """``loader`` (re-batched for more replicas than ``batch0 = (batch_size, replicas)`` was for)
    with as many batches per epoch as on ``batch0``'s replicas.

    With ``drop_last=True``, Lightning's ``DistributedSampler`` (or the ``DistributedSamplerWrapper``
    it puts around a sampler of the user's) pads each replica's share by repeating samples, so more
    replicas can make one more global batch an epoch (39 samples, global batch 8: 4 batches on one
    replica, 5 on two). An LR schedule sized by ``trainer.estimated_stepping_batches`` at the start
    would then run past its end. Cutting the shares instead (the sampler's ``drop_last``) gives
    ``len(sampler.dataset) // global_batch`` batches on any number of replicas that divides the
    global batch, what padding gives on fewer."""
    size0, replicas0 = batch0
    sampler = loader.sampler
    if size0 is None or not loader.drop_last or not isinstance(sampler, DistributedSampler) or sampler.drop_last:
        return loader
    batches0 = math.ceil(len(sampler.dataset) / replicas0) // size0  # padded shares on batch0's replicas
    if len(loader) == batches0:
        return loader
    shorter = like(loader, sampler=cut_shares(sampler))
    return shorter if len(shorter) == batches0 else loader


def cut_shares(sampler: DistributedSampler) -> DistributedSampler:
    """A copy of ``sampler`` (its class, replicas, seed and what it wraps) whose shares are cut to
    one length rather than padded: what ``drop_last=True`` sets up in ``DistributedSampler``, whose
    ``__iter__`` deals the first ``total_size`` indices. A subclass is cut as far as it deals through
    these attributes; the share kept is the start of each padded share, in the same order."""
    return _dealing(sampler, sampler.num_replicas, sampler.rank, drop_last=True)


def _dealing(sampler: DistributedSampler, replicas: int, rank: int, drop_last: bool) -> DistributedSampler:
    """A copy of ``sampler`` (its class, seed and what it wraps) dealing to replica ``rank`` of
    ``replicas``, its shares cut (``drop_last``) or padded to one length, as its ``__init__`` sets up."""
    dealt = copy.copy(sampler)
    dealt.num_replicas, dealt.rank, dealt.drop_last = replicas, rank, drop_last
    dealt.num_samples = share_length(len(sampler.dataset), replicas, drop_last)
    dealt.total_size = dealt.num_samples * replicas
    return dealt


def like(
    loader: DataLoader, batch_size: int | None = None, sampler: Any = None, batch_sampler: Any = None
) -> DataLoader:
    """A loader like ``loader``, with another batch size, sampler or batch sampler: of its class and
    with its arguments (workers, collation, pinning, a subclass's own), built again as Lightning
    builds one to inject its distributed sampler."""
    try:
        args, kwargs = lightning_data._get_dataloader_init_args_and_kwargs(loader, sampler or loader.sampler)
    except (TypeError, MisconfigurationException) as error:  # a batch sampler Lightning cannot rebuild
        if type(loader) is not DataLoader:
            raise ValueError(
                f"ElasticPipelineStrategy cannot build the training {type(loader).__name__} again for another "
                f"number of replicas ({error}). Create it in the train_dataloader hook (Lightning then records its "
                f"arguments), or pass keep_global_batch=False and sampler='distributed'."
            ) from error
        args, kwargs = (), _plain_arguments(loader, sampler or loader.sampler)
    kwargs = dict(kwargs)  # a loader Lightning wrapped lends its saved arguments
    if batch_sampler is not None:  # exclusive with batch_size, shuffle, sampler and drop_last
        kwargs.update(sampler=None, shuffle=False, batch_size=1, drop_last=False)
        args, kwargs = _with_argument(loader, args, kwargs, "batch_sampler", batch_sampler)
    elif batch_size is not None:
        args, kwargs = _with_argument(loader, args, kwargs, "batch_size", batch_size)
    return fabric_data._reinstantiate_wrapped_cls(loader, *args, **kwargs)


def _with_argument(loader: DataLoader, args: tuple, kwargs: dict[str, Any], name: str, value: Any) -> tuple:
    """``args`` and ``kwargs`` (to build ``loader`` again) with argument ``name`` set to ``value``:
    where the user passed it by position, in its place."""
    names = getattr(loader, "__pl_saved_arg_names", ())
    if name in names:
        index = names.index(name)
        return args[:index] + (value,) + args[index + 1 :], kwargs
    return args, {**kwargs, name: value}


def shards_one_index_space(loader: DataLoader) -> bool:
    """Whether ``loader`` draws its indices through Lightning's distributed sampler (or the
    stable one that replaces it), which deals one data set's indices to the replicas: only then
    is an index the same sample on every rank, so that ranks may read each other's cached states.
    A sampler of the user's (``use_distributed_sampler=False``) may index a data set of the rank's own."""
    samplers = (loader.sampler, getattr(loader.batch_sampler, "sampler", None))
    return any(isinstance(s, (DistributedSampler, StableShardSampler)) for s in samplers)


def stable_shards(loader: DataLoader) -> DataLoader:
    """``loader`` with Lightning's ``DistributedSampler`` replaced by a :class:`StableShardSampler`
    of the same replicas, seed, shuffling and ``drop_last``; other samplers are kept."""
    sampler = loader.sampler
    if type(sampler) is not DistributedSampler or loader.batch_size is None:
        return loader
    stable = StableShardSampler(
        len(loader.dataset), sampler.num_replicas, sampler.rank, sampler.shuffle, sampler.seed, sampler.drop_last
    )
    return like(loader, sampler=stable)


def _plain_arguments(loader: DataLoader, sampler: Any) -> dict[str, Any]:
    """The arguments of a plain ``DataLoader`` like ``loader`` (batching, workers, collation, pinning)
    drawing from ``sampler``."""
    if loader.batch_size is None:
        kwargs: dict[str, Any] = {"batch_sampler": loader.batch_sampler}
    else:
        kwargs = {"batch_size": loader.batch_size, "sampler": sampler, "drop_last": loader.drop_last}
    kwargs.update(
        dataset=loader.dataset,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
        pin_memory_device=loader.pin_memory_device,
    )
    if loader.num_workers > 0:
        kwargs.update(
            multiprocessing_context=loader.multiprocessing_context,
            prefetch_factor=loader.prefetch_factor,
            persistent_workers=loader.persistent_workers,
        )
    return kwargs
