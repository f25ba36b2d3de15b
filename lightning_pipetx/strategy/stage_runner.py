"""Runs one rank's stage over the micro-batches of a step: GPipe or 1F1B.

The user's ``training_step`` (unchanged) is called once per micro-batch on every stage;
:class:`StageHooks` make it run only this stage's blocks. Training runs the whole schedule,
forwards and backwards, inside Lightning's ``training_step``; the gradients are handed to
Lightning's ``backward`` by the strategy. Evaluation steps exchange their hidden states
through :meth:`StageRunner.receive_activation` and :meth:`StageRunner.send_activation`,
called by :mod:`~lightning_pipetx.strategy.output_relay`.

Communication follows :func:`communication_plan`: before each action, the sends the previous
action produced and the receives this action needs are posted as one batch (an NCCL group).
The first activation of a step is received in two batches, its header and then the payload
whose shapes the header tells; the later ones in one, into buffers of the step's previous
activation's shapes (a second batch follows only when the shapes changed). The plan is what
the runner executes, and what the tests check cannot deadlock when every send blocks until
its receive is posted.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipetx.strategy.boundary_extras import BoundaryExtras
from lightning_pipetx.strategy.fingerprint import batch_fingerprint
from lightning_pipetx.strategy.model_checks import UnsupportedRecipeError
from lightning_pipetx.strategy.p2p import (
    Activation,
    Channel,
    allocate,
    buffers_for,
    empty_header,
    stand_in_sends,
)
from lightning_pipetx.strategy.split_backward import WeightGradients, backward_input, cannot_split
from lightning_pipetx.strategy.stage_hooks import BlockCalls, StageExit, StageHooks
from lightning_pipetx.strategy.topology import Topology

log = logging.getLogger("lightning_pipetx")

SCHEDULES = ("gpipe", "1f1b")


def schedule_actions(schedule: str, num_stages: int, stage: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The ordered ``("F", i)`` / ``("B", i)`` actions of one stage.

    GPipe: all forwards, then all backwards. 1F1B: ``num_stages - stage - 1`` warm-up
    forwards, then one forward and one backward alternately, then the remaining backwards;
    at most ``num_stages - stage`` micro-batches hold activations at once.
    """
    m = num_microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(num_stages - stage - 1, m)
        actions = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [("F", warmup + i), ("B", i)]
        actions += [("B", i) for i in range(m - warmup, m)]
        return actions
    raise ValueError(f"schedule={schedule!r}: choose one of {SCHEDULES}")


@dataclass(frozen=True)
class Op:
    """One send or receive of a plan: with ``peer`` (a stage) and what is transferred,
    ``("act", i, "header" | "payload")`` or ``("grad", i, "")``."""

    send: bool
    peer: int
    message: tuple[str, int, str]


def _receives(kind: str, i: int, stage: int, num_stages: int, changed: Set[int]) -> list[list[Op]]:
    """The receive batches an action needs before it runs: for the step's first activation the
    header, then the payload; for a later one both at once, and when its shapes ``changed`` the
    stand-in first, then the payload."""
    if kind == "F" and stage > 0:
        header, payload = Op(False, stage - 1, ("act", i, "header")), Op(False, stage - 1, ("act", i, "payload"))
        if i == 0:
            return [[header], [payload]]
        if i in changed:
            return [[header, Op(False, stage - 1, ("act", i, "stand-in"))], [payload]]
        return [[header, payload]]
    if kind == "B" and stage < num_stages - 1:
        return [[Op(False, stage + 1, ("grad", i, ""))]]
    return [[]]


def _sends(kind: str, i: int, stage: int, num_stages: int, changed: Set[int]) -> list[Op]:
    """What an action sends once it has run."""
    if kind == "F" and stage < num_stages - 1:
        stand_in = [Op(True, stage + 1, ("act", i, "stand-in"))] if i > 0 and i in changed else []
        return [Op(True, stage + 1, ("act", i, "header")), *stand_in, Op(True, stage + 1, ("act", i, "payload"))]
    if kind == "B" and stage > 0:  # with, once, the answer about extra elements (BoundaryExtras), alike
        return [Op(True, stage - 1, ("grad", i, ""))]
    return []


