"""AutoCache's measurements: seconds per sample to read each tier and to compute the prefix.

A few micro-batches per epoch are timed, with CUDA events on a GPU (read when the epoch
ends, long after they completed: no synchronisation on the training step) and with the
clock elsewhere. The median of each kind is kept.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator

import torch

TIMED_PER_EPOCH = 8  # windows of each kind per epoch
MIN_WINDOWS = 3  # before a verdict


class Stopwatch:
    """Per-sample read cost of each tier and per-sample, per-block cost of the frozen prefix."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pending: list[tuple[str, object, object, float]] = []
        self._taken: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, list[float]] = defaultdict(list)  # kind -> seconds per unit, resolved

    def _mark(self, stream: torch.cuda.Stream | None = None) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def start(self, kind: str, stream: torch.cuda.Stream | None = None) -> object | None:
        """A start mark, or None when this epoch's windows of ``kind`` are all taken."""
        if self._taken[kind] >= TIMED_PER_EPOCH:
            return None
        self._taken[kind] += 1
        return self._mark(stream)

    def stop(self, kind: str, begin: object | None, units: float, stream: torch.cuda.Stream | None = None) -> None:
        if begin is not None and units > 0:
            self._pending.append((kind, begin, self._mark(stream), units))

    @contextlib.contextmanager
    def reading(self, tier: str, samples: int, stream: torch.cuda.Stream | None = None) -> Iterator[None]:
        begin = self.start(tier, stream)
        yield
        self.stop(tier, begin, samples, stream)

    def _resolve(self) -> None:
        for kind, begin, end, units in self._pending:
            if self.cuda:
                end.synchronize()
                elapsed = begin.elapsed_time(end) / 1000
            else:
                elapsed = end - begin
            self.seconds[kind].append(elapsed / units)
        self._pending.clear()
        self._taken.clear()

    def per_unit(self, kind: str) -> float | None:
        values = self.seconds.get(kind, [])
        return statistics.median(values) if len(values) >= MIN_WINDOWS else None

    def slower_than_compute(self, depth: int) -> set[str]:
        """Tiers whose read costs more than computing ``depth`` frozen blocks (after enough windows)."""
        self._resolve()
        per_block = self.per_unit("compute")
        if per_block is None or depth == 0:
            return set()
        return {
            kind
            for kind in self.seconds
            if kind != "compute" and (read := self.per_unit(kind)) is not None and read > per_block * depth
        }

    def explain(self, tier: str) -> str:
        read, per_block = self.per_unit(tier), self.per_unit("compute")
        return (
            f"reading a sample's state costs {read * 1e6:.1f} us, more than computing a frozen block "
            f"({per_block * 1e6:.1f} us per sample) times the frozen depth"
        )
