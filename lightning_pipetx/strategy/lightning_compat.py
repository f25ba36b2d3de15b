"""The few non-public parts of Lightning and torchmetrics that the strategy relies on.

Lightning has no public hook for these. Each is checked when the strategy is set up, so that
a release that renamed or removed one fails at once, with a message naming it and the
supported versions, instead of training silently wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
import torchmetrics
from lightning.fabric.utilities import data as fabric_data
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import CombinedLoader, GradClipAlgorithmType
from lightning.pytorch.utilities import data as lightning_data
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from lightning_pipetx.strategy.loss_scaling import unscales_in_own_step
from lightning_pipetx.strategy.model_checks import UnsupportedRecipeError

SUPPORTED = {"lightning": ">=2.4,<2.7", "torchmetrics": ">=1.0,<2.0"}  # as pyproject.toml bounds them
SUPPORTED_VERSIONS = "lightning{lightning} (tested with 2.6.6) and torchmetrics{torchmetrics} (tested with 1.9)".format(
    **SUPPORTED
)


class UnsupportedLightningError(RuntimeError):
    """The installed Lightning or torchmetrics lacks something the strategy relies on."""


@dataclass(frozen=True)
class Internal:
    """One non-public attribute, what it is used for, and how to tell it is still there."""

    name: str
    use: str
    present: Callable[[pl.Trainer], bool]


def _metric_has_forward_cache(trainer: pl.Trainer) -> bool:
    return hasattr(torchmetrics.SumMetric(), "_forward_cache")


def _metric_has_computed_cache(trainer: pl.Trainer) -> bool:
    return hasattr(torchmetrics.SumMetric(), "_computed")


def _loader_takes_a_new_batch_sampler(trainer: pl.Trainer) -> bool:
    # Its own generator: iterating a loader draws a seed, which must not move the user's random stream.
    loader = DataLoader(range(4), batch_size=2, generator=torch.Generator())
    replacement = BatchSampler(SequentialSampler(range(3)), batch_size=3, drop_last=False)
    object.__setattr__(loader, "batch_sampler", replacement)
    return [len(batch) for batch in loader] == [3]


INTERNALS = (
    # Set to None as Lightning's own tuner does (there is no public way to force a reload).
    Internal(
        "Trainer.fit_loop._combined_loader",
        "set to None after a transition, so that the training DataLoader is rebuilt for the new replica count",
        lambda trainer: hasattr(trainer.fit_loop, "_combined_loader"),
    ),
    Internal(
        "Trainer.fit_loop.epoch_loop.val_loop._combined_loader",
        "set to None after a transition, so that the validation DataLoader is rebuilt for the new replica count",
        lambda trainer: hasattr(trainer.fit_loop.epoch_loop.val_loop, "_combined_loader"),
    ),
    Internal(
        "Trainer.fit_loop.epoch_loop.val_loop._seen_batches_per_dataloader",
        "kept across the validation DataLoader's rebuild after a transition: the step of validation's on_step logs",
        lambda trainer: isinstance(
            getattr(trainer.fit_loop.epoch_loop.val_loop, "_seen_batches_per_dataloader", None), dict
        ),
    ),
    Internal(
        "Trainer.fit_loop._last_train_dl_reload_epoch and its val_loop's _last_val_dl_reload_epoch",
        "kept across the rebuild after a transition, so that reload_dataloaders_every_n_epochs reloads when under DDP",
        lambda trainer: (
            hasattr(trainer.fit_loop, "_last_train_dl_reload_epoch")
            and hasattr(trainer.fit_loop.epoch_loop.val_loop, "_last_val_dl_reload_epoch")
        ),
    ),
    Internal(
        "Trainer.fit_loop._data_source and its val_loop's (the dataloader method replaced on the instance)",
        "the loaders the user's hooks returned, built again after a transition without calling the hooks again",
        lambda trainer: all(
            callable(getattr(getattr(loop, "_data_source", None), "dataloader", None))
            and hasattr(loop._data_source, "instance")
            for loop in (trainer.fit_loop, trainer.fit_loop.epoch_loop.val_loop)
        ),
    ),
    Internal(
        "Trainer.fit_loop.epoch_loop._results and its entries' has_reset",
        "the training results Lightning reset at an epoch's end are dropped, so that every rank reduces keys alike",
        lambda trainer: (
            isinstance(getattr(trainer.fit_loop.epoch_loop, "_results", None), dict)
            and all(hasattr(result, "has_reset") for result in trainer.fit_loop.epoch_loop._results.values())
        ),
    ),
    Internal(
        "torchmetrics.Metric._forward_cache",
        "a logged metric's value for the step, given to the stages that do not compute it in training_step",
        _metric_has_forward_cache,
    ),
    Internal(
        "torchmetrics.Metric._computed",
        "cleared on every rank after a training step under a pipeline, which updates the last stages' metrics only",
        _metric_has_computed_cache,
    ),
    # Used by AutoCache and gradient clipping at the time of writing: drop an entry when its use goes.
    Internal(
        "DataLoader.batch_sampler (replaced on a built DataLoader)",
        "AutoCache records the dataset indices of every training batch",
        _loader_takes_a_new_batch_sampler,
    ),
    Internal(
        "lightning.pytorch.utilities.data._get_dataloader_init_args_and_kwargs and fabric's _reinstantiate_wrapped_cls",
        "a training DataLoader is built again, of the user's class, for another number of replicas",
        lambda trainer: (
            callable(getattr(lightning_data, "_get_dataloader_init_args_and_kwargs", None))
            and callable(getattr(fabric_data, "_reinstantiate_wrapped_cls", None))
        ),
    ),
    Internal(
        "LightningModule._on_before_batch_transfer",
        "AutoCache prepares the samples drop_last left out as the loop prepares a batch (DataModule's hook first)",
        lambda trainer: callable(getattr(pl.LightningModule, "_on_before_batch_transfer", None)),
    ),
    Internal(
        "PrecisionPlugin.clip_gradients (replaced on the instance)",
        "gradient clipping by the norm over every stage's gradients",
        lambda trainer: callable(getattr(trainer.precision_plugin, "clip_gradients", None)),
    ),
)


def check_lightning_internals(trainer: pl.Trainer, internals: tuple[Internal, ...] = INTERNALS) -> None:
    """Raise :class:`UnsupportedLightningError` naming every relied-on attribute that is missing."""
    missing = [internal for internal in internals if not internal.present(trainer)]
    if not missing:
        return
    names = "; ".join(f"{internal.name} ({internal.use})" for internal in missing)
    raise UnsupportedLightningError(
        f"ElasticPipelineStrategy relies on parts of Lightning and torchmetrics that the installed versions "
        f"(lightning {lightning.__version__}, torchmetrics {torchmetrics.__version__}) do not have: {names}. "
        f"Install a supported version: {SUPPORTED_VERSIONS}."
    )


def forget_reset_results(trainer: pl.Trainer) -> None:
    """At a training epoch's first batch: drop the results Lightning reset at the last epoch's end.
    It reduces an epoch's values in the order their keys were first logged in the fit; where each
    stage logged keys of its own (its blocks' gradient norms) that order differs between ranks, and
    once a transition puts ranks of other stages in one group their reductions would pair unlike
    keys. Dropped, the keys come back in the order this epoch logs them, alike on every rank."""
    results = trainer.fit_loop.epoch_loop._results
    for key in [key for key, result in results.items() if result.has_reset]:
        del results[key]


class LoaderRebuild:
    """What the user's loaders and Lightning's loops keep across the rebuild a transition forces
    (for the new replicas), as they do under DDP between the user's reloads: the loaders the
    ``train_dataloader`` and ``val_dataloader`` hooks returned, built again without calling the
    hooks (a hook may pick its data by epoch, or draw from the random stream), and a
    ``CombinedLoader``'s own loaders (Lightning replaces them in it with those it built for the
    layout of then); the epoch of each loop's last reload, from which
    ``reload_dataloaders_every_n_epochs`` counts; and the batches fit's validation has seen per
    loader, the step its ``on_step`` logs go to. ``on_reload`` is told the loop (``"train"`` or
    ``"val"``) whose hook ran again within the fit: a reload the user asked for."""

    def __init__(self, on_reload: Callable[[str], None] | None = None) -> None:
        self._on_reload = on_reload
        self._train_reload: float | None = None
        self._val_reload: float | None = None
        self._val_seen: dict[int, int] = {}
        # By loop: what its source gave last, and the loaders first in it where that is a CombinedLoader.
        self._returned: dict[str, tuple[Any, list[Any]]] = {}
        self._reuse: set[str] = set()  # loops whose next build takes that again
        self._sources: list[Any] = []

    def install(self, trainer: pl.Trainer) -> None:
        """At the set-up of fit: record what the loops' sources give (the LightningModule's or the
        DataModule's hooks, or the loaders given to fit)."""
        loops = {"train": trainer.fit_loop, "val": trainer.fit_loop.epoch_loop.val_loop}
        for loop, owner in loops.items():
            source = owner._data_source
            if source.instance is not None:
                source.dataloader = self._recorded(trainer, loop, source.dataloader)
                self._sources.append(source)

    def _recorded(self, trainer: pl.Trainer, loop: str, hook: Callable[[], Any]) -> Callable[[], Any]:
        def dataloader() -> Any:
            reuse, last_reload = loop in self._reuse, self._train_reload if loop == "train" else self._val_reload
            self._reuse.discard(loop)
            last, own = self._returned.get(loop, (None, []))
            if reuse and last is not None and not _user_reload_due(trainer, last_reload):
                loaders = last
            else:
                loaders = hook()
                if loop in self._returned and self._on_reload is not None:
                    self._on_reload(loop)
                if loaders is not last:  # a source given to fit gives the same object, already rewritten
                    own = list(loaders.flattened) if isinstance(loaders, CombinedLoader) else []
                self._returned[loop] = (loaders, own)
            if isinstance(loaders, CombinedLoader):
                loaders.flattened = own
            return loaders

        return dataloader

    def remove(self) -> None:
        for source in self._sources:
            source.__dict__.pop("dataloader", None)
        self._sources.clear()
        self._returned.clear()

    def keep(self, trainer: pl.Trainer) -> None:
        """Before a transition has the loaders rebuilt."""
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        self._train_reload = trainer.fit_loop._last_train_dl_reload_epoch
        self._val_reload = val_loop._last_val_dl_reload_epoch
        self._val_seen = dict(val_loop._seen_batches_per_dataloader)
        self._reuse = {"train", "val"}

    def training_rebuilt(self, trainer: pl.Trainer) -> None:
        """At the first batch of the epoch after a transition (Lightning built the loader at its start)."""
        if self._train_reload is not None:
            if not _user_reload_due(trainer, self._train_reload):
                trainer.fit_loop._last_train_dl_reload_epoch = self._train_reload
            self._train_reload = None

    def validation_rebuilt(self, trainer: pl.Trainer) -> None:
        """At the start of fit's next validation (Lightning built the loader just before)."""
        if self._val_reload is not None:
            if not _user_reload_due(trainer, self._val_reload):
                val_loop = trainer.fit_loop.epoch_loop.val_loop
                val_loop._last_val_dl_reload_epoch = self._val_reload
                val_loop._seen_batches_per_dataloader.update(self._val_seen)
            self._val_reload = None


