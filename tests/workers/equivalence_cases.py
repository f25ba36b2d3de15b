"""Cases shared by the equivalence workers and the single-process reference in the tests."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from tiny_models import TASKS, build_task
from torch.utils.data import DataLoader, DistributedSampler

TRAIN_SIZE = 48
EVAL_SIZE = 12


class _Predicting:
    """Adds a ``predict_step`` returning logits; the rest of the module stays as written.

    AdamW's ``eps`` is raised from 1e-8 to 1e-6: attention key biases have an exactly zero
    gradient, and Adam would turn the float noise in it (about 1e-10, different for every
    summation order) into full-size steps that no tolerance could compare. Adam does not see
    a constant factor on the gradients, so some cases use SGD, which does.
    """

    optimizer_name = "adamw"

    def configure_optimizers(self):
        if self.optimizer_name == "adamw_groups":  # weight decay on matrices only, as nanoGPT groups them
            matrices = [p for p in self.parameters() if p.dim() >= 2]
            vectors = [p for p in self.parameters() if p.dim() < 2]
            groups = [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}]
            return torch.optim.AdamW(groups, lr=self.hparams.lr, eps=1e-6)
        if self.optimizer_name == "adamw_fused":  # steps with the loss scale inside its kernel under fp16
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, eps=1e-6, fused=True)
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr * 100, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, eps=1e-6)

    def predict_step(self, batch, batch_idx):
        if getattr(getattr(self.model, "config", None), "is_encoder_decoder", False):
            return self.model(input_ids=batch["input_ids"], decoder_input_ids=batch["input_ids"]).logits
        inputs = {k: v for k, v in batch.items() if k != "labels"} if isinstance(batch, dict) else batch[0]
        out = self.model(**inputs) if isinstance(inputs, dict) else self.model(inputs)
        return out.logits if hasattr(out, "logits") else out


class _PoppingLabels:
    """A ``training_step`` that pops the labels from its batch before the model call, as many
    Hugging Face recipes do: the batch every stage compares changes inside the step."""

    def training_step(self, batch, batch_idx):
        labels = batch.pop("labels")
        return torch.nn.functional.cross_entropy(self.model(**batch).logits, labels)


class _ClippingInHook:
    """Clips by norm in ``on_before_optimizer_step`` through ``self.clip_gradients``, by hand."""

    clip_in_hook = 0.0

    def on_before_optimizer_step(self, optimizer):
        self.clip_gradients(optimizer, gradient_clip_val=self.clip_in_hook, gradient_clip_algorithm="norm")


def build_case_module(case: dict) -> pl.LightningModule:
    base = type(build_task(case["model"], seed=0, dropout=0.0))
    mixins = (_PoppingLabels, _Predicting) if case.get("pops_labels") else (_Predicting,)
    if case.get("clip_in_hook"):
        mixins = (_ClippingInHook, *mixins)
    cls = type(f"Predicting{base.__name__}", (*mixins, base), {})
    module = cls(seed=case.get("seed", 0), lr=case.get("lr", 1e-3), dropout=0.0)
    module.optimizer_name = case.get("optimizer", "adamw")
    module.clip_in_hook = case.get("clip_in_hook", 0.0)
    return module


def pad_to_longest(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Dynamic padding: each batch is cut to its longest sequence."""
    batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    length = int(batch["attention_mask"].sum(1).max())
    return {k: (v[:, :length] if v.dim() == 2 else v) for k, v in batch.items()}


def _collate(case: dict):
    return pad_to_longest if case.get("pad") else None


def train_dataset(case: dict):
    return TASKS[case["model"]].dataset(size=case.get("train_size", TRAIN_SIZE), seed=1)


def case_loader(case: dict, batch_size: int) -> DataLoader:
    """Training data; the strategy injects a DistributedSampler (shuffled, seed 0)."""
    return DataLoader(train_dataset(case), batch_size=batch_size, shuffle=True, collate_fn=_collate(case))


def eval_loader(case: dict, batch_size: int) -> DataLoader:
    dataset = TASKS[case["model"]].dataset(size=EVAL_SIZE, seed=2)
    return DataLoader(dataset, batch_size=batch_size, collate_fn=_collate(case))


def reference_run(case: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The same training in one process on the same global batches: weights and predictions."""
    module = build_case_module(case)
    dataset = train_dataset(case)
    # Lightning's distributed sampler order over one replica: the same global batches.
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=case["steps"],
        gradient_clip_val=case["clip"] or None,
        accumulate_grad_batches=case["accumulate"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(
        module, DataLoader(dataset, batch_size=case["global_batch"], sampler=sampler, collate_fn=_collate(case))
    )
    predictions = trainer.predict(module, eval_loader(case, case["global_batch"]))
    return module.state_dict(), torch.cat(predictions)
