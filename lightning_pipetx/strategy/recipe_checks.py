"""What a run asks that a pipeline or AutoCache cannot do exactly, refused at set-up or as it
is asked: the fit's recipe (optimizers, loss scaling, callbacks, Trainer flags, the model's
config) and models asked for every block's outputs.

A refusal under a pipeline raises an error naming the fix; one that concerns the cache
alone turns it off (``cache="auto"``) or raises (``cache=True``), through
:class:`~lightning_pipetx.autocache.CacheControl`.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_pipetx.autocache import CacheControl
from lightning_pipetx.strategy.lightning_compat import (
    WeightAveragingError,
    averaged_weights_used_in,
    refuse_model_pruning,
    refuse_time_based_validation,
    refuse_weight_averaging,
    weight_averaging,
)
from lightning_pipetx.strategy.loss_scaling import refuse_unagreed_overflow
from lightning_pipetx.strategy.model_checks import (
    UnsupportedOutputsError,
    UnsupportedRecipeError,
    block_dropping,
    refuse_block_dropping,
)


def check_fit_recipe(
    trainer: pl.Trainer,
    optimizers: list[torch.optim.Optimizer],
    scaler: Any,
    blocks: torch.nn.Module,
    pipeline_length: int,
    world_size: int,
    autocache: CacheControl,
) -> None:
    """Refuse, on every rank, what the fit's recipe asks that this layout or the cache cannot
    run exactly (after ``configure_optimizers``)."""
    module = trainer.lightning_module
    refuse_whole_model_optimizers(optimizers, pipeline_length)
    refuse_unagreed_overflow(optimizers, scaler, pipeline_length)
    refuse_weight_averaging(trainer.callbacks, pipeline_length)
    refuse_averaged_models(module, pipeline_length)
    refuse_model_pruning(trainer.callbacks, pipeline_length)
    refuse_time_based_validation(trainer, world_size)
    dropping = block_dropping(module, blocks)
    refuse_block_dropping(dropping, pipeline_length)
    if dropping:
        model, key, value = dropping[0]
        reason = f"{model}.config.{key}={value:g} skips frozen blocks at random, which cached states cannot"
        autocache.refuse(reason, UnsupportedRecipeError, f"Pass cache=False, or set {key} to 0.")
    for callback in weight_averaging(trainer.callbacks):
        _refuse_cache_for_averaging(
            autocache, type(callback).__name__, averaged_weights_used_in(callback, module, trainer.max_epochs)
        )


def refuse_averaged_models(module: torch.nn.Module, pipeline_length: int) -> None:
    """Refuse, under a pipeline, an EMA of the model kept inside the LightningModule: a torch
    ``AveragedModel`` or timm's ``ModelEmaV2``/``ModelEmaV3``. It averages every weight, and a rank
    holds only its stage's blocks (the others read NaN), so its averages of the other blocks would be NaN."""
    if pipeline_length <= 1:
        return
    for name, child in module.named_modules():
        if _is_averaged_model(child):
            raise WeightAveragingError(
                f"{name} is an average of the model's weights ({type(child).__module__.partition('.')[0]}'s "
                f"{type(child).__name__}) under a {pipeline_length}-stage pipeline: it averages every weight, but "
                f"each rank holds only the blocks of its stage, so its averages of the other blocks would be of "
                f"placeholders (NaN). Pass ElasticPipelineStrategy(pipeline_length=1) (replicas only)."
            )


def _is_averaged_model(module: torch.nn.Module) -> bool:
    if isinstance(module, torch.optim.swa_utils.AveragedModel):
        return True
    kind = type(module)
    return kind.__module__.startswith("timm.") and kind.__name__.startswith("ModelEma")


