"""The engine's side of AutoCache, on the first stage: per step, record the inputs and serve
or fill the frozen prefix of each micro-batch."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_pipetx.autocache.cache import AutoCache
from lightning_pipetx.autocache.entries import EpochCounts
from lightning_pipetx.autocache.extra_outputs import ExtraOutputReads
from lightning_pipetx.autocache.random_streams import random_state_kept
from lightning_pipetx.strategy.fingerprint import hidden_state_fingerprints, sample_fingerprints
from lightning_pipetx.strategy.microbatch import _tensors, opaque_leaf, sample_shapes
from lightning_pipetx.strategy.p2p import Activation
from lightning_pipetx.strategy.stage_hooks import StageExit, StageHooks

log = logging.getLogger("lightning_pipetx")


class CachedPrefix:
    """Serves the frozen prefix of a stage's micro-batches from ``cache`` through ``hooks``."""

    def __init__(self, cache: AutoCache, hooks: StageHooks, device: torch.device) -> None:
        self.cache = cache
        self.hooks = hooks
        self.device = device
        self._unserved = False  # the micro-batch's states, looked up, were not served after all

    def begin_step(
        self, batch: Any, indices: torch.Tensor, sizes: list[int], depth: int
    ) -> Callable[[int], contextlib.AbstractContextManager] | None:
        """Record the batch's inputs; the per-micro-batch context when ``depth`` frozen blocks can be cached."""
        cache = self.cache
        cache.flush_writes()
        if cache.enabled:
            self._check_rows(batch, len(indices), sizes)
        self._observe_input(indices, batch)
        if depth == 0 or not cache.enabled:
            return None
        parts = torch.split(indices, sizes)
        return lambda position: self._microbatch(parts[position], depth)

    def end_step(self, upcoming: torch.Tensor | None, depth: int) -> None:
        """Start reading the next batch's states while this step's work finishes."""
        if upcoming is not None and depth > 0 and self.cache.enabled:
            self.cache.prefetch(upcoming, depth)

    def _check_rows(self, batch: Any, samples: int, sizes: list[int]) -> None:
        """Refuse a batch whose rows are not one per sample (the cache keys and fingerprints rows)."""
        firsts = {t.shape[0] for t in _tensors(batch) if t.dim() > 0}
        others = sorted(firsts - {samples})
        if not firsts:
            self._refuse(
                f"a batch of type {type(batch).__name__} holds no tensor with a batch dimension that the cache "
                f"can find (it reads the tensors of dicts, lists and tuples), so its rows cannot be matched with "
                f"the samples whose states are cached: give it tensors with one row per sample, in a dict, list "
                f"or tuple"
            )
        elif (opaque := opaque_leaf(batch)) is not None:
            self._refuse(
                f"a batch holds a {opaque}, whose tensors the cache cannot read (it reads the tensors of dicts, "
                f"lists and tuples), so a change to its inputs would not be found: put its tensors in a dict, "
                f"list or tuple"
            )
        elif others and samples in firsts:
            self._refuse(
                f"a batch of {samples} samples holds tensors whose first dimension is not that ({others}: a tensor "
                f"per batch, not per sample), which the cache cannot match with the samples whose states are cached"
            )
        elif sum(sizes) != samples or samples not in firsts:  # the micro-batches' rows are not the samples
            rows = next(iter(firsts)) if len(firsts) == 1 else sum(sizes)
            self._refuse(
                f"a batch of {rows} rows was made of {samples} samples (a collate_fn that drops or adds rows), "
                f"so its rows cannot be matched with the samples whose states are cached"
            )

    def _refuse(self, reason: str) -> None:
        """An error under ``cache=True``, else the cache off with a warning."""
        if self.cache.force:
            raise ValueError(f"ElasticPipelineStrategy(cache=True): {reason}. Pass cache=False (or cache='auto').")
        self.cache.disable(reason + ".")

    def _observe_input(self, indices: torch.Tensor, batch: Any) -> None:
        self.cache.guard.observe(indices, sample_fingerprints(batch, len(indices), self.device))

    def _observe_prefix_input(self, indices: torch.Tensor, hidden: torch.Tensor) -> None:
        if hidden.dim() == 0 or hidden.shape[0] != len(indices):  # not one row per sample
            return
        cache, shape = self.cache, tuple(hidden.shape[1:])
        if cache.prefix_input_shape is None:
            cache.prefix_input_shape = shape
        elif shape != cache.prefix_input_shape and cache.enabled:
            cache.disable(
                f"the hidden state entering block 0 has the per-sample shape {shape}, the run's first "
                f"{cache.prefix_input_shape}: a training_step that changes its batch's shape before the model call "
                f"(a sequence-length warm-up, a crop), or a model that trims its input by batch, so the cached "
                f"states, of the other shape, cannot stand for its frozen blocks. Keep that shape fixed to use the "
                f"cache, or pass cache=False."
            )
            self.hooks.skip_until = 0  # this micro-batch, looked up before, runs its frozen blocks too
            self._unserved = True
            return
        cache.prefix_guard.observe(indices, hidden_state_fingerprints(hidden, self.device))

    def fill(self, indices: torch.Tensor, depth: int, load: Callable[[], Any], run: Callable[[Any], Any]) -> None:
        """Cache the frozen prefix of samples that no batch of the epoch held (``drop_last``):
        ``load`` makes their batch and ``run`` calls the user's step on it, which stops after
        block ``depth - 1``. Without it each later batch holding one of them would run the
        frozen blocks again when the depth next grows."""
        cache = self.cache
        if depth == 0 or not (cache.enabled and cache.fills) or cache.cached_depth(indices, depth) == depth:
            return
        with random_state_kept(self.device):  # a plain run neither loads them nor runs them
            self._fill(indices, depth, load, run)

    def _fill(self, indices: torch.Tensor, depth: int, load: Callable[[], Any], run: Callable[[Any], Any]) -> None:
        cache = self.cache
        try:  # loading them may fail too (a dataset opened in the loader's workers only)
            batch = load()
            if sample_shapes(batch) != cache.input_shapes:
                return  # padded to another length than the run's batches: its states would not fit
            self._observe_input(indices, batch)
            with self._microbatch(indices, depth, stop_at_capture=True):
                run(batch)
        except StageExit:
            pass
        except Exception as error:  # a step that trains on full batches only: caching them is optional
            cache.fills = False
            log.warning(
                "pipetx: %s: loading the %d samples drop_last left out, or training_step on them, failed (%s: %s); "
                "they are not cached in this run, which trains as before",
                cache.label,
                len(indices),
                type(error).__name__,
                error,
            )
        finally:
            self.hooks.incoming = None

    @contextlib.contextmanager
    def _microbatch(self, indices: torch.Tensor, depth: int, stop_at_capture: bool = False) -> Iterator[None]:
        hooks, cache = self.hooks, self.cache
        hooks.on_prefix_input = lambda hidden: self._observe_prefix_input(indices, hidden)
        looked = EpochCounts()
        level, states, tuple_len = cache.lookup(indices, depth, looked)
        self._unserved = False
        if states is not None:
            hooks.incoming = Activation.of_hidden(states, tuple_len)
            hooks.skip_until = level
        timing: list[object | None] = [None]
        reads: list[ExtraOutputReads] = []

        def captured() -> None:
            cache.watch.stop("compute", timing[0], len(indices) * (depth - level))
            if stop_at_capture:
                raise StageExit(hooks.captured)
            if not reads and hooks.captured.extra_tensors and cache.extras_unread is None and hooks.is_last_stage:
                reads.append(ExtraOutputReads(hooks.captured.tensors[1:]))
                reads[0].start()

        hooks.on_uncacheable = self._refuse  # serving or capturing
        if level < depth:
            hooks.capture_at = depth - 1
            hooks.on_first_block = lambda: timing.__setitem__(0, cache.watch.start("compute"))
            hooks.on_capture = captured
        try:
            yield
            if reads:  # the forward ended here: whatever read the extra elements has run
                reads[0].stop()
                cache.extras_unread = not reads[0].read
        finally:
            for watch in reads:
                watch.stop()
            if not stop_at_capture:  # a training batch's lookup counts in the epoch's hit rate
                cache.counts.add(EpochCounts(lookups=looked.lookups) if self._unserved else looked)
            captured_state = hooks.captured
            hooks.skip_until, hooks.capture_at, hooks.captured = 0, -1, None
            hooks.on_first_block = hooks.on_capture = hooks.on_prefix_input = hooks.on_uncacheable = None
            if captured_state is not None and cache.enabled:
                cache.store(indices, depth, captured_state)
