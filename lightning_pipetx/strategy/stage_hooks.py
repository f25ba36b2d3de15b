"""Hooks on the block list that make the user's unchanged forward run one stage only.

On a rank that runs blocks ``[start, end)``:

* blocks before ``start`` are skipped: they return the hidden state received from the
  previous stage (their weights need not be present);
* block ``start`` gets that hidden state as its first input;
* after block ``end - 1`` (unless this is the last stage) the hidden state is captured and
  the rest of the forward is abandoned by raising :class:`StageExit`, which the stage
  runner catches.

Side inputs (attention masks, position ids, rotary tables) are recomputed by the model's
own code from the same micro-batch on every stage; only the hidden state crosses stages.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_pipetx.checkpointing import in_reentrant_checkpoint
from lightning_pipetx.strategy.installed import InstalledForward
from lightning_pipetx.strategy.model_checks import UnsupportedRecipeError
from lightning_pipetx.strategy.p2p import Activation, BoundaryError
from lightning_pipetx.strategy.unread_output import unread


class StageExit(BaseException):  # noqa: N818 - control flow, not an error
    """Raised after a non-last stage's final block; carries what crosses the boundary.

    A ``BaseException``, so that a user's ``except Exception:`` around the model call does
    not swallow the stage boundary."""

    def __init__(self, activation: Activation) -> None:
        super().__init__(_ESCAPED_BOUNDARY)
        self.activation = activation


_ESCAPED_BOUNDARY = (
    "stage boundary: the model's forward stopped after the last block of this rank's pipeline stage. Raised "
    "to your code, it means the model was called outside a pipelined step (in a hook such as "
    "on_validation_epoch_end): under ElasticPipelineStrategy each rank holds only its stage's blocks, so call the "
    "model from training/validation/test/predict_step."
)


class BlockTimer:
    """Forward time of each block this rank runs, while :attr:`active`."""

    def __init__(self, num_blocks: int) -> None:
        self.active = False
        self.seconds = [0.0] * num_blocks
        self.calls = [0] * num_blocks

    def run(self, index: int, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        if not self.active:
            return fn(*args, **kwargs)
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        output = fn(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        self.seconds[index] += time.perf_counter() - start
        self.calls[index] += 1
        return output

    def mean_seconds(self) -> list[float]:
        return [s / c if c else 0.0 for s, c in zip(self.seconds, self.calls)]


class StageHooks:
    """Installs per-block forward overrides for the stage ``[start, end)`` of ``blocks``."""

    def __init__(self, blocks: nn.Module, start: int, end: int, is_last_stage: bool) -> None:
        self.blocks = blocks
        self.start, self.end = start, end
        self.is_last_stage = is_last_stage
        self.incoming: Activation | None = None
        self.timer = BlockTimer(len(blocks))
        self._block_modules = [list(block.modules()) for block in blocks]  # whose forward hooks a skip would bypass
        # Set per micro-batch by AutoCache on the first stage: skip the blocks before
        # ``skip_until`` (``incoming`` holds their cached output), and keep the output of
        # block ``capture_at`` in ``captured``.
        self.skip_until = 0
        self.capture_at = -1
        self.captured: Activation | None = None
        self.on_first_block: Callable[[], None] | None = None  # AutoCache times the prefix it computes
        self.on_stage_start: Callable[[], None] | None = None  # the stage's random stream begins
        self.on_capture: Callable[[], None] | None = None
        self.on_uncacheable: Callable[[str], None] | None = None  # why the micro-batch's prefix cannot be cached
        self.on_prefix_input: Callable[[torch.Tensor], None] | None = None  # block 0's hidden state, for AutoCache
        self.calls: BlockCalls | None = None  # what the current micro-batch's step called, while counted
        self._saved: dict[int, Any] = {}

    def install(self) -> None:
        for index, block in enumerate(self.blocks):
            original = block.forward
            first_arg = next(iter(inspect.signature(original).parameters), None)
            self._saved[index] = block.__dict__.get("forward")
            block.forward = InstalledForward(original, self._forward, index, original, first_arg)

    def remove(self) -> None:
        for index, block in enumerate(self.blocks):
            saved = self._saved.pop(index, None)
            if saved is None:
                block.__dict__.pop("forward", None)
            else:
                block.forward = saved

    def _forward(self, index: int, original: Callable, first_arg: str | None, *args: Any, **kwargs: Any) -> Any:
        if self.calls is not None:
            self._count(index, self.calls)
        if index == self.start and self.on_stage_start is not None:
            self.on_stage_start()
        if index == 0 and self.on_prefix_input is not None:
            hidden = _first_input(args, kwargs, first_arg)
            if isinstance(hidden, torch.Tensor):
                self.on_prefix_input(hidden)
        if index == self.start and self.skip_until > self.start:  # the first block AutoCache would skip
            self._serve_only_unhooked_blocks()
        start = max(self.start, self.skip_until)
        if index < start:
            if _has_user_forward_hook(self._block_modules[index]):
                _refuse_hooked_skipped_block(index)
            incoming = self._incoming()
            if index == self.end - 1 and not self.is_last_stage:  # the whole stage was cached
                raise StageExit(incoming)
            # The tuple's other elements (T5's position bias) reach the next block through the
            # model's own loop, as if this block had run; the hidden state is the last skipped block's.
            output = incoming.as_output()
            return output if index == start - 1 else unread(output, index, start)
        if index >= self.end:
            raise RuntimeError(
                f"block {index} was called on a stage that runs blocks [{self.start}, {self.end}): under a "
                "pipeline the model's forward must call every block of its list once, in order. One that skips "
                "a block in some steps (a branch, a layer drop of its own) or calls blocks out of order cannot be "
                "split into stages: pass pipeline_length=1 (data parallel), where any order trains."
            )
        if index == start and start > 0:
            incoming, hidden = self._incoming().tensor, _first_input(args, kwargs, first_arg)
            if hidden is not None and hidden is not incoming:
                _refuse_changed_boundary(index, hidden, served=start > self.start)
            args, kwargs = _replace_first_input(args, kwargs, first_arg, incoming)
        if index == self.capture_at + 1 and self.captured is not None:
            self._check_captured_input(index, _first_input(args, kwargs, first_arg))
        if index == start and self.capture_at >= start:
            self._uncacheable_if_hooked(range(start, self.capture_at + 1))
        if index == start and self.on_first_block is not None:
            self.on_first_block()
        output = self.timer.run(index, original, *args, **kwargs)
        if index == self.capture_at:
            self._capture(output)
        if index == self.end - 1 and not self.is_last_stage:
            self._refuse_reentrant_exit(index)
            raise StageExit(Activation.of_output(output))
        return output

    def _refuse_reentrant_exit(self, index: int) -> None:
        """A stage whose last block ran in a reentrant checkpoint hands on an output that needs no
        gradient: the next stage sends none back, and this stage's weights would never train."""
        training = self.calls is not None and self.calls.refuse_repeats
        if not training or torch.is_grad_enabled() or not in_reentrant_checkpoint():
            return
        if any(p.requires_grad for i in range(self.start, self.end) for p in self.blocks[i].parameters()):
            raise UnsupportedRecipeError(
                f"block {index}, the last block of a pipeline stage, ran inside a reentrant activation checkpoint "
                f"(torch.utils.checkpoint with use_reentrant=True, its default when use_reentrant is not passed): "
                f"its output, which crosses to the next stage, requires no gradient, and the blocks of this stage "
                f"and the stages before it would never train. A checkpoint taken around a block's call recomputes "
                f"it where a stage cannot: checkpoint inside each block's forward (torch's checkpoint_wrapper on "
                f"each block; Hugging Face 5's gradient_checkpointing_enable), or pass pipeline_length=1."
            )

    def _count(self, index: int, calls: BlockCalls) -> None:
        """Before block ``index`` runs: a second run of a block in one micro-batch's step is refused
        under a pipeline, and ends AutoCache's part in it (served or captured states stand for one
        run of each block: a second call of the model may differ in any input, or in weights)."""
        if index not in calls.seen:
            calls.seen.add(index)
            return
        if calls.refuse_repeats:
            raise RuntimeError(
                f"block {index} ran twice in one micro-batch's {calls.step}: the step calls the model more than once "
                f"(two views of a batch, the model as its own teacher), or the model reuses a block's weights "
                f"(ALBERT). A pipeline stage runs its blocks once per micro-batch: call the model once per step "
                f"(concatenate the views into one batch), or pass ElasticPipelineStrategy(pipeline_length=1)."
            )
        if self.on_uncacheable is not None:
            self._uncacheable(
                f"block {index} ran twice in one {calls.step} (the model called more than once per step, or reusing "
                f"a block's weights as ALBERT does): a cached state stands for one run of each block"
            )
            self.skip_until = 0

    def _serve_only_unhooked_blocks(self) -> None:
        """AutoCache serves none of the blocks it would skip when one has a forward hook (which
        would see the cached state instead of the block's output): they run, and it stops."""
        if self._uncacheable_if_hooked(range(self.start, self.skip_until)):
            self.skip_until = 0

    def _uncacheable_if_hooked(self, indices: range) -> bool:
        """End AutoCache's part where a block of ``indices`` (of the frozen prefix) has a forward hook."""
        hooked = next((i for i in indices if _has_user_forward_hook(self._block_modules[i])), None)
        if hooked is not None:
            self._uncacheable(
                f"block {hooked} of the frozen prefix, or a module inside it, has a forward hook, which a cached "
                f"state skips"
            )
        return hooked is not None

    def _check_captured_input(self, index: int, hidden: Any) -> None:
        """The captured output of block ``index - 1`` must be what block ``index`` gets, or a
        cached state would leave out what the model does between them."""
        if isinstance(hidden, (tuple, list)):
            self._uncacheable(f"{_whole_output_passed_on(index, hidden)}, where a cached state stands for a tensor")
        elif hidden is not self.captured.tensor:
            self._uncacheable(
                f"the model changes the hidden state between blocks {index - 1} and {index}, outside the block "
                f"list, so block {index - 1}'s output is not block {index}'s input"
            )

    def _uncacheable(self, reason: str) -> None:
        """AutoCache's part in this micro-batch ends (its ``on_uncacheable`` says why); every block
        from here on is computed."""
        if self.on_uncacheable is not None:
            self.on_uncacheable(reason)
        self.on_uncacheable = None
        self.capture_at, self.captured = -1, None

    def _capture(self, output: Any) -> None:
        try:
            self.captured = Activation.of_output(output)
        except BoundaryError as error:  # for AutoCache, which cannot keep it: not a stage boundary
            if self.on_uncacheable is None or (self.capture_at == self.end - 1 and not self.is_last_stage):
                raise
            self.on_uncacheable(f"the frozen prefix's last block returns what cannot be kept ({error})")
            return
        if self.on_capture is not None:
            self.on_capture()

    def _incoming(self) -> Activation:
        if self.incoming is None:
            raise RuntimeError(
                "the model was called outside a pipelined step: under ElasticPipelineStrategy each rank "
                "holds only its stage's blocks, so call the model from training/validation/test/predict_step. "
                "If this happened in the backward, activation checkpointing wraps several blocks from outside "
                "them and recomputes them there (timm's set_grad_checkpointing does): a stage cannot; turn it off, "
                "checkpoint inside each block (Hugging Face's gradient_checkpointing_enable), or pass "
                "pipeline_length=1."
            )
        return self.incoming


