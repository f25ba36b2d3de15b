"""AutoCache's guard of the frozen prefix's weights.

A state cached at a depth stands for ``pre`` and the frozen blocks as they were when it was
computed. Code that changes their weights or buffers afterwards outdates every state: Lightning's
``ModelPruning`` pruning a frozen block (it re-registers ``weight`` as ``weight_orig`` and adds a
``weight_mask`` buffer, then changes the mask), a callback or hook writing to a frozen weight, a
block whose forward updates a buffer its output depends on (a running mean, persistent or not).
The guard compares exact fingerprints of the prefix's parameters and buffers, by name, from one
check to the next, on the ranks that compute it for the cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_pipetx.blocks import BlockSplit

_INTEGER_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22  # elements summed at once where a tensor's bytes are not whole 8-byte words
_ABSENT = object()  # a name the prefix's state did not hold


class FrozenWeightsChangedError(RuntimeError):
    """A weight or buffer of the frozen prefix changed while AutoCache (``cache=True``) served its states."""


def exact_fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of ``tensor``'s bits (all of its 8-byte words, and those at odd positions),
    wrapping: a change of one value changes them, so does most reordering, and they are the same
    on every device and in any order of summation. No copy of the tensor where its bytes are whole
    words; otherwise summed in chunks."""
    values = tensor.detach()
    if values.layout != torch.strided:
        values = values.to_dense()
    if values.dtype == torch.bool:
        values = values.to(torch.uint8)
    if values.is_complex():
        values = torch.view_as_real(values.resolve_conj())
    flat = values.contiguous().reshape(-1)
    if (flat.numel() * flat.element_size()) % 8 == 0:
        if (flat.storage_offset() * flat.element_size()) % 8:
            flat = flat.clone()  # words start where the storage does: the path depends on shape and dtype only
        words = flat.view(torch.int64)
        return torch.stack([words.sum(), words[1::2].sum()])
    integers = flat.view(_INTEGER_VIEWS[flat.element_size()])
    chunks = integers.split(_CHUNK) or (integers,)
    total = torch.stack([chunk.sum(dtype=torch.int64) for chunk in chunks]).sum()
    odd = torch.stack([chunk[1::2].sum(dtype=torch.int64) for chunk in chunks]).sum()  # chunks hold even counts
    return torch.stack([total, odd])


class FrozenWeightsGuard:
    """Watches the state of a frozen prefix: :meth:`changed` names what changed since its last call.

    ``computes(module)`` says whether this rank computes ``module``'s output for the cache (a
    pipeline's first stage, holding the module's weights): only those modules are compared here."""

    def __init__(self) -> None:
        self._prefix: tuple[nn.Module, BlockSplit, int, Callable[[nn.Module], bool]] | None = None
        self._reference: dict[str, list[int] | None] = {}  # None: not computed here
        self._modules: set[str] = set()

    def watch(self, root: nn.Module, split: BlockSplit, frozen_blocks: int, computes: Callable[[nn.Module], bool]):
        """The prefix is now ``pre`` and blocks ``[0, frozen_blocks)`` of ``split``."""
        self._prefix = (root, split, frozen_blocks, computes)

    def changed(self) -> list[str]:
        """Names of the tensors of the modules the last call covered that changed since, or appeared
        or disappeared (computed here both times); the prefix now (which may have grown) becomes the
        reference. Empty while no prefix is watched."""
        if self._prefix is None:
            return []
        root, split, frozen_blocks, computes = self._prefix
        paths = {id(module): name for name, module in root.named_modules(remove_duplicate=False)}
        modules = split.prefix_modules(frozen_blocks)
        training_on = {id(p) for _, p in split.post_by_use}  # in a prefix module, but feeding no block
        current: dict[str, list[int] | None] = {}
        covering: dict[str, str] = {}  # tensor name -> the prefix module it belongs to
        held, fingerprints = [], []
        for module in modules:
            path = paths[id(module)]
            compared = computes(module)
            tensors = module.state_dict(keep_vars=True)  # parameters, persistent buffers
            tensors.update((name, b) for name, b in module.named_buffers() if name not in tensors)  # a forward's too
            for name, tensor in tensors.items():
                if not isinstance(tensor, torch.Tensor) or id(tensor) in training_on:
                    continue  # extra state, or a weight that trains on
                key = f"{path}.{name}" if path else name
                current[key], covering[key] = None, path
                if compared:
                    held.append(key)
                    fingerprints.append(exact_fingerprint(tensor))
        if fingerprints:
            device = fingerprints[0].device
            current.update(zip(held, torch.stack([f.to(device) for f in fingerprints]).tolist()))
        changed = []
        if self._modules:
            names = {key for key, path in covering.items() if path in self._modules} | set(self._reference)
            for key in sorted(names):
                before, now = self._reference.get(key, _ABSENT), current.get(key, _ABSENT)
                if before is not None and now is not None and before != now:
                    changed.append(key)
        self._reference, self._modules = current, {paths[id(module)] for module in modules}
        return changed

    def reset(self) -> None:
        self._prefix, self._reference, self._modules = None, {}, set()
