"""ElasticPipelineStrategy: pipeline x data parallel training of an unchanged LightningModule."""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import uuid
from collections.abc import Generator
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch.distributed import ReduceOp
from torch.distributed.constants import default_pg_timeout
from torch.utils.data import DataLoader

from lightning_pipetx.autocache import CacheControl, CacheFeed, CacheSite
from lightning_pipetx.blocks import BlockSplit, find_blocks
from lightning_pipetx.strategy.autodp import AutoDP, Transition
from lightning_pipetx.strategy.autopipe import FROZEN_TIME, AutoPipe, Plan, device_memory
from lightning_pipetx.strategy.checkpoint import (
    ClosedRun,
    atomic_save,
    gather_optimizer_state,
    load_held_weights,
    refuse_other_plan,
)
from lightning_pipetx.strategy.dataloading import seed_workers_by_replica, shards_one_index_space, stable_shards
from lightning_pipetx.strategy.engine import PipelineEngine
from lightning_pipetx.strategy.failure import (
    FailureAgreement,
    checkpoint_refused,
    explain_placeholder_write,
    explain_training_outputs,
    holds_whole_model,
    stop_after_failure,
)
from lightning_pipetx.strategy.host_memory import reuse_for_training
from lightning_pipetx.strategy.lightning_compat import (
    LoaderRebuild,
    check_lightning_internals,
    clip_norm_over_stages,
    forget_reset_results,
    restore_clipping,
)
from lightning_pipetx.strategy.loss_scaling import agreeing_scaler
from lightning_pipetx.strategy.metric_sync import PipelineMetrics
from lightning_pipetx.strategy.model_checks import (
    CollectedOutputChecks,
    batch_norm_names,
    microbatches_for_training,
    refuse_diverging_learning_rates,
    refuse_manual_optimization,
    refuse_random_input_mask,
    refuse_shared_block_weights,
    refuse_shared_layers,
    refuse_unconverted_batch_norms,
)
from lightning_pipetx.strategy.options import check_arguments, check_ddp_arguments
from lightning_pipetx.strategy.param_store import ParamStore, collective_device
from lightning_pipetx.strategy.predictions import QuietWriters, gather_trainer_predictions, input_rows
from lightning_pipetx.strategy.recipe_checks import (
    BlockCopyWatch,
    check_fit_recipe,
    refuse_collected_outputs,
    refuse_repeated_closure,
)
from lightning_pipetx.strategy.stage_streams import start_unseeded_ranks_alike
from lightning_pipetx.strategy.topology import Layout, Topology
from lightning_pipetx.strategy.transition import drop_optimizer_state

log = logging.getLogger("lightning_pipetx")


_NOT_RUNNING = (
    "ElasticPipelineStrategy is not running: it is not set up (run it through a Trainer), or its set-up "
    "stopped on an error before training began (the error this one was raised while handling)."
)
_LEFT_INCOMPLETE = (
    "ElasticPipelineStrategy is not running: its last run stopped on an error before this rank got back the "
    "blocks it did not run (see the error logged at teardown), so it left neither a layout nor a whole model. "
    "Load the last checkpoint in new processes."
)


def _another_epoch_may_follow(trainer: pl.Trainer) -> bool:
    """Whether the training limits (``max_epochs``, ``max_steps``) leave room for an epoch after
    this step's, the last of its epoch."""
    if trainer.max_epochs is not None and 0 <= trainer.max_epochs <= trainer.current_epoch + 1:
        return False
    return not 0 <= trainer.max_steps <= trainer.global_step + 1


