"""Fine-tune a small timm Vision Transformer on scikit-learn's 8x8 digits, with LightningCLI.

An ordinary LightningModule and LightningDataModule: nothing here knows about
lightning_pipetx. The plugin comes in from the command line or a YAML config, e.g.::

    python examples/image_classification.py fit --config examples/configs/demo.yaml
    python examples/image_classification.py fit --trainer.max_epochs=4 \\
        --trainer.callbacks+=lightning_pipetx.FreezeCallback --trainer.callbacks.alpha=0.5
    python examples/image_classification.py fit --data.data=synthetic --model.depth=12

``--data.data=digits`` uses the 1,797 digits images that ship with scikit-learn, upsampled to
``img_size`` with three channels; ``--data.data=synthetic`` draws fixed-seed random images
(one random template per class plus noise) for speed runs. Nothing is downloaded: the
model is built from its config with ``pretrained=False``.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import timm
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

_DATA_MODES = ("digits", "synthetic")


class ImageClassifier(pl.LightningModule):
    """A timm Vision Transformer trained with cross-entropy, AdamW and warm-up + cosine LR.

    Args:
        model_name: timm architecture; its config is the starting point for the overrides below.
        img_size: input resolution (square).
        patch_size: patch size; ``(img_size / patch_size) ** 2`` tokens plus the class token.
        depth: number of Transformer blocks.
        embed_dim: token width.
        num_heads: attention heads.
        num_classes: output classes.
        global_pool: ``"token"`` (class token) or ``"avg"`` (mean of the patch tokens) before the head.
        drop_rate: dropout after the attention/MLP projections and before the head.
        drop_path_rate: stochastic depth.
        lr: peak learning rate.
        weight_decay: AdamW weight decay.
        warmup_ratio: fraction of the training steps with a linear LR warm-up; cosine decay after.
    """

    def __init__(
        self,
        model_name: str = "vit_tiny_patch16_224",
        img_size: int = 32,
        patch_size: int = 8,
        depth: int = 6,
        embed_dim: int = 128,
        num_heads: int = 4,
        num_classes: int = 10,
        global_pool: str = "token",
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        lr: float = 1e-3,
        weight_decay: float = 0.05,
        warmup_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = timm.create_model(
            model_name,
            pretrained=False,
            img_size=img_size,
            patch_size=patch_size,
            depth=depth,
            embed_dim=embed_dim,
            num_heads=num_heads,
            num_classes=num_classes,
            global_pool=global_pool,
            drop_rate=drop_rate,
            proj_drop_rate=drop_rate,
            drop_path_rate=drop_path_rate,
        )
        self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        self.train_acc(logits, labels)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.val_acc(logits, labels)
        self.log("val_loss", F.cross_entropy(logits, labels), prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self):
        hparams = self.hparams
        # No weight decay on biases, norms, the class token and position embeddings.
        skip = set(getattr(self.model, "no_weight_decay", set)())
        decay, no_decay = [], []
        for name, param in self.model.named_parameters():
            (no_decay if param.ndim <= 1 or name in skip else decay).append(param)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=hparams.lr,
        )
        total = max(1, self.trainer.estimated_stepping_batches)
        warmup = max(1, round(hparams.warmup_ratio * total))

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ImageDataModule(pl.LightningDataModule):
    """The digits images, or fixed-seed synthetic ones, as ``img_size`` RGB tensors.

    Args:
        data: ``"digits"`` (scikit-learn's 8x8 digits) or ``"synthetic"``.
        img_size: output resolution; digits are upsampled bilinearly.
        batch_size: samples per batch, for training and validation.
        val_fraction: share of the samples held out for validation (fixed-seed split).
        train_repeats: passes over the training samples per epoch (digits makes short epochs).
        num_samples: number of synthetic samples (ignored for digits).
        num_classes: number of synthetic classes (digits has 10).
        seed: seed of the split and of the synthetic images.
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        data: str = "digits",
        img_size: int = 32,
        batch_size: int = 32,
        val_fraction: float = 0.2,
        train_repeats: int = 1,
        num_samples: int = 2048,
        num_classes: int = 10,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if data not in _DATA_MODES:
            raise ValueError(f"data={data!r}: choose one of {_DATA_MODES}.")
        if data == "digits" and num_classes != 10:
            raise ValueError(f"digits has 10 classes, got num_classes={num_classes}.")
        self.save_hyperparameters()
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        hparams = self.hparams
        generator = torch.Generator().manual_seed(hparams.seed)
        if hparams.data == "digits":
            images, labels = _digits(hparams.img_size)
        else:
            images, labels = _synthetic(hparams.num_samples, hparams.num_classes, hparams.img_size, generator)
        order = torch.randperm(len(labels), generator=generator)
        num_val = max(1, round(hparams.val_fraction * len(labels)))
        val, train = order[:num_val], order[num_val:]
        train = train.repeat(hparams.train_repeats)
        self.train_set = TensorDataset(images[train], labels[train])
        self.val_set = TensorDataset(images[val], labels[val])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.hparams.batch_size,
            shuffle=True,
            num_workers=self.hparams.num_workers,
            drop_last=True,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)


def _digits(img_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
    images = F.interpolate(images, size=(img_size, img_size), mode="bilinear", align_corners=False)
    images = ((images - 0.5) / 0.5).expand(-1, 3, -1, -1).contiguous()
    return images, torch.tensor(digits.target, dtype=torch.long)


def _synthetic(
    num_samples: int, num_classes: int, img_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    templates = torch.randn(num_classes, 3, img_size, img_size, generator=generator)
    labels = torch.randint(num_classes, (num_samples,), generator=generator)
    noise = torch.randn(num_samples, 3, img_size, img_size, generator=generator)
    return templates[labels] + 2.0 * noise, labels


class ImageClassificationCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.img_size", "model.img_size")
        parser.link_arguments("data.num_classes", "model.num_classes")


def main() -> None:
    ImageClassificationCLI(ImageClassifier, ImageDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
