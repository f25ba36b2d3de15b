"""Runs one rank's stage over the micro-batches of a step: GPipe or 1F1B.

The user's step function (``training_step`` and friends, unchanged) is called once per
micro-batch on every stage; :class:`StageHooks` make it run only this stage's blocks.
Training runs the whole schedule, forwards and backwards, inside Lightning's
``training_step``; the gradients are handed to Lightning's ``backward`` by the strategy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_pipetx.strategy.p2p import Activation, Channel
from lightning_pipetx.strategy.stage_hooks import StageExit, StageHooks
from lightning_pipetx.strategy.topology import Topology

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


@dataclass
class _InFlight:
    """One micro-batch between its forward and its backward."""

    input: torch.Tensor | None  # the received hidden state (a leaf), if any
    output: Any  # the hidden state sent on, or (last stage) the step's output
    loss: torch.Tensor | None = None


class StageRunner:
    """Executes forwards and backwards of one stage and exchanges hidden states."""

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

    # ------------------------------------------------------------ forward
    def _forward(self, microbatch: Any, step_fn: Callable[[Any], Any], position: int = 0) -> _InFlight:
        topo = self.topology
        received = None
        if not topo.is_first_stage:
            act = self.channel.recv_activation(topo.prev_rank)
            received = act.tensor.requires_grad_(act.needs_grad and torch.is_grad_enabled())
            self.hooks.incoming = Activation(received, act.needs_grad, act.tuple_len)
        try:
            with self.microbatch_context(position):
                output = step_fn(microbatch)
        except StageExit as boundary:
            hidden = boundary.hidden
            needs_grad = hidden.requires_grad
            self.channel.send_activation(hidden, topo.next_rank, needs_grad, boundary.tuple_len)
            return _InFlight(received, hidden if needs_grad else None)
        finally:
            self.hooks.incoming = None
        if not topo.is_last_stage:
            raise RuntimeError(
                f"stage {topo.stage} finished its step without reaching block {self.hooks.end - 1}: the "
                f"model's forward must run every block for each micro-batch."
            )
        return _InFlight(received, output)

    # ----------------------------------------------------------- backward
    def _backward(self, flight: _InFlight, loss_weight: float) -> None:
        topo = self.topology
        if topo.is_last_stage:
            loss = flight.loss
            if loss is not None and loss.requires_grad:
                self.scale_loss(loss * loss_weight).backward()
        elif flight.output is not None:
            grad = self.channel.recv_gradient(flight.output, topo.next_rank)
            torch.autograd.backward(flight.output, grad)
        received = flight.input
        if received is not None and received.requires_grad:
            grad = received.grad if received.grad is not None else torch.zeros_like(received)
            self.channel.send_gradient(grad, topo.prev_rank)

    # -------------------------------------------------------------- steps
    def train(
        self,
        microbatches: Sequence[Any],
        step_fn: Callable[[Any], Any],
        loss_weights: Sequence[float],
        schedule: str,
    ) -> list[Any]:
        """Forwards and backwards of every micro-batch; returns the last stage's step outputs."""
        topo = self.topology
        flights: dict[int, _InFlight] = {}
        outputs: list[Any] = [None] * len(microbatches)
        actions = schedule_actions(schedule, topo.pipeline_length, topo.stage, len(microbatches))
        for position, (kind, i) in enumerate(actions):
            if position == len(actions) - 1:
                self.on_last_backward()
            if kind == "F":
                flight = self._forward(microbatches[i], step_fn, i)
                if topo.is_last_stage:
                    outputs[i] = flight.output
                    flight.loss = extract_loss(flight.output)
                flights[i] = flight
            else:
                self._backward(flights.pop(i), loss_weights[i])
        self.channel.flush()
        return outputs

    def evaluate(self, microbatches: Sequence[Any], step_fn: Callable[[Any], Any]) -> list[Any]:
        """Forwards only; returns the last stage's step outputs."""
        outputs = [self._forward(mb, step_fn).output for mb in microbatches]
        self.channel.flush()
        return outputs
