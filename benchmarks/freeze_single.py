"""Progressive freezing on one device: the same fine-tune without and with FreezeCallback,
and with FreezeCallback plus AutoCache (ElasticPipelineStrategy on one device).

Trains the example's ViT (examples/image_classification.py) three times for the same
number of epochs from the same seed: without ``FreezeCallback``, with it, and with it under
``ElasticPipelineStrategy(cache=True)`` on one device, and reports per epoch the training
wall time (validation excluded: it costs the same in all runs), the ratios to the unfrozen
run, the cache hit rate, and the final validation accuracies. A few throw-away batches
run first so that neither run pays the one-off start-up costs. Process CPU time is
reported next to wall time: on a shared CPU machine it is the steadier of the two. Speed is
measured, never asserted.

The runs share one process. On CPU ElasticPipelineStrategy keeps host memory freed by a step
for the next (``reuse_host_memory``), process-wide and for the rest of the process's life: the
``frozen_cached`` run, which runs last, sets it; the warm-up, ``unfrozen`` and ``frozen`` runs
before it use ``malloc`` as users' runs do, unless ``--baselines-keep-freed-memory`` gives
them the same setting (applied before the warm-up). Example::

    OMP_NUM_THREADS=1 python benchmarks/freeze_single.py --epochs 6 --data digits --device cpu
    python benchmarks/freeze_single.py --device cuda --data synthetic --depth 12 --embed-dim 384 --num-heads 6

``--model bert``: a BERT classifier (random weights) of ``--depth`` blocks and width
``--embed-dim`` on fixed-length synthetic sentences (``--max-length`` tokens), the AutoCache
benchmark. BERT-base-sized on a GPU, 7 epochs (the last one at the final depth, warm)::

    python benchmarks/freeze_single.py --model bert --device cuda --precision bf16-mixed --depth 12 \
        --embed-dim 768 --num-heads 12 --max-length 128 --num-samples 8192 --batch-size 32 \
        --epochs 7 --signal schedule --alpha 0.3333
    OMP_NUM_THREADS=1 python benchmarks/freeze_single.py --model bert --depth 6 --embed-dim 256 \
        --num-heads 4 --max-length 64 --num-samples 1024 --epochs 7 --signal schedule --alpha 0.3333
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT / "examples"), str(_ROOT)]

import lightning  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from _launch import ratio_figure, unfavourable, write_json  # noqa: E402
from finetune import ideal_speedup  # noqa: E402
from image_classification import ImageClassifier, ImageDataModule  # noqa: E402
from pipeline_static import add_keep_freed_memory_option, keep_freed_memory_if_asked  # noqa: E402
from text_classification import SentimentDataModule, TextClassifier  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback  # noqa: E402
from lightning_pipetx.callbacks.report import EpochReport  # noqa: E402


class EpochTimer(pl.Callback):
    """Per training epoch: wall time with and without the validation run at its end, and the
    process CPU time without it (steadier than wall time on a shared machine)."""

    def __init__(self) -> None:
        self.epoch_seconds: list[float] = []
        self.train_seconds: list[float] = []
        self.train_cpu_seconds: list[float] = []
        self._start = self._start_cpu = self._val_start = self._val_start_cpu = 0.0
        self._val = self._val_cpu = 0.0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _synchronize(pl_module)
        self._start, self._start_cpu = time.perf_counter(), time.process_time()
        self._val = self._val_cpu = 0.0

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _synchronize(pl_module)
        self._val_start, self._val_start_cpu = time.perf_counter(), time.process_time()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _synchronize(pl_module)
        self._val += time.perf_counter() - self._val_start
        self._val_cpu += time.process_time() - self._val_start_cpu

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _synchronize(pl_module)
        wall = time.perf_counter() - self._start
        self.epoch_seconds.append(wall)
        self.train_seconds.append(wall - self._val)
        self.train_cpu_seconds.append(time.process_time() - self._start_cpu - self._val_cpu)


def _synchronize(pl_module: pl.LightningModule) -> None:
    if pl_module.device.type == "cuda":
        torch.cuda.synchronize(pl_module.device)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=6, help="epochs of each run")
    parser.add_argument("--model", choices=("vit", "bert"), default="vit")
    parser.add_argument("--data", choices=("digits", "synthetic"), default="digits", help="the ViT's data")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per sentence (bert)")
    parser.add_argument("--signal", choices=("grad_norm", "schedule"), default="grad_norm")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", default="32-true", help="Trainer precision, e.g. bf16-mixed")
    parser.add_argument("--depth", type=int, default=6, help="Transformer blocks")
    parser.add_argument("--embed-dim", type=int, default=128, help="token width")
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--patch-size", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--train-repeats", type=int, default=4, help="passes over the training set per epoch")
    parser.add_argument("--num-samples", type=int, default=2048, help="synthetic samples")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--alpha", type=float, default=1 / 3, help="FreezeCallback's alpha")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-batches", type=int, default=5, help="throw-away batches before timing")
    add_keep_freed_memory_option(parser, "the warm-up, unfrozen and frozen runs")
    parser.add_argument("--out", default="results/freeze_single.json", help="JSON file for the figures")
    return parser.parse_args(argv)


def _build(args: argparse.Namespace) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    pl.seed_everything(args.seed, verbose=False)
    if args.model == "bert":
        model = TextClassifier(
            pretrained="none",
            hidden_size=args.embed_dim,
            num_layers=args.depth,
            num_heads=args.num_heads,
            lr=args.lr,
        )
        data = SentimentDataModule(
            pretrained="none",
            dataset="synthetic",
            num_samples=args.num_samples,
            batch_size=args.batch_size,
            max_length=args.max_length,
            seed=args.seed,
            fixed_length=True,
        )
        return model, data
    model = ImageClassifier(
        img_size=args.img_size,
        patch_size=args.patch_size,
        depth=args.depth,
        embed_dim=args.embed_dim,
        num_heads=args.num_heads,
        lr=args.lr,
    )
    data = ImageDataModule(
        data=args.data,
        img_size=args.img_size,
        batch_size=args.batch_size,
        train_repeats=args.train_repeats,
        num_samples=args.num_samples,
        seed=args.seed,
    )
    return model, data


def _trainer(args: argparse.Namespace, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator=args.device,
        devices=1,
        precision=args.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **kwargs,
    )


def warm_up(args: argparse.Namespace) -> None:
    if args.warmup_batches > 0:
        model, data = _build(args)
        _trainer(args, [], max_epochs=1, limit_train_batches=args.warmup_batches, limit_val_batches=0).fit(model, data)


def _in_distributed_order(data: pl.LightningDataModule) -> None:
    """Shuffle the training loader as Lightning does under a distributed strategy (a
    ``DistributedSampler``, seed 0), the strategy's single-device run included, so that the runs
    without one train on the same batches in the same order."""
    make = data.train_dataloader

    def train_dataloader() -> DataLoader:
        loader = make()
        order = DistributedSampler(loader.dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
        return DataLoader(
            loader.dataset,
            batch_size=loader.batch_size,
            sampler=order,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            drop_last=loader.drop_last,
        )

    data.train_dataloader = train_dataloader


def run(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One fit (``unfrozen``, ``frozen`` or ``frozen_cached``); per-epoch times, accuracies, frozen blocks."""
    print(f"\n=== {name} ===", flush=True)
    report = EpochReport(output_dir=str(Path(args.out).with_suffix("") / name))
    timer = EpochTimer()
    callbacks: list[pl.Callback] = [timer, report]
    kwargs: dict[str, Any] = {}
    if name != "unfrozen":
        callbacks.append(FreezeCallback(alpha=args.alpha, signal=args.signal))
    if name == "frozen_cached":  # the single-device path of the strategy, for AutoCache
        kwargs["strategy"] = ElasticPipelineStrategy(cache=True)
    model, data = _build(args)
    _in_distributed_order(data)
    _trainer(args, callbacks, max_epochs=args.epochs, **kwargs).fit(model, data)
    records = report.records
    return {
        "cache_hit_rate": [r.get("cache_hit_rate") for r in records],
        "train_seconds": timer.train_seconds,
        "train_cpu_seconds": timer.train_cpu_seconds,
        "epoch_seconds": timer.epoch_seconds,
        "val_acc": [r["val_acc"] for r in records],
        "frozen_blocks": [int(r.get("frozen_blocks", 0)) for r in records],
        "total_train_seconds": sum(timer.train_seconds),
        "total_train_cpu_seconds": sum(timer.train_cpu_seconds),
        "final_val_acc": records[-1]["val_acc"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    keep_freed_memory_if_asked(args)
    warm_up(args)
    unfrozen = run(args, "unfrozen")
    frozen = run(args, "frozen")
    cached = run(args, "frozen_cached")  # last: its strategy keeps freed host memory from here on (CPU)
    cached_ratios = [c / u for c, u in zip(cached["train_seconds"], unfrozen["train_seconds"])]
    # Epochs with at least half the blocks frozen whose cache was warm (every lookup a hit).
    warm = [
        ratio
        for ratio, blocks, hits in zip(cached_ratios, cached["frozen_blocks"], cached["cache_hit_rate"])
        if blocks * 2 >= args.depth and hits == 1.0
    ]

    ideal_frozen = ideal_speedup(frozen["frozen_blocks"], args.depth, cache=False)
    ideal_cached = ideal_speedup(cached["frozen_blocks"], args.depth)
    ratios = [f / u for f, u in zip(frozen["train_seconds"], unfrozen["train_seconds"])]
    total_ratio = frozen["total_train_seconds"] / unfrozen["total_train_seconds"]
    cpu_ratios = [f / u for f, u in zip(frozen["train_cpu_seconds"], unfrozen["train_cpu_seconds"])]
    cpu_total_ratio = frozen["total_train_cpu_seconds"] / unfrozen["total_train_cpu_seconds"]
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]),
        "config": vars(args),
        "environment": {
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "torch": torch.__version__,
            "lightning": lightning.__version__,
        },
        "unfrozen": unfrozen,
        "frozen": frozen,
        "frozen_cached": cached,
        "cached_time_ratio_per_epoch": cached_ratios,
        "cached_time_ratio_total": cached["total_train_seconds"] / unfrozen["total_train_seconds"],
        "half_frozen_warm_cache_epoch_ratio": min(warm) if warm else None,
        "speedup_frozen": 1 / total_ratio,
        "speedup_cached": unfrozen["total_train_seconds"] / cached["total_train_seconds"],
        "ideal_speedup_frozen": ideal_frozen,
        "ideal_speedup_cached": ideal_cached,
        "train_time_ratio_per_epoch": ratios,
        "train_time_ratio_total": total_ratio,
        "train_cpu_time_ratio_per_epoch": cpu_ratios,
        "train_cpu_time_ratio_total": cpu_total_ratio,
    }

    kept = "yes" if args.baselines_keep_freed_memory else "no (malloc's default)"
    print(f"\nunfrozen and frozen runs keep freed host memory (--baselines-keep-freed-memory): {kept}")
    print("\ntraining time per epoch (validation excluded), frozen / unfrozen")
    print("epoch  frozen  unfrozen s  frozen s  ratio  | unfrozen cpu s  frozen cpu s  cpu ratio")
    rows = zip(
        range(len(ratios)),
        frozen["frozen_blocks"],
        unfrozen["train_seconds"],
        frozen["train_seconds"],
        ratios,
        unfrozen["train_cpu_seconds"],
        frozen["train_cpu_seconds"],
        cpu_ratios,
    )
    for epoch, blocks, u, f, ratio, u_cpu, f_cpu, cpu_ratio in rows:
        print(
            f"{epoch:5d}  {blocks:6d}  {u:10.2f}  {f:8.2f}  {_cost(ratio):>5}  | {u_cpu:14.2f}  {f_cpu:12.2f}  "
            f"{_cost(cpu_ratio):>9}"
        )
    print(
        f"total  {'':6s}  {unfrozen['total_train_seconds']:10.2f}  {frozen['total_train_seconds']:8.2f}  "
        f"{_cost(total_ratio):>5}  | {unfrozen['total_train_cpu_seconds']:14.2f}  "
        f"{frozen['total_train_cpu_seconds']:12.2f}  {_cost(cpu_total_ratio):>9}"
    )
    wall, cpu = ratio_figure(1 / total_ratio), ratio_figure(1 / cpu_total_ratio)
    print(f"speed-up (unfrozen / frozen training time): wall {wall}, cpu {cpu}")
    print(f"final val_acc: unfrozen {unfrozen['final_val_acc']:.4f}, frozen {frozen['final_val_acc']:.4f}")
    print("\nwith AutoCache (ElasticPipelineStrategy on one device): per-epoch time / unfrozen")
    for epoch, (ratio, blocks, hits) in enumerate(
        zip(cached_ratios, cached["frozen_blocks"], cached["cache_hit_rate"])
    ):
        hit_rate = "-" if hits is None else f"{hits:.0%}"
        print(f"{epoch:5d}  frozen {blocks:2d}  hit rate {hit_rate:>5s}  ratio {_cost(ratio):>5}")
    print(f"total ratio {_cost(result['cached_time_ratio_total'])}, final val_acc {cached['final_val_acc']:.4f}")
    print(
        f"speed-up over unfrozen: freezing {ratio_figure(result['speedup_frozen'])} (ideal {ideal_frozen:.2f}x), "
        f"freezing + AutoCache {ratio_figure(result['speedup_cached'])} (ideal {ideal_cached:.2f}x)"
    )
    if warm:
        print(
            f"epoch with >= half the blocks frozen and a warm cache: {_cost(min(warm))}x "
            "the unfrozen epoch (target <= 0.6)"
        )

    write_json(args.out, result)
    return result


def _cost(ratio: float) -> str:
    """A time ratio, frozen over unfrozen (lower is better), rounded up."""
    return unfavourable(ratio, 2, higher_is_better=False)


if __name__ == "__main__":
    main()
