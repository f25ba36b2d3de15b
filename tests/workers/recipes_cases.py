"""LightningModules written as users write them, shared by the recipes worker and its tests."""

from __future__ import annotations

import copy
from collections.abc import Callable

import lightning.pytorch as pl
import torch
from equivalence_cases import build_case_module
from lightning.pytorch.plugins import MixedPrecision
from tiny_models import (
    HIDDEN,
    NUM_LABELS,
    TASKS,
    VOCAB,
    ResidualMLPBlock,
    SharpnessAware,
    TinySequentialRegressor,
    make_trainer,
)
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler
from torchmetrics import MeanMetric, Metric, SumMetric
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC

from lightning_pipetx import FreezeCallback

STEPS = 3
GLOBAL_BATCH = 8


def hook_counting_module() -> pl.LightningModule:
    """A tiny BERT that counts its backward hooks and checks gradients in on_after_backward."""
    module = build_case_module({"model": "bert", "lr": 1e-3})
    module.hook_calls = {"on_before_backward": 0, "on_after_backward": 0, "grads_seen": 0}

    def on_before_backward(loss):
        module.hook_calls["on_before_backward"] += 1

    def on_after_backward():
        module.hook_calls["on_after_backward"] += 1
        module.hook_calls["grads_seen"] += int(any(p.grad is not None for p in module.parameters()))

    module.on_before_backward = on_before_backward
    module.on_after_backward = on_after_backward
    return module


def hidden_states_module() -> pl.LightningModule:
    """A tiny BERT whose training step asks for every layer's hidden state (a layer-wise probe)."""
    module = build_case_module({"model": "bert", "lr": 1e-3})

    def training_step(batch, batch_idx):
        out = module.model(**batch, output_hidden_states=True)
        return out.loss + 0.0 * sum(h.mean() for h in out.hidden_states)

    module.training_step = training_step
    return module


def intermediates_module() -> pl.LightningModule:
    """A tiny timm ViT whose training step reads every block's output (forward_intermediates)."""
    module = build_case_module({"model": "timm_vit", "lr": 1e-3})

    def training_step(batch, batch_idx):
        images, labels = batch
        final, intermediates = module.model.forward_intermediates(images)
        logits = module.model.forward_head(final)
        return module.loss_fn(logits, labels) + 0.0 * sum(t.mean() for t in intermediates)

    module.training_step = training_step
    return module


def timm_checkpointing_module() -> pl.LightningModule:
    """A tiny timm ViT with timm's own activation checkpointing, which wraps its blocks from outside."""
    module = build_case_module({"model": "timm_vit", "lr": 1e-3})
    module.model.set_grad_checkpointing(True)
    return module


class ReentrantCheckpointing(TinySequentialRegressor):
    """A model whose own loop checkpoints each block's call with torch's reentrant checkpoint (as
    Hugging Face 4.x's encoders do with ``use_reentrant=True``): the segment encloses the block's
    forward, and so the stage hooks on it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed(x)
        for block in self.model.blocks:
            hidden = checkpoint(block, hidden, use_reentrant=True)
        return self.model.head(self.model.norm(hidden))


class SelfCheckpointingBlock(ResidualMLPBlock):
    """A residual block that checkpoints its own forward with torch's reentrant checkpoint where
    ``checkpointed`` (inside the block's call, as Hugging Face's GradientCheckpointingLayer does)."""

    checkpointed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return checkpoint(super().forward, x, use_reentrant=True)
        return super().forward(x)


def self_checkpointing_module(first: int) -> pl.LightningModule:
    """A tiny regressor whose blocks from ``first`` on checkpoint themselves (reentrant)."""
    module = TinySequentialRegressor(seed=0, dropout=0.0)
    blocks = module.model.blocks
    for index, block in enumerate(blocks):
        replacement = SelfCheckpointingBlock(block.norm.normalized_shape[0], float(block.scale), dropout=0.0)
        replacement.load_state_dict(block.state_dict())
        replacement.checkpointed = index >= first
        blocks[index] = replacement
    return module


class _InfOnce:
    """A gradient hook that turns the first gradient of one parameter into inf: an overflow
    in one stage only, as fp16 produces when one block's gradients outgrow the scale."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return grad * float("inf") if self.calls == 1 else grad


