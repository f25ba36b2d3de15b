"""Callables the strategy installs on a user's modules (a block's ``forward``, hooks),
which a deep copy of the module leaves behind.

A script may copy or save its model during fit (``copy.deepcopy(self.model)`` in ``on_fit_start``,
for an EMA or a reference model; ``torch.save(self.model)``). Without this, the copy would carry the
strategy's callables, whose state (process groups) cannot be copied or pickled, and whose
``forward`` would run the original module.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any


class InstalledForward:
    """``function(*args, ...)`` installed in place of a module's ``original`` method; a deep copy of
    the module gets ``original`` back, bound to the copy."""

    def __init__(self, original: Callable[..., Any], function: Callable[..., Any], *args: Any) -> None:
        self.original = original
        self._call = functools.partial(function, *args)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., Any]:
        return copy.deepcopy(self.original, memo)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return _same, (self.original,)


class InstalledHook:
    """A hook of the strategy's (forward, forward pre-, ``state_dict`` post-); a deep copy of its
    module gets one that does nothing."""

    def __init__(self, hook: Callable[..., Any]) -> None:
        self._hook = hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._hook(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., Any]:
        return _no_change

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return _same, (_no_change,)


def _same(value: Any) -> Any:
    return value


def _no_change(*args: Any, **kwargs: Any) -> None:
    """A hook that leaves the call as it is."""
    return None
