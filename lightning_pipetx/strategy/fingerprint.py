"""Cheap fingerprints of a batch's inputs, computed where the batch lives (no host copy).

* :func:`sample_fingerprints`: one number per sample (AutoCache's input guard: a sample
  whose input changes between epochs must not be served from the cache);
* :func:`hidden_state_fingerprints`: one number per sample of a float hidden state (AutoCache's
  guard of what enters the frozen blocks);
* :func:`batch_fingerprint`: one number per (micro-)batch, order-sensitive (every stage of
  a replica must read the same batch).

A fingerprint mixes every tensor's values with position weights, and its shape, in
float64: equal inputs give equal fingerprints; different inputs give different ones
except by an unlikely coincidence. It is a check, not a cryptographic hash.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from lightning_pipetx.strategy.microbatch import _tensors


@functools.lru_cache(maxsize=32)
def _weights(length: int, device: torch.device) -> torch.Tensor:
    return torch.linspace(1.0, 2.0, length, dtype=torch.float64, device=device)


def sample_fingerprints(batch: Any, size: int, device: torch.device | None = None) -> torch.Tensor:
    """One float64 per sample, from every tensor of ``batch`` whose first dimension is ``size``.

    The result lives on ``device`` (default: the device of the batch's first tensor). The
    tensors are joined per sample first (one join per dtype), so a batch costs a few operators,
    however many tensors it holds.
    """
    tensors = [t.detach().reshape(size, -1) for t in _tensors(batch) if t.dim() > 0 and t.shape[0] == size]
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    if not tensors:
        return torch.zeros(size, dtype=torch.float64, device=device)
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    flat = torch.cat([torch.cat(group, dim=1).to(device, torch.float64) for group in groups.values()], dim=1)
    # the widths, each weighted by its tensor's position: a change of shape changes the sum
    shape_term = sum((position + 1) * t.shape[1] for position, t in enumerate(tensors))
    return flat @ _weights(flat.shape[1], device) + shape_term


@functools.lru_cache(maxsize=8)
def _scattered_weights(length: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return (1.0 + torch.rand(length, generator=generator, dtype=torch.float64)).to(device)


def hidden_state_fingerprints(hidden: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One float64 per sample of a hidden state ``[samples, ...]``, on ``device``. Its weights are
    scattered: a normalised state's rows have zero mean, which the smooth weights of
    :func:`sample_fingerprints` cancel, hiding a changed token."""
    flat = hidden.detach().reshape(hidden.shape[0], -1).to(device, torch.float64)
    return flat @ _scattered_weights(flat.shape[1], device) + flat.shape[1]


def batch_fingerprint(batch: Any, device: torch.device | None = None) -> torch.Tensor:
    """One float64 for the whole batch, sensitive to the order of its samples."""
    tensors = [t for t in _tensors(batch) if t.dim() > 0]
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    result = torch.zeros((), dtype=torch.float64, device=device)
    for tensor in tensors:
        size = tensor.shape[0]
        per_sample = sample_fingerprints(tensor, size, device)
        result += per_sample @ _weights(size, device) + size
    return result
