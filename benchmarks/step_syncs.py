"""Host reads of device values per training step, and where they come from.

Every ``.item()``, ``float(tensor)``, ``bool(tensor)`` or ``.tolist()`` runs
``aten::_local_scalar_dense``, and ``.to("cpu")`` an ``aten::_to_copy`` to the host: on a GPU
each one waits for all queued work, so a step with many of them cannot keep the GPU busy.
This benchmark trains a small BERT classifier (fixed-length synthetic sentences) under
``ElasticPipelineStrategy(cache=True)`` with ``FreezeCallback(signal="grad_norm")`` on one
device, and counts these calls in the steps of the last epoch (the prefix frozen and cached)
with a ``TorchDispatchMode``, by the innermost caller: a module of lightning_pipetx, or
Lightning, transformers or torch itself; torch.profiler counts the same operators over the
same epoch, every caller together, as a cross-check. On CPU the calls are the same as on a GPU, but a
read of a host tensor (AutoCache's index bookkeeping) is no synchronisation there: the
per-call-site table says which is which. JSON out. Example::

    OMP_NUM_THREADS=1 python benchmarks/step_syncs.py --out results/step_syncs.json
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections import Counter
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT / "examples"), str(_ROOT)]

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from _launch import write_json  # noqa: E402
from text_classification import SentimentDataModule, TextClassifier  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import lightning_pipetx  # noqa: E402
from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback  # noqa: E402

_PACKAGES = ("lightning_pipetx", "lightning", "transformers", "torchmetrics")


def _caller() -> str:
    """The innermost frame outside torch: ``lightning_pipetx/<file>:<function>`` or a package name."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        parts = Path(frame.filename).parts
        for package in _PACKAGES:
            if package in parts:
                if package == "lightning_pipetx":
                    return f"lightning_pipetx/{parts[-1]}:{frame.name}"
                return package
    return "torch"


class HostReads(TorchDispatchMode):
    """Counts scalar reads and copies to the host by caller while :attr:`active`."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.active:
            if func is torch.ops.aten._local_scalar_dense.default:
                self.calls[f"read  {_caller()}"] += 1
            elif func is torch.ops.aten._to_copy.default and str(kwargs.get("device")) == "cpu":
                self.calls[f"copy  {_caller()}"] += 1
        return func(*args, **kwargs)


PROFILED = ("aten::_local_scalar_dense", "aten::item", "aten::_to_copy")


class LastEpoch(pl.Callback):
    """Turns ``reads`` on for the training batches of the last epoch, and runs torch.profiler
    over the same epoch (its own count of the operators, every caller together)."""

    def __init__(self, reads: HostReads) -> None:
        self.reads = reads
        self.steps = 0
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.profiled: dict[str, int] = {}

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.reads.active = trainer.current_epoch == trainer.max_epochs - 1
        if self.reads.active:
            self.profiler.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps += int(self.reads.active)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.reads.active:
            self.profiler.stop()
            counts = {event.key: event.count for event in self.profiler.key_averages()}
            self.profiled = {name: counts.get(name, 0) for name in PROFILED}
        self.reads.active = False


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=7)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--num-samples", type=int, default=320)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", default="results/step_syncs.json")
    args = parser.parse_args(argv)
    pl.seed_everything(0, verbose=False)
    model = TextClassifier(pretrained="none", hidden_size=64, num_layers=args.depth, num_heads=4)
    data = SentimentDataModule(
        pretrained="none",
        dataset="synthetic",
        num_samples=args.num_samples,
        batch_size=args.batch_size,
        max_length=32,
        fixed_length=True,
    )
    reads = HostReads()
    last_epoch = LastEpoch(reads)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ElasticPipelineStrategy(cache=True, profile_steps=0),
        max_epochs=args.epochs,
        callbacks=[FreezeCallback(alpha=1 / 2, signal="grad_norm"), last_epoch],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    with reads:
        trainer.fit(model, data)
    steps = last_epoch.steps
    ours = {site: n / steps for site, n in reads.calls.items() if "lightning_pipetx" in site}
    result = {
        "code": str(Path(lightning_pipetx.__file__).parent),
        "steps": steps,
        "cache_hit_rate": float(trainer.callback_metrics.get("pipetx/cache_hit_rate", float("nan"))),
        "per_step_by_caller": {site: n / steps for site, n in reads.calls.most_common()},
        "lightning_pipetx_per_step": sum(ours.values()),
        "profiler_per_step": {name: n / steps for name, n in last_epoch.profiled.items()},
    }
    print(f"last epoch: {steps} steps, cache hit rate {result['cache_hit_rate']:.2f}")
    print("host reads (read) and copies to the host (copy) per step, by caller:")
    for site, per_step in result["per_step_by_caller"].items():
        print(f"  {per_step:6.2f}  {site}")
    print(f"lightning_pipetx's: {result['lightning_pipetx_per_step']:.2f} per step")
    print("torch.profiler, every caller, per step (_to_copy: to any device):")
    for name, per_step in result["profiler_per_step"].items():
        print(f"  {per_step:6.2f}  {name}")
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
