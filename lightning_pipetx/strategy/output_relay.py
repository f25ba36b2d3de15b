"""Evaluation steps run to their end on every stage, with the model's real output.

Under a pipeline, the forward of a non-last stage stops after the stage's last block. In
training that ends the step on that rank: the code after the model call runs on the last
stages only, because the pipeline cannot wait there. In ``validation_step``, ``test_step``
and ``predict_step`` :class:`OutputRelay` lets the step go on. It wraps the forward of every
module from the LightningModule down to the block list; the outermost of them that the step
calls becomes a pipelined call: a stage receives the hidden state from the previous stage,
runs its blocks and sends the result on, then every stage of the replica receives the call's
output from the last stage, and the call returns it. The rest of the user's step (metrics,
``self.log``, lists of outputs, ``self.all_gather``) then runs on every rank with the output
a single process would have computed.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipetx.strategy.installed import InstalledForward
from lightning_pipetx.strategy.model_checks import UnsupportedRecipeError
from lightning_pipetx.strategy.stage_hooks import StageExit, StageHooks
from lightning_pipetx.strategy.stage_runner import StageRunner
from lightning_pipetx.strategy.topology import Topology


def modules_on_path(root: nn.Module, path: str) -> list[nn.Module]:
    """``root`` and every module between it and the module at dotted ``path`` (excluded)."""
    modules, current = [root], root
    for name in path.split(".")[:-1]:
        current = getattr(current, name)
        modules.append(current)
    return modules


class OutputRelay:
    """Turns the outermost model call of an evaluation step into a pipelined call."""

    def __init__(
        self,
        root: nn.Module,
        path: str,
        topology: Topology,
        hooks: StageHooks,
        runner: StageRunner,
        device: torch.device,
    ) -> None:
        self.modules = modules_on_path(root, path)
        self.topology = topology
        self.hooks = hooks
        self.runner = runner
        self.device = torch.device(device)
        self._fingerprint: torch.Tensor | None = None  # the evaluation batch's, before its step
        self._active = False
        self._depth = 0
        self._saved: list[Any] = []
        self._caches: weakref.WeakSet[Any] = weakref.WeakSet()  # key/value caches the relayed calls returned

    def install(self) -> None:
        self._saved = [module.__dict__.get("forward") for module in self.modules]
        for module in self.modules:
            module.forward = InstalledForward(module.forward, self._forward, module.forward)

    def remove(self) -> None:
        for module, saved in zip(self.modules, self._saved):
            if saved is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = saved
        self._saved = []

    def begin(self, batch: Any) -> None:
        """Relay the model calls of the evaluation step that reads ``batch`` (before it runs)."""
        self._fingerprint, self._active, self._depth = self.runner.fingerprint(batch), True, 0

    def end(self) -> None:
        self._fingerprint, self._active, self._depth = None, False, 0

    def _forward(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        if not self._active or self._depth > 0:
            return original(*args, **kwargs)
        if torch.is_grad_enabled() and self.topology.pipeline_length > 1:  # on every stage, before any exchange
            raise UnsupportedRecipeError(
                f"ElasticPipelineStrategy: an evaluation step calls the model with gradients enabled (under "
                f"torch.enable_grad(): input saliency, test-time adaptation), which a pipeline of "
                f"{self.topology.pipeline_length} stages cannot run: no backward reaches the blocks of the stages "
                f"before the last, nor the step's inputs. Evaluate with a Trainer whose strategy has "
                f"pipeline_length=1, or call the model without gradients."
            )
        self._refuse_returned_cache(args, kwargs)
        self._depth += 1
        try:
            output = self._run_stage(original, args, kwargs)
        finally:
            self._depth -= 1
        output = share_output(output, self.topology, self.device)
        cache = output.get("past_key_values") if isinstance(output, Mapping) else None
        if cache is not None:
            with contextlib.suppress(TypeError):  # a cache of tuples cannot be watched
                self._caches.add(cache)
        return output

    def _refuse_returned_cache(self, args: tuple, kwargs: dict) -> None:
        """Refuse, on every stage, a call given the key/value cache an earlier call returned (a
        decoding step of ``generate``): each stage filled only its own blocks' layers of it."""
        length = self.topology.pipeline_length
        if length > 1 and any(_is_in(value, self._caches) for value in (*args, *kwargs.values())):
            raise UnsupportedRecipeError(
                f"ElasticPipelineStrategy: an evaluation step's model call reads the key/value cache an earlier call "
                f"returned (generate() with use_cache=True, its default): under a pipeline of {length} stages each "
                f"stage fills only its own blocks' layers of the cache, so decoding from it would give wrong tokens. "
                f"Pass use_cache=False to generate() (or the call), or evaluate with a Trainer whose strategy has "
                f"pipeline_length=1."
            )

    def _run_stage(self, original: Callable, args: tuple, kwargs: dict) -> Any:
        topo = self.topology
        if not topo.is_first_stage:
            self.hooks.incoming = self.runner.receive_activation(self._fingerprint)
        try:
            output = original(*args, **kwargs)
        except StageExit as boundary:
            self.runner.send_activation(boundary.activation, self._fingerprint)
            return None
        finally:
            self.hooks.incoming = None
        if not topo.is_last_stage:
            raise RuntimeError(
                f"stage {topo.stage} finished a model call without reaching block {self.hooks.end - 1}: the "
                f"model's forward must run every block. "
                f"If it never calls the modules of the block list found (a list of lists, as "
                f"Funnel Transformer's), name the list it calls with ElasticPipelineStrategy(blocks=...), or pass "
                f"pipeline_length=1."
            )
        return output


