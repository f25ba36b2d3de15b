"""The loaders' side of AutoCache: which samples each batch holds, and the caches they open.

The training loader and the validation loader run during fit are recorded (their batch
samplers tell the dataset indices of each batch, :mod:`.sample_keys`); the first recorded
loader of each kind opens its cache; each step then takes the keys of its batch and of the
next one (which the cache prefetches).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_pipetx.autocache.cache import AutoCache
from lightning_pipetx.autocache.control import CacheControl, CacheSite
from lightning_pipetx.autocache.random_streams import generators_kept
from lightning_pipetx.autocache.sample_keys import RecordingBatchSampler, ValidationKeys, recording

Keys = tuple[torch.Tensor | None, torch.Tensor | None]

SEVERAL_LOADERS = (
    "the fit trains from several DataLoaders (train_dataloader() returned a list or dict of them, or a "
    "CombinedLoader): AutoCache keys the batches of one loader, and one that restarts within an epoch "
    "(max_size_cycle) would name the wrong samples"
)


def _rebuilt(kind: str, hook: str) -> str:
    """Why a ``kind`` loader rebuilt over another dataset object cannot keep the cache."""
    return (
        f"the {kind} loader was rebuilt over another dataset object, whose indices may name other samples "
        f"than the cached states; return the same dataset object from {hook}() to keep the cache"
    )


def _resized(kind: str, cached_samples: int, dataset: Any) -> str | None:
    """Why the ``kind`` dataset's indices may no longer name the cached samples (None: its length is kept)."""
    if len(dataset) == cached_samples:
        return None
    return (
        f"the {kind} dataset changed its length between epochs ({cached_samples} -> {len(dataset)} samples): "
        f"its indices may name other samples than the cached states; keep its length fixed to keep the cache"
    )


def _has_len(dataset: Any) -> bool:
    try:
        len(dataset)
    except TypeError:
        return False
    return True


def _not_a_position(kind: str, keys: list[Any], samples: int) -> str | None:
    """Why a ``kind`` batch's dataset ``keys`` cannot name cached states (None: each is a position
    ``0 <= key < samples``, as the cache keeps one state per position)."""
    for key in keys:
        if not (isinstance(key, numbers.Integral) and 0 <= key < samples):
            return (
                f"the {kind} loader's sampler yields {key!r}, which is not a position 0-{samples - 1} of its dataset "
                f"of {samples} samples (a dataset keyed by ids, or one that grew since the cache opened): the cache "
                f"keeps one state per position"
            )
    return None


def _out_of_order(kind: str, loader: DataLoader) -> str | None:
    """Why ``loader``'s batches may reach the step in another order than its sampler drew them
    (None: in order, as the cache names each batch's samples by that order)."""
    if getattr(loader, "in_order", True) or loader.num_workers == 0:
        return None
    return (
        f"the {kind} loader yields its batches as its workers finish them (DataLoader(in_order=False)), not in "
        f"the order its sampler drew them, by which the cache names each batch's samples"
    )


IN_ORDER_FIX = "Leave the DataLoader's in_order=True (the default), or pass cache=False."


def _as_tensors(current: list[int] | None, after: list[int] | None) -> Keys:
    return tuple(None if i is None else torch.tensor(i, dtype=torch.long) for i in (current, after))


