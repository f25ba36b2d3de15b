"""Elastic pipelining with progressive freezing, against its baselines, on N processes.

The same fine-tune (the ViT of examples/image_classification.py on scikit-learn's digits,
fixed epochs, the same global batch) under:

* ``ddp``: Lightning's own DDP strategy, no freezing;
* ``pipe``: a static pipeline of ``--pipeline-length`` stages, no freezing (the paper's baseline);
* ``freeze_static``: FreezeCallback(alpha) with ``elastic=False`` (the layout never changes);
* ``elastic_nocache``: FreezeCallback(alpha) with AutoPipe + AutoDP, AutoCache off;
* ``elastic``: the full system (AutoPipe + AutoDP + AutoCache).

Prints wall time, samples/s per epoch and final validation accuracy of each, with speed-ups
against ``ddp`` and ``pipe``, and writes them to ``--out`` (JSON).
Usage: python benchmarks/elastic.py --nprocs 4 [--epochs 4] [--out results/elastic_4.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from _launch import add_worker_options, launch, ratio_figure

CONFIGS = ("ddp", "pipe", "freeze_static", "elastic_nocache", "elastic")


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    from image_classification import ImageClassifier, ImageDataModule
    from lightning.pytorch.callbacks import Callback

    from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback

    pl.seed_everything(0)
    world = int(os.environ["WORLD_SIZE"])
    config = args.worker
    callbacks: list[Callback] = []
    if config == "ddp":
        strategy, replicas = "ddp", world
    else:
        strategy = ElasticPipelineStrategy(
            pipeline_length=args.pipeline_length,
            elastic=config.startswith("elastic"),
            cache=config == "elastic",
        )
        replicas = world // args.pipeline_length
    if config in ("freeze_static", "elastic_nocache", "elastic"):
        callbacks.append(FreezeCallback(alpha=args.alpha))

    class EpochClock(Callback):
        """Training time (validation excluded), samples and layout of every epoch. The layout,
        replica count and frozen blocks are read as the epoch starts: a freeze at its end has
        already moved to the next layout when this callback's on_train_epoch_end runs."""

        def __init__(self) -> None:
            self.epochs: list[dict] = []

        def on_train_epoch_start(self, trainer, pl_module):
            self._start, self._samples = time.perf_counter(), 0
            self._frozen = callbacks[0].frozen_blocks if callbacks else 0
            self._replicas = trainer.strategy.distributed_sampler_kwargs["num_replicas"]
            layout = getattr(trainer.strategy, "layout", None)
            self._layout = str(layout) if layout is not None else f"1x{trainer.world_size}"

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self._samples += batch[0].shape[0]

        def on_validation_start(self, trainer, pl_module):
            self._paused = time.perf_counter()

        def on_validation_end(self, trainer, pl_module):
            if trainer.training:
                self._start += time.perf_counter() - self._paused

        def on_train_epoch_end(self, trainer, pl_module):
            seconds = time.perf_counter() - self._start
            record = {
                "seconds": seconds,
                "samples": self._samples * self._replicas,
                "samples_per_sec": self._samples * self._replicas / seconds,
                "val_acc": float(trainer.callback_metrics.get("val_acc", float("nan"))),
                "frozen": self._frozen,
                "layout": self._layout,
            }
            self.epochs.append(record)

    clock = EpochClock()
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=world,
        strategy=strategy,
        max_epochs=args.epochs,
        callbacks=[*callbacks, clock],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = ImageClassifier(depth=args.depth, embed_dim=args.width, num_heads=max(1, args.width // 32))
    data = ImageDataModule(batch_size=args.batch // replicas, train_repeats=args.train_repeats)
    started = time.perf_counter()
    trainer.fit(model, data)
    wall = time.perf_counter() - started
    if trainer.is_global_zero:
        result = {"wall_seconds": wall, "epochs": clock.epochs, "final_val_acc": clock.epochs[-1]["val_acc"]}
        Path(args.result_dir, f"{config}_rank0.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--pipeline-length", type=int, default=None, help="initial K0 (default: nprocs)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=1 / 3)
    parser.add_argument("--batch", type=int, default=32, help="global batch")
    parser.add_argument("--train-repeats", type=int, default=2)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--out", default=None, help="default: results/elastic_<nprocs>.json")
    add_worker_options(parser)
    args = parser.parse_args()
    args.pipeline_length = args.pipeline_length or args.nprocs
    if args.worker:
        worker(args)
        return

    argv = [*sys.argv[1:], "--pipeline-length", str(args.pipeline_length)]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs.split(","):
            print(f"running {config} on {args.nprocs} processes ...", flush=True)
            runs[config] = launch(__file__, config, args.nprocs, argv, tmp)[0]

    summary = {"command": " ".join([sys.executable, *sys.argv]), "settings": vars(args), "runs": runs}
    print(
        f"\n{'config':<14} {'wall s':>8} {'vs ddp':>7} {'vs pipe':>8} {'val acc':>8}  per-epoch samples/s [layout, frozen]"
    )
    for config, run in runs.items():
        speedups = {}
        for base in ("ddp", "pipe"):
            if base in runs:
                speedups[base] = runs[base]["wall_seconds"] / run["wall_seconds"]
        run["speedup"] = speedups
        epochs = "  ".join(f"{e['samples_per_sec']:.0f} [{e['layout']}, {e['frozen']}]" for e in run["epochs"])
        vs_ddp, vs_pipe = (ratio_figure(speedups.get(base)) for base in ("ddp", "pipe"))
        print(
            f"{config:<14} {run['wall_seconds']:>8.1f} {vs_ddp:>7} {vs_pipe:>8} {run['final_val_acc']:>8.3f}  {epochs}"
        )
    out = Path(args.out or f"results/elastic_{args.nprocs}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2, default=str))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
