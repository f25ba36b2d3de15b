"""Where AutoCache keeps the hidden states of one depth: the training device, host RAM, disk.

Every tier answers, on the host and without touching the device, which of a micro-batch's
samples it holds (:meth:`Tier.holds`), reads them with one batched gather, and writes them.

* :class:`DeviceTier`: a tensor on the training device with a slot per sample it took, up
  to a row budget: a warm step reads it without crossing PCIe.
* :class:`FileTier`: a file-backed array every process of the node maps, in ``/dev/shm``
  (``"host"``) or in a disk folder (``"disk"``). Reads gather rows into pinned memory and
  copy them to the device without blocking; replicas of one node share what any of them
  cached.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Collection, Iterator
from pathlib import Path

import torch

TIER_NAMES = ("device", "host", "disk")


def nbytes_of(rows: int, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return rows * math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def shared_tensor(path: Path, shape: tuple[int, ...], dtype: torch.dtype, create: bool = True) -> torch.Tensor:
    """A tensor backed by ``path``, shared with every process that maps the same file.

    The file's blocks are reserved first (``posix_fallocate``): a full file system (a 64 MB
    ``/dev/shm`` in a container) raises ``OSError`` here instead of a SIGBUS on a later write.
    ``create=False`` maps an existing file of exactly this size, or raises ``OSError``.
    """
    nbytes = nbytes_of(1, shape, dtype)
    fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    try:
        size = os.fstat(fd).st_size
        if not create and size != nbytes:
            raise OSError(f"{path} holds {size} bytes, not the {nbytes} described")
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
        # mapped through the open descriptor where the system allows: the file checked above,
        # even if another rank removed its name meanwhile
        mapped = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else str(path)
        return torch.from_file(mapped, shared=True, size=math.prod(shape), dtype=dtype).view(shape)
    finally:
        os.close(fd)


def free_bytes(folder: Path) -> int:
    """Bytes the file system of ``folder`` (or of its nearest existing parent) still has for an unprivileged writer."""
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    stats = os.statvfs(folder)
    return stats.f_bavail * stats.f_frsize


RAM_FREE_SHARE = 1 / 2  # of the RAM mount's free space a new depth may take: the rest stays for others


def ram_room(budget: int, held: int, free: int) -> int:
    """Bytes a new depth may take in RAM: what ``budget`` leaves beside the ``held`` bytes, and no more
    than half the mount's ``free`` bytes (DataLoader workers pass their batches through it too)."""
    return min(budget - held, int(free * RAM_FREE_SHARE))


def first_occurrences(indices: torch.Tensor) -> torch.Tensor:
    """The positions in ``indices`` (on the host) where each value first occurs, in order."""
    values, inverse = torch.unique(indices, return_inverse=True)
    positions = torch.arange(len(indices))
    first = torch.full((len(values),), len(indices), dtype=torch.long)
    return first.scatter_reduce_(0, inverse, positions, "amin").sort().values


class SharedFileMismatchError(RuntimeError):
    """Two ranks of a node would keep different states in one shared depth file."""


