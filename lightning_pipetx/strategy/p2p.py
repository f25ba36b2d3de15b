"""Point-to-point transfer of hidden states and their gradients between stages.

A stage sends what its last block returned: a tensor, or a tuple whose tensor elements all
cross (T5 passes its position bias from block to block that way). Every activation is
preceded by a small fixed-size header (dtypes, shapes, which elements send a gradient back,
the tuple's length, and a fingerprint of the micro-batch), so shapes may change from one
micro-batch to the next without any rank knowing them in advance. Gradients need no header.

Within a training step a receiver expects the shapes of the step's previous activation: it
posts the header and buffers of those shapes in one batch, which saves a round trip per
micro-batch. When the shapes did change, the sender fills the expected buffers with a stand-in
and sends the activation after it, as the header says (:func:`stand_in_sends`).

Transfers are posted in batches (:func:`torch.distributed.batch_isend_irecv`, an NCCL group):
the stage runner pairs the sends of one action with the receives of the next, in an order
that cannot deadlock even when every send blocks until its receive is posted (NCCL's rule;
see :func:`~lightning_pipetx.strategy.stage_runner.communication_plan`). Every wait is bounded
by the process-group timeout and a lost peer raises :class:`PeerError` naming it.

``PIPETX_STRICT_P2P=1`` makes gloo as strict as NCCL: a batch completes only when every
receiver has taken its data (each receive is acknowledged), so an ordering that could
deadlock under NCCL ends in a timeout on CPU too. ``PIPETX_COALESCED_P2P=1`` makes gloo answer
a batch as NCCL does, with one work for all its sends and receives, whose receives land in
their tensors only when it is waited on (:class:`CoalescedWork`). The two modes are tested
apart: strict mode's acknowledgements, waited on before the next batch, would add waits to a
batch NCCL completes on its own.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

MAX_TENSORS = 4  # tensor elements of a block's output that may cross a stage boundary
MAX_DIMS = 8
_ELEMENT_LEN = 4 + MAX_DIMS  # present, dtype, needs_grad, ndim, shape...
_FIELDS = 4  # tuple length, has fingerprint, fingerprint, a stand-in precedes the payload
HEADER_LEN = _FIELDS + MAX_TENSORS * _ELEMENT_LEN
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
_TAG_DATA, _TAG_ACK = 1, 2
STRICT_ENV = "PIPETX_STRICT_P2P"
COALESCED_ENV = "PIPETX_COALESCED_P2P"


class PeerError(RuntimeError):
    """A neighbouring stage stopped answering: it died, or did not answer within the timeout."""


class BoundaryError(TypeError):
    """A block returned something that cannot cross a stage boundary."""


@dataclass(frozen=True)
class Activation:
    """What crosses a stage boundary: the elements of a block's output (``tensors[0]`` is the
    hidden state), whether each sends a gradient back, and the length of the tuple the block
    returned (0: a bare tensor)."""

    tensors: tuple[torch.Tensor | None, ...]
    needs_grad: tuple[bool, ...]
    tuple_len: int
    fingerprint: float | None = None

    @property
    def tensor(self) -> torch.Tensor:
        return self.tensors[0]

    @classmethod
    def of_hidden(cls, tensor: torch.Tensor, tuple_len: int) -> Activation:
        """Just a hidden state (as AutoCache stores it); the tuple's other elements are None."""
        count = max(1, tuple_len)
        return cls((tensor,) + (None,) * (count - 1), (False,) * count, tuple_len)

    @classmethod
    def of_output(cls, output: object) -> Activation:
        """The elements of a block's output that cross the boundary."""
        if isinstance(output, torch.Tensor):
            return cls((output,), (output.requires_grad,), 0)
        if not (isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor)):
            raise BoundaryError(
                f"a block returned {type(output).__name__}; ElasticPipelineStrategy needs blocks that return "
                f"the hidden state as a tensor, or as the first element of a tuple."
            )
        for position, item in enumerate(output):
            if item is not None and not isinstance(item, torch.Tensor):
                raise BoundaryError(
                    f"a block returned a {type(item).__name__} at position {position} of its output tuple; only "
                    f"tensors (and None) can cross a pipeline stage. Turn off what returns it (for example "
                    f"use_cache=False or output_attentions=False), or pass pipeline_length=1."
                )
        if any(item is not None for item in output[MAX_TENSORS:]):
            raise BoundaryError(
                f"a block returned {len(output)} outputs; at most the first {MAX_TENSORS} can cross a stage."
            )
        tensors = tuple(output[:MAX_TENSORS]) + (None,) * max(0, len(output) - MAX_TENSORS)
        return cls(tensors, tuple(t is not None and t.requires_grad for t in tensors), len(output))

    def as_output(self) -> object:
        """The block output a skipped block returns."""
        if self.tuple_len == 0:
            return self.tensors[0]
        return tuple(self.tensors) + (None,) * (self.tuple_len - len(self.tensors))

    @property
    def layout(self) -> tuple:
        """What a receiver must know to post its buffers: the tuple's length, and each
        element's dtype, shape and gradient flag."""
        elements = tuple(
            None if t is None else (t.dtype, tuple(t.shape), need) for t, need in zip(self.tensors, self.needs_grad)
        )
        return self.tuple_len, elements

    @property
    def extra_tensors(self) -> int:
        """Tensor elements besides the hidden state."""
        return sum(t is not None for t in self.tensors[1:])

    def header(self, fingerprint: torch.Tensor | None, stand_in: bool = False) -> torch.Tensor:
        """The header announcing this activation (int64, on the first tensor's device);
        ``stand_in``: a stand-in of the expected shapes comes before the payload."""
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[0] = self.tuple_len
        header[1] = int(fingerprint is not None)
        header[3] = int(stand_in)
        for e, tensor in enumerate(self.tensors[:MAX_TENSORS]):
            if tensor is None:
                continue
            if tensor.dim() > MAX_DIMS:
                raise BoundaryError(f"hidden states with more than {MAX_DIMS} dimensions cannot cross a stage")
            base = _FIELDS + e * _ELEMENT_LEN
            header[base : base + 4] = torch.tensor(
                [1, _DTYPES.index(tensor.dtype), int(self.needs_grad[e]), tensor.dim()]
            )
            header[base + 4 : base + 4 + tensor.dim()] = torch.tensor(tensor.shape)
        header = header.to(self.tensors[0].device)
        if fingerprint is not None:  # float64 bits, filled in on the device: no host copy of the batch
            header[2] = fingerprint.to(header.device, torch.float64).reshape(1).view(torch.int64)[0]
        return header


