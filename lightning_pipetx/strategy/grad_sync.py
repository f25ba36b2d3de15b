"""Gradient all-reduce and global-norm clipping across stages and replicas.

Two kinds of parameters:

* *stage* parameters (the blocks a rank runs) are averaged over the stage group, one
  rank per replica, as DDP would;
* *shared* parameters (everything outside the block list: embeddings, head, tied
  weights) live on every rank and get gradient contributions on the stages that use them
  (``pre`` on the first, ``post`` on the last); they are summed over the world and
  divided by the number of replicas.

A parameter without a gradient on every rank (unused, or frozen) keeps ``grad=None``, so
the optimizer skips it exactly as it would in a single process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from lightning_pipetx.strategy.topology import Topology


class GradientSync:
    """All-reduces gradients and computes the global gradient norm for one layout."""

    def __init__(
        self,
        all_params: list[nn.Parameter],
        stage_params: list[nn.Parameter],
        shared_params: list[nn.Parameter],
        topology: Topology,
    ) -> None:
        self.all_params = all_params
        self.stage_params = stage_params
        self.shared_params = shared_params
        self.topology = topology
        self._index = {id(p): i for i, p in enumerate(all_params)}

    def _has_grad_anywhere(self, device: torch.device) -> torch.Tensor:
        mask = torch.tensor([p.grad is not None for p in self.all_params], dtype=torch.uint8, device=device)
        if self.topology.layout.world_size > 1:
            dist.all_reduce(mask, op=dist.ReduceOp.MAX)
        return mask.bool().cpu()

    def all_reduce(self, device: torch.device) -> None:
        """Average gradients as single-process training on the global batch would have them."""
        layout = self.topology.layout
        if layout.world_size == 1:
            return
        mask = self._has_grad_anywhere(device)
        groups = ((self.stage_params, self.topology.stage_group, layout.replicas),)
        groups += ((self.shared_params, None, layout.world_size),)
        for params, group, group_size in groups:
            if group_size == 1:
                continue
            params = [p for p in params if mask[self._index[id(p)]]]
            if not params:
                continue
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in params]
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=group)
            flat /= layout.replicas
            for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(synced)

    def clip_by_norm(self, max_norm: float) -> torch.Tensor:
        """Clip every local gradient by the norm over all stages' gradients (one replica)."""
        stage_grads = [p.grad for p in self.stage_params if p.grad is not None]
        shared_grads = [p.grad for p in self.shared_params if p.grad is not None]
        device = next((g.device for g in stage_grads + shared_grads), torch.device("cpu"))
        squares = torch.zeros((), dtype=torch.float32, device=device)
        for grad in stage_grads:
            squares += grad.detach().float().pow(2).sum()
        if self.topology.is_last_stage:  # shared gradients are equal on every stage: count once
            for grad in shared_grads:
                squares += grad.detach().float().pow(2).sum()
        if self.topology.pipeline_length > 1:
            dist.all_reduce(squares, group=self.topology.replica_group)
        total = squares.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in stage_grads + shared_grads:
            grad.mul_(coef.to(grad.dtype))
        return total