def scheduled_module() -> pl.LightningModule:
    """A tiny BERT whose LR schedule is sized by ``trainer.estimated_stepping_batches`` (which
    builds the training DataLoader inside configure_optimizers, as warm-up schedules do)."""
    module = build_case_module({"model": "bert", "lr": 1e-3})

    def configure_optimizers():
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        module.estimated_steps = module.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / module.estimated_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    module.configure_optimizers = configure_optimizers
    return module


def scheduled_reference() -> dict[str, torch.Tensor]:
    """The scheduled run in one process, on the same global batches."""
    module = scheduled_module()
    dataset = TASKS["bert"].dataset(size=32, seed=1)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    make_trainer([], max_epochs=2).fit(module, train_loader(GLOBAL_BATCH, sampler))
    return {"state": module.state_dict(), "estimated_steps": module.estimated_steps}


def step_synced_metric_module() -> pl.LightningModule:
    """A tiny BERT whose training step updates metrics synced on every update (``dist_sync_on_step=True``),
    a mean of the labels before the model call and an accuracy after it, and logs them for the epoch."""
    module = build_case_module({"model": "bert", "lr": 1e-3})
    module.label_mean = MeanMetric(dist_sync_on_step=True)
    module.train_accuracy = MulticlassAccuracy(NUM_LABELS, dist_sync_on_step=True)

    def training_step(batch, batch_idx):
        module.label_mean(batch["labels"].float().mean())
        module.log("label_mean", module.label_mean, on_step=False, on_epoch=True)
        out = module.model(**batch)
        module.train_accuracy(out.logits.argmax(-1), batch["labels"])
        module.log("train_acc", module.train_accuracy, on_step=False, on_epoch=True)
        return out.loss

    module.training_step = training_step
    return module


def step_synced_metric_reference() -> dict[str, float]:
    """The epoch's values of :func:`step_synced_metric_module`'s metrics in one process, same batches."""
    module = step_synced_metric_module()
    dataset = TASKS["bert"].dataset(size=32, seed=1)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer = make_trainer([], max_epochs=1)
    trainer.fit(module, train_loader(GLOBAL_BATCH, sampler))
    return {name: float(trainer.callback_metrics[name]) for name in ("train_acc", "label_mean")}


