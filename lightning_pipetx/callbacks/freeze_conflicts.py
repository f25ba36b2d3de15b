"""Other code that decides which blocks train, against :class:`~lightning_pipetx.FreezeCallback`:
Lightning's finetuning callbacks, and a frozen weight made trainable again.

FreezeCallback's prefix stays frozen for the rest of the run: its decisions, the pipeline's
layout and AutoCache's states assume it. Under a pipeline a frozen block runs without gradients
(or is served from the cache), so a block made trainable again would silently not train.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BackboneFinetuning, BaseFinetuning
from torch import nn

from lightning_pipetx.blocks import BlockSplit

ONE_FREEZER = (
    "FreezeCallback and a finetuning callback would both decide which blocks train (FreezeCallback freezes a "
    "growing prefix for good, a finetuning callback freezes and unfreezes on its own schedule): use one of them."
)


def finetuning_callbacks(trainer: pl.Trainer) -> list[str]:
    """Names of Lightning's finetuning callbacks (``BaseFinetuning``) among the Trainer's: they
    freeze weights in their ``setup`` and may unfreeze them later."""
    return [type(c).__name__ for c in trainer.callbacks if isinstance(c, BaseFinetuning)]


def refuse_backbone_finetuning(trainer: pl.Trainer, module: pl.LightningModule, split: BlockSplit) -> None:
    """Refuse a ``BackboneFinetuning`` whose ``module.backbone`` holds the blocks, or the weights
    before them (the embeddings): it would unfreeze what FreezeCallback froze."""
    if not any(isinstance(c, BackboneFinetuning) for c in trainer.callbacks):
        return
    backbone = getattr(module, "backbone", None)
    if not isinstance(backbone, nn.Module):
        return  # BackboneFinetuning refuses such a module itself
    held = {id(p) for p in backbone.parameters()}
    if any(id(p) in held for p in split.blocks.parameters()):
        what = f"the blocks {split.path!r}"
    elif any(id(p) in held for p in split.pre_parameters()):
        what = f"weights before the blocks {split.path!r} (the embeddings), which freeze with the first block"
    else:
        return
    raise ValueError(
        f"BackboneFinetuning unfreezes the LightningModule's backbone, which holds {what} that FreezeCallback "
        f"freezes. {ONE_FREEZER}"
    )


def refuse_retrained(trainer: pl.Trainer, module: nn.Module, frozen: list[nn.Parameter], frozen_blocks: int) -> None:
    """Raise if a weight of the frozen prefix (``frozen``) trains again (``requires_grad``)."""
    if not any(p.requires_grad for p in frozen):
        return
    retrained = {id(p) for p in frozen if p.requires_grad}
    names = (n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in retrained)
    name = next(names, "a weight no longer in the LightningModule")
    finetuning = finetuning_callbacks(trainer)
    cause = f" ({' and '.join(finetuning)} among the Trainer's callbacks)" if finetuning else ""
    raise ValueError(
        f"FreezeCallback froze the first {frozen_blocks} blocks and the weights before them, but {name!r} was made "
        f"trainable again (requires_grad=True){cause}. A frozen prefix stays frozen: under ElasticPipelineStrategy "
        f"its blocks run without gradients or are served from AutoCache, so they would not train. "
        + (ONE_FREEZER if finetuning else "Leave the weights FreezeCallback froze frozen, or train without it.")
    )
