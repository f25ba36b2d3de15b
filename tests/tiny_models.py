"""Tiny models, LightningModules and data sets built in code, for the test suite.

Nothing here downloads anything: every model comes from a small config (hidden size 32,
2 heads, 4 blocks, vocabulary 100) with weights drawn from a fixed seed, so that two calls
with the same seed give bit-identical models. Later test files (strategy equivalence tests)
import these factories, so keep them deterministic and side-effect free:

* :func:`build_model` ``(name, seed)`` builds any model of :data:`MODEL_NAMES`; the global
  RNG state is left untouched.
* :class:`TinyBertClassifier` and :class:`TinyViTClassifier` are ordinary, unchanged
  LightningModules around tiny HF BERT and timm ViT models; :class:`TinySequentialRegressor`
  wraps the plain ``nn.Sequential`` model and is the fastest one.
* :class:`RandomTokenDataset`, :class:`RandomImageDataset` and :class:`RandomVectorDataset`
  are fixed-seed random data sets whose labels depend on the inputs (so training learns).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

HIDDEN = 32
HEADS = 2
LAYERS = 4
INTERMEDIATE = 64
VOCAB = 100
MAX_POSITIONS = 64
SEQ_LEN = 16
IMG_SIZE = 32
PATCH = 8
NUM_LABELS = 3
NUM_CLASSES = 5


def _seeded(seed: int, factory: Callable[[], nn.Module]) -> nn.Module:
    """Run ``factory`` with the torch CPU RNG seeded, without disturbing the caller's RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


# --------------------------------------------------------------------------- HF models
def _bert_sizes(dropout: float, num_labels: int) -> dict:
    """The tiny sizes of a BERT-like encoder's config."""
    return dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=INTERMEDIATE,
        max_position_embeddings=MAX_POSITIONS,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        num_labels=num_labels,
    )


def _bert_config(dropout: float, num_labels: int):
    from transformers import BertConfig

    return BertConfig(**_bert_sizes(dropout, num_labels), attn_implementation="eager")


def tiny_bert(seed: int = 0, dropout: float = 0.1, num_labels: int = NUM_LABELS) -> nn.Module:
    from transformers import BertForSequenceClassification

    return _seeded(seed, lambda: BertForSequenceClassification(_bert_config(dropout, num_labels)))


def _offset_position_sizes(dropout: float, num_labels: int) -> dict:
    """The tiny sizes for a RoBERTa-style config, whose positions start at pad_token_id + 1."""
    return dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=INTERMEDIATE,
        max_position_embeddings=MAX_POSITIONS + 2,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        num_labels=num_labels,
        pad_token_id=1,
    )


def tiny_roberta(seed: int = 0, dropout: float = 0.1, num_labels: int = NUM_LABELS) -> nn.Module:
    from transformers import RobertaConfig, RobertaForSequenceClassification

    config = RobertaConfig(**_offset_position_sizes(dropout, num_labels), attn_implementation="eager")
    return _seeded(seed, lambda: RobertaForSequenceClassification(config))


def tiny_xlm_roberta(seed: int = 0, dropout: float = 0.1, num_labels: int = NUM_LABELS) -> nn.Module:
    """XLM-R: its classification head is registered before the backbone."""
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    config = XLMRobertaConfig(**_offset_position_sizes(dropout, num_labels), attn_implementation="eager")
    return _seeded(seed, lambda: XLMRobertaForSequenceClassification(config))


def tiny_mpnet(seed: int = 0, dropout: float = 0.1, num_labels: int = NUM_LABELS) -> nn.Module:
    """MPNet: its relative position bias comes from a weight of the encoder outside the block
    list, computed once per call and passed to every block."""
    from transformers import MPNetConfig, MPNetForSequenceClassification

    config = MPNetConfig(**_offset_position_sizes(dropout, num_labels))
    return _seeded(seed, lambda: MPNetForSequenceClassification(config))


def tiny_distilbert(seed: int = 0, dropout: float = 0.1, num_labels: int = NUM_LABELS) -> nn.Module:
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    config = DistilBertConfig(
        vocab_size=VOCAB,
        dim=HIDDEN,
        n_layers=LAYERS,
        n_heads=HEADS,
        hidden_dim=INTERMEDIATE,
        max_position_embeddings=MAX_POSITIONS,
        dropout=dropout,
        attention_dropout=dropout,
        seq_classif_dropout=dropout,
        num_labels=num_labels,
        attn_implementation="eager",
    )
    return _seeded(seed, lambda: DistilBertForSequenceClassification(config))


