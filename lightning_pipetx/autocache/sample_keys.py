"""The keys of AutoCache: the dataset indices of each training (and validation) batch, and of
the one after it.

The loader's batch sampler is wrapped so that it records what it yields, one batch ahead
(AutoCache reads the next batch's states while the current one trains), and the samples a
``drop_last`` batch sampler leaves out of the epoch (AutoCache caches them too, so that they do
not keep the next epoch's batches that hold them from being served).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from typing import Any

from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import BatchSampler, DataLoader


class RecordingBatchSampler:
    """Wraps a batch sampler and remembers the dataset indices of every batch it yields, and
    of the one after (sampled one batch early, so that AutoCache can read it ahead).

    Batches reach the training step in the order they were sampled, also with worker
    processes and prefetching, so the step pops its batch's indices from :attr:`yielded`.
    """

    def __init__(self, batch_sampler: Any) -> None:
        self.batch_sampler = batch_sampler
        self.sampler = getattr(batch_sampler, "sampler", None)  # Lightning calls set_epoch on it
        self.yielded: deque[list[int]] = deque()
        self.ahead: list[int] | None = None  # the batch after the last one yielded
        self.dropped: list[int] = []  # the epoch's samples ``drop_last`` left out, once sampled

    def __iter__(self) -> Iterator[list[int]]:
        self.yielded.clear()
        self.dropped = []
        batches = self._batches()
        ahead = next(batches, None)
        while ahead is not None:
            current = list(ahead)
            ahead = next(batches, None)
            self.ahead = None if ahead is None else list(ahead)
            self.yielded.append(current)
            yield current

    def _batches(self) -> Iterator[list[int]]:
        """The batch sampler's batches; for torch's ``BatchSampler(drop_last=True)`` made here, as it
        makes them (one pass over its sampler, cut in ``batch_size``), keeping the cut-off tail."""
        sampler = self.batch_sampler
        if type(sampler) is not BatchSampler or not sampler.drop_last:
            yield from sampler
            return
        samples = iter(sampler.sampler)
        while batch := list(itertools.islice(samples, sampler.batch_size)):
            if len(batch) < sampler.batch_size:
                self.dropped = batch
                return
            yield batch

    def pop(self) -> tuple[list[int] | None, list[int] | None]:
        """The indices of the batch now trained, and of the one after it (None: unknown or none)."""
        if not self.yielded:
            return None, None
        current = self.yielded.popleft()
        return current, self.yielded[0] if self.yielded else self.ahead

    def take_dropped(self) -> list[int]:
        """Once the epoch's last batch is popped, the samples ``drop_last`` left out of it (once)."""
        if self.yielded:
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
