"""Step outputs, collectives inside steps, and failures, under a pipeline; every rank reports.

Usage: torchrun --nproc_per_node=N outputs_worker.py OUT_DIR MODE, where MODE is
  everywhere     (4 processes, 2 stages x 2 replicas) lists of validation outputs, all_gather in
                 steps, metrics counting samples (the module's, one it keeps in a dict, a callback's),
                 step outputs of one number, a log name that
                 appears late, per-token predictions, a replica without predict batches
  train_list     (2 processes) training_step collects its losses in a list, read at epoch end
  grad_in_eval   (2 processes, 2 stages) predict_step runs a backward (input saliency)
  fail_all EXC   (2 processes) every rank raises EXC (ValueError | KeyboardInterrupt) at epoch 0's end
  fail_one       (2 processes) the last stage raises in its third training step
  repeated_fits  (2 processes) four fits of one model in the same processes: the threads alive and
                 the block list's state_dict hooks after each
  ctrl_c LENGTH  (2 processes, pipeline_length LENGTH) a Ctrl-C reaches both ranks while rank 0
                 waits inside gloo for rank 1 (2x1: its hidden state; 1x2: the gradient all-reduce)
  ctrl_c_in_transition  (2 processes, 2x1 -> 1x2 after epoch 0) a Ctrl-C reaches both ranks half-way
                 through moving blocks
  ctrl_c_after_transition  (4 processes, 2x2 -> 1x4 after epoch 0) a Ctrl-C reaches every rank
                 while rank 1's replica of the old layout's stage waits for it in the epoch-end reduction
Every rank writes OUT_DIR/<MODE>_rank<N>.json (and, for fail_all, its weights).
"""

import json
import os
import signal
import sys
import time
from collections import defaultdict
from datetime import timedelta

import lightning.pytorch as pl
import torch
import torchmetrics
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from tiny_models import NUM_LABELS, RandomTokenDataset, tiny_bert
from torch.utils.data import DataLoader
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback, find_blocks
from lightning_pipetx.strategy import engine, transition


def pad_to_longest(samples):
    """Dynamic padding: every batch is as long as its longest sequence."""
    batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    length = int(batch["attention_mask"].sum(1).max())
    return {k: (v[:, :length] if v.dim() == 2 else v) for k, v in batch.items()}


def loader(size, batch_size, seed):
    return DataLoader(RandomTokenDataset(size=size, seed=seed), batch_size=batch_size, collate_fn=pad_to_longest)