def _is_in(value: Any, caches: weakref.WeakSet[Any]) -> bool:
    try:
        return value in caches
    except TypeError:  # not hashable, or not weakly referable
        return False


# ------------------------------------------------------------------ output transfer
class _TensorPickler(pickle.Pickler):
    """Pickles an object with its tensors left out (sent separately, on the device)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        self.tensors.append(obj)
        return len(self.tensors) - 1


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return self.tensors[pid]


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` is sent as."""
    return torch.uint8 if dtype == torch.bool else dtype  # not every backend reduces bool


def share_output(output: Any, topology: Topology, device: torch.device) -> Any:
    """``output`` of the last stage of this replica, on every stage of it.

    The object's structure travels pickled, its tensors as one flat buffer per dtype, so that
    NCCL moves them device to device. Tensors come back on this rank's device (tensors that
    were on the CPU, on the CPU)."""
    src, group = topology.last_stage_rank, topology.replica_group
    sender = topology.is_last_stage
    message: list[Any] = [None]
    tensors: list[torch.Tensor] = []
    if sender:
        buffer = io.BytesIO()
        pickler = _TensorPickler(buffer)
        try:
            pickler.dump(output)
        except Exception as error:
            raise TypeError(
                f"the model returned a {type(output).__name__} that cannot be sent to the other stages of the "
                f"pipeline ({error}); under ElasticPipelineStrategy an evaluation step's model call must return "
                f"tensors, numbers, strings, or containers and dataclasses of them."
            ) from error
        tensors = [t.detach() for t in pickler.tensors]
        message = [(buffer.getvalue(), [(tuple(t.shape), t.dtype, t.device.type == "cpu") for t in tensors])]
    dist.broadcast_object_list(message, src=src, group=group, device=device)
    data, specs = message[0]
    received: dict[int, torch.Tensor] = {}
    for dtype in dict.fromkeys(spec[1] for spec in specs):
        members = [i for i, spec in enumerate(specs) if spec[1] == dtype]
        sizes = [torch.Size(specs[i][0]).numel() for i in members]
        if sender:
            if sum(sizes) > 0:
                flat = torch.cat([tensors[i].to(device).reshape(-1) for i in members])
                dist.broadcast(flat.view(wire_dtype(dtype)), src=src, group=group)
            continue
        flat = torch.empty(sum(sizes), dtype=wire_dtype(dtype), device=device)
        if sum(sizes) > 0:
            dist.broadcast(flat, src=src, group=group)
        for i, part in zip(members, torch.split(flat.view(dtype), sizes)):
            shape, _, on_cpu = specs[i]
            received[i] = part.view(shape).cpu() if on_cpu else part.view(shape)
    if sender:
        return output
    return _TensorUnpickler(io.BytesIO(data), [received[i] for i in range(len(specs))]).load()