# Forward hooks that leave a block's output alone and collect nothing from it: ours (a trace's), torch's
# composable activation checkpoint, transformers' output capturing, inert unless outputs of every block
# are asked for (which is refused, or turns the cache off), and Lightning's PyTorchProfiler, which names
# each module's time (a module that does not run has none).
_INERT_HOOK_MODULES = (
    "lightning_pipetx",
    "torch.distributed._composable.checkpoint_activation",
    "transformers.utils.output_capturing",
    "lightning.pytorch.profilers",
)


def _has_user_forward_hook(modules: list[nn.Module]) -> bool:
    """Whether one of ``modules`` (a block and the modules inside it) has a forward hook of the
    user's: skipped, the block would hand it the hidden state its stage received, and the modules
    inside it would not call theirs."""
    return any(
        not str(getattr(_unwrapped(hook), "__module__", "")).startswith(_INERT_HOOK_MODULES)
        for module in modules
        if module._forward_hooks
        for hook in module._forward_hooks.values()
    )


def _unwrapped(hook: Callable) -> Callable:
    while isinstance(hook, functools.partial):
        hook = hook.func
    return hook


def _first_input(args: tuple, kwargs: dict[str, Any], first_arg: str | None) -> Any:
    return args[0] if args else kwargs.get(first_arg)


