"""AutoCache: the frozen prefix's output per training sample, shared by the ranks of a node.

The output of blocks ``[0, F)`` for a sample depends only on the sample once those blocks
are frozen (eval mode, no gradient), so it is computed once and read back afterwards.
Entries are keyed by (sample index, depth ``F``) and live in file-backed arrays that every
process on the node maps, so a replica that meets a sample another rank cached reads it
too. Arrays go to RAM (``/dev/shm``) up to a byte budget, beyond it to a disk directory.
When the depth grows from ``F1`` to ``F2``, a sample cached at ``F1`` runs blocks
``[F1, F2)`` only.

Guards: the frozen prefix must not train. A weight of ``pre`` or of a frozen block that
still requires a gradient (GPT-2's input embedding, tied to its LM head) is found when the
blocks freeze; a trainable weight the prefix uses from elsewhere (one registered after the
blocks) is found when the first state is cached, because that state then requires a
gradient. Either way a cached state would be stale and its gradient lost. A fingerprint of every sample's input is kept; a sample whose input changes
between epochs (random augmentation, or dynamic padding that pads it differently) switches
the cache off for the run, with one warning. So does a hidden state whose shape differs
from the ones already cached.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipetx.blocks import BlockSplit
from lightning_pipetx.strategy.microbatch import _tensors
from lightning_pipetx.strategy.p2p import Activation

log = logging.getLogger("lightning_pipetx")

_SHM = Path("/dev/shm")


def _shared(path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor backed by ``path``, shared with every process that maps the same file.

    The file's blocks are reserved first (``posix_fallocate``): a full file system (a 64 MB
    ``/dev/shm`` in a container) raises ``OSError`` here instead of a SIGBUS on a later write.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
    finally:
        os.close(fd)
    return torch.from_file(str(path), shared=True, size=math.prod(shape), dtype=dtype).view(shape)


class TrainablePrefixError(ValueError):
    """``cache=True`` was asked for a frozen prefix that still has a trainable weight."""


def trainable_prefix_weights(root: torch.nn.Module, split: BlockSplit, frozen_blocks: int) -> list[str]:
    """Names of the weights of ``pre`` and blocks ``[0, frozen_blocks)`` that still require a gradient."""
    if frozen_blocks <= 0:
        return []
    prefix = {id(p) for p in split.pre_parameters()}
    for i in range(frozen_blocks):
        prefix.update(id(p) for p in split.block_parameters(i))
    return [name for name, p in root.named_parameters() if id(p) in prefix and p.requires_grad]


def trainable_prefix_reason(names: list[str]) -> str:
    """Why the cache cannot serve a prefix in which ``names`` still train."""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (
        f"the frozen prefix still trains {shown} (for example an input embedding tied to the output layer, as in "
        f"GPT-2): cached hidden states would go stale and the gradient through them would be lost"
    )


def sample_fingerprints(batch: Any, size: int) -> torch.Tensor:
    """One float per sample, from every tensor of the batch (values and shape)."""
    result = torch.zeros(size, dtype=torch.float64)
    for tensor in _tensors(batch):
        if tensor.dim() == 0 or tensor.shape[0] != size:
            continue
        flat = tensor.detach().reshape(size, -1).to("cpu", torch.float64)
        weights = torch.linspace(1.0, 2.0, flat.shape[1], dtype=torch.float64)
        result += flat @ weights + flat.shape[1]
    return result


@dataclass
class _Store:
    data: torch.Tensor  # (num_samples, *sample_shape)
    valid: torch.Tensor  # (num_samples,) uint8
    tuple_len: int
    in_ram: bool
    paths: tuple[Path, ...]


class ActivationCache:
    """Per-sample hidden states at each frozen depth, for one run on one node."""

    def __init__(self, directory: Path, spill_directory: Path, num_samples: int, ram_budget: int) -> None:
        self.directory = directory
        self.spill_directory = spill_directory
        self.num_samples = num_samples
        self.ram_budget = ram_budget
        for path in {directory, spill_directory}:
            path.mkdir(parents=True, exist_ok=True)
        self._fingerprints = _shared(directory / "fingerprints", (num_samples,), torch.float64)
        self._seen = _shared(directory / "seen", (num_samples,), torch.uint8)
        self._disabled = _shared(directory / "disabled", (1,), torch.uint8)
        self._stores: dict[int, _Store] = {}
        self.hits = self.lookups = 0
        self._warned = False

    # ------------------------------------------------------------------ guards
    @property
    def enabled(self) -> bool:
        return not bool(self._disabled[0])

    def disable(self, reason: str) -> None:
        self._disabled[0] = 1
        if not self._warned:
            self._warned = True
            log.warning("pipetx: AutoCache switched off for this run: %s", reason)

    def check_inputs(self, indices: torch.Tensor, fingerprints: torch.Tensor, force: bool = False) -> None:
        """Switch the cache off if a sample's input differs from the last time it was seen
        (with ``force``, only warn)."""
        seen = self._seen[indices].bool()
        if not torch.equal(self._fingerprints[indices][seen], fingerprints[seen]) and self.enabled:
            if force:
                if not self._warned:
                    self._warned = True
                    log.warning("pipetx: a sample's input changed between epochs; cache=True keeps caching it.")
            else:
                self.disable(
                    "a sample's input changed between epochs (random augmentation, or dynamic padding that pads "
                    "it to another length). Cache only deterministic, fixed-shape inputs, or pass cache=False."
                )
        self._fingerprints[indices] = fingerprints
        self._seen[indices] = 1

    # ------------------------------------------------------------- entries
    def lookup(self, indices: torch.Tensor, depth: int) -> tuple[int, torch.Tensor | None, int]:
        """The deepest depth ``<= depth`` at which every sample is cached: (depth, states, tuple_len)."""
        self.lookups += len(indices)
        if not self.enabled:
            return 0, None, 0
        for level in sorted(self._stores, reverse=True):
            store = self._stores[level]
            if level <= depth and bool(store.valid[indices].all()):
                if level == depth:
                    self.hits += len(indices)
                return level, store.data[indices], store.tuple_len
        return 0, None, 0

    def store(self, indices: torch.Tensor, depth: int, output: Activation) -> None:
        if output.extra_tensors:
            self.disable(
                "the frozen blocks pass more than their hidden state on to the next block (T5's position bias): "
                "only the hidden state can be cached."
            )
            return
        hidden, tuple_len = output.tensor, output.tuple_len
        if hidden.requires_grad:
            self.disable(
                "the frozen blocks' output requires a gradient: a weight they use from outside the frozen prefix "
                "(registered after the blocks) still trains, so a cached state would go stale and its gradient "
                "would be lost. Freeze that weight too, or pass cache=False"
            )
            return
        store = self._stores.get(depth) or self._open(depth, tuple(hidden.shape[1:]), hidden.dtype, tuple_len)
        if tuple(store.data.shape[1:]) != tuple(hidden.shape[1:]):
            self.disable(
                f"hidden states of shape {tuple(hidden.shape[1:])} and {tuple(store.data.shape[1:])} at one depth: "
                f"dynamic padding. Pad every batch to one length to use the cache, or pass cache=False."
            )
            return
        store.data[indices] = hidden.detach().to("cpu", store.data.dtype)
        store.valid[indices] = 1

    def _open(self, depth: int, shape: tuple[int, ...], dtype: torch.dtype, tuple_len: int) -> _Store:
        nbytes = self.num_samples * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        # Another rank of the node may have placed this depth in RAM already: share its file.
        in_ram = (self.directory / f"depth{depth}").exists() or self.ram_bytes + nbytes <= self.ram_budget
        if in_ram:
            try:
                return self._map(self.directory, depth, shape, dtype, tuple_len, in_ram=True)
            except OSError as error:  # the RAM file system is full (or smaller than the budget)
                log.info(
                    "pipetx: AutoCache: %s has no room for depth %d (%.1f MiB: %s); it goes to %s",
                    self.directory.parent,
                    depth,
                    nbytes / 2**20,
                    error.strerror,
                    self.spill_directory,
                )
                self._unlink(self.directory, depth)
        return self._map(self.spill_directory, depth, shape, dtype, tuple_len, in_ram=False)

    def _map(
        self, folder: Path, depth: int, shape: tuple[int, ...], dtype: torch.dtype, tuple_len: int, in_ram: bool
    ) -> _Store:
        paths = (folder / f"depth{depth}", folder / f"depth{depth}.valid")
        data = _shared(paths[0], (self.num_samples, *shape), dtype)
        valid = _shared(paths[1], (self.num_samples,), torch.uint8)
        self._stores[depth] = store = _Store(data, valid, tuple_len, in_ram, paths)
        return store

    @staticmethod
    def _unlink(folder: Path, depth: int) -> None:
        for name in (f"depth{depth}", f"depth{depth}.valid"):
            (folder / name).unlink(missing_ok=True)

    def drop_below(self, depth: int) -> None:
        """Free the arrays of depths below ``depth`` except the deepest of them (incremental input),
        and their files: no rank reads a depth again once a deeper one exists below ``depth``."""
        lower = sorted(level for level in self._stores if level < depth)
        for level in lower[:-1]:
            store = self._stores.pop(level)
            for path in store.paths:  # pages already mapped by another rank stay valid until it drops them
                path.unlink(missing_ok=True)

    # --------------------------------------------------------------- metrics
    def _bytes(self, in_ram: bool) -> int:
        return sum(s.data.numel() * s.data.element_size() for s in self._stores.values() if s.in_ram == in_ram)

    @property
    def ram_bytes(self) -> int:
        return self._bytes(True)

    @property
    def disk_bytes(self) -> int:
        return self._bytes(False)

    def take_counts(self) -> tuple[int, int]:
        """(hits, lookups) since the last call."""
        counts = (self.hits, self.lookups)
        self.hits = self.lookups = 0
        return counts

    def close(self, remove_files: bool) -> None:
        self._stores.clear()
        if remove_files:
            for path in {self.directory, self.spill_directory}:
                shutil.rmtree(path, ignore_errors=True)


def cache_directories(run_token: str, node_rank: int, spill_root: str | None) -> tuple[Path, Path]:
    """RAM folder (``/dev/shm`` when there is one) and disk folder for one run on one node."""
    name = f"pipetx-{run_token}-node{node_rank}"
    spill = Path(spill_root or os.environ.get("TMPDIR", "/tmp")) / name
    ram = _SHM / name if _SHM.is_dir() and os.access(_SHM, os.W_OK) else spill / "ram"
    return ram, spill


def gather_cache_stats(cache: ActivationCache | None, device: torch.device, world_size: int) -> dict[str, float]:
    """Hit rate over every rank since the last call, and the bytes cached per node (collective)."""
    hits, lookups = cache.take_counts() if cache is not None else (0, 0)
    counts = torch.tensor([hits, lookups], dtype=torch.float64, device=device)
    sizes = torch.tensor([cache.ram_bytes, cache.disk_bytes] if cache else [0, 0], dtype=torch.float64, device=device)
    if world_size > 1:
        dist.all_reduce(counts)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX)  # the ranks of a node share the same files
    stats = {"cache_ram_bytes": float(sizes[0]), "cache_disk_bytes": float(sizes[1])}
    if counts[1] > 0:
        stats["cache_hit_rate"] = float(counts[0] / counts[1])
    return stats