def communication_plan(
    schedule: str, num_stages: int, stage: int, num_microbatches: int, changed: Set[int] = frozenset()
) -> list[list[Op]]:
    """The batches of sends and receives one stage posts during a step, in order; ``changed``:
    the micro-batches whose hidden-state shapes differ from the micro-batch before them.

    Before action ``k`` the stage posts one batch: what action ``k - 1`` produced (sends)
    together with what action ``k`` needs (receives: a gradient, or an activation's header and,
    after the step's first, its payload); the first activation's payload, and one whose shapes
    changed, follows in a batch of its own. A batch is posted only when the previous one has
    completed. Under GPipe and 1F1B this pairs every send with a receive the peer has already
    posted or posts in its own current batch (Megatron's send-forward-receive-backward
    pairing), so no send waits on a peer that waits on it.
    """
    actions = schedule_actions(schedule, num_stages, stage, num_microbatches)
    batches: list[list[Op]] = []
    outbox: list[Op] = []
    for kind, i in actions:
        first, *rest = _receives(kind, i, stage, num_stages, changed)
        batches.append(outbox + first)
        batches.extend(rest)
        outbox = _sends(kind, i, stage, num_stages, changed)
    batches.append(outbox)
    return [batch for batch in batches if batch]


def refuse_skipped_step() -> None:
    """``training_step`` returned None, which asks Lightning to skip the batch."""
    raise UnsupportedRecipeError(
        "training_step returned None for a micro-batch, which asks Lightning to skip the batch (plain Lightning "
        "does on one device; its DDP refuses it, as here): every rank runs the step of every micro-batch and "
        "takes the optimizer step together. Leave such batches out in the data instead (a collate_fn that returns "
        "None for a batch makes Lightning skip it), or return the loss."
    )


def extract_loss(output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor):
        raise RuntimeError(
            "training_step must return the loss (a tensor, or a dict with a 'loss' key) under "
            f"ElasticPipelineStrategy; it returned {type(output).__name__}."
        )
    return loss


def no_microbatch_context(position: int) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


class BatchMismatchError(RuntimeError):
    """The stages of one replica read different batches."""


@dataclass
class _InFlight:
    """One micro-batch between its forward and its backward."""

    input: Activation | None  # what was received (leaf tensors), if anything
    output: Any  # the activation sent on, or (last stage) the step's output
    loss: torch.Tensor | None = None
    asks: bool = False  # the next stage's answer about extra elements comes back with the gradients
    answer: torch.Tensor | None = None  # this stage's answer, sent back with the gradients