class SecondSetUpFails(pl.LightningModule):
    """Trains once; the next fit's configure_optimizers raises (``fail``)."""

    fail = False

    def __init__(self):
        super().__init__()
        self.model = tiny_bert(seed=0, dropout=0.0)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        if self.fail:
            raise ValueError("the second fit's configure_optimizers failed")
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Recipes(pl.LightningModule):
    """The patterns of Lightning's documentation that run code after the model call."""

    def __init__(self):
        super().__init__()
        self.model = tiny_bert(seed=0, dropout=0.0)
        self.head = torch.nn.Linear(NUM_LABELS, 1)  # outside the model call: trained on the last stages only
        self.val_samples = torchmetrics.SumMetric()
        # metrics outside the submodules; the training one synced over the replicas at each call
        self.kept = {
            "val_samples": torchmetrics.SumMetric(),
            "train_samples": torchmetrics.SumMetric(dist_sync_on_step=True),
        }
        self.validation_step_outputs = []
        self.seen = defaultdict(list)

    def training_step(self, batch, batch_idx):
        out = self.model(**batch)
        self.seen["train_gather"].append(list(self.all_gather(out.loss.detach()).shape))
        self.log("train_loss", out.loss)
        if batch_idx >= 2:
            self.log("late", 2 * out.loss)
        self.log("twice", 1.0)
        self.log("twice", 3.0)  # the last call of a step counts
        logged = out.loss.detach().clone()
        self.log("changed_after", logged)
        logged.add_(100.0)  # the value logged is what it held at the call
        self.kept["train_samples"](torch.tensor(float(len(batch["labels"]))))
        loss = out.loss + self.head(out.logits).pow(2).mean()
        return {"loss": loss, "label0": (batch["labels"] == 0).float().mean()}

    def on_train_epoch_end(self):
        self.seen["kept_train_samples"].append(float(self.kept["train_samples"].compute()))
        self.kept["train_samples"].reset()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if "label0" in outputs:  # the last stages: the step's other outputs, for the whole batch
            expected = (batch["labels"] == 0).float().mean()
            self.seen["label0_matches"].append(bool(torch.isclose(outputs["label0"], expected)))

    def validation_step(self, batch, batch_idx):
        out = self.model(**batch)
        self.validation_step_outputs.append(out.logits)
        self.val_samples.update(torch.tensor(float(len(batch["labels"]))))
        self.kept["val_samples"].update(torch.tensor(float(len(batch["labels"]))))
        self.log("val_samples", self.val_samples)
        self.log("val_loss", out.loss, sync_dist=True)
        self.log("val_head", self.head(out.logits).mean(), sync_dist=True)
        self.seen["val_gather"].append(list(self.all_gather(out.logits.argmax(-1)).shape))

    def on_validation_epoch_end(self):
        logits = torch.cat(self.validation_step_outputs)
        self.seen["val_rows"].append(logits.shape[0])
        self.log("val_logit_mean", logits.mean(), sync_dist=True)
        self.validation_step_outputs.clear()
        self.seen["kept_val_samples"].append(float(self.kept["val_samples"].compute()))
        self.kept["val_samples"].reset()

    def predict_step(self, batch, batch_idx):
        return self.model.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class CollectedLosses(pl.LightningModule):
    """Lightning's documented epoch-end pattern in training."""

    def __init__(self):
        super().__init__()
        self.model = tiny_bert(seed=0, dropout=0.0)
        self.training_step_outputs = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.training_step_outputs.append(loss.detach())
        return loss

    def on_train_epoch_end(self):
        self.log("epoch_mean", torch.stack(self.training_step_outputs).mean())
        self.training_step_outputs.clear()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class EpochLoss(pl.LightningModule):
    """Logs its loss for the epoch, reduced over the replicas."""

    def __init__(self):
        super().__init__()
        self.model = tiny_bert(seed=0, dropout=0.0)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class FailingLastStage(CollectedLosses):
    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        if batch_idx == 2:
            raise RuntimeError("the user's step failed on one rank")
        return loss


def ctrl_c(out_dir, ranks):
    """SIGINT to the given global ranks, in order, as a terminal's Ctrl-C (each wrote its pid at start)."""
    for rank in ranks:
        with open(os.path.join(out_dir, f"pid_rank{rank}")) as f:
            os.kill(int(f.read()), signal.SIGINT)


class CtrlCWhileRank0Waits(CollectedLosses):
    """Ctrl-C, as a terminal sends it to every process, in the third step, while global rank 0
    waits inside gloo for rank 1, which runs Python (2x1: the first stage, before its model call;
    1x2: the other replica, before its backward): rank 1 is interrupted at once, rank 0 only when
    its wait ends."""

    def __init__(self, out_dir):
        super().__init__()
        self.out_dir = out_dir

    def training_step(self, batch, batch_idx):
        if batch_idx == 2 and self.global_rank == 1:
            time.sleep(2.0)  # rank 0 waits for this rank by now
            ctrl_c(self.out_dir, (0, 1))
        return super().training_step(batch, batch_idx)


class CtrlCAfterTransition(Callback):
    """Ctrl-C on every process at the end of epoch 0, after FreezeCallback moved the run from 2x2
    to 1x4: global rank 1 runs Python (this hook, after FreezeCallback's), while its replica of the
    old layout's stage waits for it inside gloo, in the epoch-end reduction of the values logged
    under that layout (over that layout's stage group)."""

    def __init__(self, out_dir, report):
        self.out_dir, self.report = out_dir, report

    def on_train_epoch_end(self, trainer, pl_module):
        self.report["layout_at_ctrl_c"] = str(trainer.strategy.layout)
        if trainer.current_epoch == 0 and trainer.global_rank == 1:
            time.sleep(2.0)  # the others wait for this rank by now
            ctrl_c(self.out_dir, (0, 2, 3, 1))


def ctrl_c_after_the_first_block_sent(out_dir, rank):
    """Ctrl-C on both ranks once global rank 1 sent its first block in a transition: both are half-way
    through moving blocks (fault injection at the transfer of a block)."""
    send = transition.BlockMover.send

    def send_then_ctrl_c(mover, block, dst):
        send(mover, block, dst)
        if rank == 1 and not os.path.exists(os.path.join(out_dir, "interrupted")):
            open(os.path.join(out_dir, "interrupted"), "w").close()
            ctrl_c(out_dir, (0, 1))

    transition.BlockMover.send = send_then_ctrl_c


