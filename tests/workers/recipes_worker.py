"""Run a user recipe under ElasticPipelineStrategy (2-stage pipeline; fp16_fused_replicas: 2 replicas);
rank 0 writes what it saw.

Usage: torchrun --nproc_per_node=2 recipes_worker.py OUT_DIR (hooks | averaged_model | timm_ema | copied_ema | copied_ema_in_step | late_copied_ema | lazy_ema | reference_model_at_fit_start | reference_model_at_fit_start_replicas | reference_model | reference_model_hidden_states | clamping | hooks_profiled | fp16 | bf16 | occasional_head | occasional_head_in_window | skipped_block | fp16_fused | fp16_fused_replicas | random_collate | own_sampler | hidden_states | intermediates | scheduled | scheduled_uneven | scheduled_uneven_sampler | ema | step_synced_metric | summed_count | epoch_metrics | timed_validation | plateau | layerdrop | albert | shared_list | timm_checkpointing | reentrant | reentrant_after_freeze | two_calls | pruning | pruning_replicas | random_collate_popped | exports) [resume CKPT]

"random_collate" masks tokens at random in the collate function (as MLM collators do), and
"own_sampler" turns Lightning's distributed sampler off (the loader shuffles), each from random
states seeded per rank (``seed_everything(1 + rank)``): both give the two stages different
batches, which must end in an error.
"""

import json
import os
import sys
from datetime import timedelta

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, EMAWeightAveraging, ModelCheckpoint, ModelPruning
from lightning.pytorch.profilers import PyTorchProfiler
from lightning.pytorch.utilities.model_summary import summarize
from recipes_cases import (
    GLOBAL_BATCH,
    STEPS,
    ReentrantCheckpointing,
    albert_module,
    averaged_model_module,
    block_hooks_module,
    clamping_module,
    copied_ema_module,
    deberta_conv_module,
    epoch_metrics_module,
    fp16_module,
    fp16_plugin,
    hidden_states_module,
    hook_counting_module,
    intermediates_module,
    lazy_ema_module,
    lbfgs_module,
    mixed_precision_module,
    none_step_module,
    occasional_head_module,
    plateau_module,
    popping_module,
    random_masking,
    reference_model_module,
    sam_module,
    scheduled_module,
    self_checkpointing_module,
    shared_list_module,
    skipping_module,
    stage_norms_module,
    step_synced_metric_module,
    summed_count_module,
    timm_checkpointing_module,
    timm_ema_module,
    train_loader,
    two_calls_module,
    weight_penalty_module,
)
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback
from lightning_pipetx.strategy.param_store import ReleasedWeightsError


class SeededOrder(torch.utils.data.Sampler):
    """A user's sampler: one fixed permutation of ``size`` indices."""

    def __init__(self, size):
        self.size = size

    def __iter__(self):
        return iter(torch.randperm(self.size, generator=torch.Generator().manual_seed(1)).tolist())

    def __len__(self):
        return self.size


class SummaryAtFitStart(Callback):
    def on_fit_start(self, trainer, pl_module):
        self.total_parameters = summarize(pl_module).total_parameters


class EpochSteps(Callback):
    """Per epoch: the layout it trained on, its batches, what the module kept of it (``seen``),
    and the epoch values of ``names`` (read once Lightning reduced them, the last one after fit)."""

    def __init__(self, names=()):
        self.rows = []
        self.values = {name: [] for name in names}

    def record(self, trainer):
        for name, values in self.values.items():
            if name in trainer.callback_metrics:  # not before the first epoch of a run resumed in mid-epoch
                values.append(float(trainer.callback_metrics[name]))

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch > 0:
            self.record(trainer)

    def on_train_epoch_end(self, trainer, pl_module):
        row = {"layout": str(trainer.strategy.layout), "batches": trainer.num_training_batches}
        if hasattr(pl_module, "seen"):
            row["seen"] = {key: list(values) for key, values in pl_module.seen.items()}
            for values in pl_module.seen.values():
                values.clear()
        self.rows.append(row)


