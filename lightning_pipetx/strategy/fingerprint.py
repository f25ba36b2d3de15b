"""Cheap fingerprints of a batch's inputs, computed where the batch lives (no host copy).

* :func:`sample_fingerprints`: one number per sample (AutoCache's input guard: a sample
  whose input changes between epochs must not be served from the cache);
* :func:`hidden_state_fingerprints`: one number per sample of a float hidden state (AutoCache's
  guard of what enters the frozen blocks);
* :func:`batch_fingerprint`: one number per (micro-)batch, order-sensitive (every stage of
  a replica must read the same batch).

A fingerprint mixes every tensor's values with position weights, and its shape, in
float64: equal inputs give equal fingerprints; different inputs give different ones
except by an unlikely coincidence. It is a check, not a cryptographic hash. A sample's
fingerprint is exact integer arithmetic (16-bit pieces of each value's bits, integer weights,
sums below 2**53), so it does not depend on the batch the sample is in: a matrix product
sums a row in an order that depends on the number of rows, which rounds the last bits of a
float sum differently.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from lightning_pipetx.strategy.microbatch import _tensors


@functools.lru_cache(maxsize=32)
def _weights(length: int, device: torch.device) -> torch.Tensor:
    return torch.linspace(1.0, 2.0, length, dtype=torch.float64, device=device)


_PIECE = 2**16  # values of a piece: 16 bits
_EXACT = 2**53  # float64 holds every integer below this


@functools.lru_cache(maxsize=32)
def _piece_weights(length: int, device: torch.device) -> torch.Tensor:
    """Integer weights in ``1..top``, drawn once (seeded) per position: ``top`` is small enough that a
    row's weighted sum of 16-bit pieces stays an exact float64 integer in any order of summation,
    and unordered weights leave no regular edit unseen (weights in a progression miss +1, -2, +1
    on three neighbouring values)."""
    top = max(1, min(_PIECE - 1, _EXACT // (_PIECE * max(1, length))))
    generator = torch.Generator().manual_seed(0)
    return torch.randint(1, top + 1, (length,), generator=generator).to(device, torch.float64)


def _pieces(tensor: torch.Tensor) -> torch.Tensor:
    """``[samples, ...]`` -> ``[samples, pieces]``: the bits of every value in 16-bit pieces, as
    integers (a view where the tensor is contiguous; bytes for 1-byte types)."""
    if tensor.dtype == torch.bool:
        tensor = tensor.to(torch.uint8)
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    flat = tensor.detach().reshape(tensor.shape[0], -1).contiguous()
    return flat.view(torch.uint8) if flat.element_size() == 1 else flat.view(torch.int16)


def sample_fingerprints(batch: Any, size: int, device: torch.device | None = None) -> torch.Tensor:
    """One float64 per sample, from every tensor of ``batch`` whose first dimension is ``size``;
    the same for a sample whatever else its batch holds.

    The result lives on ``device`` (default: the device of the batch's first tensor). The pieces
    are joined per kind first, so a batch costs a few operators, however many tensors it holds.
    """
    tensors = [t for t in _tensors(batch) if t.dim() > 0 and t.shape[0] == size]
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    result = torch.zeros(size, dtype=torch.float64, device=device)
    if not tensors:
        return result
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        pieces = _pieces(tensor)
        groups.setdefault((pieces.dtype, pieces.device), []).append(pieces)
    joined = [torch.cat(group, dim=1).to(device, torch.float64) for group in groups.values()]
    weights = _piece_weights(sum(j.shape[1] for j in joined), device)
    offset = 0
    for pieces in joined:  # every partial sum is an integer below 2**53: exact in any order
        result += pieces @ weights[offset : offset + pieces.shape[1]]
        offset += pieces.shape[1]
    # the widths, each weighted by its tensor's position: a change of shape changes the sum
    return result + sum((position + 1) * t[0].numel() for position, t in enumerate(tensors))


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
    """One float64 for the whole batch, sensitive to the order of its samples (a 0-dim tensor
    counts as one sample)."""
    tensors = [t if t.dim() > 0 else t.reshape(1) for t in _tensors(batch)]
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    result = torch.zeros((), dtype=torch.float64, device=device)
    for position, tensor in enumerate(tensors, start=1):  # two tensors that swap values differ
        size = tensor.shape[0]
        per_sample = sample_fingerprints(tensor, size, device)
        result += (per_sample @ _weights(size, device) + size) * position
    return result