class ElasticPipelineStrategy(DDPStrategy):
    """Train an unchanged LightningModule as ``replicas`` pipelines of ``pipeline_length`` stages.

    The model's block list (see :func:`~lightning_pipetx.find_blocks`) is split into
    contiguous stages of balanced cost (each block's parameter count, then its forward time
    measured over the first ``profile_steps``); each rank runs one stage of one replica, the
    user's own ``training_step`` (and ``validation_step``, ...) on every micro-batch, with hooks
    on the block list deciding which blocks run where. The world size must be a multiple of
    ``pipeline_length``: ``world_size // pipeline_length`` data-parallel replicas.

    Args:
        pipeline_length: stages per replica. ``"auto"``: the layout predicted fastest among
            those whose stages' weights, gradients and optimizer state fit in half of
            ``memory_budget`` (the shortest pipeline that fits: one stage if the model fits a
            device), up to one node and the number of blocks.
        num_microbatches: micro-batches per batch. ``"auto"``: 1 without a pipeline, else
            ``2 * pipeline_length`` (1 in fit for a model with batch norms, where more splits
            with a warning). A batch smaller than this is split into one-sample micro-batches.
        schedule: ``"gpipe"`` (all forwards, then all backwards) or ``"1f1b"`` (bounded memory).
        blocks: dotted path of the block list inside the LightningModule; found when None.
        elastic: compress the pipeline and add replicas as blocks freeze.
        keep_global_batch: keep the global batch constant across layout changes.
        cache: AutoCache, the frozen prefix's output cached per training sample: ``"auto"``
            (on, switched off if inputs change between epochs), True (on regardless) or False.
        profile_steps: training steps (after one warm-up step) whose per-block forward time
            becomes the cost model at the first freeze; 0 keeps parameter counts.
        cache_dir: AutoCache's disk folder, beyond ``cache_ram_bytes`` of RAM (``$TMPDIR``
            by default).
        cache_ram_bytes: host RAM (``/dev/shm``) AutoCache may use per node; a depth goes
            there only where it takes at most half of the mount's free space (else to disk).
        cache_device_bytes: memory of the training device AutoCache may use per process before
            host RAM. ``"auto"``: a third of the GPU's free memory; 0 on CPU (host RAM is then
            the fastest tier, shared by the node's processes).
        sampler: how the training loader deals samples to replicas. ``"distributed"``: Lightning's
            ``DistributedSampler`` (new shards every epoch); ``"stable"``: each replica keeps its
            shard and shuffles within it (:class:`StableShardSampler`), so that a node-local cache
            keeps hitting; ``"auto"``: ``"stable"`` when the run spans several nodes and caches.
        memory_budget: bytes of memory per device for ``pipeline_length="auto"`` and for the
            layouts transitions move to; by default the GPU's memory, or on CPU the host's memory
            divided among this node's processes.
        bucket_cap_mb: size of a gradient bucket (all-reduced as one), as for DDP.
        reuse_host_memory: keep host memory freed by a training step for the next instead of
            handing it back to the system (glibc's ``malloc``, process-wide; see
            :mod:`~lightning_pipetx.strategy.host_memory`). ``"auto"``: when training on CPU.
        split_backward: under a pipeline, in a step's last backward a stage computes the gradient
            the previous stage waits for first, and its weights' gradients after sending it
            (:mod:`~lightning_pipetx.strategy.split_backward`); False: fused backwards only.
        **kwargs: DDPStrategy's arguments (``process_group_backend``, ``timeout``,
            ``start_method``, ``cluster_environment``, ...); those of ``DistributedDataParallel``
            have no effect (a warning says so), a communication hook is refused.

    The DataLoader's ``batch_size`` is the batch of one replica: the global batch is
    ``batch_size * replicas``, as with DDP.
    """

    strategy_name = "elastic_pipeline"

    def __init__(
        self,
        pipeline_length: int | str = "auto",
        num_microbatches: int | str = "auto",
        schedule: str = "gpipe",
        blocks: str | None = None,
        elastic: bool = True,
        keep_global_batch: bool = True,
        cache: bool | str = "auto",
        profile_steps: int = 3,
        cache_dir: str | None = None,
        cache_ram_bytes: int | float = 8 * 2**30,
        cache_device_bytes: int | float | str = "auto",
        sampler: str = "auto",
        memory_budget: int | float | None = None,
        bucket_cap_mb: float = 25.0,
        reuse_host_memory: bool | str = "auto",
        split_backward: bool = True,
        **kwargs: Any,
    ) -> None:
        check_arguments(
            pipeline_length,
            num_microbatches,
            schedule,
            profile_steps,
            sampler,
            memory_budget,
            bucket_cap_mb,
            reuse_host_memory,
            split_backward,
            blocks,
            elastic,
            keep_global_batch,
        )
        check_ddp_arguments(kwargs, own=inspect.signature(type(self).__init__).parameters.values())
        self._autocache = CacheControl(cache, cache_dir, cache_ram_bytes, cache_device_bytes)
        super().__init__(**kwargs)
        self.timeout = kwargs.get("timeout") or default_pg_timeout
        self.pipeline_length = pipeline_length
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        self.blocks = blocks
        self.elastic = elastic
        self.keep_global_batch = keep_global_batch
        self.cache = cache
        self.sampler = sampler
        self.profile_steps = profile_steps
        self.memory_budget = memory_budget
        self.bucket_cap_mb = bucket_cap_mb
        self.reuse_host_memory = reuse_host_memory
        self.split_backward = split_backward
        self.engine: PipelineEngine | None = None
        self._last_run = ClosedRun()  # what a run leaves for trainer.save_checkpoint after it
        self._split: BlockSplit | None = None
        self._layout0: Layout | None = None
        self._sync_grads = True
        self.autopipe: AutoPipe | None = None  # the run's layout planner, from setup
        self._frozen = 0
        self._store: ParamStore | None = None
        self._autodp = AutoDP(keep_global_batch)
        self.cache_dir = cache_dir
        self.cache_ram_bytes = cache_ram_bytes
        self._cache_feed = CacheFeed(self._autocache)
        self._run_token = ""
        self._private_sites = False  # a loader was given cache folders of this rank's own, for it to remove
        self._epoch_begun: int | None = None  # the training epoch whose first batch this run has seen
        self._transition_seconds: float | None = None
        self.last_transition: Transition | None = None  # what the last transition did on this rank
        self._output_checks: CollectedOutputChecks | None = None
        self._block_copies: BlockCopyWatch | None = None  # in fit, copies of the block list an EMA may write
        self._metrics = PipelineMetrics(self._running_layout)
        self._predict_rows: dict[int, list[int | None]] = {}  # per predict dataloader: each input batch's samples
        self._quiet_writers = QuietWriters()
        self._agreement: FailureAgreement | None = None
        self._stopped_topology: Topology | None = None  # the engine's, once an exception stopped it
        self._restored_profile: list[float] | None = None  # block costs from the checkpoint resumed
        self._fingerprints_to_save: dict[str, Any] | None = None  # AutoCache's, for the checkpoint being written
        self._loader_rebuild = LoaderRebuild()
        self._batch_keys: tuple[Any, Any] = (None, None)  # AutoCache's sample indices of this batch and the next
        self._closure_calls = 0  # training_step calls for this batch (an optimizer may call the closure again)
        self._loaders_named: str | None = None  # "train", "val", ...: the loaders Lightning's loop is building

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "elastic_pipeline", cls, description="Elastic pipeline strategy (subprocess launcher)", start_method="popen"
        )
        strategy_registry.register(
            "elastic_pipeline_spawn",
            cls,
            description="Elastic pipeline strategy (spawn launcher)",
            start_method="spawn",
        )

    # -------------------------------------------------------------- layout
    @property
    def layout(self) -> Layout:
        """The running layout; after a run, the one it ended with."""
        if self.engine is None and self._last_run.plan is not None:
            return self._last_run.plan.layout
        return self._require_engine().layout

    @property
    def block_path(self) -> str | None:
        """Dotted path of the block list the strategy pipelines (found at set-up; None before)."""
        return None if self._split is None else self._split.path

    def _memory_budget(self) -> float:
        """Bytes per device for the initial layout, the smallest over all ranks."""
        budget = self.memory_budget or device_memory(self.root_device, self.num_processes)
        if self.world_size > 1:
            value = torch.tensor(budget, dtype=torch.float64, device=self.root_device)
            dist.all_reduce(value, op=ReduceOp.MIN)
            budget = float(value)
        return budget

    def _plan(self, frozen: int) -> Plan | None:
        if frozen == 0:
            return self._require_autopipe().plan(0, self.world_size)
        # A cached frozen prefix costs nothing; computed, it costs its forward pass.
        frozen_time = 0.0 if self._autocache.active(self.root_device, self.world_size) else FROZEN_TIME
        plan = self._require_autopipe().plan(frozen, self.world_size, self._autodp.accepts, frozen_time)
        return self.broadcast(plan)  # global rank 0's decision, taken by every rank

    def _start_plan(self, split: BlockSplit, num_microbatches: int | str) -> Plan:
        """The run's planner and its plan with nothing frozen (logged on global rank 0)."""
        self.autopipe = AutoPipe(self.pipeline_length, num_microbatches)
        per_node = max(1, self.world_size // max(1, self.num_nodes))
        plan, why = self.autopipe.start(
            split, self.world_size, min(per_node, split.num_blocks), self._memory_budget, self.profile_steps > 0
        )
        if why is not None and self.is_global_zero:
            log.info("pipetx: pipeline_length='auto': %s", why)
        self.autopipe.restore_profile(self._restored_profile)
        self._restored_profile = None
        return plan

    def _require_autopipe(self) -> AutoPipe:
        if self.autopipe is None:
            raise self._not_running()
        return self.autopipe

    def _running_layout(self) -> Layout | None:
        return self.engine.layout if self.engine is not None else None

    def _loader_layout(self) -> Layout | None:
        """The layout loaders are built for: the engine's, or while setup builds it the first
        plan's (configure_optimizers may build the training loader, for an LR schedule)."""
        return self._running_layout() or self._layout0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        layout = self._loader_layout()
        if layout is None:  # before setup: every rank its own replica, as DDP
            return super().distributed_sampler_kwargs
        return {"num_replicas": layout.replicas, "rank": layout.coords(self.global_rank)[0]}

    # --------------------------------------------------------------- setup
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        check_lightning_internals(trainer)
        self._last_run = ClosedRun()
        self._block_copies = None
        self._metrics.forget_logged()
        self._loader_rebuild = LoaderRebuild(on_reload=self._cache_feed.user_reloaded)
        self._epoch_begun = None
        if trainer.state.fn == TrainerFn.FITTING:
            self._loader_rebuild.install(trainer)  # before configure_optimizers, which may build the training loader
        self._batch_keys = (None, None)
        self.accelerator.setup(trainer)
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:  # precision="16-mixed": one scale and one overflow decision for all stages
            self.precision_plugin.scaler = agreeing_scaler(scaler, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._broadcast_module_state()
        self._split = find_blocks(self.lightning_module, self.blocks)
        if self._store is not None:
            self._store.close()
        self._store = ParamStore(self._split.blocks, self._split.path)
        self._frozen = 0
        self._autodp.reset(self.world_size)
        self._autocache.begin_fit()
        self._run_token = self.broadcast(uuid.uuid4().hex[:12] if self.is_global_zero else None)
        self._private_sites = False
        if self._agreement is not None:  # the last run's, which stopped on an exception
            self._agreement.close()
        self._agreement = FailureAgreement(self.world_size, self.timeout)
        fitting = trainer.state.fn == TrainerFn.FITTING
        microbatches = self.num_microbatches
        if fitting:
            microbatches = microbatches_for_training(microbatches, self.lightning_module)
        plan = self._start_plan(self._split, microbatches)
        # configure_optimizers may build the training DataLoader (trainer.estimated_stepping_batches,
        # for an LR schedule): it is sharded by replica and recorded for AutoCache as it is built, so
        # that Lightning keeps it (building it again would draw another seed from the user's stream).
        self._layout0 = plan.layout
        if plan.layout.pipeline_length > 1:
            start_unseeded_ranks_alike(self.broadcast, self.is_global_zero, self.root_device)
        refuse_shared_layers(self.lightning_module, self._split.blocks, plan.layout.pipeline_length)
        refuse_shared_block_weights(
            self.lightning_module, self._split.path, self._split.blocks, plan.layout.pipeline_length
        )
        if fitting:
            refuse_manual_optimization(self.lightning_module)
            refuse_unconverted_batch_norms(self.lightning_module, self._layer_sync)
            # configure_optimizers sees every weight as one process would (it may group them by
            # shape or read them); the blocks this rank does not run are released after it.
            self.setup_optimizers(trainer)
            length = plan.layout.pipeline_length
            check_fit_recipe(
                trainer, self.optimizers, scaler, self._split.blocks, length, self.world_size, self._autocache
            )
        self.engine = self._build_engine(plan)
        self.engine.profile_steps = self.profile_steps
        drop_optimizer_state(self._split.blocks, self.optimizers, self.engine.block_range)
        clip_norm_over_stages(
            self.precision_plugin,
            lambda norm, optimizer: self._require_engine().grad_sync.clip_by_norm(norm, optimizer),
        )
        self._output_checks = CollectedOutputChecks(
            self.lightning_module, self._refuse_collected_outputs, self._refuse_random_input_mask, self._split.blocks
        )
        self._output_checks.install()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            self._optimizer_state_to(self.root_device)
            if reuse_for_training(self.reuse_host_memory, self.root_device) and self.is_global_zero:
                log.info("pipetx: host memory freed by a training step is kept for the next (reuse_host_memory)")

    def _optimizer_state_to(self, device: torch.device) -> None:
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                for key, value in state.items():
                    if key != "step":  # optimizers keep their step count where they made it
                        state[key] = move_data_to_device(value, device)

    def _build_engine(self, plan: Plan) -> PipelineEngine:
        engine = PipelineEngine(
            self.lightning_module,
            self._split,
            plan,
            self._store,
            self.global_rank,
            self.root_device,
            self.schedule,
            self.timeout,
            int(self.bucket_cap_mb * 2**20),
            lambda: self.optimizers,
            self.split_backward,
        )
        engine.cache, engine.frozen = self._autocache.cache, self._frozen
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            engine.runner.scale_loss = scaler.scale
        if self.is_global_zero:
            log.info("pipetx: %s (pipeline_length x replicas), %s schedule", plan.describe(), self.schedule)
        return engine

    # ---------------------------------------------------------- transitions
    def on_freeze(self, trainer: pl.Trainer, frozen_blocks: int, split: BlockSplit | None = None) -> None:
        """Called by FreezeCallback on every rank after it froze ``frozen_blocks`` leading blocks
        (``split``: its view of the model, with what its trace found outside ``pre``).

        With ``elastic=True`` the strategy re-plans the layout for the new frozen prefix and,
        when the plan changed, moves to it before the next epoch's dataloaders are built; when no
        layout is left for the prefix, its blocks freeze in place.
        """
        self._take_back_lent_blocks()
        engine = self._require_engine()
        engine.share_updated_params(self.optimizers)
        engine.share_pre_buffers()  # the frozen embeddings' buffers are replica 0's first stage's everywhere
        engine.frozen = frozen_blocks
        split = split or self._split
        self._autocache.on_freeze(self.lightning_module, split, frozen_blocks, self._computes_prefix)
        if not self.elastic:
            self._frozen = frozen_blocks
            return  # the ablation: blocks freeze in place, the layout stays
        self._take_profile(engine)
        previous, self._frozen = self._frozen, frozen_blocks
        training_norms = batch_norm_names(self.lightning_module, training_only=True)
        self._autodp.keep_replicas_for_batch_norms(training_norms, engine.layout.replicas)
        new_plan = self._plan(frozen_blocks)
        if new_plan is None:  # no layout is left for this prefix: it freezes in place, as with elastic=False
            if self.is_global_zero:
                why = self._require_autopipe().kept_reason(frozen_blocks)
                log.info("pipetx: frozen %d->%d blocks, %s", previous, frozen_blocks, why)
            return
        if new_plan.same_layout(engine.plan):
            return
        self.engine, done = self._autodp.transition(
            trainer,
            engine,
            new_plan,
            self._build_engine,
            self._split.blocks,
            self.optimizers,
            self._store,
            self.global_rank,
            self.root_device,
        )
        self._cache_feed.loaders_reloaded()
        self._loader_rebuild.keep(trainer)
        self.last_transition = done
        self._transition_seconds = done.seconds
        if trainer.training:  # the epoch's logged values are reduced after this, until the next epoch starts
            self._metrics.logged_under(engine.layout, engine.topology.stage_group, engine.topology.destroy)
        else:
            engine.topology.destroy()
        if self.is_global_zero:
            log.info("pipetx: frozen %d->%d blocks, %s by rank 0", previous, frozen_blocks, done.describe())

    def _computes_prefix(self, module: torch.nn.Module) -> bool:
        """Whether this rank computes ``module`` of the frozen prefix for AutoCache (a first stage holding it)."""
        engine = self.engine
        return engine is not None and engine.topology.is_first_stage and not self._store.has_released(module)

    def _take_profile(self, engine: PipelineEngine) -> None:
        """The profiled forward times become the planner's costs (once; on every rank, a collective)."""
        seconds = self._require_autopipe().take_profile(engine.profiled_block_seconds)
        if seconds is not None and self.is_global_zero:
            log.info("pipetx: block costs from profiled forward time: %s", [f"{s:.2e}" for s in seconds])

    def process_dataloader(self, dataloader: Any) -> Any:
        """Keep the global batch constant when the number of replicas changes, and record
        which samples each batch holds (AutoCache: training, and validation in fit)."""
        trainer = self.lightning_module.trainer
        layout = self._loader_layout()
        if layout is None or not isinstance(dataloader, DataLoader):
            return dataloader
        replica = layout.coords(self.global_rank)[0]
        if not self._builds_training_loaders(trainer):
            if trainer.state.fn != TrainerFn.FITTING:
                return seed_workers_by_replica(dataloader, replica)
            self._autodp.note_validation(dataloader, trainer.limit_val_batches)
            dataloader = self._cache_feed.validation_loader(dataloader, self._cache_site(layout, dataloader))
            return seed_workers_by_replica(dataloader, replica)
        dataloader = self._autodp.reshard(dataloader, layout.replicas, replica)
        if self._stable_shards():
            dataloader = stable_shards(dataloader)
        dataloader, opened = self._cache_feed.training_loader(dataloader, self._cache_site(layout, dataloader))
        if opened is not None and self.engine is not None:  # else the engine gets it when it is built
            self.engine.cache = opened
        return seed_workers_by_replica(dataloader, replica)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.failure_group is None:
            return super().broadcast(obj, src)
        message = [obj]  # the run stopped on an exception: the world's group may be out of step
        dist.broadcast_object_list(message, src, group=self.failure_group)
        return message[0]

    def barrier(self, name: str | None = None) -> None:
        if name is not None and name.endswith("_dataloader()"):  # a loop about to build its loaders
            self._loaders_named = name.removesuffix("_dataloader()")
            if self._loaders_named == "train":
                self._autodp.training_loaders_requested()
        if self.failure_group is not None:  # the run stopped on an exception: the world's group may be out of step
            dist.barrier(group=self.failure_group)
            return
        super().barrier(name)

    def _builds_training_loaders(self, trainer: pl.Trainer) -> bool:
        """Whether the loaders processed now are for training: the loop that builds them names them
        at its barrier (a resumed fit's validation loop builds its loaders while ``trainer.training``
        is still set); without a name, ``trainer.training`` says."""
        return trainer.training if self._loaders_named is None else self._loaders_named == "train"

    def _cache_site(self, layout: Layout, loader: DataLoader) -> CacheSite:
        if not shards_one_index_space(loader):  # the ranks' datasets may differ: no rank reads another's states
            self._private_sites = True
            token = f"{self._run_token}-rank{self.global_rank}"
            return CacheSite(token, self.node_rank, self.root_device, False, private_processes=self.num_processes)
        first_stages = sum(layout.coords(r)[1] == 0 for r in self._node_ranks())  # of this node
        return CacheSite(self._run_token, self.node_rank, self.root_device, share_host=first_stages > 1)

    def _stable_shards(self) -> bool:
        if self.sampler == "auto":
            return self.num_nodes > 1 and self.cache is not False
        return self.sampler == "stable"

    def _node_ranks(self) -> range:
        """Global ranks of this node (Lightning numbers them node by node)."""
        start = self.node_rank * self.num_processes
        return range(start, start + self.num_processes)

    def epoch_cache_stats(self) -> dict[str, float]:
        """AutoCache's hit rate, tiers served and sizes since the last call, agreed by every rank (collective)."""
        return self._autocache.epoch_stats(self.root_device, self.world_size)

    def on_train_start(self) -> None:
        # After the callbacks' hooks: a frozen prefix re-applied on resume moved before anything was logged.
        self._metrics.forget_logged()
        self._epoch_begun = None
        length = self._require_engine().layout.pipeline_length
        self._block_copies = BlockCopyWatch(self.lightning_module.trainer, self._split.blocks, length)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._take_back_lent_blocks()
        # Once per batch: an optimizer may call the closure, and so training_step, more than once (SAM).
        self._batch_keys = self._cache_feed.training_keys()
        self._closure_calls = 0
        if self._batch_keys[0] is not None:
            self._autocache.check_training_batch(batch)
        if batch_idx <= 1:  # the first step of the run, and then every epoch's
            self._require_engine().check_batches(everywhere=True)
            self._check_block_copies()
        epoch = self.lightning_module.trainer.current_epoch
        if epoch != self._epoch_begun:  # batch 0, or the first batch of an epoch resumed mid-way
            self._epoch_begun = epoch
            forget_reset_results(self.lightning_module.trainer)
            self._loader_rebuild.training_rebuilt(self.lightning_module.trainer)
            self._metrics.begin_epoch(self.lightning_module)
            refuse_diverging_learning_rates(self.optimizers, self.root_device)
            self._autocache.begin_epoch(self.world_size)
            layout = self._require_engine().layout
            values = {"pipeline_length": layout.pipeline_length, "replicas": layout.replicas}
            if self._transition_seconds is not None:
                values["transition_seconds"], self._transition_seconds = self._transition_seconds, None
            if not self.lightning_module.trainer.barebones:  # which logs nothing, and warns at self.log
                for name, value in values.items():
                    log_value = float(value)
                    self.lightning_module.log(f"pipetx/{name}", log_value, on_step=False, on_epoch=True, sync_dist=True)

    def _check_block_copies(self) -> None:
        """In fit and after it (a copy written in the last steps): not after a run stopped on an error."""
        if self._block_copies is not None and not self._last_run.failed:
            self._block_copies.check()

    def _broadcast_module_state(self) -> None:
        """Start every rank from global rank 0's weights, as DDP does when it wraps."""
        if self.world_size > 1:
            for tensor in list(self.lightning_module.parameters()) + list(self.lightning_module.buffers()):
                dist.broadcast(tensor.data, src=0)

    def _refuse_collected_outputs(self, model: str, what: str) -> None:
        length, training = self._require_engine().layout.pipeline_length, self.lightning_module.trainer.training
        refuse_collected_outputs(model, what, length, training, self.cache, self._autocache)

    def _refuse_random_input_mask(self, model: str, switch: str) -> None:
        length = self._require_engine().layout.pipeline_length
        if length > 1 and self.lightning_module.trainer.training:
            refuse_random_input_mask(model, switch, length)

    def _require_engine(self) -> PipelineEngine:
        if self.engine is None:
            raise self._not_running()
        return self.engine

    def _not_running(self) -> RuntimeError:
        return RuntimeError(_LEFT_INCOMPLETE if self._last_run.incomplete else _NOT_RUNNING)

    # --------------------------------------------------------------- steps
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self.lightning_module.trainer
        self._closure_calls += 1
        if self._closure_calls > 1:
            refuse_repeated_closure(self._require_engine().layout.pipeline_length, trainer.accumulate_grad_batches)
        loss_scale = 1.0 / max(1, trainer.accumulate_grad_batches)
        indices, upcoming = self._batch_keys
        engine, step = self._require_engine(), self.lightning_module.training_step
        with (
            self.precision_plugin.train_step_context(),
            self._metrics.training_step(self.lightning_module, engine.topology),
        ):
            output = engine.train_step(step, args[0], args[1:], kwargs, loss_scale, indices, self._sync_grads, upcoming)
            dropped = self._cache_feed.dropped_samples()  # after the epoch's last batch only
            if dropped is not None and _another_epoch_may_follow(trainer):
                engine.fill_cache(step, args[1:], kwargs, dropped[0], lambda: self._to_device(dropped[1]()))
        return output

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if batch is None and self.lightning_module.trainer.training:  # a batch Lightning skips: so do its samples
            self._cache_feed.training_keys()
        return super().batch_to_device(batch, device, dataloader_idx)

    def _to_device(self, batch: Any) -> Any:
        """A batch of the training loader's, prepared as Lightning's loop prepares each: the
        precision's input conversion, ``on_before_batch_transfer`` (the DataModule's or the
        LightningModule's), the move with the transfer hooks."""
        batch = self.precision_plugin.convert_input(batch)
        batch = self.lightning_module._on_before_batch_transfer(batch, dataloader_idx=0)
        return self.batch_to_device(batch)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The pipeline already ran the backwards in ``training_step``: hand its gradients over,
        between the precision plugin's ``pre_backward`` and ``post_backward`` (which call the
        ``on_before_backward`` and ``on_after_backward`` hooks on every rank)."""
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._require_engine().install_grads()
        return self.precision_plugin.post_backward(closure_loss, module)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        self._sync_grads = False
        try:
            yield None
        finally:
            self._sync_grads = True

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        engine = self._require_engine()
        cache, indices, upcoming = self._cache_feed.validation_keys(args)  # AutoCache's, in fit
        if cache is not None:  # on every rank: one that becomes a first stage at a transition knows the shapes
            cache.check_input_shapes(args[0])
        engine.eval_cache = cache if cache is not None and cache.enabled else None
        with self.precision_plugin.val_step_context():
            output = engine.eval_step(
                self.lightning_module.validation_step, args[0], args[1:], kwargs, indices, upcoming
            )
        self._metrics.evaluation_step_done(self.lightning_module)
        return output

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._eval(self.lightning_module.test_step, args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        loader = args[2] if len(args) > 2 else kwargs.get("dataloader_idx", 0)
        self._predict_rows.setdefault(loader, []).append(input_rows(args[0]))
        with self.precision_plugin.predict_step_context():
            return self._eval(self.lightning_module.predict_step, args, kwargs)

    def _eval(self, step: Any, args: tuple, kwargs: dict) -> Any:
        output = self._require_engine().eval_step(step, args[0], args[1:], kwargs)
        self._metrics.evaluation_step_done(self.lightning_module)
        return output

    def on_train_end(self) -> None:
        self._require_engine().check_batches(everywhere=True)
        self._check_block_copies()

    def on_validation_start(self) -> None:
        trainer = self.lightning_module.trainer
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_block_copies()
            self._loader_rebuild.validation_rebuilt(trainer)
            self._require_engine().share_updated_weights()
            self._cache_feed.begin_validation(trainer.val_dataloaders, self.world_size)
        self._evaluation_starts()

    def on_validation_end(self) -> None:
        self._evaluation_ends()

    def on_test_start(self) -> None:
        self._evaluation_starts()

    def on_test_end(self) -> None:
        self._evaluation_ends()

    def on_predict_start(self) -> None:
        self._predict_rows = {}
        self._evaluation_starts()
        self._quiet_writers.enter(self.lightning_module.trainer.callbacks, self._require_engine().topology)

    def _evaluation_starts(self) -> None:
        self._take_back_lent_blocks()
        self._metrics.evaluation_starts(self.lightning_module, self._require_engine().topology)

    def _evaluation_ends(self) -> None:
        self._metrics.evaluation_ends()
        self._require_engine().check_batches(everywhere=False)  # a replica without batches skips this hook

    def on_predict_end(self) -> None:
        self._quiet_writers.exit()
        self._evaluation_ends()

    # ---------------------------------------------------- collectives
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Reduce over the replicas (this stage's group): every stage holds the same logged values.
        Between a transition and the next epoch, the epoch's training values were logged under the
        old layout: over its stage group, kept until then."""
        if group is None:
            group = self._metrics.logged_stage_group
        if group is None and self.engine is not None:
            group = self.engine.topology.stage_group
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        """Gather over the replicas (this stage's group): one entry per data-parallel replica, as
        DDP gives one per rank. In ``training_step`` the code after the model call runs on the last
        stages only, and they gather among themselves. (``LightningModule.all_gather`` passes the
        world for "all processes": that means the replicas here.)"""
        if (group is None or group is dist.group.WORLD) and self.engine is not None:
            group = self.engine.topology.stage_group
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """The last stages' decisions (``all``: every one's, else any one's), on every rank: under a
        pipeline only they run the code after the model call in ``training_step``, and a value it
        updates (a count of correct predictions that ModelCheckpoint or EarlyStopping monitors) is
        theirs alone. Without a pipeline every rank is a last stage, as under DDP."""
        if not (dist.is_available() and dist.is_initialized()):
            return decision
        voter = self.engine is None or self.engine.topology.is_last_stage
        group = self.failure_group
        votes = torch.tensor([int(decision and voter), int(voter)], device=collective_device(self.root_device, group))
        dist.all_reduce(votes, op=ReduceOp.SUM, group=group)
        agree, voters = votes.tolist()
        return agree == voters if all else agree > 0

    # --------------------------------------------------------- checkpoint
    def _saving_plan(self) -> Plan | None:
        """The running engine's plan, else (``trainer.save_checkpoint`` after a run) the last one's;
        None where set-up stopped on an error before it built the engine (every rank then holds the
        whole model and optimizer state, as one process would)."""
        return self._plan_after_run() or (self.engine.plan if self.engine is not None else None)

    def _plan_after_run(self) -> Plan | None:
        """The last run's plan once it closed (every rank then holds every block), else None."""
        return self._last_run.plan_after_run(running=self.engine is not None)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state as one process would hold it, gathered on global rank 0."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap LightningOptimizer
        plan = self._saving_plan()
        if plan is None:
            self._last_run.check_optimizer_state_without_plan(self.world_size)
            return optimizer.state_dict()
        fitting = self.engine is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        self._last_run.check_optimizer_state(fitting)
        blocks, group = self._split.blocks, self.failure_group
        return gather_optimizer_state(optimizer, blocks, plan, self.global_rank, self.root_device, group)

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's, keeping the block costs the saving run measured for :meth:`setup` (which follows)
        and its AutoCache fingerprints for the training cache this fit opens."""
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        saved = checkpoint.get("pipetx") or {}
        self._restored_profile = saved.get("block_costs")
        self._autocache.restore_fingerprints(saved.get("input_fingerprints"))
        return checkpoint

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Lightning's; while a fit runs (Lightning's learning-rate finder restores the module it
        saved before its trial steps), each rank loads the weights it holds."""
        if self.engine is None:
            super().load_model_state_dict(checkpoint, strict=strict)
            return
        refuse_other_plan(checkpoint.get("pipetx"), self.engine.plan, self._frozen)
        load_held_weights(self.lightning_module, checkpoint["state_dict"], self._store, strict)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        # A consolidated checkpoint holds every block's state: keep this rank's blocks only.
        drop_optimizer_state(self._split.blocks, self.optimizers, self._require_engine().block_range)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        try:
            if not self.is_global_zero:
                return
            plan = self._saving_plan()
            if plan is not None:
                autopipe = self._require_autopipe()
                checkpoint["pipetx"] = {
                    "layout": str(plan.layout),
                    "bounds": plan.bounds,
                    "frozen_blocks": self._frozen,
                    "block_costs": autopipe.costs if autopipe.profiled else None,
                }
                if self._fingerprints_to_save is not None:
                    checkpoint["pipetx"]["input_fingerprints"] = self._fingerprints_to_save
            atomic_save(self.checkpoint_io, checkpoint, filepath, storage_options)
        finally:
            self._fingerprints_to_save = None
            self._take_back_lent_blocks()

    def _take_back_lent_blocks(self) -> None:
        """Release again what :meth:`lightning_module_state_dict` lent for a checkpoint's hooks (once
        it is written, or where a save stopped half-way)."""
        if self._store is not None:
            self._store.take_back()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The plain module's ``state_dict``, with every block gathered on global rank 0 (which writes
        it); on the other ranks the blocks of other stages read NaN."""
        self._take_back_lent_blocks()
        interrupted = self.lightning_module.trainer.state.status == TrainerStatus.INTERRUPTED
        if self.engine is not None and interrupted:
            self._stop_before_checkpoint()
        if not interrupted:  # a checkpoint as the run stops on an exception keeps what it can
            self._check_block_copies()
        if self.engine is None:  # after the run, or where set-up stopped before it: every rank holds every block
            self._plan_after_run()  # refuses a model that a failed run left incomplete
            return self.lightning_module.state_dict()
        engine = self.engine
        if engine.profiling_done:  # a checkpoint before the first freeze keeps the measured costs for a resume
            self._take_profile(engine)
        engine.share_updated_params(self.optimizers)
        engine.share_pre_buffers()
        prefix = self._split.path + "."
        gathered = engine.block_state(prefix)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if fitting and self._frozen > 0 and not self._private_sites:  # for AutoCache after a resume
            self._fingerprints_to_save = self._autocache.fingerprints(self.world_size)
        # Until save_checkpoint: every name of a block's tensor (a second name the module gives the
        # blocks, too) and on_save_checkpoint's hooks read the whole model on global rank 0, which
        # writes it, and every key on the others, as under DDP (the other stages' blocks NaN there).
        if self.is_global_zero:
            self._store.lend(gathered, prefix)
        self._store.permit_reads()
        return self.lightning_module.state_dict()

    def _stop_before_checkpoint(self) -> None:
        """A checkpoint as the run stops on an exception (Lightning's ``OnExceptionCheckpoint`` saves
        before the strategy hears of it): stop the engine now, and refuse where the ranks did not agree."""
        moving = self._autodp.moving
        if not self._stop_after_failure():
            error = checkpoint_refused(moving)
            # Raised in a callback's on_exception, it makes Lightning skip the strategy's hooks that follow.
            self.on_exception(error)
            self.teardown()
            raise error

    def _stop_after_failure(self) -> bool:
        """Close the engine after an exception; True where every rank holds the whole model again
        (until the next set-up, checkpoints then gather over the agreement's group)."""
        engine, trainer = self._require_engine(), self.lightning_module.trainer
        self.engine, self._stopped_topology = None, engine.topology
        self._last_run.failed = True
        path, moving = self._split.path, self._autodp.moving
        waited_in = self._metrics.waited_in()  # a reduction of the epoch's values logged before a transition
        self._last_run.incomplete = True  # until the blocks are back (the restore may raise half-way)
        restored = stop_after_failure(
            engine, self._agreement, moving, self.global_rank, path, self.optimizers, waited_in
        )
        if restored or holds_whole_model(engine, moving):  # weights can be saved
            self._last_run.plan, self._last_run.incomplete = engine.plan, False
        self._last_run.fit = restored and trainer.state.fn == TrainerFn.FITTING
        return restored

    @property
    def failure_group(self) -> dist.ProcessGroup | None:
        """The group collectives over every rank go over once the ranks agreed that the run stopped on
        an exception, until the next set-up (the world's may be out of step then); else None."""
        agreement = self._agreement
        return agreement.group if agreement is not None and agreement.agreed else None

    # ----------------------------------------------------------- teardown
    def on_exception(self, exception: BaseException) -> None:
        self._last_run.failed = True
        self._quiet_writers.exit()
        topology = self.engine.topology if self.engine is not None else self._stopped_topology
        if topology is not None:
            length = topology.pipeline_length
            wrote_placeholder = explain_placeholder_write(exception, length)
            stepping = self.lightning_module.trainer.training and self._epoch_begun is not None  # not restoring
            if not wrote_placeholder and not topology.is_last_stage and stepping:
                explain_training_outputs(exception, topology.stage, length)
        super().on_exception(exception)

    def teardown(self) -> None:
        self._metrics.remove()
        self._loader_rebuild.remove()
        self._restored_profile = None  # loaded during the run (the learning-rate finder), or before a failed set-up
        self._autocache.restore_fingerprints(None)  # for a cache this run did not open
        self._fingerprints_to_save = None  # of a checkpoint whose writing stopped on an error
        if self._output_checks is not None:
            self._output_checks.remove()
            self._output_checks = None
        if self._cache_feed.open:
            if not self._last_run.failed:
                self.barrier("pipetx-cache")  # every rank is done with the files
            # After a failure every rank removes the node's folders: a peer may have written to
            # them after local rank 0 removed them, or local rank 0 may be dead.
            failed = self._last_run.failed
            self._cache_feed.close(remove_files=self.local_rank == 0 or self._private_sites or failed)
        self._take_back_lent_blocks()
        if self.engine is not None:
            if self._last_run.failed:
                self._stop_after_failure()
            else:
                trainer = self.lightning_module.trainer
                if trainer.state.fn == TrainerFn.PREDICTING:  # here, as a replica without batches skips the hooks
                    gather_trainer_predictions(trainer, self.engine.topology, self._predict_rows)
                self.engine.share_updated_params(self.optimizers)
                self.engine.close(restore_weights=True)
                self._last_run.plan, self._last_run.fit = self.engine.plan, trainer.state.fn == TrainerFn.FITTING
            self.engine = None
        if self._store is not None and not self._store.released_blocks():  # the model is whole: no guard left on it
            self._store.close()
            self._store = None
        self._layout0 = None  # loaders built before the next setup are not this run's
        if self._agreement is not None and not self._agreement.agreed:  # an agreed one serves saves after the run
            if not self._last_run.failed:  # else a peer may be out of step in it
                self._agreement.close()
            self._agreement = None
        self._stopped_topology = None
        restore_clipping(self.precision_plugin)
        if self.world_size > 1:
            # The run's engine sits in reference cycles (hooks and closures) with its process groups,
            # whose gloo threads and connections last as long as the objects: free them now, not at
            # some later collection (a sweep of fits in the same processes piles them up otherwise).
            gc.collect()
        super().teardown()


# Register "elastic_pipeline" and "elastic_pipeline_spawn" as soon as the package is imported.
ElasticPipelineStrategy.register_strategies(StrategyRegistry)
