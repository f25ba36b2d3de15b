"""Point-to-point transfer of hidden states and their gradients between stages.

Every activation is preceded by a small fixed-size header (dtype, shape, whether a
gradient comes back, how the block packed its output), so shapes may change from one
micro-batch to the next (a partial last batch, dynamic padding) without any rank having
to know them in advance. Gradients need no header: they have the activation's shape.
Sends are asynchronous and completed by :meth:`Channel.flush`, so no schedule can
deadlock on two ranks sending to each other; receives block, up to the group timeout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

_HEADER_LEN = 12
_MAX_DIMS = _HEADER_LEN - 4
_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
]
_TAG_ACTIVATION, _TAG_GRADIENT = 1, 2


@dataclass(frozen=True)
class Activation:
    """A received hidden state: the tensor, whether its gradient is expected back, and the
    length of the tuple the sending block returned it in (0: a bare tensor)."""

    tensor: torch.Tensor
    needs_grad: bool
    tuple_len: int


class PeerError(RuntimeError):
    """A neighbouring stage stopped answering: it died, or did not answer within the timeout."""


def _recv(tensor: torch.Tensor, src: int, tag: int, what: str) -> None:
    try:
        dist.recv(tensor, src=src, tag=tag)
    except RuntimeError as error:  # gloo/NCCL report a lost peer or a timeout as RuntimeError
        raise PeerError(
            f"rank {dist.get_rank()} lost global rank {src} while waiting for its {what}: {error}. "
            f"That rank died or stopped answering within the process-group timeout "
            f"(ElasticPipelineStrategy(timeout=...)); see its own log for the cause."
        ) from error


class Channel:
    """Sends and receives between this rank and its neighbours in a pipeline."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def send_activation(self, tensor: torch.Tensor, dst: int, needs_grad: bool, tuple_len: int) -> None:
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(f"hidden states with more than {_MAX_DIMS} dimensions are not supported")
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        header[0] = _DTYPES.index(tensor.dtype)
        header[1] = int(needs_grad)
        header[2] = tuple_len
        header[3] = tensor.dim()
        header[4 : 4 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        self._isend(header.to(self.device), dst, _TAG_ACTIVATION)
        self._isend(tensor.detach().contiguous(), dst, _TAG_ACTIVATION)

    def recv_activation(self, src: int) -> Activation:
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
        _recv(header, src, _TAG_ACTIVATION, "hidden state")
        header = header.tolist()
        dtype, needs_grad, tuple_len, ndim = _DTYPES[header[0]], bool(header[1]), header[2], header[3]
        tensor = torch.empty(header[4 : 4 + ndim], dtype=dtype, device=self.device)
        _recv(tensor, src, _TAG_ACTIVATION, "hidden state")
        return Activation(tensor, needs_grad, tuple_len)

    def send_gradient(self, grad: torch.Tensor, dst: int) -> None:
        self._isend(grad.contiguous(), dst, _TAG_GRADIENT)

    def recv_gradient(self, like: torch.Tensor, src: int) -> torch.Tensor:
        grad = torch.empty_like(like, device=self.device)
        _recv(grad, src, _TAG_GRADIENT, "gradient")
        return grad

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._pending.append((dist.isend(tensor, dst=dst, tag=tag), tensor))

    def flush(self) -> None:
        """Wait for every send issued so far."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