class SummedLoss(Metric):
    """A replica's summed loss, averaged over the replicas: a state that syncs by its mean."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="mean")

    def update(self, loss: torch.Tensor) -> None:
        self.total += loss.detach().to(torch.float64)

    def compute(self) -> torch.Tensor:
        return self.total


def epoch_metrics_module() -> pl.LightningModule:
    """A tiny BERT whose training step updates, after the model call, an AUROC (states: lists
    that the sync concatenates) and a :class:`SummedLoss` (a state averaged over the ranks), both
    logged for the epoch; ``module.seen`` keeps what it fed them. Its validation counts the samples
    it sees, and ``on_validation_epoch_end`` computes both training metrics and that count into
    ``module.validated`` (in the sanity check too, which leaves the summed loss's computed value
    cached), with the mean of every loss since the fit started, a metric its first step makes, and a
    second count of validation samples, a metric the sanity check's first step makes
    (``module.sanity_checked``: the sanity check's values)."""
    module = build_case_module({"model": "bert", "lr": 1e-3})
    module.train_auroc = MulticlassAUROC(NUM_LABELS)
    module.summed_loss = SummedLoss()
    module.val_samples = SumMetric()
    module.seen = {"probs": [], "labels": [], "losses": []}
    module.validated = []

    def validation_step(batch, batch_idx):
        if not hasattr(module, "made_in_validation"):  # in the sanity check's first step
            module.made_in_validation = SumMetric()
        module.model(**batch)
        for metric in (module.val_samples, module.made_in_validation):
            metric.update(torch.tensor(float(len(batch["labels"]))))

    def on_validation_epoch_end():
        metrics = {
            "summed_loss": module.summed_loss,
            "val_samples": module.val_samples,
            "made_in_validation": module.made_in_validation,
        }
        if not module.trainer.sanity_checking:  # the sanity check's AUROC would have no samples
            metrics.update(train_auroc=module.train_auroc, running_loss=module.running_loss)
        values = {name: float(metric.compute()) for name, metric in metrics.items()}
        if module.trainer.sanity_checking:
            module.sanity_checked = values
        else:
            module.validated.append(values)
        module.val_samples.reset()
        module.made_in_validation.reset()

    def training_step(batch, batch_idx):
        if not hasattr(module, "running_loss"):  # a metric made during the first epoch, on every stage
            module.running_loss = MeanMetric()
        out = module.model(**batch)
        probs = out.logits.detach().softmax(-1)
        module.train_auroc.update(probs, batch["labels"])
        module.summed_loss.update(out.loss)
        module.running_loss.update(out.loss.detach())
        module.seen["probs"] += probs.tolist()
        module.seen["labels"] += batch["labels"].tolist()
        module.seen["losses"].append(float(out.loss))
        module.log("train_auroc", module.train_auroc, on_step=False, on_epoch=True)
        module.log("summed_loss", module.summed_loss, on_step=False, on_epoch=True)
        return out.loss

    module.training_step = training_step
    module.validation_step = validation_step
    module.on_validation_epoch_end = on_validation_epoch_end
    return module


def plateau_module() -> pl.LightningModule:
    """A tiny BERT whose ReduceLROnPlateau monitors a validation value logged without
    ``sync_dist``: better every epoch on global rank 0, worse on the others (as a value each rank
    computes on its own share of the data can be)."""
    module = build_case_module({"model": "bert", "lr": 1e-3})

    def validation_step(batch, batch_idx):
        module(batch)
        trend = -1.0 if module.global_rank == 0 else 1.0
        module.log("val_score", trend * module.current_epoch)

    def configure_optimizers():
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        schedule = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "monitor": "val_score"}}

    module.validation_step = validation_step
    module.configure_optimizers = configure_optimizers
    return module


def albert_module() -> pl.LightningModule:
    """A tiny ALBERT whose 4 layers share the weights of 2 layer groups (``num_hidden_groups=2``):
    each group, a block of its block list, runs twice in every forward."""
    from transformers import AlbertConfig, AlbertForSequenceClassification

    return _tiny_hf_module(
        AlbertForSequenceClassification,
        AlbertConfig,
        embedding_size=16,
        num_hidden_layers=4,
        num_hidden_groups=2,
        max_position_embeddings=64,
    )


def _tiny_hf_module(model_class, config_class, **config) -> pl.LightningModule:
    """The case module with a tiny Hugging Face classifier of ``model_class`` (no dropout) as its model."""
    module = build_case_module({"model": "bert", "lr": 1e-3})
    sizes = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=2, intermediate_size=64)
    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config = config_class(**sizes, num_labels=NUM_LABELS, **no_dropout, **config)
    torch.manual_seed(0)
    module.model = model_class(config)
    return module


def shared_list_module() -> pl.LightningModule:
    """A tiny BERT whose encoder runs one layer four times: its block list holds one module."""
    module = build_case_module({"model": "bert", "lr": 1e-3})
    layers = module.model.bert.encoder.layer
    module.model.bert.encoder.layer = torch.nn.ModuleList([layers[0]] * len(layers))
    return module


def two_calls_module() -> pl.LightningModule:
    """A tiny BERT whose training step calls the model on two views of the batch."""
    module = build_case_module({"model": "bert", "lr": 1e-3})

    def training_step(batch, batch_idx):
        shifted = {**batch, "input_ids": (batch["input_ids"] + 1) % VOCAB}
        return (module.model(**batch).loss + module.model(**shifted).loss) / 2

    module.training_step = training_step
    return module


