"""FreezeCallback: progressive freezing of a Transformer's leading blocks."""

from __future__ import annotations

import contextlib
import logging
import numbers
import time
import weakref
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size

from lightning_pipetx.blocks import BlockListNotFoundError, BlockSplit, find_blocks
from lightning_pipetx.callbacks.block_norms import IntervalNorms
from lightning_pipetx.callbacks.freeze_boundary import FreezeBoundary
from lightning_pipetx.callbacks.freeze_conflicts import (
    ONE_FREEZER,
    finetuning_callbacks,
    refuse_backbone_finetuning,
    refuse_retrained,
)
from lightning_pipetx.callbacks.freeze_context import (
    agreed_block_path,
    all_reduce_mean,
    gradients_outside_blocks_finite,
    loss_scale_left_in,
    num_replicas,
    ran_every_batch,
    rewrap_ddp,
    skips_overflowed_steps,
    stopped_group,
)
from lightning_pipetx.callbacks.freeze_guard import FreezeGuard, check_guard_arguments
from lightning_pipetx.callbacks.freeze_rule import FreezeDecision, decide
from lightning_pipetx.callbacks.prefix_findings import PrefixFindings
from lightning_pipetx.strategy.elastic_pipeline import ElasticPipelineStrategy
from lightning_pipetx.strategy.failure import keyboard_interrupts_held

log = logging.getLogger("lightning_pipetx")

_SIGNALS = ("grad_norm", "schedule")


def _check_whole(name: str, value: object, minimum: int, why: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"FreezeCallback({name}={value!r}): use a whole number >= {minimum}{why}.")