class CacheFeed:
    """Records the training loader and the validation loader of a fit for ``control``'s caches,
    and hands each step its keys. A loader over an iterable dataset, or one without a length, is not cached, nor
    a fit that trains from several loaders (Lightning builds them all before a step)."""

    def __init__(self, control: CacheControl) -> None:
        self.control = control
        self._training: RecordingBatchSampler | None = None
        self._training_dataset: Any = None
        self._collate: Any = None  # the training loader's collate_fn
        self._validation = ValidationKeys()
        self._built: list[DataLoader] = []  # the training loaders built since the last training step
        self._several = False  # the fit trains from several loaders: none is recorded

    def _cacheable(self, loader: DataLoader) -> bool:
        # batch_sampler None: the loader yields the dataset's items unbatched (no indices to record);
        # an IterableDataset's sampler yields no indices, whether or not it has a length
        dataset = loader.dataset
        indexed = not isinstance(dataset, IterableDataset) and _has_len(dataset)
        return self.control.mode is not False and loader.batch_sampler is not None and indexed

    def training_loader(self, loader: DataLoader, site: CacheSite) -> tuple[DataLoader, AutoCache | None]:
        """``loader``, recording its batches; and the training cache if this call opened it."""
        if all(loader is not built for built in self._built):  # Lightning builds all of them before a step
            self._built.append(loader)
        if len(self._built) > 1 and self.control.mode is not False:
            self._several, self._training = True, None
            self.control.refuse(SEVERAL_LOADERS, ValueError, "Train from one DataLoader, or pass cache=False.")
        if self._several or not self._cacheable(loader):
            return loader, None
        if (reason := _out_of_order("training", loader)) is not None:
            self._training = None
            self.control.refuse(reason, ValueError, IN_ORDER_FIX)
            return loader, None
        cache = self.control.cache
        if cache is not None:
            reason = self._reload_refusal(loader.dataset, cache.num_samples)
            if reason is not None:
                cache.disable(reason)
            if not cache.enabled:  # it never serves again: no keys to record
                self._training = None
                return loader, None
        loader, self._training = recording(loader)
        self._collate = loader.collate_fn
        if cache is not None:
            return loader, None
        self._training_dataset = loader.dataset
        size = len(loader.dataset)
        return loader, self.control.open(site, size)

    def validation_loader(self, loader: DataLoader, site: CacheSite) -> DataLoader:
        """``loader``, recording its batches if it is the recorded one (the first, or a reload of it)."""
        if not self._cacheable(loader):
            return loader
        loader = self._validation.record(loader)
        if self._validation.dataset is loader.dataset:
            size = len(loader.dataset)
            self.control.open_eval(site, size)
            if (reason := _out_of_order("validation", loader)) is not None:
                self.control.refuse_validation(f"{reason}. {IN_ORDER_FIX}")
        return loader

    def _reload_refusal(self, dataset: Any, cached_samples: int) -> str | None:
        """Why a reloaded training loader's indices may not name the cached samples (None: they do)."""
        reason = _rebuilt("training", "train_dataloader") if dataset is not self._training_dataset else None
        reason = reason or _resized("training", cached_samples, dataset)
        return None if reason is None else reason + "."

    def user_reloaded(self, loop: str) -> None:
        """The hook of ``loop`` (``"train"`` or ``"val"``) built its loaders again: the cache of that
        kind serves again only once it compared the inputs loaded since with the earlier ones."""
        cache = self.control.cache if loop == "train" else self.control.eval_cache
        if cache is not None and cache.enabled:
            cache.reloaded()

    def loaders_reloaded(self) -> None:
        """The loaders built so far are to be built again (a transition): the next build is a
        reload of the recorded loader, not a second loader, even before a training step ran (a
        transition at the start of a resumed fit)."""
        self._built.clear()

    def training_keys(self) -> Keys:
        """The dataset indices of this training batch and of the next one (None: not recorded)."""
        self._built.clear()
        if self._training is None:
            return None, None
        current, after = self._training.pop()
        if self._refused_keys((current or []) + (after or [])):
            return None, None
        return _as_tensors(current, after)

    def _refused_keys(self, keys: list[Any]) -> bool:
        """Refuse the training cache where ``keys`` are not positions of the cached samples."""
        cache = self.control.cache
        reason = None if cache is None else _not_a_position("training", keys, cache.num_samples)
        if reason is not None:
            self._training = None
            self.control.refuse(
                reason, ValueError, "Index its dataset by position (0 to len - 1), or pass cache=False."
            )
        return reason is not None

    def dropped_samples(self) -> tuple[torch.Tensor, Callable[[], Any]] | None:
        """After the epoch's last training batch: the dataset indices of the samples ``drop_last``
        left out of the epoch, and a function that loads them as one batch (the training
        loader's ``collate_fn``); None when there are none."""
        dropped = self._training.take_dropped() if self._training is not None else []
        if not dropped or self._refused_keys(dropped):
            return None
        dataset, collate = self._training_dataset, self._collate

        def load() -> Any:
            with generators_kept(dataset, collate):  # a plain run never loads them: its draws are as without
                return collate([dataset[i] for i in dropped])

        return torch.tensor(dropped, dtype=torch.long), load

    def begin_validation(self, loaders: Any, world_size: int) -> None:
        """Before a validation run in fit (a collective where the validation cache exists). A
        recorded loader rebuilt over another dataset, or its dataset resized, switches the
        validation cache off: it is freed."""
        cache = self.control.eval_cache
        if cache is not None:
            if not self._validation.locate(loaders):
                self.control.refuse_validation(_rebuilt("validation", "val_dataloader"))
            elif (resized := _resized("validation", cache.num_samples, self._validation.dataset)) is not None:
                self.control.refuse_validation(resized)
            self.control.begin_validation(world_size)

    def validation_keys(self, step_args: tuple) -> tuple[AutoCache | None, torch.Tensor | None, torch.Tensor | None]:
        """For a validation step: the cache serving it (None: not served), and the dataset indices
        of its batch and of the next one."""
        current, after = self._validation.pop(step_args)
        eval_cache = self.control.eval_cache
        if current is not None and eval_cache is not None:
            reason = _not_a_position("validation", current + (after or []), eval_cache.num_samples)
            if reason is not None:
                self.control.refuse_validation(reason)
                return None, None, None
        cache = self.control.serving_eval() if current is not None else None
        return (cache, *_as_tensors(current, after))

    @property
    def open(self) -> bool:
        """A cache, or a refusal of one, to be closed when the fit ends."""
        return self.control.cache is not None or self.control.eval_cache is not None or self.control.refused

    def close(self, remove_files: bool) -> None:
        """Close both caches (``remove_files``: one rank per node) and forget the loaders."""
        self.control.close(remove_files)
        self._training = self._training_dataset = self._collate = None
        self._built, self._several = [], False
        self._validation.reset()