def _refuse_hooked_skipped_block(index: int) -> None:
    raise UnsupportedRecipeError(
        f"block {index}, or a module inside it, has a forward hook (register_forward_hook) under a pipeline: the "
        f"block runs on another stage, and on this one the hook would get the hidden state this stage received "
        f"instead of the block's output, or not be called at all (deep supervision, feature distillation, "
        f"attention maps). Take what the hook collects from the model's outputs, make a hook that changes its "
        f"module's output (an adapter) a sub-module the block calls, or pass ElasticPipelineStrategy(pipeline_length=1)."
    )


def _whole_output_passed_on(index: int, hidden: tuple | list) -> str:
    return (
        f"block {index} takes a {type(hidden).__name__} as its first input (the model hands a block's whole "
        f"output to the next block as one argument)"
    )


def _refuse_changed_boundary(index: int, hidden: Any, served: bool) -> None:
    where = "AutoCache's cached state" if served else "a pipeline stage boundary"
    fix = "cache=False" if served else "pipeline_length=1"
    if isinstance(hidden, (tuple, list)):
        raise UnsupportedRecipeError(
            f"{_whole_output_passed_on(index, hidden)}: {where} hands on the hidden state as a tensor, the first "
            f"argument of the block after it. Make each block take the hidden state as a tensor first argument "
            f"and the rest as further arguments (h, mask = block(h, mask)), or pass ElasticPipelineStrategy({fix})."
        )
    raise UnsupportedRecipeError(
        f"the model changes the hidden state between blocks {index - 1} and {index}, outside the block list (a "
        f"module applied between blocks, as DeBERTa-v2's conv after block 0, or a residual added around each "
        f"block, as XLM's feed-forward list), or a forward pre-hook of block {index} replaced its input: "
        f"{where} stands for block {index - 1}'s output there and would leave that out. Pass "
        f"ElasticPipelineStrategy({fix}), or blocks= naming a list whose blocks hold all of each layer's work."
    )


def _replace_first_input(
    args: tuple, kwargs: dict[str, Any], first_arg: str | None, value: torch.Tensor
) -> tuple[tuple, dict[str, Any]]:
    if args:
        return (value, *args[1:]), kwargs
    if first_arg is None or first_arg not in kwargs:
        raise TypeError("cannot find the hidden-state input of the stage's first block")
    return args, {**kwargs, first_arg: value}


class BlockCalls:
    """The blocks one micro-batch's step has run (``step``: its name in messages)."""

    def __init__(self, step: str, refuse_repeats: bool) -> None:
        self.step = step
        self.refuse_repeats = refuse_repeats  # pipelined training
        self.seen: set[int] = set()
