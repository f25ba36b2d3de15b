"""Gradient all-reduce, bucketed and overlapped with the backward, and global-norm clipping.

Each parameter is averaged over the ranks that produce gradients for it, and only those:

* *stage* parameters (the blocks a rank runs) over the stage group, one rank per replica;
* *shared* parameters (outside the block list: embeddings, head, tied weights, weights that
  every block uses) over the ranks of the stages that use them, in every replica; their
  per-stage contributions add up to the replica's gradient.

Which stages use which parameter is found at the first synchronised step of a layout (one
small all-reduce) and kept until the frozen prefix changes; as in DDP, a parameter found
unused keeps ``grad=None`` (the optimizer skips it as one process would), and a parameter
used at discovery that gets no gradient in a later step contributes zeros.

From the second step on, gradients are copied into flat buckets as the last micro-batch's
backward produces them (``register_post_accumulate_grad_hook``), and each bucket's
all-reduce starts as soon as it is full, while the backward goes on. After the backward
(Lightning's ``backward``), the reduced buckets become the parameters' ``.grad``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipetx.strategy.topology import Topology

DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclass
class _Bucket:
    """Gradients of some parameters reduced together over one process group."""

    params: list[nn.Parameter]
    group: dist.ProcessGroup | None
    buffer: torch.Tensor
    offsets: list[int]
    filled: set[int] = field(default_factory=set)
    work: dist.Work | None = None

    def put(self, position: int, grad: torch.Tensor) -> None:
        start = self.offsets[position]
        self.buffer[start : start + grad.numel()].copy_(grad.reshape(-1))
        self.filled.add(position)

    def launch(self) -> None:
        self.work = dist.all_reduce(self.buffer, group=self.group, async_op=True)

    def views(self) -> list[torch.Tensor]:
        return [self.buffer[start : start + p.numel()].view_as(p) for p, start in zip(self.params, self.offsets)]


class UnexpectedGradientError(RuntimeError):
    """A parameter got a gradient although no rank produced one when usage was discovered."""


class GradientSync:
    """Averages gradients as single-process training on the global batch would have them."""

    def __init__(
        self,
        all_params: Sequence[nn.Parameter],
        stage_params: Sequence[nn.Parameter],
        shared_params: Sequence[nn.Parameter],
        topology: Topology,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.all_params = list(all_params)
        self.stage_params = list(stage_params)
        self.shared_params = list(shared_params)
        self.topology = topology
        self.bucket_bytes = bucket_bytes
        self._stage_ids = {id(p) for p in self.stage_params}
        self._index = {id(p): i for i, p in enumerate(self.all_params)}
        # Usage, discovered at the first synchronised step: the stages that produce each
        # parameter's gradient, and the buckets built from it.
        self._usage: dict[int, tuple[int, ...]] | None = None
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, tuple[_Bucket, int]] = {}
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._hooks: list = []
        # Per step.
        self._sync = False
        self._armed = False
        self._window_open = False  # earlier batches of this accumulation window left gradients in .grad
        self._earlier: list[torch.Tensor | None] = []
        self._fresh: list[torch.Tensor | None] | None = None
        self.launched_during_backward = 0  # buckets whose all-reduce started before the backward ended

    # ------------------------------------------------------------------ a step
    def begin_step(self, sync: bool) -> None:
        """Before the schedule: gradients start from zero (Lightning's ``.grad`` is set aside)."""
        self._sync = sync
        self._earlier = [p.grad for p in self.all_params]
        for p in self.all_params:
            p.grad = None
        for bucket in self._buckets:
            bucket.filled.clear()
            bucket.work = None
        if self._usage is not None and not self._hooks and self.topology.layout.world_size > 1:
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._bucketed_params()]

    def arm(self) -> None:
        """Called before this stage's last backward: its gradients are final as they arrive."""
        self._armed = self._sync and self._usage is not None

    def end_step(self) -> None:
        """After the schedule: keep the new gradients aside and give ``.grad`` back."""
        self._armed = False
        self._fresh = [p.grad for p in self.all_params]
        for p, grad in zip(self.all_params, self._earlier):
            p.grad = grad

    def install(self) -> None:
        """In Lightning's ``backward`` (after its ``zero_grad``): put the step's gradients in
        ``.grad``, reduced over the replicas when this step synchronises."""
        if self._fresh is None:
            raise RuntimeError("backward called without a pipelined training_step before it")
        fresh, self._fresh = self._fresh, None
        earlier = self._earlier if self._window_open else [None] * len(fresh)
        self._earlier = []
        if not self._sync or self.topology.layout.world_size == 1:
            for p, grad in zip(self.all_params, fresh):
                if grad is not None:
                    p.grad = grad if p.grad is None else p.grad.add_(grad)
            self._window_open = not self._sync
            return
        self._window_open = False
        totals = [_add(a, b) for a, b in zip(fresh, earlier)]
        if self._usage is None:
            self._discover(totals)
        self._check_unexpected(totals)
        for bucket in self._buckets:
            if bucket.work is None:
                for position, p in enumerate(bucket.params):
                    if position not in bucket.filled:
                        total = totals[self._index[id(p)]]
                        bucket.put(position, total if total is not None else torch.zeros_like(p))
                bucket.launch()
        replicas = self.topology.layout.replicas
        for bucket in self._buckets:
            bucket.work.wait()
            if replicas > 1:
                bucket.buffer.div_(replicas)
            for p, view in zip(bucket.params, bucket.views()):
                p.grad = view
        for p, total in zip(self.all_params, totals):
            if id(p) not in self._bucket_of:
                p.grad = total if self._usage.get(id(p)) else None

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._armed:
            return
        bucket, position = self._bucket_of[id(param)]
        grad = param.grad
        if self._window_open:
            earlier = self._earlier[self._index[id(param)]]
            if earlier is not None:
                grad = grad + earlier
        bucket.put(position, grad)
        if len(bucket.filled) == len(bucket.params):
            bucket.launch()
            self.launched_during_backward += 1

    # ---------------------------------------------------------------- usage
    def stages_using(self, param: nn.Parameter) -> tuple[int, ...] | None:
        """The stages whose gradients make up ``param``'s (None before discovery)."""
        return None if self._usage is None else self._stages_of(param)

    def owner_stage(self, param: nn.Parameter) -> int | None:
        """For a shared parameter that only some stages update: the first of them
        (None when every rank holds the same value)."""
        if self._usage is None or id(param) in self._stage_ids:
            return None
        stages = self._usage.get(id(param), ())
        return stages[0] if stages and len(stages) < self.topology.pipeline_length else None

    def reset_usage(self) -> None:
        """Forget which parameters get gradients (the frozen prefix changed)."""
        self._remove_hooks()
        self._usage = None
        self._buckets, self._bucket_of = [], {}

    def _discover(self, totals: list[torch.Tensor | None]) -> None:
        """Agree on the stages that produce each parameter's gradient; build the buckets."""
        layout, stage = self.topology.layout, self.topology.stage
        device = next((g.device for g in totals if g is not None), torch.device("cpu"))
        mask = torch.zeros(len(self.all_params), layout.pipeline_length, dtype=torch.uint8, device=device)
        for i, grad in enumerate(totals):
            mask[i, stage] = int(grad is not None)
        dist.all_reduce(mask, op=dist.ReduceOp.MAX)
        rows = mask.cpu().tolist()
        self._usage = {id(p): tuple(s for s, used in enumerate(row) if used) for p, row in zip(self.all_params, rows)}
        stage_sets = sorted({stages for stages in self._usage.values() if len(stages) > 1})
        for stages in stage_sets:  # every rank creates every group, in the same order
            if stages not in self._groups:
                ranks = sorted(layout.rank(r, s) for r in range(layout.replicas) for s in stages)
                self._groups[stages] = dist.new_group(ranks)
        self._build_buckets()

    def _stages_of(self, param: nn.Parameter) -> tuple[int, ...]:
        stages = self._usage.get(id(param), ())
        if id(param) in self._stage_ids:
            return (self.topology.stage,) if stages else ()
        return stages

    def _group_for(self, stages: tuple[int, ...]) -> tuple[dist.ProcessGroup | None, int]:
        layout = self.topology.layout
        if len(stages) == 1:
            return self.topology.stage_group, layout.replicas
        return self._groups[stages], layout.replicas * len(stages)

    def _bucketed_params(self) -> list[nn.Parameter]:
        return [p for bucket in self._buckets for p in bucket.params]

    def _build_buckets(self) -> None:
        """Buckets in reverse parameter order (the order backward produces gradients)."""
        self._buckets, self._bucket_of = [], {}
        open_buckets: dict[tuple, list[nn.Parameter]] = {}
        my_stage = self.topology.stage

        def close(key: tuple) -> None:
            params = open_buckets.pop(key)
            offsets = [0]
            for p in params[:-1]:
                offsets.append(offsets[-1] + p.numel())
            numel = offsets[-1] + params[-1].numel()
            buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
            bucket = _Bucket(params, key[0], buffer, offsets)
            for position, p in enumerate(params):
                self._bucket_of[id(p)] = (bucket, position)
            self._buckets.append(bucket)

        for p in reversed(self.all_params):
            stages = self._stages_of(p)
            if my_stage not in stages:
                continue
            group, size = self._group_for(stages)
            if size == 1:
                continue
            key = (group, p.dtype, p.device)
            open_buckets.setdefault(key, []).append(p)
            if sum(q.numel() * q.element_size() for q in open_buckets[key]) >= self.bucket_bytes:
                close(key)
        for key in list(open_buckets):
            close(key)

    def _check_unexpected(self, totals: list[torch.Tensor | None]) -> None:
        for p, total in zip(self.all_params, totals):
            if total is not None and self.topology.stage not in self._stages_of(p):
                raise UnexpectedGradientError(
                    f"parameter {self._index[id(p)]} of shape {tuple(p.shape)} got a gradient on stage {self.topology.stage}, "
                    f"but no gradient when ElasticPipelineStrategy found which parameters are used (the first "
                    f"step of this layout). Parameters whose use changes from step to step are not supported: "
                    f"use every trainable parameter in every step, or set requires_grad=False on the others."
                )

    # ------------------------------------------------------------- clipping
    def clip_by_norm(self, max_norm: float) -> torch.Tensor:
        """Clip every local gradient by the norm over all stages' gradients (one replica)."""
        counted, local = [], []
        for p in self.all_params:
            if p.grad is None:
                continue
            local.append(p.grad)
            stages = self._stages_of(p) if self._usage is not None else (self.topology.stage,)
            if id(p) in self._stage_ids or not stages or self.topology.stage == stages[0]:
                counted.append(p.grad)  # a shared gradient is equal on its stages: count it once
        device = next((g.device for g in local), torch.device("cpu"))
        squares = torch.zeros((), dtype=torch.float32, device=device)
        for grad in counted:
            squares += grad.detach().float().pow(2).sum()
        if self.topology.pipeline_length > 1:
            dist.all_reduce(squares, group=self.topology.replica_group)
        total = squares.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in local:
            grad.mul_(coef.to(grad.dtype))
        return total

    # --------------------------------------------------------------- teardown
    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def close(self) -> None:
        """Remove the hooks and free the process groups this object created."""
        self._remove_hooks()
        for group in self._groups.values():
            dist.destroy_process_group(group)
        self._groups.clear()


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else a + b
