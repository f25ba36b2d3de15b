"""A random stream of its own for each pipeline stage's blocks, in training forwards.

Every rank starts from the same seed (``seed_everything``; unseeded, the strategy gives every
rank global rank 0's random states: :func:`start_unseeded_ranks_alike`). Under a pipeline
each stage draws dropout and drop-path masks for its own blocks, and stages that draw alike (GPT-2's
stage 1 runs the embeddings' dropout and then two blocks, as stage 0 does) would draw the same
masks: block 2 would drop what block 0 dropped, for every micro-batch. :class:`StageStream` gives
stage ``s``, from its first block to the end of each micro-batch's forward, torch's streams
seeded from the run's seed, ``s`` and the step the layout began at, and leaves the process's own
streams as they were. The last stage alone runs the step's code after the model call: it swaps in
Python's and NumPy's streams of its own too, so that draws there leave the process's alike. What
a step draws before the stage's first block (Mixup, masking tokens, the embeddings' dropout) comes
from the process's streams, which every stage of a replica runs alike: the first stage's inputs
and the last stage's targets are mixed alike. What the loaders and
callbacks draw stays alike on every rank. Replicas of a stage draw alike, as DDP's replicas do;
one stage (1xN) keeps the process's streams, so 1xN draws what DDP draws.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

_MASK = (1 << 63) - 1

log = logging.getLogger("lightning_pipetx")


def start_unseeded_ranks_alike(broadcast: Callable[[Any], Any], is_global_zero: bool, device: torch.device) -> bool:
    """In a run no ``seed_everything`` seeded, set every rank's random states (torch's on the CPU
    and on ``device``, Python's, NumPy's) to global rank 0's (``broadcast`` from it, a collective):
    a replica's stages must draw the same random augmentation, and seed their loader workers alike.
    Whether it did."""
    mine = process_random_states(device) if is_global_zero and "PL_GLOBAL_SEED" not in os.environ else None
    states = broadcast(mine)
    if states is None:
        return False
    set_process_random_states(states, device)
    if is_global_zero:
        log.info("pipetx: the run is not seeded (seed_everything): every rank starts from rank 0's random states")
    return True


def process_random_states(device: torch.device, host: bool = True) -> tuple[Any, ...]:
    """The process's random states: torch's on the CPU and on ``device``; with ``host``, Python's
    and NumPy's too."""
    backend = device_module(device)
    on_device = None if backend is None else backend.get_rng_state(device)
    torch_states = (torch.get_rng_state(), on_device)
    return (*torch_states, random.getstate(), np.random.get_state(legacy=False)) if host else torch_states


def set_process_random_states(states: tuple[Any, ...], device: torch.device) -> None:
    """Set the states :func:`process_random_states` returned (Python's and NumPy's where it read them)."""
    cpu, on_device, *host = states
    torch.set_rng_state(cpu)
    backend = device_module(device)
    if backend is not None:
        backend.set_rng_state(on_device, device)
    if host:
        python, numpy_state = host
        random.setstate(python)
        np.random.set_state(numpy_state)


def device_module(device: torch.device) -> Any:
    """torch's module that keeps ``device``'s random state (``torch.cuda``); None for the CPU."""
    return None if device.type == "cpu" else torch.get_device_module(device.type)


def stage_seed(base: int, stage: int, step: int) -> int:
    """A seed for ``stage`` of a layout that began at training step ``step`` of a run seeded ``base``."""
    return (base * 6364136223846793005 + (stage + 1) * 1442695040888963407 + step * 2862933555777941757) & _MASK


class StageStream:
    """One stage's random states, swapped in from its first block: torch's on the CPU and
    ``device``; on the last stage (``host_streams``), where the step's code after the model call
    runs, Python's and NumPy's too."""

    def __init__(self, seed: int, device: torch.device, host_streams: bool) -> None:
        backend = device_module(device)
        self._device = device
        self._host_streams = host_streams
        on_device = None
        if backend is not None:  # seeded as the process's own, then put back: one state format
            current = getattr(backend, "device", None)  # a context that makes ``device`` current
            with contextlib.nullcontext() if current is None else current(device):
                saved = backend.get_rng_state(device)
                backend.manual_seed(seed)  # seeds the current device
                on_device = backend.get_rng_state(device)
                backend.set_rng_state(saved, device)
        self._states: tuple[Any, ...] = (torch.Generator().manual_seed(seed).get_state(), on_device)
        if host_streams:  # NumPy's in the format of the bit generator its global functions use
            numpy_state = np.random.RandomState(type(np.random.get_bit_generator())(seed)).get_state(legacy=False)
            self._states += (random.Random(seed).getstate(), numpy_state)

    @contextlib.contextmanager
    def from_first_block(self, arm: Callable[[Callable[[], None] | None], None]) -> Iterator[None]:
        """Inside, draw from the process's streams until ``arm``'s callback runs (the stage's first
        block, through :class:`~lightning_pipetx.strategy.stage_hooks.StageHooks`), from this
        stage's streams after it; the process's streams continue where they were left."""
        saved: list[tuple[Any, ...]] = []

        def enter() -> None:
            if not saved:
                saved.append(self._swap(self._states))

        arm(enter)
        try:
            yield
        finally:
            arm(None)
            if saved:
                self._states = self._swap(saved[0])

    def _swap(self, states: tuple[Any, ...]) -> tuple[Any, ...]:
        """Set ``states``; return those they replaced."""
        replaced = process_random_states(self._device, host=self._host_streams)
        set_process_random_states(states, self._device)
        return replaced
