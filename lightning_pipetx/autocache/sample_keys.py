"""The keys of AutoCache: the dataset indices of each training (and validation) batch, and of
the one after it.

The loader's batch sampler is wrapped so that it records what it yields, and the batch after it
(AutoCache reads the next batch's states while the current one trains), and the samples a
``drop_last`` batch sampler leaves out of the epoch (AutoCache caches them too, so that they do
not keep the next epoch's batches that hold them from being served).

The wrapper draws nothing from a random stream that a plain run would not draw, nor at another
time: a sampler may draw as it goes (from the global stream, between the steps' dropout masks),
and torch's ``RandomSampler`` draws from its generator (the user's, shared by the epochs) once
more when exhausted. So it samples ahead, and reads the samples ``drop_last`` leaves out, only
for torch's ``BatchSampler`` over a sampler that draws its whole order up front, and never past
the epoch's last batch; otherwise the next batch is known only where the loader fetched it
early (worker processes).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from typing import Any

from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from lightning_pipetx.strategy.shard_sampler import StableShardSampler

# Lightning's wrapper lists the user's sampler when an epoch's iteration starts, as a plain run does.
_UP_FRONT = (
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    DistributedSampler,
    DistributedSamplerWrapper,
    StableShardSampler,
)


class RecordingBatchSampler:
    """Wraps a batch sampler and remembers the dataset indices of every batch it yields, and
    of the one after (sampled one batch early where that draws nothing, so that AutoCache can
    read it ahead).

    Batches reach the training step in the order they were sampled, also with worker
    processes and prefetching, so the step pops its batch's indices from :attr:`yielded`.
    """

    def __init__(self, batch_sampler: Any) -> None:
        self.batch_sampler = batch_sampler
        self.sampler = getattr(batch_sampler, "sampler", None)  # Lightning calls set_epoch on it
        self.yielded: deque[list[int]] = deque()
        self.ahead: list[int] | None = None  # the batch after the last one yielded
        self.dropped: list[int] = []  # the epoch's samples ``drop_last`` left out, once sampled
        self._last_yielded = False  # the epoch's last batch was yielded
        self._drawn_up_front = type(batch_sampler) is BatchSampler and draws_up_front(batch_sampler.sampler)

    def __iter__(self) -> Iterator[list[int]]:
        self.yielded.clear()
        self.dropped, self.ahead, self._last_yielded = [], None, False
        if not self._drawn_up_front:
            for batch in self.batch_sampler:
                current = list(batch)
                self.yielded.append(current)
                yield current
            return
        batches, left = self._batches(), len(self.batch_sampler)
        ahead = next(batches, None) if left else None
        while ahead is not None:
            current, left = list(ahead), left - 1
            ahead = next(batches, None) if left else None  # never past the epoch's last batch
            self.ahead = None if ahead is None else list(ahead)
            self.yielded.append(current)
            self._last_yielded = not left
            if self._last_yielded and self._runs_out_with_last():
                next(batches, None)  # torch's BatchSampler runs its sampler out to cut a short last batch
            yield current
        for _ in batches:  # asked past the last batch (a loader's workers ask ahead)
            pass

    def _runs_out_with_last(self) -> bool:
        sampler = self.batch_sampler
        return not sampler.drop_last and len(sampler.sampler) % sampler.batch_size != 0

    def _batches(self) -> Iterator[list[int]]:
        """The batches of torch's ``BatchSampler``, made here as it makes them (one pass over its
        sampler, cut in ``batch_size``) without running the sampler out (``RandomSampler`` then
        draws once more), the cut-off tail of ``drop_last`` read with the last batch (already drawn:
        reading it draws nothing). Asked for more, it runs its sampler out, as torch's does (see
        :meth:`__iter__` for when)."""
        sampler = self.batch_sampler
        size, count, total = sampler.batch_size, len(sampler), len(sampler.sampler)
        samples = iter(sampler.sampler)
        for number in range(count):
            batch = list(itertools.islice(samples, min(size, total - number * size)))
            if sampler.drop_last and number == count - 1:
                self.dropped = list(itertools.islice(samples, total - count * size))
            yield batch
        for _ in samples:
            pass

    def pop(self) -> tuple[list[int] | None, list[int] | None]:
        """The indices of the batch now trained, and of the one after it (None: unknown or none)."""
        if not self.yielded:
            return None, None
        current = self.yielded.popleft()
        return current, self.yielded[0] if self.yielded else self.ahead

    def take_dropped(self) -> list[int]:
        """Once the epoch's last batch is popped, the samples ``drop_last`` left out of it (once)."""
        if self.yielded or not self._last_yielded:
            return []
        dropped, self.dropped = self.dropped, []
        return dropped

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __getattr__(self, name: str) -> Any:
        """The wrapped batch sampler's attributes (``set_epoch``, ``batch_size``) read through the wrapper."""
        if name == "batch_sampler":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)