def _user_reload_due(trainer: pl.Trainer, last_reload: float | None) -> bool:
    """Whether ``reload_dataloaders_every_n_epochs`` has Lightning reload now (as its loops decide)."""
    every = trainer.reload_dataloaders_every_n_epochs
    return bool(every) and last_reload is not None and trainer.current_epoch - last_reload >= every


class WeightAveragingError(ValueError):
    """A weight-averaging callback the strategy cannot run exactly: under a pipeline, or with
    ``cache=True`` where it copies averaged weights into the model for training."""


def weight_averaging(callbacks: list[pl.Callback]) -> list[pl.Callback]:
    """Lightning's weight-averaging callbacks among ``callbacks`` (EMA and other ``WeightAveraging``, SWA)."""
    kinds = tuple(
        getattr(pl.callbacks, name)
        for name in ("WeightAveraging", "StochasticWeightAveraging")
        if hasattr(pl.callbacks, name)  # WeightAveraging is newer than Lightning 2.4
    )
    return [callback for callback in callbacks if isinstance(callback, kinds)]


def averaged_weights_used_in(callback: pl.Callback, module: pl.LightningModule, max_epochs: int | None) -> str | None:
    """Where a weight-averaging ``callback`` puts its averages into the model during fit:
    ``"training"`` (SWA, for the epoch it adds to update a model's batch norms when the epochs
    are limited), ``"validation"`` (``WeightAveraging`` swaps them in for each validation), or
    None (SWA otherwise copies them in after the last epoch only)."""
    swa = pl.callbacks.StochasticWeightAveraging
    if not isinstance(callback, swa):
        return "validation"
    adds_an_epoch = swa.pl_module_contains_batch_norm(module) and max_epochs != -1
    return "training" if adds_an_epoch else None