class BlockCopyWatch:
    """Copies of the block list kept beside the model (an EMA kept as a ``deepcopy`` of it, in the
    LightningModule or in a callback; a frozen reference model), watched under a pipeline. A rank
    holds only its stage's blocks, the others read NaN: a copy whose weights turn NaN was written
    from them (an average of every weight), or copied them, and is refused before a checkpoint
    keeps it. A reference model is never written. Copies are looked for at each check: a script
    may make one at any time (an EMA made at its first update)."""

    def __init__(self, trainer: pl.Trainer, blocks: torch.nn.Module, pipeline_length: int) -> None:
        self._trainer = trainer
        self._blocks = blocks
        self._pipeline_length = pipeline_length

    def _probes(self) -> list[tuple[str, torch.Tensor]]:
        """Per copied block, its smallest weight."""
        probes = []
        roots = _copy_roots(self._trainer.lightning_module, self._trainer.callbacks)
        for name, copy in _block_list_copies(roots, self._blocks):
            for index, block in enumerate(copy.children()):
                weights = list(block.parameters())
                if weights:
                    probes.append((f"{name}.{index}", min(weights, key=torch.Tensor.numel)))
        return probes

    def check(self) -> None:
        """Raise :class:`WeightAveragingError` on every rank where a copy holds NaN on one (a
        collective: one host read per device the copies are on, where there are copies, and a
        gather of what each rank found, for code that wrote a copy on some stages only)."""
        if self._pipeline_length <= 1:
            return
        by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for name, weight in self._probes():
            by_device.setdefault(weight.device, []).append((name, torch.isfinite(weight.detach()).all()))
        turned = [
            name
            for probes in by_device.values()
            for (name, _), finite in zip(probes, torch.stack([flag for _, flag in probes]).tolist())
            if not finite
        ]
        if dist.is_initialized() and dist.get_world_size() > 1:
            found: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(found, turned[0] if turned else None)
            turned = [name for name in found if name is not None]
        if not turned:
            return
        name = turned[0].rpartition(".")[0]
        raise WeightAveragingError(
            f"{name} is a copy of the model's blocks whose weights turned NaN under a {self._pipeline_length}-stage "
            f"pipeline: code that copies or averages the model's weights into it (an EMA updated from the model) "
            f"reads every block, but each rank holds only the blocks of its stage, and the others are placeholders "
            f"that read NaN. Pass ElasticPipelineStrategy(pipeline_length=1) (replicas only)."
        )


def _copy_roots(module: torch.nn.Module, callbacks: list[pl.Callback]) -> list[tuple[str, torch.nn.Module]]:
    """Where copies of the block list may be kept: the LightningModule, and modules held by callbacks."""
    roots = [("", module)]
    for callback in callbacks:
        for attribute, value in getattr(callback, "__dict__", {}).items():  # none where it has __slots__
            if isinstance(value, torch.nn.Module) and value is not module:
                roots.append((f"{type(callback).__name__}.{attribute}", value))
    return roots


def _block_list_copies(
    roots: list[tuple[str, torch.nn.Module]], blocks: torch.nn.Module
) -> list[tuple[str, torch.nn.Module]]:
    """Modules under ``roots`` built as the block list is, holding none of its blocks: the same
    type, and block for block the same type and weight shapes."""
    shape, own = _structure(blocks), {id(block) for block in blocks.children()}
    copies = []
    for prefix, root in roots:
        for name, child in root.named_modules(prefix=prefix):
            if (
                type(child) is type(blocks)
                and not own & {id(block) for block in child.children()}
                and _structure(child) == shape
            ):
                copies.append((name, child))
    return copies


def _structure(blocks: torch.nn.Module) -> list[tuple[type, list[tuple[int, ...]]]]:
    return [(type(block), [tuple(w.shape) for w in block.parameters()]) for block in blocks.children()]