def draws_up_front(sampler: Any) -> bool:
    """Whether ``sampler`` draws no random number after its first index until it is run out
    (torch's samplers draw their whole order at once; ``RandomSampler`` draws again past
    ``len(data_source)`` samples, or with replacement as it goes)."""
    if type(sampler) is RandomSampler:
        return not sampler.replacement and sampler.num_samples == len(sampler.data_source)
    return type(sampler) in _UP_FRONT


def recording(loader: DataLoader) -> tuple[DataLoader, RecordingBatchSampler]:
    """The same loader, its batch sampler now recording indices.

    DataLoader forbids setting ``batch_sampler`` after construction; it is swapped in
    place anyway so that the loader keeps every attribute (``batch_size`` included) the
    user and Lightning see.
    """
    if isinstance(loader.batch_sampler, RecordingBatchSampler):  # a loader Lightning handed back unchanged
        return loader, loader.batch_sampler
    batch_sampler = RecordingBatchSampler(loader.batch_sampler)
    object.__setattr__(loader, "batch_sampler", batch_sampler)
    return loader, batch_sampler


class ValidationKeys:
    """The keys of AutoCache's validation cache: the dataset indices of each batch of the
    validation loader run during fit.

    One loader is recorded: the first the strategy processes, and later loaders over the same
    dataset object (a reload); the others are left as they are. A validation step belongs to
    the recorded loader when its ``dataloader_idx`` is that loader's position among the loaders
    of the run (found by :meth:`locate` when validation starts). A reload over another dataset
    object replaces the recorded loader with one whose indices are not recorded.
    """

    def __init__(self) -> None:
        self.dataset: Any = None
        self._recorder: RecordingBatchSampler | None = None
        self._position: int | None = None

    def record(self, loader: DataLoader) -> DataLoader:
        """``loader``, recording its indices if it is (a reload of) the recorded loader."""
        if self.dataset is not None and loader.dataset is not self.dataset:
            return loader
        loader, self._recorder = recording(loader)
        self.dataset = loader.dataset
        return loader

    def locate(self, loaders: Any) -> bool:
        """Find the recorded loader among the run's validation ``loaders`` (``trainer.val_dataloaders``);
        False where one was recorded and is gone (rebuilt over another dataset object)."""
        flat = CombinedLoader(loaders).flattened if loaders is not None else []
        self._position = next(
            (
                i
                for i, dl in enumerate(flat)
                if self._recorder is not None and getattr(dl, "batch_sampler", None) is self._recorder
            ),
            None,
        )
        return self._recorder is None or self._position is not None

    def pop(self, step_args: tuple) -> tuple[list[int] | None, list[int] | None]:
        """The indices of this validation step's batch and of the next one (None: not recorded)."""
        position = step_args[2] if len(step_args) > 2 else 0  # (batch, batch_idx[, dataloader_idx])
        if self._recorder is None or position != self._position:
            return None, None
        return self._recorder.pop()

    def reset(self) -> None:
        self.dataset, self._recorder, self._position = None, None, None