def buffers_for(layout: tuple, device: torch.device) -> Activation:
    """Empty tensors of an :attr:`Activation.layout`."""
    tuple_len, elements = layout
    tensors = tuple(None if e is None else torch.empty(e[1], dtype=e[0], device=device) for e in elements)
    return Activation(tensors, tuple(e is not None and e[2] for e in elements), tuple_len)


def stand_in_sends(expected: tuple, act: Activation) -> list[torch.Tensor]:
    """What to send before ``act``'s payload to a receiver that posted buffers of the layout
    ``expected``: nothing when ``act`` has that layout, else a stand-in of it."""
    if expected == act.layout:
        return []
    return [t for t in buffers_for(expected, act.tensor.device).tensors if t is not None]


def _announced_layout(values: list[int]) -> tuple:
    """The :attr:`Activation.layout` a header (read on the host) announces."""
    elements = []
    for e in range(MAX_TENSORS):
        base = _FIELDS + e * _ELEMENT_LEN
        present, dtype, grad, ndim = values[base : base + 4]
        shape = tuple(values[base + 4 : base + 4 + ndim])
        elements.append((_DTYPES[dtype], shape, bool(grad)) if present else None)
    return values[0], tuple(elements[: max(1, values[0])])


def allocate(header: torch.Tensor, device: torch.device, received: Activation | None = None) -> tuple[Activation, bool]:
    """The activation announced by ``header`` (read on the host), and whether it has arrived:
    ``received``, buffers filled in the header's batch, unless the header says they held a
    stand-in; else empty tensors to receive it into."""
    values = header.tolist()
    fingerprint = struct.unpack("<d", struct.pack("<q", values[2]))[0] if values[1] else None
    if received is not None and not values[3]:
        return replace(received, fingerprint=fingerprint), True
    return replace(buffers_for(_announced_layout(values), device), fingerprint=fingerprint), False


def empty_header(device: torch.device) -> torch.Tensor:
    return torch.empty(HEADER_LEN, dtype=torch.int64, device=device)


def strict_mode() -> bool:
    return os.environ.get(STRICT_ENV, "0") == "1"