class FreezeCallback(Callback):
    """Freeze a growing prefix of the model's blocks between epochs (PipeTransformer's rule).

    Every ``freeze_interval`` epochs, all ranks take the same decision: the new number of
    frozen leading blocks is the smallest of the alpha progression bound, the active block
    with the smallest gradient norm accumulated over the interval (that block included), and
    ``L - min_active_blocks``. Freezing ``F`` blocks turns off ``requires_grad`` for ``pre``
    (embeddings) and blocks ``[0, F)``, keeps them in eval mode (no dropout) and so takes
    them out of backward and of the optimizer step. Blocks are never unfrozen: a frozen weight that
    other code makes trainable again (``BackboneFinetuning``) stops the run with an error. A weight
    registered after the blocks that the first training step reads only before block 0
    (MPNet's relative position bias) counts as ``pre``.

    Args:
        alpha: progression bound in (0, 1]: at most ``ceil(alpha * active)`` more blocks
            freeze per decision.
        freeze_interval: epochs between decisions.
        warmup_epochs: epochs trained before the first decision's interval begins (0: the
            first decision ends the first ``freeze_interval`` epochs); the first decision's
            gradient norms are averaged over the warm-up too.
        min_active_blocks: never freeze more than ``L - min_active_blocks`` blocks, nor so many
            that fewer than ``min_active_blocks`` blocks with a trainable weight are left (blocks
            the user froze are not active ones).
        signal: ``"grad_norm"`` (both terms of the rule) or ``"schedule"`` (the closed form
            ``ceil(L * (1 - (1 - alpha) ** T))`` alone). Gradient norms are measured each
            step until the cap is reached or the guard stops freezing; then no decision uses them.
        blocks: dotted path of the block list inside the LightningModule; found
            automatically when None.
        monitor: the guard: a validation metric (e.g. ``"val_acc"``), judged at the end of each
            training epoch in which a validation ran (its last one); once it is worse than its
            best so far by more than ``tolerance``, no more blocks freeze in this run. None: no guard.
        mode: ``"max"`` when a higher ``monitor`` is better, ``"min"`` when lower is.
        tolerance: how far below (``"max"``) or above (``"min"``) its best the metric may go.

    Logs ``pipetx/frozen_blocks`` (blocks frozen during the epoch) and
    ``pipetx/samples_per_sec`` (training throughput over all data-parallel replicas) every
    epoch, and one line per decision.
    """

    def __init__(
        self,
        alpha: float = 1 / 3,
        freeze_interval: int = 1,
        warmup_epochs: int = 0,
        min_active_blocks: int = 1,
        signal: str = "grad_norm",
        blocks: str | None = None,
        monitor: str | None = None,
        mode: str = "max",
        tolerance: float = 0.0,
    ) -> None:
        if not isinstance(alpha, numbers.Real) or isinstance(alpha, bool) or not 0.0 < alpha <= 1.0:
            raise ValueError(f"FreezeCallback(alpha={alpha!r}): alpha must be a number in (0, 1], e.g. 1/3.")
        if blocks is not None and not isinstance(blocks, str):
            raise ValueError(
                f"FreezeCallback(blocks={blocks!r}): use the block list's dotted path (a string), or None."
            )
        _check_whole("freeze_interval", freeze_interval, 1)
        _check_whole("warmup_epochs", warmup_epochs, 0)
        _check_whole("min_active_blocks", min_active_blocks, 1, "; at least one block must stay trainable")
        if signal not in _SIGNALS:
            raise ValueError(f"FreezeCallback(signal={signal!r}): choose one of {_SIGNALS}.")
        check_guard_arguments(mode, tolerance)
        self.alpha = alpha
        self.freeze_interval = freeze_interval
        self.warmup_epochs = warmup_epochs
        self.min_active_blocks = min_active_blocks
        self.signal = signal
        self.blocks = blocks
        self.guard = FreezeGuard(monitor, mode, tolerance) if monitor is not None else None

        self.frozen_blocks = 0
        self.decisions = 0
        self.last_decision: FreezeDecision | None = None
        self._norms = IntervalNorms()
        self._strategy: Any = None  # the trainer's, from setup
        self._split: BlockSplit | None = None
        self._frozen_params: list[torch.nn.Parameter] = []  # frozen by this fit, to stay so
        self._boundary = FreezeBoundary()
        self._backward_ran = False  # since the last optimizer step
        self._findings = PrefixFindings()
        self._epoch_samples = 0
        self._epoch_seconds = 0.0
        self._last_tick = 0.0
        self._observed: float | None = None  # the guard's metric at the last validation since the epoch's end
        self._epochs_ended: int | None = None  # the last epoch whose end this fit saw (None: an older checkpoint's)
        self._state_loaded = False  # this fit resumed this callback's state from a checkpoint
        self._fitted: weakref.ref | None = None  # the LightningModule the last fit trained
        self._warned_unguarded = False  # that a decision of this fit came before any guarded validation

    # ------------------------------------------------------------------ set-up
    @property
    def split(self) -> BlockSplit:
        if self._split is None:
            raise RuntimeError("FreezeCallback is not attached to a model yet (call trainer.fit first).")
        return self._split

    @property
    def pre_weights(self) -> list[str] | None:
        """Weights registered after the blocks that the first training step read only before
        them: they freeze with the prefix (None until that step ran)."""
        return self._findings.pre_weights

    @property
    def post_weights(self) -> list[str]:
        """Weights registered before the blocks from which the first training step computed no
        block's input (a head assigned before the backbone): they train on."""
        return self._findings.post_weights

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._state_loaded = False  # until a checkpoint's state is loaded
        self._warned_unguarded = False
        self._frozen_params = []
        strategy = self._strategy = trainer.strategy
        if isinstance(strategy, DeepSpeedStrategy) or not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
            raise ValueError(
                f"FreezeCallback does not support {type(strategy).__name__}: it runs on a single device, under "
                f"DDPStrategy or under ElasticPipelineStrategy (strategies that shard parameters, FSDP, DeepSpeed "
                f"and ModelParallelStrategy, cannot stop a weight training after wrapping, and their gradient "
                f"norms are per shard). Use one of those."
            )
        try:
            self._split = find_blocks(pl_module, agreed_block_path(self.blocks, trainer.strategy))
        except BlockListNotFoundError:
            if type(pl_module).configure_model is pl.LightningModule.configure_model:
                raise
            self._split = None  # built in configure_model, which Lightning calls after this hook
            return
        self._check_split(trainer, pl_module, fitting=stage == "fit")

    def _check_split(self, trainer: pl.Trainer, pl_module: pl.LightningModule, fitting: bool) -> None:
        self._split = self._findings.applied(self._split)
        if fitting:
            refuse_backbone_finetuning(trainer, pl_module, self._split)
        num_blocks = self._split.num_blocks
        if num_blocks <= self.min_active_blocks:
            raise ValueError(
                f"FreezeCallback(min_active_blocks={self.min_active_blocks}) leaves nothing to freeze in a "
                f"model with {num_blocks} blocks; lower min_active_blocks."
            )
        self._norms.resize(num_blocks)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._split is None:  # the model was built in configure_model
            self._split = find_blocks(pl_module, agreed_block_path(self.blocks, trainer.strategy))
            self._check_split(trainer, pl_module, fitting=True)
        self._refuse_untrained_blocks(trainer)
        if not isinstance(trainer.strategy, ElasticPipelineStrategy):
            return
        pipelined = trainer.strategy.block_path  # found at its set-up, which follows this callback's
        if pipelined != self.split.path:
            raise ValueError(
                f"FreezeCallback would freeze the blocks of {self.split.path!r} while ElasticPipelineStrategy "
                f"pipelines those of {pipelined!r}. Pass the same blocks=... to both."
            )

    def _refuse_untrained_blocks(self, trainer: pl.Trainer) -> None:
        """At the start of fit, after every callback's ``setup`` (a finetuning callback freezes
        weights in its own): some block must train. (``model.freeze()`` before validate is fine.)"""
        if self.frozen_blocks or any(p.requires_grad for p in self.split.blocks.parameters()):
            return
        what = f"FreezeCallback: no weight of the blocks {self.split.path!r} trains (requires_grad=False everywhere)"
        finetuning = finetuning_callbacks(trainer)
        if finetuning:
            raise ValueError(f"{what}; {' and '.join(finetuning)} among the callbacks freezes weights. {ONE_FREEZER}")
        raise ValueError(
            f"{what}, so there is nothing to freeze. Pass blocks='...' naming the block list you train, or train "
            f"without FreezeCallback where only weights outside the blocks train (a head, a soft prompt)."
        )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_tick = time.perf_counter()  # a run resumed mid-epoch skips on_train_epoch_start
        if self._state_loaded:
            self._decide_skipped_epoch(trainer)
        else:  # a new fit, or one resumed from a checkpoint written without this callback: nothing was skipped
            if self._fitted is not None and self._fitted() is not pl_module:
                self._forget_other_model(trainer)
            self._epochs_ended = trainer.current_epoch - 1
        self._fitted = weakref.ref(pl_module)
        # Re-applies a frozen prefix restored from a checkpoint (ckpt_path=...).
        if self.frozen_blocks:
            self._apply(trainer)

    def _forget_other_model(self, trainer: pl.Trainer) -> None:
        """This callback's last fit trained another model: this one starts with nothing frozen and no decision."""
        if self.frozen_blocks and trainer.is_global_zero:
            log.info("pipetx: FreezeCallback fits another model than in its last fit: it starts with no block frozen")
        self.frozen_blocks, self.decisions, self.last_decision = 0, 0, None
        self._norms.reset()
        self._observed = None
        if self.guard is not None:
            self.guard = FreezeGuard(self.guard.monitor, self.guard.mode, self.guard.tolerance)

    def _decide_skipped_epoch(self, trainer: pl.Trainer) -> None:
        """Resumed from a checkpoint of an epoch's last batch (``ModelCheckpoint(every_n_train_steps=...)``),
        Lightning starts the next epoch without that epoch's end: take its decision here, from the
        gradient norms the checkpoint holds, as the uninterrupted run took it at the epoch's end."""
        finished = trainer.current_epoch - 1
        if self._epochs_ended is None or self._epochs_ended >= finished:
            return
        self._epochs_ended = finished
        self._judge_observed(trainer)  # a validation inside that epoch, saved in the checkpoint
        stopped = self.guard is not None and self.guard.stopped
        if self._decides_after(finished) and not stopped:
            self._decide(trainer, finished)

    # ------------------------------------------------------------------ signal
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set_prefix_eval()
        self._epoch_samples, self._epoch_seconds = 0, 0.0
        self._last_tick = time.perf_counter()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # Lightning calls module.train() at epoch start and after validation.
        self._set_prefix_eval()
        self._boundary.in_training_step = True
        refuse_retrained(trainer, pl_module, self._frozen_params, self.frozen_blocks)
        self._findings.start(self._split)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._boundary.in_training_step = False
        self._split = self._findings.end(self._split, trainer)
        now = time.perf_counter()
        self._epoch_seconds += now - self._last_tick
        self._last_tick = now
        with contextlib.suppress(Exception):  # a batch with no tensor: throughput is not known
            self._epoch_samples += extract_batch_size(batch)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._boundary.remove()  # the model leaves fit without hooks of this callback's

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._boundary.remove()  # Lightning skips the callbacks' teardown after an error
        self._findings.abandon()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation inside a training epoch is not training time.
        self._last_tick = time.perf_counter()
        fitting = trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking  # not trainer.validate
        if self.guard is not None and fitting:
            # Read here: a checkpoint written after this hook, before the epoch's decision, keeps it.
            self._observed = self.guard.read(trainer.callback_metrics)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._backward_ran = True

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        backward_ran, self._backward_ran = self._backward_ran, False
        watched = self._boundary.watched
        runs_here = watched is not None and self._runs_block(trainer, watched)
        self._boundary.check(self.split, backward_ran, runs_here)
        if not self._measures_gradients():
            return
        device = pl_module.device
        finite = torch.ones((), dtype=torch.bool, device=device)
        if skips_overflowed_steps(trainer):  # fp16 loss scaling: an overflow anywhere skips the step
            finite = gradients_outside_blocks_finite(optimizer, self.split).to(device)
        scale = loss_scale_left_in(trainer, optimizer, device)
        self._norms.record(self.split, self.frozen_blocks, device, scale, finite)

    @staticmethod
    def _runs_block(trainer: pl.Trainer, index: int) -> bool:
        """Whether this rank holds block ``index``'s weights (under a pipeline, its stage's blocks only)."""
        strategy = trainer.strategy
        if isinstance(strategy, ElasticPipelineStrategy) and strategy.engine is not None:
            return index in strategy.engine.block_range
        return True

    def _measures_gradients(self) -> bool:
        """Whether decisions use gradient norms (measured each step, read at a decision): not at
        the cap, where the rule freezes nothing more whatever they are, nor once the guard stopped freezing."""
        return self.signal == "grad_norm" and not self._capped and not (self.guard and self.guard.stopped)

    @property
    def _capped(self) -> bool:
        return self.frozen_blocks >= self.split.num_blocks - self.min_active_blocks

    # ---------------------------------------------------------------- decision
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._norms.agree()
        values = {"frozen_blocks": float(self.frozen_blocks)}
        if self._epoch_seconds > 0 and self._epoch_samples > 0:
            values["samples_per_sec"] = self._epoch_samples * num_replicas(trainer) / self._epoch_seconds
        cache_stats = getattr(trainer.strategy, "epoch_cache_stats", None)
        if callable(cache_stats):  # ElasticPipelineStrategy's AutoCache; a collective call
            values.update(cache_stats())
        if not trainer.barebones:  # which logs nothing, and warns at self.log
            for name, value in values.items():
                # The values agree on every rank; sync_dist only keeps Lightning from warning.
                pl_module.log(f"pipetx/{name}", value, on_step=False, on_epoch=True, sync_dist=True)
        complete = ran_every_batch(trainer)
        if complete:  # a cut-short epoch is judged, as it is decided, when a resumed run completes it
            self._judge_observed(trainer)
        self._epochs_ended = trainer.current_epoch
        stopped = self.guard is not None and self.guard.stopped
        decides = self._decides_after(trainer.current_epoch) and not stopped and complete
        if not decides:
            return
        if self.guard is not None and self.guard.best is None and not self._warned_unguarded:
            self._warned_unguarded = True
            rank_zero_warn(
                f"FreezeCallback(monitor={self.guard.monitor!r}): no validation has logged it before the decision "
                f"after epoch {trainer.current_epoch}, which is therefore not guarded; the guard starts with the first "
                f"validation that logs it (a fit without validation batches is never guarded)."
            )
        with keyboard_interrupts_held():  # a Ctrl-C during a transition: the ranks stop after it, in one layout
            if self._decide(trainer, trainer.current_epoch):
                self._apply(trainer)

    def _decides_after(self, epoch: int) -> bool:
        trained = epoch + 1 - self.warmup_epochs
        return trained > 0 and trained % self.freeze_interval == 0

    def _judge_observed(self, trainer: pl.Trainer) -> None:
        """The guard's verdict on the metric observed since the last epoch's end, if any."""
        if self.guard is not None and not self.guard.stopped and self._observed is not None:
            self._watch(trainer)
        self._observed = None

    def _watch(self, trainer: pl.Trainer) -> None:
        """The guard: stop freezing, on every rank alike, once the monitored metric degraded. It
        judges the mean over the ranks (a collective): a metric logged without ``sync_dist``
        holds each replica's share of the validation set, whose number can change."""
        value = self._mean_observed()
        if self.guard.judge(value):
            self.guard.stopped = True
            if trainer.is_global_zero:
                log.info(
                    "pipetx: epoch %d: %s = %.4g is worse than its best %.4g by more than %s: no more blocks freeze "
                    "(%d of %d frozen)",
                    trainer.current_epoch,
                    self.guard.monitor,
                    value,
                    float("nan") if self.guard.best is None else self.guard.best,
                    self.guard.tolerance,
                    self.frozen_blocks,
                    self.split.num_blocks,
                )

    def _mean_observed(self, group: dist.ProcessGroup | None = None) -> float:
        return float(all_reduce_mean(torch.tensor([self._observed]), group)[0])

    def _longest_prefix(self) -> int:
        """The longest frozen prefix that leaves ``min_active_blocks`` blocks with a trainable weight
        after it: blocks the user froze (the last ones, with the head) are not active ones."""
        trainable = self.split.trainable_blocks(self.frozen_blocks)
        return trainable[-self.min_active_blocks] if len(trainable) >= self.min_active_blocks else self.frozen_blocks

    def _decide(self, trainer: pl.Trainer, epoch: int) -> bool:
        """The rule's decision after ``epoch``; whether the prefix grew (not applied yet)."""
        grad_norms = None
        if self._measures_gradients():
            sums, steps = self._norms.totals()
            if steps == 0:  # no evidence to act on
                if trainer.is_global_zero:
                    log.info(
                        "pipetx: epoch %d: no decision: no active block measured a gradient since the last one "
                        "(no optimizer step counted, or no active block has a trainable weight)",
                        epoch,
                    )
                return False
            grad_norms = (sums / steps).tolist()
        self.decisions += 1
        decision = decide(
            self.frozen_blocks,
            self.split.num_blocks,
            self.alpha,
            self.min_active_blocks,
            grad_norms=grad_norms,
            decisions=self.decisions,
        )
        limit = self._longest_prefix()
        if decision.frozen > limit:
            kept = max(decision.previous, limit)
            reason = f"{decision.reason}; kept to {kept}: blocks you froze do not count as active (min_active_blocks)"
            decision = FreezeDecision(decision.previous, kept, reason)
        self.last_decision = decision
        self._norms.reset()
        if trainer.is_global_zero:
            log.info(
                "pipetx: epoch %d: frozen blocks %d -> %d of %d (%s)",
                epoch,
                decision.previous,
                decision.frozen,
                self.split.num_blocks,
                decision.reason,
            )
        if decision.changed:
            self.frozen_blocks = decision.frozen
        return decision.changed

    # ------------------------------------------------------------------ action
    def _apply(self, trainer: pl.Trainer) -> None:
        self._frozen_params = self.split.prefix_parameters(self.frozen_blocks)
        if trainer.is_global_zero:
            self._name_frozen_pre_weights(trainer.lightning_module)
        for param in self._frozen_params:
            param.requires_grad_(False)
            param.grad = None
        self._set_prefix_eval()
        self._boundary.install(self.split, self.frozen_blocks)
        on_freeze = getattr(trainer.strategy, "on_freeze", None)
        if callable(on_freeze):  # ElasticPipelineStrategy re-plans its layout
            on_freeze(trainer, self.frozen_blocks, self.split)
        elif isinstance(trainer.strategy, DDPStrategy):
            rewrap_ddp(trainer.strategy)

    def _name_frozen_pre_weights(self, module: pl.LightningModule) -> None:
        """Log the weights before block 0 that trained until now (the embeddings, a soft prompt):
        they freeze with the prefix."""
        in_blocks = {id(p) for p in self.split.blocks.parameters()}
        freezing = {id(p) for p in self._frozen_params if p.requires_grad and id(p) not in in_blocks}
        names = [name for name, p in module.named_parameters() if id(p) in freezing]
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            log.info("pipetx: weights before block 0 freeze with the prefix: %s%s", ", ".join(names[:3]), more)

    def _set_prefix_eval(self) -> None:
        if self._split is not None:
            for module in self._split.prefix_modules(self.frozen_blocks):
                if module.training:  # Lightning's module.train() reaches every submodule
                    module.eval()

    # -------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The same on every rank, which Lightning calls it on (global rank 0 writes the file):
        the gradient norms of every rank's blocks, a collective."""
        stopped = stopped_group(self._strategy)
        sums, steps = (None, 0) if self._norms.sums is None else self._norms.totals(stopped)
        return {
            "frozen_blocks": self.frozen_blocks,
            "decisions": self.decisions,
            "norm_sums": None if sums is None else sums.tolist(),
            "norm_steps": steps,
            "guard": None if self.guard is None else self.guard.state_dict(),
            "observed": None if self._observed is None else self._mean_observed(stopped),  # not judged yet
            **self._findings.state_dict(),
            "epochs_ended": self._epochs_ended,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.frozen_blocks = int(state_dict["frozen_blocks"])
        self.decisions = int(state_dict["decisions"])
        self._norms.load(state_dict.get("norm_sums"), int(state_dict.get("norm_steps", 0)))
        self._findings.load_state_dict(state_dict)
        self._epochs_ended = state_dict.get("epochs_ended")  # None in a checkpoint written before it was kept
        self._state_loaded = True
        self._split = self._findings.applied(self._split)
        if self.guard is not None and state_dict.get("guard") is not None:
            self.guard.load_state_dict(state_dict["guard"])
            self._observed = state_dict.get("observed")
