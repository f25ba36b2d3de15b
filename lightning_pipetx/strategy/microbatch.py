"""Split a batch of any structure into micro-batches along dim 0, and join outputs back.

A batch is a tensor or a (nested) tuple, list, namedtuple or mapping (dict, HF
``BatchEncoding``) of tensors. Every tensor is split along dim 0; lists of per-sample
non-tensor values (strings, ids) of the batch's length are split alike; any other leaf
(a scalar, None) is given to every micro-batch unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException


class BatchSplitError(ValueError):
    """Raised when a batch cannot be split into micro-batches."""


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _tensors(v)]
    return []


_PLAIN = (torch.Tensor, str, bytes, int, float, complex, bool, type(None))


def opaque_leaf(batch: Any) -> str | None:
    """The type of a value in ``batch`` that may hold tensors not found in its dicts, lists and
    tuples (a dataclass, another object), or None where every value is a tensor or plain."""
    if isinstance(batch, _PLAIN):
        return None
    if isinstance(batch, Mapping):
        values = batch.values()
    elif isinstance(batch, (list, tuple)):
        values = batch
    else:
        return type(batch).__name__
    return next((found for v in values if (found := opaque_leaf(v)) is not None), None)


def sample_shapes(batch: Any) -> list[tuple[int, ...]]:
    """The shape of one sample in each tensor of ``batch`` (the batch dimension left out)."""
    return [tuple(t.shape[1:]) for t in _tensors(batch) if t.dim() > 0]


def batch_size(batch: Any) -> int:
    """The common dim-0 size of the batch's tensors."""
    sizes = {t.shape[0] for t in _tensors(batch) if t.dim() > 0}
    if not sizes:
        raise BatchSplitError(
            f"cannot split a batch of type {type(batch).__name__} into micro-batches: it holds no tensor "
            f"with a batch dimension. Use a tensor, tuple, list or dict batch, or num_microbatches=1."
        )
    if len(sizes) > 1:
        raise BatchSplitError(
            f"cannot split the batch into micro-batches: its tensors have different first dimensions "
            f"{sorted(sizes)}. Give every tensor the batch size as dim 0, or use num_microbatches=1."
        )
    return sizes.pop()


def whole_batch_size(batch: Any) -> int:
    """The size of a batch left whole as Lightning infers it for ``self.log`` under DDP (its first
    tensor's dim 0, 1 for a single number; 1 where it finds none): the tensors need not agree."""
    try:
        return extract_batch_size(batch)
    except MisconfigurationException:
        return 1


def chunk_sizes(size: int, num_chunks: int) -> list[int]:
    """Near-equal sizes, larger chunks first; fewer chunks when ``size < num_chunks``."""
    num_chunks = min(num_chunks, size)
    base, extra = divmod(size, num_chunks)
    return [base + (1 if i < extra else 0) for i in range(num_chunks)]


def _rebuild(like: Any, items: list[Any]) -> Any:
    if _is_namedtuple(like):
        return type(like)(*items)
    if isinstance(like, tuple):
        return tuple(items)
    return type(like)(items) if type(like) is not list else items


def _split(obj: Any, size: int, sizes: list[int]) -> list[Any]:
    n = len(sizes)
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            return [obj] * n
        # Copies, not views: views of one batch share its autograd version counter, so a step that
        # changes its micro-batch in place (timm's Mixup) would invalidate what the others saved.
        return [part.clone() for part in torch.split(obj, sizes, dim=0)]
    if isinstance(obj, Mapping):
        parts = {k: _split(v, size, sizes) for k, v in obj.items()}
        out = []
        for i in range(n):
            data = {k: v[i] for k, v in parts.items()}
            try:
                out.append(type(obj)(data))
            except TypeError:
                out.append(data)
        return out
    if isinstance(obj, (list, tuple)):
        if obj and not _tensors(obj) and len(obj) == size:
            offsets = [sum(sizes[:i]) for i in range(n + 1)]
            return [_rebuild(obj, list(obj[offsets[i] : offsets[i + 1]])) for i in range(n)]
        columns = [_split(v, size, sizes) for v in obj]
        return [_rebuild(obj, [col[i] for col in columns]) for i in range(n)]
    return [obj] * n


def split_batch(batch: Any, num_microbatches: int) -> list[Any]:
    """Split ``batch`` into ``num_microbatches`` micro-batches (fewer if the batch is smaller)."""
    size = batch_size(batch)
    if size == 0:
        raise BatchSplitError("cannot split an empty batch into micro-batches.")
    return _split(batch, size, chunk_sizes(size, num_microbatches))


def join_outputs(outputs: list[Any], sizes: list[int]) -> Any:
    """Join per-micro-batch outputs into what the whole batch would have given.

    Tensors with a batch dimension are concatenated along dim 0 and per-sample lists joined;
    single numbers (0-dim tensors, Python floats) are averaged weighted by the micro-batch
    ``sizes``, as the loss is; any other value is the last micro-batch's.
    """
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() > 0:
            return torch.cat(outputs, dim=0)
        total = sum(sizes)
        return sum(o * (n / total) for o, n in zip(outputs, sizes))
    if isinstance(first, float):
        return sum(o * n for o, n in zip(outputs, sizes)) / sum(sizes)
    if isinstance(first, Mapping):
        joined = {k: join_outputs([o[k] for o in outputs], sizes) for k in first}
        try:
            return type(first)(joined)
        except TypeError:
            return joined
    if isinstance(first, (list, tuple)):
        if first and not _tensors(first):
            return _rebuild(first, [item for o in outputs for item in o])
        return _rebuild(first, [join_outputs([o[i] for o in outputs], sizes) for i in range(len(first))])
    return outputs[-1]


def take(obj: Any, indices: list[int]) -> Any:
    """Select samples ``indices`` (along dim 0) from every tensor and per-sample list."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.dim() == 0 else obj[torch.as_tensor(indices, dtype=torch.long, device=obj.device)]
    if isinstance(obj, Mapping):
        picked = {k: take(v, indices) for k, v in obj.items()}
        try:
            return type(obj)(picked)
        except TypeError:
            return picked
    if isinstance(obj, (list, tuple)):
        if obj and not _tensors(obj):
            return _rebuild(obj, [obj[i] for i in indices])
        return _rebuild(obj, [take(v, indices) for v in obj])
    return obj


def chunk(obj: Any, size: int) -> list[Any]:
    """Split ``obj`` into consecutive pieces of ``size`` samples (the last may be smaller)."""
    total = batch_size(obj)
    sizes = [min(size, total - start) for start in range(0, total, size)]
    return _split(obj, total, sizes)