def refuse_weight_averaging(callbacks: list[pl.Callback], pipeline_length: int) -> None:
    """Refuse Lightning's weight-averaging callbacks (EMA, SWA) under a pipeline: they read every
    weight after each step, and a rank holds only its stage's blocks (the others are placeholders)."""
    if pipeline_length <= 1:
        return
    for callback in weight_averaging(callbacks):
        name = type(callback).__name__
        raise WeightAveragingError(
            f"{name} under a {pipeline_length}-stage pipeline: it averages every weight after each step, but "
            f"each rank holds only the blocks of its stage, so the other blocks' averages would be of "
            f"placeholders. Pass ElasticPipelineStrategy(pipeline_length=1) (replicas only), or train without "
            f"{name}."
        )


def refuse_model_pruning(callbacks: list[pl.Callback], pipeline_length: int) -> None:
    """Refuse Lightning's ``ModelPruning`` under a pipeline: it computes masks from every weight it
    prunes (global thresholds by default), and a rank holds only its stage's blocks; at the end of
    training it registers new weights in place of the pruned ones on every rank."""
    if pipeline_length <= 1:
        return
    for callback in callbacks:
        if isinstance(callback, pl.callbacks.ModelPruning):
            raise UnsupportedRecipeError(
                f"ModelPruning under a {pipeline_length}-stage pipeline: it prunes by the values of every weight "
                f"it covers, but each rank holds only the blocks of its stage (the others are placeholders), so "
                f"its masks would not be one process's. Pass ElasticPipelineStrategy(pipeline_length=1) (replicas "
                f"only), or train without ModelPruning."
            )


