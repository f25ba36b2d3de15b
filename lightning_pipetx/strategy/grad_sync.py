"""Gradient all-reduce across replicas, overlapped with the last backward, and global-norm clipping.

Two kinds of parameters:

* *stage* parameters (the blocks a rank runs) are averaged over the stage group, one rank
  per replica, as DDP would;
* *shared* parameters (everything outside the block list: embeddings, head, tied weights)
  live on every rank but get gradients only on the stages that use them. At the first
  synchronised step of a layout, and again whenever a parameter's ``requires_grad`` changes
  (a freeze), every rank reports which of them it has gradients for; from then on each is
  summed only over the ranks of the stages that produce it (its own stage group when that is
  one stage: no extra process group) and divided by the number of replicas. The other ranks
  keep a stale copy, brought up to date by :meth:`GradientSync.share` (before checkpoints,
  freezes, layout changes and the end of fit).

Reductions run in buckets (:mod:`~lightning_pipetx.strategy.grad_buckets`). On a
synchronised step, a post-accumulate-grad hook puts each parameter's gradient into its bucket
during the backward of the step's *last* micro-batch (:meth:`GradientSync.arm`), when it is
final, and a bucket's all-reduce starts as soon as it is full and every bucket before it has
started: the same order on every rank of the group, and the reduction of late blocks overlaps
the backward of early ones. Buckets reduced over several stages (a weight tied between the first and the last
stage) start after the schedule, when point-to-point traffic is over, so that ranks never
wait on two communicators in different orders (NCCL). DDP's own reducer cannot be used: it
expects one backward per forward, while a pipeline runs many forwards before the backwards,
and it reduces every parameter over one group.

Lightning zeroes ``.grad`` between ``training_step`` (where the pipeline runs its backwards)
and ``backward``, except inside an accumulation window. The last step of a window therefore
adds the window's earlier gradients into the buckets, and the hand-over checks that Lightning
left ``.grad`` as expected. A parameter without a gradient on every rank keeps ``grad=None``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_pipetx.blocks import BlockSplit
from lightning_pipetx.strategy.grad_buckets import Bucket, make_buckets, wait_and_install
from lightning_pipetx.strategy.topology import Topology
from lightning_pipetx.strategy.transition import broadcast_shared

DEFAULT_BUCKET_BYTES = 25 * 2**20
Grads = Sequence[torch.Tensor | None]


class UnexpectedGradientError(RuntimeError):
    """A weight outside the block list got a gradient on a stage that produced none for it
    when the layout's gradient producers were found."""


