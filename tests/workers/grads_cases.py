"""Cases shared by grads_worker.py (under the strategy) and tests/test_grad_sync.py (one plain process).

Each case trains a tiny model for a few steps on the same global batches, with a callback
that records what ``on_before_backward`` and ``on_after_backward`` see on each rank.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from tiny_models import RandomTokenDataset, TinyBertClassifier, tiny_gpt2
from torch.utils.data import DataLoader, DistributedSampler

TRAIN_SIZE = 32


def _case(name, model, pipeline_length, **options):
    case = {"name": name, "model": model, "pipeline_length": pipeline_length, "global_batch": 8, "steps": 4}
    case.update({"microbatches": 2, "accumulate": 1, "clip": 0.0, "bucket_cap_mb": 25.0, "checkpointing": None})
    case.update(options)
    return case


TWO_PROCESS_CASES = [
    # 1x2 data parallel, tiny buckets, two micro-batches and accumulation: the reduction
    # overlaps the last backward and folds in the window's earlier gradients.
    _case("bert_1x2_overlap", "bert", 1, accumulate=2, steps=6, bucket_cap_mb=0.01, clip=0.5),
    # 2x1 pipeline: every stage's hooks see its own gradients, at every batch; nothing to reduce.
    _case("bert_2x1_hooks", "bert", 2, accumulate=2, steps=6, clip=0.5),
    # HF activation checkpointing: reentrant (block gradients arrive in nested backwards) under
    # the overlapped sync, and non-reentrant across stages.
    _case("bert_1x2_checkpointing", "bert", 1, bucket_cap_mb=0.01, checkpointing="reentrant"),
    _case("bert_2x1_checkpointing", "bert", 2, checkpointing="non_reentrant"),
    _case("bert_1x2_pooler_outside_the_optimizer", "pooler_outside_the_optimizer", 1, bucket_cap_mb=0.01),
]
FOUR_PROCESS_CASES = [
    # GPT-2's embedding is tied to its head: reduced over stages 0 and 3 only, a group of its own.
    _case("gpt2_4x1_tied", "gpt2", 4, microbatches=4, clip=0.5),
]


class TinyGPT2LM(pl.LightningModule):
    """A causal LM around a tiny HF GPT-2 whose input embedding is tied to its LM head."""

    def __init__(self, lr: float = 1e-3):
        super().__init__()
        self.lr = lr
        self.model = tiny_gpt2(seed=0, dropout=0.0)

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        return self.model(input_ids=ids, attention_mask=batch["attention_mask"], labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, eps=1e-6)


class Bert(TinyBertClassifier):
    """TinyBertClassifier, with AdamW's eps raised (see equivalence_cases)."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, eps=1e-6)


class SkipsZeroGrad(Bert):
    """Overrides ``optimizer_zero_grad`` to keep gradients across steps: refused with an error."""

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        pass


class SometimesHead(Bert):
    """A second head, outside the block list, trained on odd batches only: refused with an error."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.extra_head = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        out = self.model(**batch)
        return out.loss + (self.extra_head(out.logits).mean() if batch_idx % 2 else 0.0)


class PoolerOutsideTheOptimizer(Bert):
    """Leaves the trainable pooler out of its optimizer: its ``.grad`` is never zeroed and adds up
    from step to step, as one process and Lightning's DDP let it."""

    def configure_optimizers(self):
        pooler = {id(p) for p in self.model.bert.pooler.parameters()}
        params = [p for p in self.parameters() if id(p) not in pooler]
        return torch.optim.AdamW(params, lr=self.hparams.lr, eps=1e-6)


MODULES = {
    "bert": Bert,
    "skips_zero_grad": SkipsZeroGrad,
    "sometimes_head": SometimesHead,
    "pooler_outside_the_optimizer": PoolerOutsideTheOptimizer,
}
ERROR_CASES = [
    _case("skips_zero_grad", "skips_zero_grad", 1, bucket_cap_mb=0.01),
    _case("sometimes_head", "sometimes_head", 1),
]


class BackwardHooks(Callback):
    """Records ``on_before_backward``'s loss and, at ``on_after_backward``, the norm of every
    gradient this rank holds."""

    def __init__(self):
        self.losses: list[float] = []
        self.grads: list[dict[str, float]] = []

    def on_before_backward(self, trainer, pl_module, loss):
        self.losses.append(float(loss.detach()))

    def on_after_backward(self, trainer, pl_module):
        self.grads.append(
            {
                name: float(p.grad.double().norm())
                for name, p in pl_module.named_parameters()
                if p.grad is not None and p.numel() > 0
            }
        )


def build_module(case: dict) -> pl.LightningModule:
    if case["model"] == "gpt2":
        return TinyGPT2LM()
    module = MODULES[case["model"]](seed=0, lr=1e-3, dropout=0.0)
    if case.get("checkpointing"):
        module.model.activation_checkpointing_enable({"use_reentrant": case["checkpointing"] == "reentrant"})
    return module


def dataset() -> RandomTokenDataset:
    return RandomTokenDataset(size=TRAIN_SIZE, seed=1)


def trainer_options(case: dict) -> dict:
    options = dict(
        accelerator="cpu",
        max_steps=case["steps"],
        gradient_clip_val=case["clip"],
        accumulate_grad_batches=case["accumulate"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return options


def reference_run(case: dict) -> dict:
    """The same training in one plain process, on the same global batches."""
    module = build_module(case)
    hooks = BackwardHooks()
    trainer = pl.Trainer(devices=1, callbacks=[hooks], **trainer_options(case))
    data = dataset()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer.fit(module, DataLoader(data, batch_size=case["global_batch"], sampler=sampler))
    return {"state": module.state_dict(), "losses": hooks.losses, "grads": hooks.grads}