class LayoutAtStop(Callback):
    def __init__(self, report):
        self.report = report

    def on_exception(self, trainer, pl_module, exception):
        self.report["layout_at_stop"] = str(trainer.strategy.layout)


class RaiseAtEpochEnd(Callback):
    def __init__(self, exception):
        self.exception = exception

    def on_train_epoch_end(self, trainer, pl_module):
        raise self.exception("stopped on every rank")


class CountsSamples(Callback):
    """A callback's own metrics, updated from every training and validation batch (on every stage,
    under a pipeline)."""

    def __init__(self):
        self.samples = torchmetrics.SumMetric()
        self.train_samples = torchmetrics.SumMetric()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train_samples.update(torch.tensor(float(len(batch["labels"]))))

    def on_train_epoch_end(self, trainer, pl_module):
        pl_module.seen["callback_train_samples"].append(float(self.train_samples.compute()))
        self.train_samples.reset()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.samples.update(torch.tensor(float(len(batch["labels"]))))

    def on_validation_epoch_end(self, trainer, pl_module):
        pl_module.seen["callback_val_samples"].append(float(self.samples.compute()))
        self.samples.reset()


class Saliency(Recipes):
    """Input saliency in predict_step: a backward inside an evaluation step."""

    def predict_step(self, batch, batch_idx):
        with torch.enable_grad():
            embeddings = self.model.bert.embeddings(input_ids=batch["input_ids"]).detach().requires_grad_()
            logits = self.model(inputs_embeds=embeddings, attention_mask=batch["attention_mask"]).logits
            logits[:, 0].sum().backward()
        return embeddings.grad


class LogShareCount(Callback):
    def on_train_end(self, trainer, pl_module):
        pl_module.seen["structure_messages"].append(trainer.strategy.engine.log_share.structure_messages)


def one_length_loader():
    """Batches of one length: AutoCache stays on, and the cached prefix costs nothing to the planner."""
    return DataLoader(RandomTokenDataset(size=32, seed=1), batch_size=4)


def fit_until_ctrl_c(trainer, model, train_loader, report, out_dir):
    """Fit until a Ctrl-C stops it; report how and when, and save the rank's weights after it."""
    start = time.monotonic()
    try:
        trainer.fit(model, train_loader)
    except SystemExit as error:  # how Lightning ends a run after a KeyboardInterrupt
        report["stopped_by"] = type(error).__name__
    report["seconds"] = time.monotonic() - start
    torch.save(model.state_dict(), os.path.join(out_dir, f"weights_rank{trainer.global_rank}.pt"))


def trainer_for(devices, timeout=60, pipeline_length=2, **kwargs):
    strategy = ElasticPipelineStrategy(
        pipeline_length=pipeline_length, num_microbatches=2, timeout=timedelta(seconds=timeout)
    )
    options = dict(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return pl.Trainer(**{**options, **kwargs})


def checkpointed_on_exception(out_dir):
    """Trainer options for Lightning's OnExceptionCheckpoint (and its default ModelCheckpoint) in ``out_dir``."""
    return dict(enable_checkpointing=True, default_root_dir=out_dir)


def everywhere(report):
    model = Recipes()
    trainer = trainer_for(4, max_epochs=2, callbacks=[LogShareCount(), CountsSamples()])
    # 30 samples, 2 replicas, batch 4: 4 steps per epoch, the last of 3 samples (micro-batches 2 + 1).
    trainer.fit(model, loader(30, 4, 1), loader(14, 4, 2))
    report["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    report["seen"] = dict(model.seen)
    # Per-token outputs: the sequence length differs from batch to batch.
    report["token_shapes"] = [list(p.shape) for p in trainer.predict(model, loader(13, 3, 3))]
    if trainer.is_global_zero:  # every rank holds the whole model again: check the documented order
        dataset, matches = RandomTokenDataset(size=13, seed=3), []
        predictions = trainer.predict(model, loader(13, 3, 3))
        for position, prediction in enumerate(predictions):
            batch_index, replica = divmod(position, 2)
            samples = [replica + 2 * (batch_index * 3 + i) for i in range(prediction.shape[0])]
            batch = pad_to_longest([dataset[s] for s in samples])
            with torch.no_grad():
                direct = model.predict_step(batch, 0)
            matches.append(torch.allclose(prediction, direct, atol=1e-5))
        report["token_order_matches"] = matches
    else:
        trainer.predict(model, loader(13, 3, 3))
    # A replica without batches: one sample, sharded by replica with a sampler of the user's own.
    predictor = trainer_for(4, use_distributed_sampler=False)
    predictions = predictor.predict(model, datamodule=OneSample())  # None where the loop had no batch
    report["one_sample"] = None if predictions is None else [list(p.shape) for p in predictions]
    # A loader Lightning does not shard: each rank predicts the whole set and keeps what it predicted.
    predictions = trainer_for(4, use_distributed_sampler=False).predict(model, loader(13, 3, 3))
    report["unsharded_shapes"] = [list(p.shape) for p in predictions]


class OneSample(pl.LightningDataModule):
    """Predicts one sample; shards it by replica itself, so the second replica reads nothing
    (Lightning's own sampler needs a sample for every replica)."""

    def __init__(self):
        super().__init__()
        self.allow_zero_length_dataloader_with_multiple_devices = True

    def predict_dataloader(self):
        shard = self.trainer.strategy.distributed_sampler_kwargs
        samples = list(range(1))[shard["rank"] :: shard["num_replicas"]]
        dataset = torch.utils.data.Subset(RandomTokenDataset(size=1, seed=3), samples)
        return DataLoader(dataset, batch_size=3, collate_fn=pad_to_longest)


def wait_for_every_report(out_dir, rank, world_size, seconds=60.0):
    """The launcher ends every rank when the first one fails: each rank waits (a bounded time)
    until every rank has printed what it reports, its error included, signalled by a file (the
    group is gone)."""
    open(os.path.join(out_dir, f"reported_rank{rank}"), "w").close()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(out_dir, f"reported_rank{r}")) for r in range(world_size)):
            return
        time.sleep(0.1)