def refuse_time_based_validation(trainer: pl.Trainer, world_size: int) -> None:
    """Refuse ``val_check_interval`` given as a time (Lightning 2.6): each rank decides on its
    own clock when to validate, so ranks would validate after different steps and their
    collectives pair with the wrong peers' (a hang, or under NCCL a silent mix-up)."""
    seconds = getattr(trainer, "_val_check_time_interval", None)  # absent before Lightning 2.6
    if seconds is not None and world_size > 1:
        raise UnsupportedRecipeError(
            f"Trainer(val_check_interval=<a time>, {seconds:g} s) on {world_size} processes: each rank decides on "
            f"its own clock when to validate, so the ranks would validate after different steps. Pass an int (every "
            f"N training batches) or a float (a fraction of the epoch) instead."
        )


def clip_norm_over_stages(plugin: Precision, clip_by_norm: Callable[[float, Any], None]) -> None:
    """Make ``plugin`` clip by the norm with ``clip_by_norm(max_norm, optimizer)`` (the norm of
    the optimizer's gradients over every stage, not only this rank's); other clipping stays the
    plugin's. Undone by :func:`restore_clipping`."""
    original = type(plugin).clip_gradients

    def clip_gradients(
        optimizer: object, clip_val: float = 0.0, gradient_clip_algorithm: object = GradClipAlgorithmType.NORM
    ) -> None:
        if clip_val > 0 and gradient_clip_algorithm == GradClipAlgorithmType.NORM:
            if getattr(plugin, "scaler", None) is not None and unscales_in_own_step(optimizer):
                # Lightning's mixed precision refuses this too: the gradients are still scaled here.
                raise RuntimeError(
                    f"The current optimizer, {type(optimizer).__qualname__}, does not allow for gradient clipping "
                    f"because it performs unscaling of gradients internally. HINT: Are you using a 'fused' optimizer?"
                )
            clip_by_norm(float(clip_val), optimizer)
        else:
            original(plugin, optimizer, clip_val, gradient_clip_algorithm)

    plugin.clip_gradients = clip_gradients


def restore_clipping(plugin: Precision) -> None:
    """Undo :func:`clip_norm_over_stages`."""
    plugin.__dict__.pop("clip_gradients", None)