class CoalescedWork:
    """NCCL's answer to a batch of sends and receives (``batch_isend_irecv`` in a coalescing
    group): one work that completes all of them. On gloo, for ``PIPETX_COALESCED_P2P=1``: the
    batch's works, with each receive staged and copied into its tensor only when waited on."""

    def __init__(self, works: list[dist.Work], staged: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._works, self._staged = works, staged

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self._works:
            work.wait(timeout) if timeout is not None else work.wait()
        for staging, tensor in self._staged:
            tensor.copy_(staging)
        self._staged = []
        return True


def _coalesced(ops: list[dist.P2POp]) -> list[CoalescedWork]:
    """``batch_isend_irecv`` answered as NCCL answers it, on a backend that does not coalesce."""
    staged, posted = [], []
    for op in ops:
        if op.op is dist.irecv:
            staging = torch.empty_like(op.tensor)
            staged.append((staging, op.tensor))
            op = dist.P2POp(dist.irecv, staging, op.peer, tag=op.tag)
        posted.append(op)
    return [CoalescedWork(dist.batch_isend_irecv(posted), staged)]


class Channel:
    """Posts batches of sends and receives between this rank and its neighbours."""

    def __init__(
        self,
        device: torch.device,
        timeout: timedelta | None = None,
        strict: bool | None = None,
        coalesced: bool | None = None,
    ) -> None:
        self.device = device
        self.timeout = timeout or timedelta(minutes=30)
        self.strict = strict_mode() if strict is None else strict
        self.coalesced = os.environ.get(COALESCED_ENV, "0") == "1" if coalesced is None else coalesced
        self._outstanding: list[tuple[dist.Work, int, torch.Tensor]] = []  # sends of the last batch
        self.bytes_sent = 0

    def exchange(
        self,
        sends: list[tuple[torch.Tensor, int]],
        recvs: list[tuple[torch.Tensor, int]],
        meanwhile: Callable[[], None] | None = None,
    ) -> None:
        """Post ``sends`` and ``recvs`` (``(tensor, global rank)``) as one batch, run ``meanwhile``
        (work nothing posted waits for), and return once the receives are complete; the sends
        complete before the next batch is posted."""
        self.flush()
        if not sends and not recvs:
            return
        self.bytes_sent += sum(t.numel() * t.element_size() for t, _ in sends)
        ops = [dist.P2POp(dist.isend, t, peer, tag=_TAG_DATA) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, tag=_TAG_DATA) for t, peer in recvs]
        works = _coalesced(ops) if self.coalesced else dist.batch_isend_irecv(ops)
        if meanwhile is not None:
            meanwhile()
        if len(works) == len(ops):  # a work per transfer (gloo)
            send_works, recv_works = works[: len(sends)], works[len(sends) :]
        else:  # NCCL coalesces the batch into one work: it completes every receive (and send) in it
            for work in works:
                self._wait(work, [peer for _, peer in sends + recvs], "a batch of hidden states or gradients")
            send_works, recv_works = [None] * len(sends), [None] * len(recvs)
        if self.strict:  # a send completes only when its receiver acknowledges it
            send_works = [dist.irecv(torch.zeros(1), peer, tag=_TAG_ACK) for _, peer in sends]
        for work, (tensor, peer) in zip(send_works, sends):
            # Keep the tensor alive until the work completes (NCCL reads it asynchronously).
            if work is not None:
                self._outstanding.append((work, peer, tensor))
            if tensor.is_cuda:
                tensor.record_stream(torch.cuda.current_stream(tensor.device))
        for work, (tensor, peer) in zip(recv_works, recvs):
            if work is not None:
                self._wait(work, peer, "a hidden state or gradient")
            if self.strict:
                self._outstanding.append((dist.isend(torch.ones(1), peer, tag=_TAG_ACK), peer, tensor))
        if self.strict:
            self.flush()  # a strict batch completes only when every receiver has taken its data

    def flush(self) -> None:
        """Wait for the sends of the last batch."""
        outstanding, self._outstanding = self._outstanding, []
        for work, peer, _ in outstanding:
            self._wait(work, peer, "the receipt of what it was sent")

    def _wait(self, work: dist.Work | CoalescedWork, peer: int | Iterable[int], what: str) -> None:
        with waiting_on(peer, what):
            work.wait(self.timeout)


@contextlib.contextmanager
def waiting_on(peer: int | Iterable[int], what: str) -> Iterator[None]:
    """Communication with ``peer`` (a global rank, or several) for ``what``: a wait that ends in
    gloo's or NCCL's RuntimeError (the peer died, or stopped answering within the process-group
    timeout) raises :class:`PeerError` naming it."""
    try:
        yield
    except RuntimeError as error:
        peers = " or ".join(str(rank) for rank in sorted({peer} if isinstance(peer, int) else set(peer)))
        raise PeerError(
            f"rank {dist.get_rank()} lost global rank {peers} while waiting for {what}: {error}. "
            f"That rank died or stopped answering within the process-group timeout "
            f"(ElasticPipelineStrategy(timeout=...)); see its own log for the cause."
        ) from error
