"""Running what a plain run does not run (AutoCache's ``drop_last`` fill loads samples no batch
held and calls the user's step on them) without drawing from a random stream that training reads
later: the global streams of torch, Python and NumPy, and the generators a dataset or a
``collate_fn`` keeps."""

from __future__ import annotations

import contextlib
import functools
import random
import types
from collections.abc import Iterator
from typing import Any

import numpy
import torch

from lightning_pipetx.strategy.stage_streams import process_random_states, set_process_random_states

_GENERATORS = (torch.Generator, random.Random, numpy.random.Generator, numpy.random.RandomState)
_LARGEST_CONTAINER = 32  # a dataset's sample lists and vocabularies are not searched


@contextlib.contextmanager
def random_state_kept(device: torch.device) -> Iterator[None]:
    """Leave torch's (the CPU's and ``device``'s), Python's and NumPy's global random streams as they were."""
    states = process_random_states(device)
    try:
        yield
    finally:
        set_process_random_states(states, device)


@contextlib.contextmanager
def generators_kept(*owners: Any, depth: int = 3) -> Iterator[None]:
    """Leave the random generators ``owners`` hold (``self.rng`` of a dataset, a ``collate_fn``'s,
    and those of the objects they hold, ``depth`` attributes deep) as they were."""
    seen: set[int] = set()
    found = [generator for owner in owners for generator in _generators(owner, depth, seen)]
    states = [_state(generator) for generator in found]
    try:
        yield
    finally:
        for generator, state in zip(found, states):
            _set_state(generator, state)


def _generators(obj: Any, depth: int, seen: set[int]) -> list[Any]:
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, random.SystemRandom):  # the system's entropy: no state, and nothing reproducible
        return []
    if isinstance(obj, _GENERATORS):
        return [obj]
    if depth == 0 or isinstance(obj, (torch.Tensor, type, str, bytes, types.ModuleType)):
        return []
    if isinstance(obj, types.FunctionType):  # a collate_fn: what it closes over, and the globals it names
        children = [_contents(cell) for cell in obj.__closure__ or ()]
        children += [obj.__globals__[name] for name in obj.__code__.co_names if name in obj.__globals__]
    elif isinstance(obj, types.MethodType):
        children = [obj.__self__]
    elif isinstance(obj, functools.partial):
        children = [obj.func, *obj.args, *obj.keywords.values()]
    elif isinstance(obj, dict):
        children = list(obj.values()) if len(obj) <= _LARGEST_CONTAINER else []
    elif isinstance(obj, (list, tuple)):
        children = list(obj) if len(obj) <= _LARGEST_CONTAINER else []
    else:
        children = list(getattr(obj, "__dict__", {}).values())
    return [generator for child in children for generator in _generators(child, depth - 1, seen)]


def _contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a closure variable not yet assigned
        return None


def _state(generator: Any) -> Any:
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    if isinstance(generator, random.Random):
        return generator.getstate()
    if isinstance(generator, numpy.random.Generator):
        return generator.bit_generator.state
    return generator.get_state()


def _set_state(generator: Any, state: Any) -> None:
    if isinstance(generator, torch.Generator):
        generator.set_state(state)
    elif isinstance(generator, random.Random):
        generator.setstate(state)
    elif isinstance(generator, numpy.random.Generator):
        generator.bit_generator.state = state
    else:
        generator.set_state(state)
