"""Host memory reuse between training steps on CPU (glibc's ``malloc``).

PyTorch's CPU allocator is ``malloc``. By default glibc returns the free memory at the top of
its heap to the operating system as soon as it exceeds a threshold that adapts to the largest
block freed so far (a few MB for a small Transformer's activations). A training step frees
its activations at the end of every backward, so each step hands that memory back and the
next forward faults it in again, page by page: in a 2-process run of a small ViT, a
hundred times the page faults of Lightning's DDP, whose gradients happen to stay alive at the
top of the heap until the next ``zero_grad``. :func:`keep_freed_memory` makes ``malloc`` keep
freed memory for the next step instead: blocks up to 32 MB come from the heap (not from
``mmap``, whose blocks go back to the system when freed) and up to 2 GiB of free heap stays
mapped. The process then keeps its peak host memory until it exits, as PyTorch's CUDA
caching allocator keeps device memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

# mallopt(3) parameters, and the largest values glibc accepts for them (an int; the mmap
# threshold is at most half of a heap's 64 MB on 64-bit systems).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20
TRIM_THRESHOLD_BYTES = 2**31 - 1


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None  # another C library (musl): its malloc has no such thresholds
    return libc


def keep_freed_memory() -> bool:
    """Make glibc's ``malloc`` keep memory freed by one training step for the next, process-wide.

    Returns whether the setting took effect (False off Linux or with another C library)."""
    libc = _glibc()
    if libc is None:
        return False
    # Setting either threshold also stops glibc from adapting them: both are set.
    mmap_set = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    trim_set = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    return bool(mmap_set) and bool(trim_set)


def reuse_for_training(reuse: bool | str, device: torch.device) -> bool:
    """Apply ``ElasticPipelineStrategy(reuse_host_memory=...)`` for training on ``device``
    (``"auto"``: on CPU); returns whether freed memory is now kept."""
    wanted = device.type == "cpu" if reuse == "auto" else reuse
    return wanted and keep_freed_memory()
