"""One layout's pipeline: everything a transition tears down and rebuilds.

A :class:`PipelineEngine` ties together, for one :class:`Layout`, this rank's topology and
process groups, the stage's block range, the hooks on the block list, the stage runner,
gradient synchronisation and the released block weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_pipetx.autocache import AutoCache, CachedPrefix
from lightning_pipetx.blocks import BlockSplit
from lightning_pipetx.strategy.autopipe import Plan
from lightning_pipetx.strategy.grad_sync import DEFAULT_BUCKET_BYTES, GradientSync
from lightning_pipetx.strategy.log_replay import LogRecorder, LogShare, replay
from lightning_pipetx.strategy.microbatch import batch_size, join_outputs, split_batch, whole_batch_size
from lightning_pipetx.strategy.model_checks import UnsupportedRecipeError
from lightning_pipetx.strategy.output_relay import OutputRelay
from lightning_pipetx.strategy.p2p import Channel
from lightning_pipetx.strategy.param_store import ParamStore, broadcast_all, gather_block_state
from lightning_pipetx.strategy.split_backward import AVAILABLE as split_backward_available
from lightning_pipetx.strategy.stage_hooks import BlockCalls, StageExit, StageHooks
from lightning_pipetx.strategy.stage_runner import StageRunner, extract_loss, no_microbatch_context
from lightning_pipetx.strategy.stage_streams import StageStream, stage_seed
from lightning_pipetx.strategy.topology import Topology
from lightning_pipetx.strategy.transition import broadcast_shared


class PipelineEngine:
    """Runs an unchanged LightningModule as ``layout.replicas`` pipelines of ``layout.pipeline_length`` stages."""

    def __init__(
        self,
        module: pl.LightningModule,
        split: BlockSplit,
        plan: Plan,
        store: ParamStore,
        rank: int,
        device: torch.device,
        schedule: str,
        timeout: timedelta | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        optimizers: Callable[[], Sequence[Optimizer]] = list,
        split_backward: bool = True,
    ) -> None:
        self.module = module
        self.split = split
        self.plan = plan
        self.layout = plan.layout
        self.bounds = list(plan.bounds)
        self.num_microbatches = plan.num_microbatches
        self.device = device
        self.schedule = schedule
        self.topology = Topology(plan.layout, rank, timeout)
        start, end = self.bounds[self.topology.stage]
        self.block_range = range(start, end)

        self.hooks = StageHooks(split.blocks, start, end, self.topology.is_last_stage)
        self.hooks.install()
        self.runner = StageRunner(self.topology, self.hooks, Channel(device, timeout))
        self.relay = OutputRelay(module, split.path, self.topology, self.hooks, self.runner, device)
        if plan.layout.pipeline_length > 1:
            self.relay.install()
        self.store = store
        store.release(self.block_range)

        self._other_stages_params = [
            (i, p) for i in range(split.num_blocks) if i not in self.block_range for p in split.block_parameters(i)
        ]
        block_buffer_ids = {id(b) for b in split.blocks.buffers()}
        pre_buffer_ids = {id(b) for _, pre in split.pre for b in pre.buffers()}
        outer_buffers = [b for b in module.buffers() if id(b) not in block_buffer_ids]
        self.pre_buffers = [b for b in outer_buffers if id(b) in pre_buffer_ids]
        self.post_buffers = [b for b in outer_buffers if id(b) not in pre_buffer_ids]
        self.grad_sync = GradientSync.for_stage(
            module, split, self.block_range, self.topology, bucket_bytes, optimizers, timeout
        )
        self.runner.on_last_backward = self.grad_sync.arm
        self.runner.split_backward = split_backward and split_backward_available and plan.layout.pipeline_length > 1
        self.runner.weights = lambda: [p for p in self.grad_sync.all_params if p.requires_grad]
        self.recorder = LogRecorder(module, pipelined=self.topology.pipeline_length > 1)
        self.log_share = LogShare(self.topology, device)
        self.profile_steps = 0  # training steps still to time, after one warm-up step
        self._steps = 0
        self._prefix: CachedPrefix | None = None  # AutoCache, on the first stage only
        self._eval_prefix: CachedPrefix | None = None  # its validation cache, on the first stage only
        self._frozen = 0
        self._stream: StageStream | None = None  # under a pipeline: this stage's random stream

    @property
    def frozen(self) -> int:
        """Leading blocks frozen (they get no gradient)."""
        return self._frozen

    @frozen.setter
    def frozen(self, value: int) -> None:
        if value != self._frozen:
            self.grad_sync.reset_usage()  # frozen parameters stop getting gradients
        self._frozen = value

    # --------------------------------------------------------------- steps
    def _stage_stream(self) -> StageStream | None:
        """Under a pipeline, this stage's own random stream (from the layout's first step on)."""
        if self.topology.pipeline_length == 1:
            return None
        if self._stream is None:
            seed = stage_seed(torch.initial_seed(), self.topology.stage, self.module.trainer.global_step)
            self._stream = StageStream(seed, self.device, host_streams=self.topology.is_last_stage)
        return self._stream

    def _drawing_from_first_block(
        self, stream: StageStream, inner: Callable[[int], contextlib.AbstractContextManager]
    ) -> Callable[[int], contextlib.AbstractContextManager]:
        """The micro-batch context ``inner``, inside which the stage's blocks draw from ``stream``."""

        def arm(enter: Callable[[], None] | None) -> None:
            self.hooks.on_stage_start = enter

        @contextlib.contextmanager
        def context(position: int) -> Iterator[None]:
            with inner(position), stream.from_first_block(arm):
                yield

        return context

    def _microbatches(self, batch: Any) -> tuple[list[Any], list[int]]:
        if self.num_microbatches == 1:  # left whole: any batch DDP takes
            return [batch], [whole_batch_size(batch)]
        microbatches = split_batch(batch, self.num_microbatches)
        return microbatches, [batch_size(mb) for mb in microbatches]

    def _step_fn(self, step: Callable[..., Any], args: tuple, kwargs: dict, sizes: list[int]) -> Callable:
        sizes_iter = iter(sizes)

        def run(microbatch: Any) -> Any:
            self.recorder.set_weight(next(sizes_iter))
            return step(microbatch, *args, **kwargs)

        return run

    @property
    def cache(self) -> AutoCache | None:
        return self._prefix.cache if self._prefix is not None else None

    @cache.setter
    def cache(self, cache: AutoCache | None) -> None:
        use = cache is not None and self.topology.is_first_stage
        self._prefix = CachedPrefix(cache, self.hooks, self.device) if use else None

    @property
    def eval_cache(self) -> AutoCache | None:
        return self._eval_prefix.cache if self._eval_prefix is not None else None

    @eval_cache.setter
    def eval_cache(self, cache: AutoCache | None) -> None:
        if cache is not self.eval_cache:
            use = cache is not None and self.topology.is_first_stage
            self._eval_prefix = CachedPrefix(cache, self.hooks, self.device) if use else None

    def _cache_depth(self) -> int:
        """Frozen blocks whose output can be cached: those on this (first) stage."""
        return min(self.frozen, self.block_range.stop) if self.topology.is_first_stage else 0

    def train_step(
        self,
        step: Callable[..., Any],
        batch: Any,
        args: tuple,
        kwargs: dict,
        loss_scale: float,
        indices: torch.Tensor | None = None,
        sync: bool = True,
        upcoming: torch.Tensor | None = None,
    ) -> Any:
        """All forwards and backwards of one batch; the gradients wait in :meth:`install_grads`.

        ``sync``: this batch ends an accumulation window, so its gradients are reduced over the
        replicas (overlapped with the backward of the last micro-batch). ``indices``: the
        dataset indices of the batch, ``upcoming``: of the next one (AutoCache)."""
        microbatches, sizes = self._microbatches(batch)
        prefix = self._prefix if indices is not None else None
        if prefix is not None:
            rows = sizes if len(microbatches) > 1 else [len(indices)]  # a whole batch: one row per sample
            context = prefix.begin_step(batch, indices, rows, self._cache_depth())
            if context is not None:
                self.runner.microbatch_context = context
        stream = self._stage_stream()
        if stream is not None:
            self.runner.microbatch_context = self._drawing_from_first_block(stream, self.runner.microbatch_context)
        total = sum(sizes)
        weights = [loss_scale * n / total for n in sizes]
        self.grad_sync.begin_step(sync)
        self.hooks.timer.active = 0 < self._steps <= self.profile_steps
        self._steps += 1
        try:
            with self.recorder.capture():
                outputs = self.runner.train(
                    microbatches, self._step_fn(step, args, kwargs, sizes), weights, self.schedule
                )
            self._refuse_gradients_of_other_stages()
        except BaseException:
            self.grad_sync.abort()  # no reduction starts after a failed schedule
            raise
        finally:
            self.hooks.timer.active = False
            self.runner.microbatch_context = no_microbatch_context
            self.grad_sync.end_step()
        if prefix is not None:
            prefix.end_step(upcoming, self._cache_depth())

        logs = loss = None
        if self.topology.is_last_stage:
            loss = sum(extract_loss(o).detach().to(torch.float64) * (n / total) for o, n in zip(outputs, sizes))
            loss = loss.to(torch.get_default_dtype())
            logs = self.recorder.merged(self.device)
        logs, loss = self.log_share.exchange(logs, loss)
        replay(self.module, logs, received=not self.topology.is_last_stage)
        if self.topology.is_last_stage and isinstance(outputs[-1], Mapping):
            with torch.no_grad():  # the other outputs, as the whole batch would have them
                joined = join_outputs(outputs, sizes)
            return {**joined, "loss": loss}
        return loss

    def _refuse_gradients_of_other_stages(self) -> None:
        """A weight of a block another stage runs got a gradient here: the step read it after the
        model call (a weight penalty over ``self.parameters()``), where this rank holds a placeholder."""
        for index, param in self._other_stages_params:
            if param.grad is not None:
                raise UnsupportedRecipeError(
                    f"a weight of block {index}, which stage {self.topology.stage} does not run, got a gradient "
                    f"there: the training step reads the blocks' weights after the model call (a weight penalty "
                    f"such as L2 or L2-SP summed over self.parameters()). Under a pipeline each stage holds only "
                    f"its own blocks' weights (the others read NaN). Give the penalty to the optimizer "
                    f"(weight_decay), or pass ElasticPipelineStrategy(pipeline_length=1)."
                )

    def fill_cache(
        self, step: Callable[..., Any], args: tuple, kwargs: dict, indices: torch.Tensor, load: Callable[[], Any]
    ) -> None:
        """Cache the frozen prefix of the samples ``indices`` that the epoch's batches left out
        (``drop_last``; ``load`` makes their batch): the user's ``step`` runs up to the last
        frozen block, on the first stage; its ``self.log`` calls are dropped."""
        if self._prefix is None:
            return

        def run(batch: Any) -> None:
            with self.recorder.capture():
                step(batch, *args, **kwargs)

        self._prefix.fill(indices, self._cache_depth(), load, run)

    def eval_step(
        self,
        step: Callable[..., Any],
        batch: Any,
        args: tuple,
        kwargs: dict,
        indices: torch.Tensor | None = None,
        upcoming: torch.Tensor | None = None,
    ) -> Any:
        """One evaluation step on the whole batch, run to its end on every stage: the model
        call returns the last stage's output everywhere (see :mod:`output_relay`).

        ``indices``: the batch's dataset indices when :attr:`eval_cache` may serve its frozen
        prefix (``upcoming``: the next batch's)."""
        prefix = self._eval_prefix if indices is not None else None
        if prefix is None:
            return self._eval_step(step, batch, args, kwargs)
        depth = self._cache_depth()
        context = prefix.begin_step(batch, indices, [len(indices)], depth)
        try:
            with context(0) if context is not None else contextlib.nullcontext():
                # Each model call is relayed on its own under a pipeline: a repeat concerns the cache only.
                self.hooks.calls = BlockCalls("evaluation step", refuse_repeats=False)
                output = self._eval_step(step, batch, args, kwargs)
        finally:
            self.hooks.calls = None
        prefix.end_step(upcoming, depth)
        return output

    def _eval_step(self, step: Callable[..., Any], batch: Any, args: tuple, kwargs: dict) -> Any:
        if self.layout.pipeline_length == 1:
            return step(batch, *args, **kwargs)
        self.relay.begin(batch)
        try:
            return step(batch, *args, **kwargs)
        except StageExit:
            raise RuntimeError(
                f"the evaluation step ran the blocks of {self.split.path!r} without calling a module that holds "
                f"them (the LightningModule, or one on the way to the blocks): under ElasticPipelineStrategy "
                f"call the model, not its blocks one by one, in validation, test and predict steps."
            ) from None
        finally:
            self.relay.end()

    def check_batches(self, everywhere: bool) -> None:
        """Raise if the stages of a replica read different batches since the last check
        (``everywhere``: on every rank, a collective)."""
        self.runner.check_batches(everywhere)

    @property
    def profiling_done(self) -> bool:
        """Whether the profiled steps have all run (the block timer reads no more)."""
        return self._steps > self.profile_steps

    def profiled_block_seconds(self) -> list[float] | None:
        """Mean forward seconds per block over the profiled steps, agreed by every rank;
        None unless every block was timed."""
        seconds = torch.tensor(self.hooks.timer.mean_seconds(), dtype=torch.float64, device=self.device)
        if self.layout.world_size > 1:
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return seconds.tolist() if bool((seconds > 0).all()) else None

    # ------------------------------------------------------------ gradients
    def install_grads(self) -> None:
        """Put the gradients of the last :meth:`train_step` in ``.grad`` (reduced when it synchronised)."""
        self.grad_sync.install()

    # ---------------------------------------------------------- weights
    def share_updated_params(self, optimizers: list) -> None:
        """Shared parameters are updated only on the stages that use them: copy them, with
        their optimizer state, to every rank (before a checkpoint, a transition, a new
        frozen prefix, or the end of the run). A collective over the world."""
        if self.layout.world_size > 1:
            self.grad_sync.share(optimizers)

    def share_updated_weights(self) -> None:
        """The same for the weights alone, before validation in fit: every stage runs the code
        after an evaluation step's model call, which may use them (a head outside the model)."""
        if self.layout.world_size > 1:
            self.grad_sync.share_weights()

    def block_state(self, prefix: str) -> dict[str, torch.Tensor]:
        return gather_block_state(
            self.split.blocks, prefix, self.store, self.layout, self.bounds, self.topology.global_rank
        )

    def share_outer_buffers(self, group: dist.ProcessGroup | None = None) -> None:
        """Give every rank replica 0's buffers outside the block list: ``pre``'s from its first
        stage and the others from global rank 0, its last stage (a later stage runs ``pre`` with
        stale weights, only the last stages run ``post``, and replicas see different data).
        A collective over the world."""
        self.share_pre_buffers(group)
        if self.layout.world_size > 1:
            broadcast_all(self.post_buffers, 0, group)

    def share_pre_buffers(self, group: dist.ProcessGroup | None = None) -> None:
        """Give every rank the buffers of ``pre`` from replica 0's first stage (before a
        checkpoint: global rank 0 writes it). A collective over the world."""
        if self.layout.world_size > 1:
            broadcast_all(self.pre_buffers, self.layout.rank(0, 0), group)

    def restore_after_failure(self, group: dist.ProcessGroup, optimizers: Sequence[Optimizer]) -> None:
        """The whole model on every rank after an exception that every rank took part in, over
        ``group`` (a gloo group: the training groups may be out of step); of the optimizer state,
        only the shared weights' moves (each rank keeps its own blocks')."""
        if self.layout.world_size > 1:
            sync = self.grad_sync
            broadcast_shared(sync.shared_params, sync.owners(), list(optimizers), sync.device, group)
        self.store.restore_all(self.layout, self.bounds, group)
        self.share_outer_buffers(group)

    def training_groups(self) -> list[dist.ProcessGroup]:
        """The process groups training waits in, the world's included."""
        return [dist.group.WORLD, *self.topology.groups, *self.grad_sync.groups]

    def close(self, restore_weights: bool, destroy_groups: bool = True) -> None:
        """Remove the hooks; bring every block back on every rank; free the process groups."""
        self.hooks.remove()
        self.relay.remove()
        self.grad_sync.close()
        if restore_weights:
            self.store.restore_all(self.layout, self.bounds)
            self.share_outer_buffers()
        if destroy_groups:
            self.topology.destroy()