class Tier:
    """The states of one depth in one kind of memory."""

    name: str
    data: torch.Tensor

    def holds(self, indices: torch.Tensor) -> torch.Tensor:
        """A host bool per sample of ``indices``: whether this tier has its state."""
        raise NotImplementedError

    def read(self, indices: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The states of ``indices`` (all held), on ``device``; may return before the copy ends."""
        raise NotImplementedError

    def write(self, indices: torch.Tensor, states: torch.Tensor) -> None:
        """Keep the states of ``indices`` (rows of ``states``, on any device), as room allows."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def close(self) -> None:
        """Release the memory (and files) of this tier."""


class DeviceTier(Tier):
    """Up to ``capacity`` samples' states on the training device, first come first kept."""

    name = "device"

    def __init__(
        self, num_samples: int, capacity: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> None:
        self.slot = torch.full((num_samples,), -1, dtype=torch.long)  # host: answers holds() without a sync
        self.data = torch.empty((capacity, *shape), dtype=dtype, device=device)
        self.used = 0

    def holds(self, indices: torch.Tensor) -> torch.Tensor:
        return self.slot[indices] >= 0

    def read(self, indices: torch.Tensor, device: torch.device) -> torch.Tensor:
        slots = self.slot[indices].to(self.data.device, non_blocking=True)
        return self.data.index_select(0, slots)

    def write(self, indices: torch.Tensor, states: torch.Tensor) -> None:
        first = first_occurrences(indices)  # a sample drawn twice into the batch takes one slot
        slots = self.slot[indices[first]]
        new = (slots < 0).nonzero().flatten()[: self.data.shape[0] - self.used]
        slots[new] = torch.arange(self.used, self.used + len(new))
        self.slot[indices[first[new]]] = slots[new]
        self.used += len(new)
        kept = (slots >= 0).nonzero().flatten()
        if len(kept):
            rows = states.index_select(0, first[kept].to(states.device, non_blocking=True))
            self.data.index_copy_(0, slots[kept].to(self.data.device, non_blocking=True), rows.to(self.data))

    def close(self) -> None:
        self.data = self.data.new_empty((0, *self.data.shape[1:]))


class FileTier(Tier):
    """Every sample's state in a file of ``folder``, shared by the ranks of the node."""

    def __init__(
        self,
        name: str,
        folder: Path,
        depth: int,
        num_samples: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        tuple_len: int | None = None,
    ) -> None:
        """``tuple_len`` None: adopt the files another rank of the node made and described, never
        creating or extending them (a failed adoption removes nothing). Otherwise make them, or share
        them where another rank described the same states (else :class:`SharedFileMismatchError`)."""
        self.name = name
        # the states, which of them are valid, and what the file holds (for ranks that open it later)
        self.paths = (folder / f"depth{depth}", folder / f"depth{depth}.valid", folder / f"depth{depth}.json")
        adopt = tuple_len is None
        if not adopt:  # made when a depth first goes there: a folder never used need not be writable
            folder.mkdir(parents=True, exist_ok=True)
        owned_elsewhere = adopt or self._claim((tuple(shape), dtype, tuple_len))
        try:
            self.data = shared_tensor(self.paths[0], (num_samples, *shape), dtype, create=not adopt)
            self.valid = shared_tensor(self.paths[1], (num_samples,), torch.uint8, create=not adopt)
        except OSError:
            if not owned_elsewhere:  # files another rank described stay, with the states it keeps there
                self.unlink()
            raise

    def holds(self, indices: torch.Tensor) -> torch.Tensor:
        return self.valid[indices].bool()

    def read(self, indices: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return self.data.index_select(0, indices)
        staging = torch.empty((len(indices), *self.data.shape[1:]), dtype=self.data.dtype, pin_memory=True)
        torch.index_select(self.data, 0, indices, out=staging)
        return staging.to(device, non_blocking=True)

    def write(self, indices: torch.Tensor, states: torch.Tensor) -> None:
        self.data.index_copy_(0, indices, states.to("cpu", self.data.dtype))
        self.valid[indices] = 1

    def _claim(self, about: tuple[tuple[int, ...], torch.dtype, int]) -> bool:
        """Describe the file before any rank maps it, unless another rank of the node did: then its
        description must be this one, and True is returned. A rank that opens the depth later reads it."""
        shape, dtype, tuple_len = about
        text = json.dumps({"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "tuple_len": tuple_len})
        path = self.paths[2]
        partial = path.with_name(f"{path.name}.{os.getpid()}")
        try:
            partial.write_text(text)
            os.link(partial, path)  # atomic, and never over another rank's description
            return False
        except FileExistsError:
            pass
        except OSError:  # a full file system: the other ranks compute this depth instead of reading it
            return False
        finally:
            partial.unlink(missing_ok=True)
        described = self.description(path)
        if described is not None and described != about:
            raise SharedFileMismatchError(
                f"another first stage of this node caches states of shape {described[0]}, {described[1]} (a tuple of "
                f"{described[2]}) at this depth, where this one has {shape}, {dtype} (a tuple of {tuple_len})"
            )
        return True

    @staticmethod
    def description(path: Path) -> tuple[tuple[int, ...], torch.dtype, int] | None:
        """What a description file says its depth's file holds: (shape per sample, dtype, tuple
        length); None where there is none yet, or it cannot be read."""
        try:
            about = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return tuple(about["shape"]), getattr(torch, about["dtype"]), about["tuple_len"]

    @classmethod
    def described(
        cls, name: str, folder: Path, num_samples: int, skip: Collection[int]
    ) -> Iterator[tuple[int, FileTier, int]]:
        """The depths (not in ``skip``) whose file in ``folder`` another rank described: (depth, tier, tuple length).
        A file removed meanwhile (its depth dropped) is passed over."""
        for path in sorted(folder.glob("depth*.json")):
            depth = int(path.name.removeprefix("depth").removesuffix(".json"))
            about = None if depth in skip else cls.description(path)
            if about is None:
                continue
            shape, dtype, tuple_len = about
            try:
                tier = cls(name, folder, depth, num_samples, shape, dtype)
            except OSError:
                continue
            yield depth, tier, tuple_len

    def unlink(self) -> None:
        """Remove the files; pages another rank still maps stay valid until it drops them."""
        for path in self.paths:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        self.unlink()