class GradientSync:
    """Synchronises the gradients of one layout: :meth:`begin_step`, :meth:`arm` (before the
    last backward), :meth:`end_step` around the schedule, then :meth:`install` in ``backward``."""

    def __init__(
        self,
        all_params: Sequence[nn.Parameter],
        stage_params: Sequence[nn.Parameter],
        shared_params: Sequence[nn.Parameter],
        topology: Topology,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        optimizers: Callable[[], Sequence[Optimizer]] = list,
        timeout: timedelta | None = None,
    ) -> None:
        self.all_params = list(all_params)
        self.stage_params = list(stage_params)
        self.shared_params = list(shared_params)
        self.topology = topology
        self.bucket_bytes = bucket_bytes
        self.optimizers = optimizers
        self.timeout = timeout
        self.device = next((p.device for p in self.all_params), torch.device("cpu"))
        self._order = {id(p): i for i, p in enumerate(self.all_params)}
        # Found by discovery: which stages produce each shared parameter's gradient.
        self.producers: dict[int, frozenset[int]] = {}
        self.buckets: list[Bucket] = []  # over this stage's group, started during the last backward
        self.late_buckets: list[Bucket] = []  # over several stages, started after the schedule
        self._signature: tuple[bool, ...] | None = None  # requires_grad flags at discovery
        self._slots: dict[int, tuple[Bucket, int]] = {}
        self._hooks: list = []
        self._groups: dict[frozenset[int], dist.ProcessGroup] = {}
        self._local: list[nn.Parameter] = []  # trained here, reduced nowhere (a group of one rank)
        self._trained_here: set[int] = set()
        self._stale = False
        # Per step.
        self._sync = False
        self._armed_step = False  # a synchronised step of a known layout: the hooks fill the buckets
        self._in_last_backward = False
        self._next = 0
        self._stashed: list[torch.Tensor | None] = []  # .grad as Lightning left it
        self._earlier: dict[int, torch.Tensor] | None = None  # the window's gradients, added into buckets
        self._fresh: list[torch.Tensor | None] | None = None
        self._window_open = False  # the previous step accumulated: Lightning will not zero .grad
        self.launched_during_backward = 0  # buckets whose all-reduce started before the backward ended

    @classmethod
    def for_stage(
        cls,
        module: nn.Module,
        split: BlockSplit,
        block_range: range,
        topology: Topology,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        optimizers: Callable[[], Sequence[Optimizer]] = list,
        timeout: timedelta | None = None,
    ) -> GradientSync:
        """The gradient sync of the stage that runs blocks ``block_range`` of ``split`` (a block list
        of ``module``): those blocks' weights are its stage parameters, every weight outside the
        block list is shared."""
        all_params = list(module.parameters())
        block_ids = {id(p) for i in range(split.num_blocks) for p in split.block_parameters(i)}
        return cls(
            all_params,
            [p for i in block_range for p in split.block_parameters(i)],
            [p for p in all_params if id(p) not in block_ids],
            topology,
            bucket_bytes,
            optimizers,
            timeout,
        )

    # ------------------------------------------------------------ a step
    def begin_step(self, sync: bool) -> None:
        """Before the schedule: the step's gradients start from None (``.grad`` is set aside).

        On a synchronised step of a known layout the buckets get fresh buffers, to be filled
        during the last backward."""
        self._sync = sync
        self._stashed = [p.grad for p in self.all_params]
        for p in self.all_params:
            p.grad = None
        self._armed_step = sync and self._signature is not None and self._signature == self._current_signature()
        if not self._armed_step:
            return
        self._earlier = None
        if self._window_open:
            self._earlier = {id(p): g for p, g in zip(self.all_params, self._stashed) if g is not None}
        for bucket in self.buckets + self.late_buckets:
            bucket.reset()
        self._next = 0

    def arm(self) -> None:
        """Called before this stage's last backward of the step: gradients are final as they arrive."""
        self._in_last_backward = self._armed_step

    def abort(self) -> None:
        """The schedule failed: start no reduction."""
        self._armed_step = self._in_last_backward = False

    def end_step(self) -> None:
        """After the schedule: start the reductions not started yet, in order; keep the step's
        gradients aside and give ``.grad`` back."""
        self._in_last_backward = False
        if self._armed_step:
            for bucket in self.buckets[self._next :] + self.late_buckets:
                bucket.fill_missing([p.grad for p in bucket.params], [self._earlier_grad(p) for p in bucket.params])
                bucket.launch()
            self._next = len(self.buckets)
        self._fresh = [p.grad for p in self.all_params]
        for p, grad in zip(self.all_params, self._stashed):
            p.grad = grad
        self._stashed = []

    def install(self) -> None:
        """In Lightning's ``backward`` (after its ``zero_grad``): add the step's gradients to
        ``.grad``, reduced over the ranks that produce them when the step synchronises."""
        if self._fresh is None:
            raise RuntimeError("backward called without a pipelined training_step before it")
        fresh, self._fresh = self._fresh, None
        if not self._sync:
            _accumulate(self.all_params, fresh)
            self._window_open = True
            return
        if self._armed_step:
            stepped = self._stepped()
            if self.buckets or self.late_buckets:
                self._check_zeroed(stepped)
            # A weight no optimizer zeroes keeps its gradient, the reduced one adds to it (a window's
            # later steps reduce it with their earlier gradients already).
            kept = [] if self._earlier is not None else self._kept_grads(stepped)
            wait_and_install(self.buckets + self.late_buckets)
            _accumulate([p for p, _ in kept], [g for _, g in kept])
            _accumulate(self._local, [fresh[self._order[id(p)]] for p in self._local])
            if self.topology.layout.world_size > 1:
                # the window's earlier batches gave the gradients of the weights Lightning zeroed at its start
                earlier = {i for i in self._earlier or {} if stepped is None or i in stepped}
                self._check_unexpected(fresh, earlier)
        else:
            _accumulate(self.all_params, fresh)
            if self._signature != self._current_signature():
                self.share(self.optimizers())  # producers are about to change: bring every rank up to date
                self._discover()
            for bucket in self.buckets + self.late_buckets:
                bucket.reset()
                bucket.fill_missing([p.grad for p in bucket.params], [None] * len(bucket.params))
                bucket.launch()
            wait_and_install(self.buckets + self.late_buckets)
        self._armed_step = self._window_open = False
        if any(0 < len(stages) < self.topology.pipeline_length for stages in self.producers.values()):
            self._stale = True

    # ---------------------------------------------------------- hooks
    def _on_gradient(self, param: nn.Parameter) -> None:
        if not self._in_last_backward:
            return
        bucket, index = self._slots[id(param)]
        bucket.fill(index, param.grad, self._earlier_grad(param))
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            self.buckets[self._next].launch()
            self._next += 1
            self.launched_during_backward += 1

    def _earlier_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        return None if self._earlier is None else self._earlier.get(id(param))

    # ---------------------------------------------------------- checks
    def _stepped(self) -> set[int] | None:
        """Ids of the weights the optimizers step (and Lightning zeroes); None if no optimizer is known."""
        stepped = {id(p) for opt in self.optimizers() for group in opt.param_groups for p in group["params"]}
        return stepped or None

    def _kept_grads(self, stepped: set[int] | None) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """The gradients of bucketed weights that no optimizer steps: they add up, as in one process."""
        if stepped is None:
            return []
        bucketed = [p for bucket in self.buckets + self.late_buckets for p in bucket.params]
        return [(p, p.grad) for p in bucketed if id(p) not in stepped and p.grad is not None]

    def _check_zeroed(self, stepped: set[int] | None) -> None:
        """The buckets assumed that Lightning zeroes ``.grad`` exactly at the start of a window
        (of the optimizers' weights: a trainable weight outside them keeps adding up, as in one process)."""
        params = self.all_params if stepped is None else [p for p in self.all_params if id(p) in stepped]
        if self._earlier is not None:
            kept = all(p.grad is self._earlier[id(p)] for p in params if id(p) in self._earlier)
        else:
            left = [p.grad.detach() for p in params if p.grad is not None and p.grad.numel()]
            kept = not left or not bool(torch.stack([g.abs().amax().float() for g in left]).amax() > 0)
        if not kept:
            raise RuntimeError(
                "ElasticPipelineStrategy: .grad was not zeroed as Lightning zeroes it (at the first batch of each "
                "accumulation window, never inside one), so the gradients reduced during the backward are wrong. "
                "Does an optimizer_zero_grad override skip or add zeroing?"
            )

    def _check_unexpected(self, fresh: Grads, earlier: set[int]) -> None:
        """Refuse a gradient, of this step or of the window's earlier batches (the weights ``earlier``
        names), that no bucket reduces."""
        for position, (param, grad) in enumerate(zip(self.all_params, fresh)):
            if (grad is not None or id(param) in earlier) and id(param) not in self._trained_here:
                raise UnexpectedGradientError(
                    f"ElasticPipelineStrategy: parameter #{position} (shape {tuple(param.shape)}, outside the block "
                    f"list) got a gradient on stage {self.topology.stage}, which produced none for it in the first "
                    "step of this layout. Gradients of weights outside the block list are reduced only over the "
                    "stages found to produce them then; a weight used only in some steps is not supported. Make it "
                    "take part in every step (for example multiply its output by 0 when unused)."
                )

    # ------------------------------------------------------- discovery
    def _current_signature(self) -> tuple[bool, ...]:
        return tuple(p.requires_grad for p in self.all_params)

    def _discover(self) -> None:
        """Agree on which stages produce each shared gradient; build groups, buckets and hooks."""
        layout, stage = self.topology.layout, self.topology.stage
        mask = torch.tensor([p.grad is not None for p in self.shared_params], dtype=torch.uint8, device=self.device)
        gathered = [mask]
        if layout.world_size > 1:
            gathered = [torch.empty_like(mask) for _ in range(layout.world_size)]
            dist.all_gather(gathered, mask)
        rows = [row.tolist() for row in gathered]
        self.producers = {
            id(p): frozenset(layout.coords(rank)[1] for rank, row in enumerate(rows) if row[j])
            for j, p in enumerate(self.shared_params)
        }
        self._signature = self._current_signature()
        self._build(stage)

    def _group(self, stages: frozenset[int]) -> dist.ProcessGroup | None:
        if len(stages) == self.topology.pipeline_length:
            return None  # the world
        return self._groups[stages]

    def _build(self, stage: int) -> None:
        layout = self.topology.layout
        for stages in sorted({s for s in self.producers.values() if 1 < len(s) < layout.pipeline_length}, key=sorted):
            if stages not in self._groups:  # every rank creates every group, in the same order
                ranks = sorted(r for s in stages for r in layout.stage_ranks(s))
                self._groups[stages] = dist.new_group(ranks, timeout=self.timeout)
        trainable = [p for p in self.stage_params if p.requires_grad]
        shared = [p for p in self.shared_params if stage in self.producers[id(p)]]
        self._trained_here = {id(p) for p in trainable + shared}
        reverse = lambda params: sorted(params, key=lambda p: -self._order[id(p)])  # noqa: E731 - backward order
        own = trainable + [p for p in shared if len(self.producers[id(p)]) == 1]
        multi = [p for p in shared if len(self.producers[id(p)]) > 1]
        replicas = layout.replicas
        self._local = own if replicas == 1 else []
        self.buckets = (
            [] if replicas == 1 else make_buckets(reverse(own), self.topology.stage_group, replicas, self.bucket_bytes)
        )
        self.late_buckets = []
        for stages in sorted({self.producers[id(p)] for p in multi}, key=sorted):
            members = reverse([p for p in multi if self.producers[id(p)] == stages])
            self.late_buckets += make_buckets(members, self._group(stages), replicas, self.bucket_bytes)
        for handle in self._hooks:
            handle.remove()
        self._slots = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for b in self.buckets for p in b.params]

    # ------------------------------------------------------ who trains what
    def stages_using(self, param: nn.Parameter) -> tuple[int, ...] | None:
        """The stages whose gradients make up ``param``'s (None before discovery)."""
        if self._signature is None:
            return None
        if id(param) in self.producers:
            return tuple(sorted(self.producers[id(param)]))
        return (self.topology.stage,) if id(param) in self._trained_here else ()

    def owner_stage(self, param: nn.Parameter) -> int | None:
        """For a shared parameter that only some stages update: the first of them (None when
        every rank updates it, or none does)."""
        stages = self.producers.get(id(param), frozenset())
        return min(stages) if 0 < len(stages) < self.topology.pipeline_length else None

    def reset_usage(self) -> None:
        """Find the producers again at the next synchronised step (call :meth:`share` first)."""
        self._signature = None

    # --------------------------------------------------- stale copies
    def share(self, optimizers: Sequence[Optimizer]) -> None:
        """Give every rank the current shared weights, with their optimizer state, from a rank
        that updates them; nothing when no copy is stale. A collective over the world."""
        if not self._stale:
            return
        self._stale = False
        broadcast_shared(self.shared_params, self.owners(), list(optimizers), self.device)

    def share_weights(self) -> None:
        """Give every rank the current shared weights, without their optimizer state (which
        stays stale until :meth:`share`). A collective over the world."""
        if self._stale:
            broadcast_shared(self.shared_params, self.owners(), [], self.device)

    def owners(self) -> dict[int, int]:
        """The global rank each shared weight is copied from: replica 0's stage that updates it."""
        layout, owners = self.topology.layout, {}
        for param in self.shared_params:
            stage = self.owner_stage(param)
            if stage is not None:
                owners[id(param)] = layout.rank(0, stage)
        return owners

    @property
    def groups(self) -> list[dist.ProcessGroup]:
        """The process groups this object created that this rank belongs to."""
        return [group for group in self._groups.values() if group is not dist.GroupMember.NON_GROUP_MEMBER]

    def close(self) -> None:
        """Remove the hooks and free the process groups this object created."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        while self._groups:  # one at a time: an interrupted close leaves the rest listed
            dist.destroy_process_group(self._groups.popitem()[1])

    # --------------------------------------------------------- clipping
    def clip_by_norm(self, max_norm: float, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Clip the local gradients of ``optimizer``'s parameters by their norm over all stages
        (one replica), as Lightning clips ``optimizer``'s parameters only."""
        stage = self.topology.stage
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        counted, local = [], []
        for p in self.stage_params + self.shared_params:
            if p.grad is None or id(p) not in stepped:
                continue
            local.append(p.grad)
            stages = self.producers.get(id(p))
            if not stages or stage == min(stages):  # a shared gradient is equal on its stages: count it once
                counted.append(p.grad)
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for grad in counted:
            squares += grad.detach().float().pow(2).sum()
        if self.topology.pipeline_length > 1:
            dist.all_reduce(squares, group=self.topology.replica_group)
        total = squares.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in local:
            grad.mul_(coef.to(grad.dtype))
        return total


def _accumulate(params: Sequence[nn.Parameter], grads: Grads) -> None:
    for param, grad in zip(params, grads):
        if grad is None:
            continue
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)