def refuse_whole_model_optimizers(optimizers: list[torch.optim.Optimizer], pipeline_length: int) -> None:
    """Refuse, under a pipeline, an optimizer whose step needs every weight's gradient at once:
    L-BFGS takes dot products over all its parameters and searches along one direction for the
    whole model, where each stage holds its own blocks' gradients only (it writes to the blocks
    of other stages too). Replicas hold every weight: ``pipeline_length=1`` trains as DDP does."""
    if pipeline_length <= 1:
        return
    for optimizer in optimizers:
        if isinstance(getattr(optimizer, "_optimizer", optimizer), torch.optim.LBFGS):
            raise UnsupportedRecipeError(
                f"torch.optim.LBFGS under a {pipeline_length}-stage pipeline: each step takes dot products over "
                f"the gradients of every weight and moves all of them along one direction, but each stage holds "
                f"only its own blocks' weights and gradients. Pass ElasticPipelineStrategy(pipeline_length=1) "
                f"(replicas that each hold every weight), or use a first-order optimizer such as AdamW."
            )


def refuse_repeated_closure(pipeline_length: int, accumulate_grad_batches: int) -> None:
    """Refuse an optimizer step that called the closure (``training_step`` and the backward) a
    second time for one batch, under a pipeline or in an accumulation window: such an optimizer
    (SAM and its variants) computes on every weight's gradient between the calls, a norm over the
    whole model, which no stage holds; and the window's gradients are reduced once, at its end."""
    if pipeline_length == 1 and accumulate_grad_batches > 1:
        raise UnsupportedRecipeError(
            f"the optimizer's step called the closure (training_step and the backward) a second time for one batch, "
            f"at the end of an accumulation window (accumulate_grad_batches={accumulate_grad_batches}): "
            f"ElasticPipelineStrategy reduces a window's gradients once, with its last backward. Pass "
            f"accumulate_grad_batches=1 with such an optimizer (SAM and its variants), or Lightning's DDP."
        )
    if pipeline_length > 1:
        raise UnsupportedRecipeError(
            f"the optimizer's step called the closure (training_step and the backward) a second time for one batch "
            f"under a {pipeline_length}-stage pipeline: an optimizer that does (SAM and its variants, L-BFGS) "
            f"computes on the gradients of every weight between the calls (a norm over the whole model), but each "
            f"stage holds only its own blocks' gradients, and would take another step than in one process. Pass "
            f"ElasticPipelineStrategy(pipeline_length=1) (replicas that each hold every weight)."
        )


def _refuse_cache_for_averaging(autocache: CacheControl, name: str, used_in: str | None) -> None:
    """A weight-averaging callback puts averaged weights into the model, frozen prefix included,
    which the cached states were not computed with: SWA for the epoch it adds to update batch
    norms (``used_in="training"``), EMA for each validation."""
    if used_in == "training":
        reason = f"{name} copies averaged weights into the model, the frozen prefix's too, for an epoch of training"
        autocache.refuse(reason, WeightAveragingError, f"Pass cache=False (or cache='auto'), or drop {name}.")
    elif used_in == "validation":
        autocache.refuse_validation(f"{name} validates with averaged weights, frozen prefix included")


def refuse_collected_outputs(
    model: str, what: str, pipeline_length: int, training: bool, cache: bool | str, autocache: CacheControl
) -> None:
    """A model was asked for outputs of every block (see
    :class:`~lightning_pipetx.strategy.model_checks.CollectedOutputChecks`)."""
    if pipeline_length > 1:
        raise UnsupportedOutputsError(
            f"{model} was asked for {what} under ElasticPipelineStrategy with pipeline_length={pipeline_length}: "
            f"each rank runs only some of its blocks, so the outputs of the blocks it skips would be missing. Turn "
            f"{what} off (in the call and in the model's config), or pass "
            f"ElasticPipelineStrategy(pipeline_length=1)."
        )
    if cache is False:
        return
    reason = f"{model} was asked for {what}, which needs every block to run, and a cache hit skips the frozen ones"
    if training:
        autocache.refuse(reason, UnsupportedOutputsError, "Pass cache=False (or cache='auto').")
    else:
        autocache.refuse_validation(reason)