class ExportsTheModel(Callback):
    """Exports the model's weights from rank 0 as a script would: during fit (refused under a pipeline,
    whose other stages hold some blocks) and in ``on_fit_end``."""

    def __init__(self):
        self.refusals, self.at_fit_end, self.saved_finite = [], None, []

    def _export(self, pl_module):
        return {key: value.clone() for key, value in pl_module.model.state_dict().items()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.is_global_zero and batch_idx == 1:
            try:
                self._export(pl_module)
            except ReleasedWeightsError as error:
                self.refusals.append(str(error))

    def on_train_end(self, trainer, pl_module):
        self.on_train_batch_end(trainer, pl_module, None, None, 1)

    def on_fit_end(self, trainer, pl_module):
        self.at_fit_end = self._export(pl_module)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        # every rank, as under DDP (a trainable-only checkpoint); the weights rank 0 writes are whole
        state = pl_module.state_dict()
        self.saved_finite.append(all(bool(value.isfinite().all()) for value in state.values()))


EPOCHS = {
    "scheduled": 2,
    "scheduled_uneven": 3,
    "scheduled_uneven_sampler": 3,
    "step_synced_metric": 1,
    "summed_count": 3,
    "epoch_metrics": 2,
    "plateau": 3,
    "pruning_replicas": 4,
    "stage_norms": 2,
    "reentrant_after_freeze": 2,
}


def block_pruning(module: pl.LightningModule) -> ModelPruning:
    """Lightning's ModelPruning of the blocks' linear layers, each by its own values, at each epoch's end."""
    layers = [(m, "weight") for m in module.model.bert.encoder.layer.modules() if isinstance(m, torch.nn.Linear)]
    return ModelPruning("l1_unstructured", parameters_to_prune=layers, amount=0.2, use_global_unstructured=False)


def main() -> None:
    out_dir, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    module = {
        "hooks": hook_counting_module,
        "hooks_profiled": hook_counting_module,
        "fp16": fp16_module,
        # the head in odd batches only; in one batch of every other window of 2 (never a window's last)
        "occasional_head": lambda: occasional_head_module(lambda i: i % 2 == 1),
        "occasional_head_in_window": lambda: occasional_head_module(lambda i: i % 4 == 2),
        "skipped_block": skipping_module,
        "bf16": mixed_precision_module,
        "fp16_fused": lambda: fp16_module("adamw_fused"),
        "fp16_fused_replicas": lambda: fp16_module("adamw_fused"),
        "hidden_states": hidden_states_module,
        "intermediates": intermediates_module,
        "scheduled": scheduled_module,
        "scheduled_uneven": scheduled_module,
        "scheduled_uneven_sampler": scheduled_module,
        "step_synced_metric": step_synced_metric_module,
        "summed_count": summed_count_module,
        "epoch_metrics": epoch_metrics_module,
        "plateau": plateau_module,
        "albert": albert_module,
        "shared_list": shared_list_module,
        "timm_checkpointing": timm_checkpointing_module,
        "reentrant": lambda: ReentrantCheckpointing(seed=0, dropout=0.0),
        # the last stage's blocks (2 and 3 of 4) only: its first block gets no gradient once 0 and 1 froze
        "reentrant_after_freeze": lambda: self_checkpointing_module(first=2),
        "two_calls": two_calls_module,
        "random_collate_popped": popping_module,
        "between_blocks": deberta_conv_module,
        "block_hooks": block_hooks_module,
        "block_hooks_inside": lambda: block_hooks_module(inside=True),
        "weight_penalty": weight_penalty_module,
        "averaged_model": averaged_model_module,
        "timm_ema": timm_ema_module,
        "copied_ema": copied_ema_module,
        "copied_ema_in_step": lambda: copied_ema_module(in_step=True),
        "late_copied_ema": lambda: copied_ema_module(first_batch=STEPS - 1),
        "lazy_ema": lazy_ema_module,
        "reference_model": reference_model_module,
        "reference_model_hidden_states": lambda: reference_model_module(hidden_states=True),
        "reference_model_at_fit_start": lambda: reference_model_module(at_fit_start=True),
        "reference_model_at_fit_start_replicas": lambda: reference_model_module(at_fit_start=True),
        "clamping": clamping_module,
        "lbfgs": lbfgs_module,
        "sam": sam_module,
        "sam_accumulated": sam_module,
        "none_step": none_step_module,
        "stage_norms": stage_norms_module,
    }.get(mode, hook_counting_module)()
    if mode == "layerdrop":  # as Wav2Vec2's and HuBERT's configs have by default
        module.model.config.layerdrop = 0.1
    summary = SummaryAtFitStart()
    freeze = FreezeCallback() if mode.startswith(("fp16", "bf16")) else None  # measures gradient norms per step
    if mode.startswith("scheduled_uneven") or mode in ("summed_count", "epoch_metrics", "stage_norms"):  # 2x1 -> 1x2
        freeze = FreezeCallback(alpha=3 / 4, signal="schedule")
    if mode in ("pruning_replicas", "reentrant_after_freeze"):  # 2 and 3 of 4 blocks frozen after epochs 0 and 1
        freeze = FreezeCallback(alpha=1 / 2, signal="schedule")
    names = {
        "summed_count": ["count", "pipetx/pipeline_length"],
        "epoch_metrics": ["train_auroc", "summed_loss"],
        "stage_norms": ["grad_2.0_norm_total"],
    }
    epochs = EpochSteps(names.get(mode, ()))
    exports = ExportsTheModel() if mode == "exports" else None
    resume = sys.argv[sys.argv.index("resume") + 1] if "resume" in sys.argv else None
    steps = [ModelCheckpoint(out_dir, save_top_k=-1, every_n_train_steps=6)] if mode == "summed_count" else []
    if mode == "exports":
        steps = [ModelCheckpoint(out_dir, save_top_k=-1, every_n_train_steps=2)]
    length = (
        1
        if mode
        in (
            "fp16_fused_replicas",
            "pruning_replicas",
            "sam_accumulated",
            "occasional_head_in_window",
            "reference_model_at_fit_start_replicas",
        )
        else 2
    )
    # The refused outputs are refused on the first stage only (the last one waits for its hidden
    # state): the ranks agree on the failure within a third of this timeout.
    timeout = timedelta(
        seconds=30
        if mode
        in ("hidden_states", "intermediates", "timm_checkpointing", "reentrant", "reentrant_after_freeze")
        + ("two_calls", "between_blocks")
        + (
            "block_hooks",
            "block_hooks_inside",
            "weight_penalty",
            "averaged_model",
            "timm_ema",
            "copied_ema",
            "copied_ema_in_step",
            "late_copied_ema",
            "lazy_ema",
            "reference_model_at_fit_start",
            "reference_model_hidden_states",
            "clamping",
            "lbfgs",
            "sam",
            "sam_accumulated",
            "stage_norms",
            "step_synced_metric",
            "none_step",
            "occasional_head",
            "occasional_head_in_window",
            "skipped_block",
        )
        else 1800
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ElasticPipelineStrategy(
            pipeline_length=length, num_microbatches=2, timeout=timeout, elastic=mode != "reentrant_after_freeze"
        ),
        plugins=[fp16_plugin()] if mode.startswith("fp16") else None,
        precision="bf16-mixed" if mode == "bf16" else None,
        use_distributed_sampler=mode != "own_sampler",
        max_steps=-1 if mode.startswith("scheduled") or mode in EPOCHS else STEPS,
        max_epochs=EPOCHS.get(mode),
        callbacks=[summary, epochs]
        + ([EMAWeightAveraging(decay=0.9)] if mode == "ema" else [])
        + ([block_pruning(module)] if mode.startswith("pruning") else [])
        + ([freeze] if freeze else [])
        + ([exports] if exports else [])
        + steps,
        logger=False,
        enable_checkpointing=bool(steps),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=2 if mode == "epoch_metrics" else 0,
        accumulate_grad_batches=2 if mode in ("sam_accumulated", "occasional_head_in_window") else 1,
        val_check_interval="00:00:00:01" if mode == "timed_validation" else None,
        # Lightning's PyTorchProfiler puts forward hooks on every module, to name each one's time
        profiler=PyTorchProfiler(dirpath=out_dir, filename="profile") if mode == "hooks_profiled" else None,
    )
    # the loader's batch is per replica, as under DDP: the global batch is GLOBAL_BATCH on either layout
    batch = GLOBAL_BATCH // 2 if length == 1 else GLOBAL_BATCH
    task = {
        "intermediates": "timm_vit",
        "timm_checkpointing": "timm_vit",
        "reentrant": "sequential",
        "reentrant_after_freeze": "sequential",
        "skipped_block": "sequential",
    }.get(mode, "bert")
    loader = train_loader(batch, task=task)
    if mode == "scheduled_uneven":  # 39 samples: 4 global batches of 8 an epoch, 7 samples dropped
        loader = train_loader(batch, size=39, drop_last=True)
    if mode == "scheduled_uneven_sampler":  # the same, through a sampler of the user's (Lightning wraps it)
        loader = train_loader(batch, sampler=SeededOrder(39), size=39, drop_last=True)
    if mode.startswith("random_collate") or mode == "own_sampler":
        pl.seed_everything(1 + trainer.global_rank)
    if mode.startswith("random_collate"):
        loader = torch.utils.data.DataLoader(loader.dataset, batch_size=GLOBAL_BATCH, collate_fn=random_masking)
    trainer.fit(module, loader, loader if mode in ("plateau", "epoch_metrics") else None, ckpt_path=resume)
    report = {"summary_parameters": summary.total_parameters}
    if mode.startswith("hooks"):
        report["hook_calls"] = module.hook_calls
    elif mode.startswith("scheduled"):
        report["estimated_steps"] = module.estimated_steps
        report["global_step"] = trainer.global_step
        report["epochs"] = epochs.rows
        report["last_lr"] = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]
    elif mode == "step_synced_metric":
        report["values"] = {name: float(trainer.callback_metrics[name]) for name in ("train_acc", "label_mean")}
    elif mode == "exports":
        report["refusals"] = exports.refusals
        report["saved_finite"] = exports.saved_finite
        final = module.model.state_dict()
        report["exported_at_fit_end"] = rank != 0 or all(
            torch.equal(value, final[key]) for key, value in exports.at_fit_end.items()
        )
    elif mode == "pruning_replicas":
        report["cache_hit_rate"] = float(trainer.callback_metrics.get("pipetx/cache_hit_rate", -1.0))
    elif mode in ("summed_count", "epoch_metrics", "stage_norms"):
        epochs.record(trainer)
        report["values"] = epochs.values
        report["epochs"] = epochs.rows
        report["validated"] = getattr(module, "validated", None)
        report["sanity_checked"] = getattr(module, "sanity_checked", None)
    else:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        report["scale"] = scaler and scaler.get_scale()
    if freeze is not None:
        report["freeze"] = freeze.state_dict()  # a collective: every rank calls it
    with open(os.path.join(out_dir, f"{mode}_rank{rank}.json"), "w") as f:
        json.dump(report, f)
    if rank == 0:
        torch.save({"state": module.state_dict()}, os.path.join(out_dir, f"{mode}.pt"))


if __name__ == "__main__":
    run_worker(main)