class StageRunner:
    """Executes forwards and backwards of one stage and exchanges what crosses its boundaries."""

    def __init__(self, topology: Topology, hooks: StageHooks, channel: Channel) -> None:
        self.topology = topology
        self.hooks = hooks
        self.channel = channel
        # Per micro-batch context (AutoCache on the first stage), given the micro-batch's position.
        self.microbatch_context: Callable[[int], contextlib.AbstractContextManager] = no_microbatch_context
        # Called before this stage's last backward of a step (gradient sync starts reducing).
        self.on_last_backward: Callable[[], None] = lambda: None
        # Applied to the last stage's loss before its backward (loss scaling under 16-mixed).
        self.scale_loss: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss
        self._mismatches: torch.Tensor | None = None  # micro-batches whose fingerprint differed, on device
        self.extras = BoundaryExtras(topology.stage, channel.device)
        # The step's last backward in two halves (split_backward); the module's weights.
        self.split_backward = False
        self.weights: Callable[[], list[torch.Tensor]] = list
        self._weight_half: WeightGradients | None = None  # of the step's last backward, once its input half ran
        self._step_loss_trains = False  # a micro-batch's loss of this step required grad (the last stage)

    # ------------------------------------------------------- communication
    def _receive_activation(self, outbox: list[tuple[torch.Tensor, int]], expected: tuple | None = None) -> Activation:
        """``expected``: the layout of the step's previous activation from this peer, whose
        buffers are posted with the header; None: the header first, then the payload."""
        prev, device = self.topology.prev_rank, self.channel.device
        header = empty_header(device)
        guess = None if expected is None else buffers_for(expected, device)
        self.channel.exchange(outbox, [(header, prev)] + self._from_prev(guess))
        act, arrived = allocate(header, device, guess)
        if not arrived:
            self.channel.exchange([], self._from_prev(act))
        grad_enabled = torch.is_grad_enabled()
        tensors = tuple(
            None if t is None else t.requires_grad_(need and grad_enabled)
            for t, need in zip(act.tensors, act.needs_grad)
        )
        return Activation(tensors, act.needs_grad, act.tuple_len, act.fingerprint)

    def _from_prev(self, act: Activation | None) -> list[tuple[torch.Tensor, int]]:
        """The receives that fill ``act``'s tensors from the previous stage."""
        return [] if act is None else [(t, self.topology.prev_rank) for t in act.tensors if t is not None]

    def _activation_sends(
        self, act: Activation, fingerprint: torch.Tensor, expected: tuple | None = None
    ) -> list[tuple[torch.Tensor, int]]:
        """``fingerprint``: the micro-batch's, as the step received it; ``expected``: the layout the
        next stage posted buffers of (the step's previous activation's)."""
        stand_in = [] if expected is None else stand_in_sends(expected, act)
        header = act.header(fingerprint, stand_in=bool(stand_in))
        payload = [t.detach().contiguous() for t in act.tensors if t is not None]
        return [(t, self.topology.next_rank) for t in [header, *stand_in, *payload]]

    def fingerprint(self, microbatch: Any) -> torch.Tensor:
        """The fingerprint stages compare: of the micro-batch as the loader gave it, before the step
        runs (a step may change its batch, ``labels = batch.pop("labels")``, on every stage alike)."""
        return batch_fingerprint(microbatch, self.channel.device)

    def _compare_batch(self, fingerprint: torch.Tensor, received: torch.Tensor | None) -> None:
        """Count the micro-batch as read differently here if its fingerprint is not the sender's."""
        if received is not None:
            differs = (fingerprint != received).int()
            self._mismatches = differs if self._mismatches is None else self._mismatches + differs

    def receive_activation(self, fingerprint: torch.Tensor) -> Activation:
        """Receive the hidden state of the micro-batch of ``fingerprint`` from the previous stage (evaluation)."""
        act = self._receive_activation([])
        self._compare_batch(fingerprint, act.fingerprint)
        return act

    def send_activation(self, act: Activation, fingerprint: torch.Tensor) -> None:
        """Send the hidden state of the micro-batch of ``fingerprint`` on to the next stage (evaluation)."""
        self.channel.exchange(self._activation_sends(act, fingerprint), [])
        self.channel.flush()

    def check_batches(self, everywhere: bool) -> None:
        """Raise if a stage read a different batch than the stage before it since the last check.

        ``everywhere``: a collective over the world that every rank calls, so that every rank
        raises together; otherwise only the rank that saw a difference raises. One host read."""
        mine, self._mismatches = self._mismatches, None
        layout = self.topology.layout
        if layout.pipeline_length == 1:
            return
        count = torch.zeros((), dtype=torch.int64, device=self.channel.device)
        if mine is not None:
            count += mine
        counts = [count]
        if everywhere:
            counts = [torch.empty_like(count) for _ in range(layout.world_size)]
            dist.all_gather(counts, count)
        ranks = range(layout.world_size) if everywhere else [self.topology.global_rank]
        found = [(rank, n) for rank, n in zip(ranks, torch.stack(counts).tolist()) if n > 0]
        if not found:
            return
        where = ", ".join(
            f"stage {layout.coords(rank)[1]} of replica {layout.coords(rank)[0]} in {n} micro-batches"
            for rank, n in found
        )
        raise BatchMismatchError(
            f"stages read a different batch than the stage before them ({where}). Every stage of a replica "
            f"must read the same batches: random augmentation or a random collate_fn (for example "
            f"DataCollatorForLanguageModeling's masking, or Mixup) drawn from random states seeded otherwise on "
            f"each rank (seed_everything(seed + rank)), a dataset built from random draws of an unseeded script "
            f"(random_split without a generator), an IterableDataset sharded by global rank, or Trainer("
            f"use_distributed_sampler=False) with a sampler of your own breaks that. Seed every rank alike before "
            f"building the data (seed_everything(seed), workers=True too), shard by "
            f"`trainer.strategy.distributed_sampler_kwargs` (num_replicas, rank), or let Lightning inject its sampler."
        )

    # ------------------------------------------------------------ forward
    def _forward(
        self, microbatch: Any, step_fn: Callable[[Any], Any], position: int, incoming: Activation | None
    ) -> tuple[_InFlight, Activation | None]:
        """Run one micro-batch's forward; returns it in flight and the activation to send on."""
        topo, hooks = self.topology, self.hooks
        hooks.incoming, hooks.calls = incoming, BlockCalls("training_step", refuse_repeats=topo.pipeline_length > 1)
        watch = self.extras.watch(incoming)  # this stage's answer about the extra elements it receives
        try:
            with watch or contextlib.nullcontext(), self.microbatch_context(position):
                output = step_fn(microbatch)
        except StageExit as boundary:
            answer = None if watch is None else self.extras.answer(watch)
            act, asks = self.extras.outgoing(boundary.activation)
            sent = act if any(act.needs_grad) else None
            return _InFlight(incoming, sent, asks=asks, answer=answer), act
        finally:
            hooks.incoming, hooks.calls = None, None
        if output is None:  # returned before its model call, on a stage whose blocks it never reached
            refuse_skipped_step()
        if not topo.is_last_stage:
            raise RuntimeError(
                f"stage {topo.stage} finished its step without reaching block {self.hooks.end - 1}: the "
                f"model's forward must run every block for each micro-batch. "
                f"If it never calls the modules of the block list found (a list of lists, as "
                f"Funnel Transformer's), name the list it calls with ElasticPipelineStrategy(blocks=...), or pass "
                f"pipeline_length=1."
            )
        answer = None if watch is None else self.extras.answer(watch)
        return _InFlight(incoming, output, answer=answer), None

    # ----------------------------------------------------------- backward
    def _backward(self, flight: _InFlight, loss_weight: float, grads: list[torch.Tensor], last: bool) -> list:
        # The schedule runs inside the precision plugin's autocast; Lightning runs backwards outside it.
        with torch.autocast(self.channel.device.type, enabled=False):
            return self._backward_without_autocast(flight, loss_weight, grads, last)

    def _backward_without_autocast(
        self, flight: _InFlight, loss_weight: float, grads: list[torch.Tensor], last: bool
    ) -> list:
        topo = self.topology
        roots: list[torch.Tensor] = []
        if topo.is_last_stage:
            loss = flight.loss
            if loss is not None and loss.requires_grad:
                roots, grads = [self.scale_loss(loss * loss_weight)], []
                self._step_loss_trains = True
            elif loss is not None and last and not self._step_loss_trains:
                raise RuntimeError(
                    "training_step returned a loss that does not require grad and has no grad_fn, for every "
                    "micro-batch of the batch (computed under torch.no_grad(), detached, or from weights that all "
                    "stopped training): its backward would train nothing. Lightning's backward stops on it in one "
                    "process and under DDP alike."
                )
            if last:
                self._step_loss_trains = False
        elif flight.output is not None:
            roots = [t for t, need in zip(flight.output.tensors, flight.output.needs_grad) if need]
        received = flight.input
        inputs = [] if received is None else [t for t in received.tensors if t is not None and t.requires_grad]
        # Only the step's last backward is split: the previous stage waits for its input gradient
        # while this stage would idle; splitting every backward costs more than it saves on CPU.
        if not (roots and inputs and last and self.split_backward and self._backward_input(roots, grads, inputs)):
            if last:
                self.on_last_backward()
            if roots:
                torch.autograd.backward(roots, grads or None)
        if not inputs:
            return []
        sends = [
            (
                t.grad.contiguous() if t.grad is not None else torch.zeros(t.shape, dtype=t.dtype, device=t.device),
                topo.prev_rank,
            )
            for t, need in zip(received.tensors, received.needs_grad)
            if need
        ]
        return sends if flight.answer is None else [*sends, (flight.answer, topo.prev_rank)]

    def _backward_input(self, roots: list[torch.Tensor], grads: list[torch.Tensor], inputs: list) -> bool:
        """The input half of the step's last backward; the weight half waits for :meth:`_run_weight_half`.
        False, with nothing accumulated, where the graph cannot be split (a reentrant activation
        checkpoint, or a compiled backward that donates its buffers, refuses ``torch.autograd.grad``
        with ``retain_graph``): this stage then runs fused backwards."""
        try:
            work = backward_input(roots, grads or None, inputs, self.weights())
        except RuntimeError as error:
            if not cannot_split(error):
                raise
            self.split_backward = False
            log.info("pipetx: stage %d runs fused backwards: %s", self.topology.stage, error.__cause__ or error)
            return False
        self._weight_half = work
        return True

    def _run_weight_half(self) -> None:
        """The weight half of the step's last backward, if it waits: its gradients are final."""
        work, self._weight_half = self._weight_half, None
        if work is not None:
            self.on_last_backward()
            with torch.autocast(self.channel.device.type, enabled=False):
                work.run()

    def _gradient_buffers(self, flight: _InFlight) -> list[torch.Tensor]:
        if self.topology.is_last_stage or flight.output is None:
            return []
        return [
            torch.empty(t.shape, dtype=t.dtype, device=t.device)
            for t, need in zip(flight.output.tensors, flight.output.needs_grad)
            if need
        ]

    # -------------------------------------------------------------- steps
    def train(
        self,
        microbatches: Sequence[Any],
        step_fn: Callable[[Any], Any],
        loss_weights: Sequence[float],
        schedule: str,
    ) -> list[Any]:
        """Forwards and backwards of every micro-batch; returns the last stage's step outputs."""
        try:
            return self._train(microbatches, step_fn, loss_weights, schedule)
        finally:
            self._weight_half = None  # after a failure: no weight half of this step runs in the next

    def _train(
        self, microbatches: Sequence[Any], step_fn: Callable[[Any], Any], loss_weights: Sequence[float], schedule: str
    ) -> list[Any]:
        topo = self.topology
        flights: dict[int, _InFlight] = {}
        outputs: list[Any] = [None] * len(microbatches)
        outbox: list[tuple[torch.Tensor, int]] = []
        received = sent = None  # layouts of the step's last activation from the previous stage and to the next
        actions = schedule_actions(schedule, topo.pipeline_length, topo.stage, len(microbatches))
        for position, (kind, i) in enumerate(actions):
            if kind == "F":
                incoming = None
                if topo.is_first_stage:
                    self.channel.exchange(outbox, [])
                else:
                    incoming = self._receive_activation(outbox, received)
                    received = incoming.layout
                fingerprint = self.fingerprint(microbatches[i]) if topo.pipeline_length > 1 else None
                if incoming is not None:
                    self._compare_batch(fingerprint, incoming.fingerprint)
                flight, act = self._forward(microbatches[i], step_fn, i, incoming)
                outbox = [] if act is None else self._activation_sends(act, fingerprint, sent)
                sent = None if act is None else act.layout
                if topo.is_last_stage:
                    outputs[i] = flight.output
                    flight.loss = extract_loss(flight.output)
                flights[i] = flight
            else:
                flight = flights.pop(i)
                grads = self._gradient_buffers(flight)
                answer = [self.extras.answer_buffer()] if flight.asks else []
                self.channel.exchange(outbox, [(t, topo.next_rank) for t in grads + answer])
                if answer:
                    self.extras.take_answer(answer[0])
                outbox = self._backward(flight, loss_weights[i], grads, last=position == len(actions) - 1)
        self.channel.exchange(outbox, [], self._run_weight_half)  # while the input gradients travel
        self._run_weight_half()  # where nothing was posted (none is, if the split ran): never skipped
        self.channel.flush()
        return outputs