def main():
    out_dir, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    if mode.startswith("ctrl_c"):
        # Ctrl-C raises KeyboardInterrupt, as in a terminal, also where the test session runs with SIGINT
        # ignored (`make test` as a background job), which the processes it starts inherit.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with open(os.path.join(out_dir, f"pid_rank{rank}"), "w") as f:  # for the rank that sends the Ctrl-C
            f.write(str(os.getpid()))
    report = {}
    if mode == "everywhere":
        everywhere(report)
    elif mode == "grad_in_eval":
        try:
            trainer_for(2).predict(Saliency(), loader(8, 4, 3))
        except ValueError as error:
            report["refused"] = str(error)
    elif mode == "train_list":
        trainer_for(2, timeout=30, max_epochs=1).fit(CollectedLosses(), loader(16, 4, 1))
    elif mode == "fail_all":
        exception = {"ValueError": ValueError, "KeyboardInterrupt": KeyboardInterrupt}[sys.argv[3]]
        model = CollectedLosses()
        on_exception = OnExceptionCheckpoint(out_dir, filename="on_exception")
        trainer = trainer_for(
            2, max_epochs=2, callbacks=[RaiseAtEpochEnd(exception), on_exception], **checkpointed_on_exception(out_dir)
        )
        try:
            trainer.fit(model, loader(16, 4, 1))
        except (ValueError, SystemExit) as error:  # Lightning exits after a KeyboardInterrupt
            report["stopped_by"] = type(error).__name__
        torch.save(model.state_dict(), os.path.join(out_dir, f"weights_rank{rank}.pt"))
        trainer.save_checkpoint(os.path.join(out_dir, "after_failure.ckpt"), weights_only=True)
        trainer.save_checkpoint(os.path.join(out_dir, "full_after_failure.ckpt"))
    elif mode == "ctrl_c":
        model = CtrlCWhileRank0Waits(out_dir)
        on_exception = OnExceptionCheckpoint(out_dir, filename="on_exception")
        saved = ModelCheckpoint(os.path.join(out_dir, "saved"), save_on_exception=True, save_last=True)
        length = int(sys.argv[3])
        trainer = trainer_for(
            2, 90, length, max_epochs=1, callbacks=[on_exception, saved], **checkpointed_on_exception(out_dir)
        )
        fit_until_ctrl_c(trainer, model, loader(32, 4, 1), report, out_dir)
    elif mode == "ctrl_c_after_transition":
        callbacks = [
            FreezeCallback(alpha=1 / 2, signal="schedule"),
            CtrlCAfterTransition(out_dir, report),
            OnExceptionCheckpoint(out_dir, filename="on_exception"),
            ModelCheckpoint(os.path.join(out_dir, "saved"), every_n_epochs=0),  # no save at epoch end
        ]
        trainer = trainer_for(4, 90, 2, max_epochs=2, callbacks=callbacks, **checkpointed_on_exception(out_dir))
        fit_until_ctrl_c(trainer, EpochLoss(), one_length_loader(), report, out_dir)
    elif mode == "ctrl_c_in_transition":
        ctrl_c_after_the_first_block_sent(out_dir, rank)
        callbacks = [
            FreezeCallback(alpha=1 / 2, signal="schedule"),
            LayoutAtStop(report),
            OnExceptionCheckpoint(out_dir, filename="on_exception"),
        ]
        trainer = trainer_for(2, 90, max_epochs=2, callbacks=callbacks, **checkpointed_on_exception(out_dir))
        fit_until_ctrl_c(trainer, EpochLoss(), one_length_loader(), report, out_dir)
    elif mode == "fail_one_checkpointed":  # Lightning's OnExceptionCheckpoint saves before the strategy hears of it
        on_exception = OnExceptionCheckpoint(out_dir, filename="on_exception")
        try:
            trainer = trainer_for(
                2, timeout=45, max_epochs=1, callbacks=[on_exception], **checkpointed_on_exception(out_dir)
            )
            trainer.fit(FailingLastStage(), loader(32, 4, 1))
        except BaseException as error:
            print(f"[rank{rank}] fit failed: {type(error).__name__}: {error}", flush=True)
            raise
    elif mode == "repeated_fits":
        report["threads_after_fit"], report["state_dict_hooks_after_fit"] = [], []
        model = Recipes()  # trained on by each fit, as a second stage of training would be
        blocks = find_blocks(model).blocks
        for _ in range(4):  # a sweep's trials in the same processes, each a 2x1 pipeline
            trainer_for(2, max_epochs=1).fit(model, loader(16, 4, 1))
            report["threads_after_fit"].append(len(os.listdir("/proc/self/task")))
            report["state_dict_hooks_after_fit"].append(len(blocks._state_dict_hooks))
    elif mode == "second_set_up_fails":  # a second fit on the same Trainer stops in configure_optimizers
        model = SecondSetUpFails()
        trainer = trainer_for(2, max_epochs=1)
        trainer.fit(model, loader(16, 4, 1))
        model.fail = True
        trainer.fit_loop.max_epochs = 2
        try:
            trainer.fit(model, loader(16, 4, 1))
        except ValueError as error:
            report["second_fit"] = str(error)
        try:
            trainer.save_checkpoint(os.path.join(out_dir, "with_optimizer.ckpt"))
        except RuntimeError as error:
            report["refused"] = str(error)
        trainer.save_checkpoint(os.path.join(out_dir, "weights.ckpt"), weights_only=True)
        torch.save(model.state_dict(), os.path.join(out_dir, f"weights_rank{rank}.pt"))
    elif mode == "restore_raises":  # the blocks' return after an agreed failure breaks off half-way

        def restore_half_way(self, group, optimizers):
            for block in self.store.blocks:
                for parameter in block.parameters():
                    self.store.materialize(parameter)  # memory for the blocks of the other stage, never filled
            raise RuntimeError("a peer was lost while the blocks were given back")

        engine.PipelineEngine.restore_after_failure = restore_half_way
        trainer = trainer_for(2, max_epochs=2, callbacks=[RaiseAtEpochEnd(ValueError)])
        try:
            trainer.fit(SecondSetUpFails(), loader(16, 4, 1))
        except RuntimeError as error:
            report["fit"] = str(error)
        try:
            trainer.save_checkpoint(os.path.join(out_dir, "weights.ckpt"), weights_only=True)
        except RuntimeError as error:
            report["refused"] = str(error)
        try:
            report["layout"] = str(trainer.strategy.layout)
        except RuntimeError as error:
            report["no_layout"] = str(error)
    elif mode == "fail_one":
        trainer = trainer_for(2, timeout=45, max_epochs=1)
        try:
            trainer.fit(FailingLastStage(), loader(32, 4, 1))
        except BaseException as error:  # printed now: the launcher may end this rank once a peer exits
            print(f"[rank{rank}] fit failed: {type(error).__name__}: {error}", flush=True)
            raise
        finally:
            try:
                trainer.save_checkpoint(os.path.join(out_dir, "after_failure.ckpt"), weights_only=True)
            except RuntimeError as error:
                print(f"[rank{rank}] save refused: {error}", flush=True)
            wait_for_every_report(out_dir, rank, 2)
    with open(os.path.join(out_dir, f"{mode}_rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    run_worker(main)