def tiny_roformer(seed: int = 0, dropout: float = 0.1, num_labels: int = NUM_LABELS):
    """A tiny HF RoFormer: each layer returns its attention probabilities beside the hidden state."""
    from transformers import RoFormerConfig, RoFormerForSequenceClassification

    config = RoFormerConfig(**_bert_sizes(dropout, num_labels))
    return _seeded(seed, lambda: RoFormerForSequenceClassification(config))


def tiny_hf_vit(seed: int = 0, dropout: float = 0.1, num_labels: int = NUM_CLASSES) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=IMG_SIZE,
        patch_size=PATCH,
        num_channels=3,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=INTERMEDIATE,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        num_labels=num_labels,
        attn_implementation="eager",
    )
    return _seeded(seed, lambda: ViTForImageClassification(config))


def tiny_gpt2(seed: int = 0, dropout: float = 0.1) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=MAX_POSITIONS,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        n_inner=INTERMEDIATE,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    return _seeded(seed, lambda: GPT2LMHeadModel(config))


def tiny_t5(seed: int = 0, dropout: float = 0.1) -> nn.Module:
    """A tiny T5 (encoder-decoder); its decoder's blocks pass the position bias on through their outputs."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        d_kv=HIDDEN // HEADS,
        d_ff=INTERMEDIATE,
        num_layers=LAYERS,
        num_heads=HEADS,
        dropout_rate=dropout,
        decoder_start_token_id=0,
        pad_token_id=0,
        attn_implementation="eager",
    )
    return _seeded(seed, lambda: T5ForConditionalGeneration(config))


def tiny_llama(seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=MAX_POSITIONS,
        attn_implementation="eager",
    )
    return _seeded(seed, lambda: LlamaForCausalLM(config))


# ------------------------------------------------------------------------- timm models
def _timm(name: str, seed: int, dropout: float, num_classes: int) -> nn.Module:
    import timm

    return _seeded(
        seed,
        lambda: timm.create_model(
            name,
            pretrained=False,
            img_size=IMG_SIZE,
            patch_size=PATCH,
            embed_dim=HIDDEN,
            depth=LAYERS,
            num_heads=HEADS,
            num_classes=num_classes,
            drop_rate=dropout,
            proj_drop_rate=dropout,
            attn_drop_rate=dropout,
        ),
    )


def tiny_timm_vit(seed: int = 0, dropout: float = 0.1, num_classes: int = NUM_CLASSES) -> nn.Module:
    """timm ``vit_tiny_patch16_224`` shrunk to 32x32 images, patch 8, width 32, depth 4."""
    return _timm("vit_tiny_patch16_224", seed, dropout, num_classes)


def tiny_timm_deit(seed: int = 0, dropout: float = 0.1, num_classes: int = NUM_CLASSES) -> nn.Module:
    """timm ``deit_tiny_patch16_224`` shrunk like :func:`tiny_timm_vit`."""
    return _timm("deit_tiny_patch16_224", seed, dropout, num_classes)


def tiny_timm_deit_distilled(seed: int = 0, dropout: float = 0.1, num_classes: int = NUM_CLASSES) -> nn.Module:
    """timm ``deit_tiny_distilled_patch16_224`` (a ``dist_token`` next to ``cls_token``), shrunk."""
    return _timm("deit_tiny_distilled_patch16_224", seed, dropout, num_classes)


# -------------------------------------------------------------------- plain Sequential
class ResidualMLPBlock(nn.Module):
    """``x + scale * mlp(norm(x))``; ``scale`` is a fixed buffer that scales the block's gradients."""

    def __init__(self, dim: int, scale: float = 1.0, dropout: float = 0.1) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.act = nn.GELU()
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.register_buffer("scale", torch.tensor(float(scale)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.fc2(self.drop(self.act(self.fc1(self.norm(x)))))


def tiny_sequential(
    seed: int = 0,
    in_features: int = 8,
    dim: int = 16,
    out_features: int = 2,
    num_blocks: int = LAYERS,
    block_scales: list[float] | None = None,
    dropout: float = 0.1,
) -> nn.Sequential:
    """A plain ``nn.Sequential``: ``embed`` (Linear + Dropout), ``blocks`` (residual MLPs), ``head``.

    ``block_scales[i]`` multiplies block ``i``'s residual branch, and so its gradient norm:
    tests use it to decide which block has the smallest gradient.
    """
    scales = block_scales if block_scales is not None else [1.0] * num_blocks
    if len(scales) != num_blocks:
        raise ValueError("block_scales needs one value per block")

    def make() -> nn.Sequential:
        return nn.Sequential(
            OrderedDict(
                embed=nn.Sequential(nn.Linear(in_features, dim), nn.Dropout(dropout)),
                blocks=nn.Sequential(*(ResidualMLPBlock(dim, s, dropout) for s in scales)),
                norm=nn.LayerNorm(dim),
                head=nn.Linear(dim, out_features),
            )
        )

    return _seeded(seed, make)


MODEL_FACTORIES: dict[str, Callable[..., nn.Module]] = {
    "bert": tiny_bert,
    "roberta": tiny_roberta,
    "mpnet": tiny_mpnet,
    "distilbert": tiny_distilbert,
    "hf_vit": tiny_hf_vit,
    "gpt2": tiny_gpt2,
    "llama": tiny_llama,
    "timm_vit": tiny_timm_vit,
    "timm_deit": tiny_timm_deit,
    "timm_deit_distilled": tiny_timm_deit_distilled,
    "sequential": tiny_sequential,
}
MODEL_NAMES = tuple(MODEL_FACTORIES)


def build_model(name: str, seed: int = 0, **kwargs) -> nn.Module:
    """Build the tiny model ``name`` (one of :data:`MODEL_NAMES`) with weights from ``seed``."""
    return MODEL_FACTORIES[name](seed=seed, **kwargs)


# ------------------------------------------------------------------------ data sets
class RandomTokenDataset(Dataset):
    """Random token ids with an attention mask and a label that depends on the tokens."""

    def __init__(
        self,
        size: int = 32,
        seq_len: int = SEQ_LEN,
        vocab_size: int = VOCAB,
        num_labels: int = NUM_LABELS,
        seed: int = 0,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(2, vocab_size, (size, seq_len), generator=g)
        lengths = torch.randint(seq_len // 2, seq_len + 1, (size,), generator=g)
        self.attention_mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
        self.input_ids = self.input_ids * self.attention_mask  # padding id 0
        self.labels = self.input_ids[:, 0] % num_labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids[index],
            "attention_mask": self.attention_mask[index],
            "labels": self.labels[index],
        }


class SwappableDataset(Dataset):
    """One dataset object whose samples its owner replaces in place (``base``), keeping its length."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        return self.base[index]


class AugmentedTokenDataset(Dataset):
    """:class:`RandomTokenDataset` with a random token swapped in every time a sample is read."""

    def __init__(self, size: int, seed: int) -> None:
        self.data = RandomTokenDataset(size=size, seed=seed)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = dict(self.data[index])
        sample["input_ids"] = sample["input_ids"].clone()
        sample["input_ids"][1] = torch.randint(2, 100, ())
        return sample


class RandomImageDataset(Dataset):
    """Random images ``(3, img_size, img_size)`` with a label that depends on the image."""

    def __init__(self, size: int = 32, img_size: int = IMG_SIZE, num_classes: int = NUM_CLASSES, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, num_classes, (size,), generator=g)
        self.images = torch.randn(size, 3, img_size, img_size, generator=g)
        self.images[:, 0] += self.labels[:, None, None].float()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


class RandomVectorDataset(Dataset):
    """Random vectors with a regression target that is a fixed function of the input."""

    def __init__(self, size: int = 32, in_features: int = 8, out_features: int = 2, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, in_features, generator=g)
        w = torch.randn(in_features, out_features, generator=g)
        self.y = torch.tanh(self.x @ w)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def make_loader(dataset: Dataset, batch_size: int = 8, shuffle: bool = False, seed: int = 0) -> DataLoader:
    """A single-process DataLoader; with ``shuffle`` its order comes from ``seed``."""
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator, num_workers=0)


# ---------------------------------------------------------------- LightningModules
class TinyBertClassifier(pl.LightningModule):
    """An ordinary LightningModule around a tiny HF ``BertForSequenceClassification``."""

    factory = staticmethod(tiny_bert)

    def __init__(self, seed: int = 0, lr: float = 1e-3, dropout: float = 0.1, num_labels: int = NUM_LABELS):
        super().__init__()
        self.save_hyperparameters()
        self.model = self.factory(seed=seed, dropout=dropout, num_labels=num_labels)

    def forward(self, batch: dict[str, torch.Tensor]):
        return self.model(**batch)

    def training_step(self, batch, batch_idx):
        loss = self(batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        out = self(batch)
        acc = (out.logits.argmax(-1) == batch["labels"]).float().mean()
        self.log("val_loss", out.loss)
        self.log("val_acc", acc)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class TinyMPNetClassifier(TinyBertClassifier):
    """The same LightningModule around a tiny HF ``MPNetForSequenceClassification``."""

    factory = staticmethod(tiny_mpnet)


class TinyXLMRobertaClassifier(TinyBertClassifier):
    """The same LightningModule around a tiny HF ``XLMRobertaForSequenceClassification``."""

    factory = staticmethod(tiny_xlm_roberta)


class TinyRoFormerClassifier(TinyBertClassifier):
    factory = staticmethod(tiny_roformer)


class TinyViTClassifier(pl.LightningModule):
    """An ordinary LightningModule around a tiny timm ``vit_tiny_patch16_224``."""

    def __init__(self, seed: int = 0, lr: float = 1e-3, dropout: float = 0.1, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.save_hyperparameters()
        self.model = tiny_timm_vit(seed=seed, dropout=dropout, num_classes=num_classes)
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = self.loss_fn(self(images), labels)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        logits = self(images)
        self.log("val_loss", self.loss_fn(logits, labels))
        self.log("val_acc", (logits.argmax(-1) == labels).float().mean())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class TinyGPT2LM(pl.LightningModule):
    """An ordinary LightningModule around a tiny HF ``GPT2LMHeadModel`` (its embedding is tied to
    the LM head: used on the first and the last stage). The loss predicts every next token, so
    every sample counts the same number of tokens."""

    def __init__(self, seed: int = 0, lr: float = 1e-3, dropout: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.model = tiny_gpt2(seed=seed, dropout=dropout)

    def forward(self, batch: dict[str, torch.Tensor]):
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"])

    def training_step(self, batch, batch_idx):
        loss = self(batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self(batch).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class TinyT5Seq2Seq(pl.LightningModule):
    """An ordinary LightningModule around a tiny HF ``T5ForConditionalGeneration`` that learns to
    copy its input (every sample has the same number of target tokens)."""

    def __init__(self, seed: int = 0, lr: float = 1e-3, dropout: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.model = tiny_t5(seed=seed, dropout=dropout)

    def forward(self, batch: dict[str, torch.Tensor]):
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"])

    def training_step(self, batch, batch_idx):
        loss = self(batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class SharpnessAware(torch.optim.Optimizer):
    """SAM (Foret et al.) as commonly written for Lightning: its step calls the closure twice, the
    second time at weights moved up the gradient, and steps AdamW from there with the old weights."""

    def __init__(self, params, rho=0.05, lr=1e-3):
        super().__init__(params, {"rho": rho, "lr": lr})
        self.base = torch.optim.AdamW(self.param_groups, lr=lr)
        self.param_groups = self.base.param_groups

    @torch.no_grad()
    def step(self, closure):
        with torch.enable_grad():
            loss = closure()
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        moved = {}
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                moved[p] = p.detach().clone()
                p.add_(p.grad * (group["rho"] / (norm + 1e-12)))
        self.zero_grad()
        with torch.enable_grad():
            closure()
        for p, weights in moved.items():
            p.copy_(weights)
        self.base.step()
        return loss


class TinySequentialRegressor(pl.LightningModule):
    """An ordinary LightningModule around :func:`tiny_sequential` (MSE regression)."""

    def __init__(
        self,
        seed: int = 0,
        lr: float = 1e-2,
        block_scales: list[float] | None = None,
        num_blocks: int = LAYERS,
        dropout: float = 0.1,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model = tiny_sequential(seed=seed, num_blocks=num_blocks, block_scales=block_scales, dropout=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class SummedBlocksRegressor(TinySequentialRegressor):
    """:class:`TinySequentialRegressor` whose head reads the sum of every block's output, not only the last's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed(x)
        total = torch.zeros_like(hidden)
        for block in self.model.blocks:
            hidden = block(hidden)
            total = total + hidden
        return self.model.head(self.model.norm(total))


class TupleStateBlock(nn.Module):
    """A block taking and returning its residual stream as one tuple: (hidden state, scale)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, state: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, scale = state
        return self.block(hidden) * scale, scale


class TupleStreamRegressor(TinySequentialRegressor):
    """:class:`TinySequentialRegressor` whose blocks each take the previous block's whole output tuple."""

    def __init__(self, seed: int = 0, dropout: float = 0.1):
        super().__init__(seed=seed, dropout=dropout)
        self.model.blocks = nn.Sequential(*(TupleStateBlock(block) for block in self.model.blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = (self.model.embed(x), torch.ones(()))
        for block in self.model.blocks:
            state = block(state)
        return self.model.head(self.model.norm(state[0]))


class TinyBatchNormRegressor(TinySequentialRegressor):
    """:class:`TinySequentialRegressor` with a batch norm in every block, in place of its layer norm."""

    def __init__(self, seed: int = 0, lr: float = 1e-2, dropout: float = 0.1):
        super().__init__(seed=seed, lr=lr, dropout=dropout)
        for block in self.model.blocks:
            block.norm = nn.BatchNorm1d(block.norm.normalized_shape[0])


@dataclass(frozen=True)
class TinyTask:
    """A LightningModule factory and its matching data, for tests that run several tasks alike."""

    name: str
    module: Callable[..., pl.LightningModule]
    dataset: Callable[..., Dataset]
    blocks_path: str  # the block list's dotted path inside the LightningModule


TASKS: dict[str, TinyTask] = {
    "bert": TinyTask("bert", TinyBertClassifier, RandomTokenDataset, "model.bert.encoder.layer"),
    "mpnet": TinyTask("mpnet", TinyMPNetClassifier, RandomTokenDataset, "model.mpnet.encoder.layer"),
    "timm_vit": TinyTask("timm_vit", TinyViTClassifier, RandomImageDataset, "model.blocks"),
    "gpt2": TinyTask("gpt2", TinyGPT2LM, RandomTokenDataset, "model.transformer.h"),
    "t5": TinyTask("t5", TinyT5Seq2Seq, RandomTokenDataset, "model.decoder.block"),
    "roformer": TinyTask("roformer", TinyRoFormerClassifier, RandomTokenDataset, "model.roformer.encoder.layer"),
    "sequential": TinyTask("sequential", TinySequentialRegressor, RandomVectorDataset, "model.blocks"),
    "batchnorm": TinyTask("batchnorm", TinyBatchNormRegressor, RandomVectorDataset, "model.blocks"),
}


def build_task(name: str, seed: int = 0, **module_kwargs) -> pl.LightningModule:
    """Build the LightningModule of task ``name`` (``bert``, ``timm_vit``, ``sequential``) from ``seed``."""
    return TASKS[name].module(seed=seed, **module_kwargs)


def task_loader(name: str, size: int = 32, batch_size: int = 8, seed: int = 0, shuffle: bool = False) -> DataLoader:
    """A DataLoader over the fixed-seed random data set of task ``name``."""
    return make_loader(TASKS[name].dataset(size=size, seed=seed), batch_size=batch_size, shuffle=shuffle, seed=seed)


# ---------------------------------------------------------------------- trainers
class HitRates(pl.Callback):
    """``pipetx/cache_hit_rate`` of every epoch (None before anything is frozen)."""

    def __init__(self):
        self.rates = []

    def on_train_epoch_end(self, trainer, pl_module):
        rate = trainer.callback_metrics.get("pipetx/cache_hit_rate")
        self.rates.append(
            None if rate is None or trainer.callback_metrics.get("pipetx/frozen_blocks") == 0 else float(rate)
        )


class Layouts(pl.Callback):
    """The strategy's layout at the start of every training epoch (``"2x1"``, ...)."""

    def __init__(self):
        self.layouts = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.layouts.append(str(trainer.strategy.layout))


def make_trainer(callbacks, max_epochs=3, **kwargs) -> pl.Trainer:
    """A quiet single-CPU Trainer (no logger, checkpoints, progress bar or sanity check)."""
    options = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **options)


def cached_trainer(tmp_path, cache, callbacks=(), alpha=1 / 2, max_epochs=4, **kwargs) -> pl.Trainer:
    """:func:`make_trainer` under ``ElasticPipelineStrategy(cache=cache)`` (spilling under ``tmp_path``),
    with a ``FreezeCallback`` freezing by schedule (``alpha``) before ``callbacks``."""
    from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback  # registers the strategy: not at import

    strategy = ElasticPipelineStrategy(cache=cache, profile_steps=0, cache_dir=str(tmp_path / "spill"))
    freeze = FreezeCallback(alpha=alpha, signal="schedule")
    return make_trainer([freeze, *callbacks], max_epochs=max_epochs, strategy=strategy, **kwargs)