def lbfgs_module() -> pl.LightningModule:
    """A tiny BERT trained with torch's L-BFGS (whose step calls the closure several times)."""
    module = build_case_module({"model": "bert", "lr": 1e-3})
    module.configure_optimizers = lambda: torch.optim.LBFGS(module.parameters(), lr=0.1, max_iter=2)
    return module


def sam_module() -> pl.LightningModule:
    """A tiny BERT trained with SAM, whose step calls the closure twice."""
    module = build_case_module({"model": "bert", "lr": 1e-3})
    module.configure_optimizers = lambda: SharpnessAware(module.parameters())
    return module


def stage_norms_module() -> pl.LightningModule:
    """A tiny BERT that logs its gradient norms for the epoch, synced, before each optimizer step
    (each stage logs those of the weights it holds: keys the other stages do not log)."""
    from lightning.pytorch.utilities import grad_norm

    module = build_case_module({"model": "bert", "lr": 1e-3})
    module.on_before_optimizer_step = lambda optimizer: module.log_dict(
        grad_norm(module, norm_type=2), sync_dist=True, on_step=False, on_epoch=True
    )
    return module


def none_step_module() -> pl.LightningModule:
    """A tiny BERT whose training step skips its second batch by returning None, before the model call."""
    module = build_case_module({"model": "bert", "lr": 1e-3})

    def training_step(batch, batch_idx):
        return None if batch_idx == 1 else module.model(**batch).loss

    module.training_step = training_step
    return module


def occasional_head_module(used: Callable[[int], bool]) -> pl.LightningModule:
    """A tiny BERT with a second head, outside the block list, in the loss of the batches ``used`` accepts."""
    module = build_case_module({"model": "bert", "lr": 1e-3})
    module.aux_head = torch.nn.Linear(NUM_LABELS, NUM_LABELS)

    def training_step(batch, batch_idx):
        out = module.model(**batch)
        return out.loss + (module.aux_head(out.logits).pow(2).mean() if used(batch_idx) else 0.0)

    module.training_step = training_step
    return module


def skipping_module() -> TinySequentialRegressor:
    """A residual MLP whose training step skips block 1 (a 2-stage pipeline's first stage's last) in odd batches."""
    module = TinySequentialRegressor(seed=0, dropout=0.0)

    def training_step(batch, batch_idx):
        x, y = batch
        hidden = module.model.embed(x)
        for index, block in enumerate(module.model.blocks):
            if not (index == 1 and batch_idx % 2):
                hidden = block(hidden)
        return torch.nn.functional.mse_loss(module.model.head(module.model.norm(hidden)), y)

    module.training_step = training_step
    return module


def summed_count_module() -> pl.LightningModule:
    """A tiny BERT that logs the samples of each step with ``reduce_fx="sum"`` over the replicas."""
    module = build_case_module({"model": "bert", "lr": 1e-3})

    def training_step(batch, batch_idx):
        count = float(len(batch["labels"]))
        module.log("count", count, reduce_fx="sum", sync_dist=True, on_step=False, on_epoch=True)
        return module.model(**batch).loss

    module.training_step = training_step
    return module


def fp16_module(optimizer: str = "adamw") -> pl.LightningModule:
    module = build_case_module({"model": "bert", "lr": 1e-3, "optimizer": optimizer})
    first_block = module.model.bert.encoder.layer[0]
    first_block.output.dense.weight.register_hook(_InfOnce())
    return module


def mixed_precision_module() -> pl.LightningModule:
    """A tiny BERT with AdamW, as trained under bf16-mixed."""
    return build_case_module({"model": "bert", "lr": 1e-3, "optimizer": "adamw"})


def fp16_plugin() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12))


def popping_module() -> pl.LightningModule:
    """A tiny BERT whose training_step takes every field out of its batch before the model call."""
    module = build_case_module({"model": "bert", "lr": 1e-3, "pops_labels": True})

    def training_step(batch, batch_idx):
        fields = {key: batch.pop(key) for key in list(batch)}
        return module.model(**fields).loss

    module.training_step = training_step
    return module


def random_masking(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack, then replace 15% of the tokens by a mask id at random (an MLM collator's habit)."""
    batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    masked = torch.rand(batch["input_ids"].shape) < 0.15
    batch["input_ids"] = batch["input_ids"].masked_fill(masked, 1)
    return batch


def train_loader(
    batch_size: int, sampler=None, task: str = "bert", size: int = 32, drop_last: bool = False
) -> DataLoader:
    dataset = TASKS[task].dataset(size=size, seed=1)
    return DataLoader(dataset, batch_size=batch_size, shuffle=sampler is None, sampler=sampler, drop_last=drop_last)


def fp16_reference(optimizer: str = "adamw", microbatches: int = 1) -> dict[str, torch.Tensor]:
    """The fp16 run in one process, on the same global batches, with FreezeCallback's gradient norms.

    ``microbatches``: each global batch split as a pipeline splits it, its gradients accumulated."""
    return mixed_precision_reference(fp16_module(optimizer), {"plugins": [fp16_plugin()]}, microbatches)


def mixed_precision_reference(module: pl.LightningModule, precision: dict, microbatches: int) -> dict:
    """``module`` trained in one process under ``precision`` (Trainer arguments) for STEPS global
    batches, each split into ``microbatches`` whose gradients are accumulated."""
    freeze = FreezeCallback()
    dataset = TASKS["bert"].dataset(size=32, seed=1)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        accumulate_grad_batches=microbatches,
        callbacks=[freeze],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **precision,
    )
    trainer.fit(module, train_loader(GLOBAL_BATCH // microbatches, sampler))
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return {"state": module.state_dict(), "scale": scaler and scaler.get_scale(), "freeze": freeze.state_dict()}


def deberta_conv_module() -> pl.LightningModule:
    """A tiny DeBERTa-v2 whose encoder applies a convolution to block 0's output before block 1
    (``conv_kernel_size``): a module outside the block list, between two blocks."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    return _tiny_hf_module(
        DebertaV2ForSequenceClassification,
        DebertaV2Config,
        num_hidden_layers=2,
        relative_attention=True,
        position_buckets=16,
        pos_att_type=["p2c", "c2p"],
        conv_kernel_size=3,
    )


def block_hooks_module(inside: bool = False) -> pl.LightningModule:
    """A tiny BERT whose forward hooks on its blocks (``inside``: on each block's attention output,
    a module inside it) collect their outputs for an auxiliary loss (deep supervision)."""
    module = build_case_module({"model": "bert", "lr": 1e-3})
    collected = []
    for block in module.model.bert.encoder.layer:
        (block.attention.output if inside else block).register_forward_hook(
            lambda m, args, out: collected.append(out[0] if isinstance(out, tuple) else out)
        )

    def training_step(batch, batch_idx):
        collected.clear()
        loss = module.model(**batch).loss + 0.01 * sum(h.pow(2).mean() for h in collected)
        module.log("total_loss", loss)
        return loss

    module.training_step = training_step
    return module


def weight_penalty_module() -> pl.LightningModule:
    """A tiny BERT whose training step adds an L2 penalty over every weight to the loss."""
    module = build_case_module({"model": "bert", "lr": 1e-3})

    def training_step(batch, batch_idx):
        return module.model(**batch).loss + 1e-4 * sum(p.pow(2).sum() for p in module.parameters())

    module.training_step = training_step
    return module


def averaged_model_module() -> pl.LightningModule:
    """A tiny BERT that keeps an exponential moving average of itself as a torch AveragedModel."""
    module = build_case_module({"model": "bert", "lr": 1e-3})
    module.ema = torch.optim.swa_utils.AveragedModel(
        module.model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    )

    def on_train_batch_end(outputs, batch, batch_idx):
        module.ema.update_parameters(module.model)

    module.on_train_batch_end = on_train_batch_end
    return module


def timm_ema_module() -> pl.LightningModule:
    """A tiny BERT that keeps an exponential moving average of itself as timm's ModelEmaV3."""
    from timm.utils import ModelEmaV3

    module = build_case_module({"model": "bert", "lr": 1e-3})
    module.ema = ModelEmaV3(module.model, decay=0.9)

    def on_train_batch_end(outputs, batch, batch_idx):
        module.ema.update(module.model, step=module.global_step)

    module.on_train_batch_end = on_train_batch_end
    return module


def copied_ema_module(first_batch: int = 0, in_step: bool = False) -> pl.LightningModule:
    """A tiny BERT that keeps an exponential moving average of itself by hand: a deepcopy of the
    model, moved towards its weights after each batch from ``first_batch`` on (a warm-up); with
    ``in_step``, in ``training_step`` after the model call (which under a pipeline the last stage
    alone reaches)."""
    module = build_case_module({"model": "bert", "lr": 1e-3})
    module.ema = copy.deepcopy(module.model).requires_grad_(False)

    def on_train_batch_end(outputs, batch, batch_idx):
        if batch_idx < first_batch:
            return
        with torch.no_grad():
            for average, weight in zip(module.ema.parameters(), module.model.parameters()):
                average.lerp_(weight, 0.1)

    def training_step(batch, batch_idx):
        loss = module.model(**batch).loss
        on_train_batch_end(None, batch, batch_idx)
        return loss

    if in_step:
        module.training_step = training_step
    else:
        module.on_train_batch_end = on_train_batch_end
    return module


def lazy_ema_module() -> pl.LightningModule:
    """A tiny BERT whose hand-written EMA is made at its first update (a deepcopy in the last
    step's on_train_batch_start), then moved towards the model after the batch."""
    module = build_case_module({"model": "bert", "lr": 1e-3})
    module.ema = None

    def on_train_batch_start(batch, batch_idx):
        if batch_idx == STEPS - 1 and module.ema is None:
            module.ema = copy.deepcopy(module.model).requires_grad_(False)

    def on_train_batch_end(outputs, batch, batch_idx):
        if module.ema is not None:
            with torch.no_grad():
                for average, weight in zip(module.ema.parameters(), module.model.parameters()):
                    average.lerp_(weight, 0.1)

    module.on_train_batch_start = on_train_batch_start
    module.on_train_batch_end = on_train_batch_end
    return module


def reference_model_module(at_fit_start: bool = False, hidden_states: bool = False) -> pl.LightningModule:
    """A tiny BERT whose loss keeps it close to a frozen copy of itself (a KL term to the copy's
    predictions, as a fine-tune against a reference model): the copy is read, never written. It
    is made in ``__init__``, or ``at_fit_start`` (in ``on_fit_start``, after the strategy's set-up).
    With ``hidden_states`` the copy, a teacher, also gives its hidden states, whose last layer's
    first token weighs each sample's KL term."""
    module = build_case_module({"model": "bert", "lr": 1e-3})

    def on_fit_start():
        module.reference = copy.deepcopy(module.model).requires_grad_(False)

    if at_fit_start:
        module.on_fit_start = on_fit_start
    else:
        on_fit_start()

    def training_step(batch, batch_idx):
        out = module.model(**batch)
        with torch.no_grad():
            teacher = module.reference(**batch, output_hidden_states=hidden_states)
            reference = teacher.logits.log_softmax(-1)
        if hidden_states:
            weight = teacher.hidden_states[-1][:, 0].norm(dim=-1)
            kl = torch.nn.functional.kl_div(out.logits.log_softmax(-1), reference, log_target=True, reduction="none")
            return out.loss + 0.1 * (kl.sum(-1) * weight).mean()
        kl = torch.nn.functional.kl_div(out.logits.log_softmax(-1), reference, log_target=True, reduction="batchmean")
        return out.loss + 0.1 * kl

    module.training_step = training_step
    return module


def clamping_module() -> pl.LightningModule:
    """A tiny BERT that clamps every weight in place after each batch (a weight constraint)."""
    module = build_case_module({"model": "bert", "lr": 1e-3})

    def on_train_batch_end(outputs, batch, batch_idx):
        with torch.no_grad():
            for param in module.parameters():
                param.clamp_(-0.1, 0.1)

    module.on_train_batch_end = on_train_batch_end
    return module
