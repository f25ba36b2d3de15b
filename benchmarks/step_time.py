"""Where a training step's time goes on the real fine-tune: Lightning's DDP against the full system.

Trains ``benchmarks/finetune.py``'s model and data (pretrained all-MiniLM-L6-v2 on Rotten
Tomatoes, the module and data module of ``examples/text_classification.py``, unchanged) for
``--epochs`` epochs on one device, once under Lightning's DDP and once under the full system
(``ElasticPipelineStrategy()`` + ``FreezeCallback()``, defaults), each in a process of its own,
and measures the training steps (validation excluded) of the last two epochs, where the full
system has frozen and cached all it will:

* the next-to-last epoch, unprofiled: wall milliseconds per step;
* the last epoch's first ``--device-steps`` steps under torch.profiler (device activity only,
  on a GPU): milliseconds of device work per step, so ``device / wall`` says whether the device
  or the host sets the pace;
* the rest of the last epoch under cProfile: the host's time per step by package. Each Python
  function's own time counts for its package, and the time of each built-in it calls (torch's
  operators: dispatch and kernel launch) for the caller's package. cProfile slows Python down,
  so its milliseconds are larger than the unprofiled step; the shares are what it tells.

Prints a table and the costliest functions of lightning_pipetx; writes JSON. ``--tiny`` trains a
6-block BERT of width 32 on synthetic sentences instead: on CPU its step is mostly the host's
work, as a GPU step of the real model is. Examples::

    python benchmarks/step_time.py --accelerator gpu --precision bf16-mixed --pretrained DIR
    OMP_NUM_THREADS=1 python benchmarks/step_time.py --tiny --train 2048 --val 256 --max-length 32
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from _launch import add_worker_options, launch, write_json
from finetune import FUSED

CONFIGS = ("ddp", "full")
# The package of a file, by the first of these folders in its path; the example is the user's code.
PACKAGES = ("lightning_pipetx", "lightning", "torchmetrics", "transformers", "torch")
USER_FILE = "text_classification.py"


def package_of(filename: str) -> str:
    """``lightning_pipetx``, Lightning, ..., ``user`` (the example module) or ``other`` (Python itself)."""
    parts = Path(filename).parts
    if parts and parts[-1] == USER_FILE:
        return "user"
    for package in PACKAGES:
        if package in parts:
            return package
    return "other"


def host_time_by_package(stats: pstats.Stats) -> tuple[Counter, Counter]:
    """Seconds by package, and by lightning_pipetx function, of own time plus the built-ins each calls."""
    packages: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    for (filename, _, name), (_, _, own, _, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if filename != "~":  # a Python function: its own time
            package = package_of(filename)
            packages[package] += own
            if package == "lightning_pipetx":
                ours[f"{Path(filename).name}:{name}"] += own
            continue
        for (caller_file, _, caller_name), (_, _, caller_own, _) in callers.items():  # a built-in: its caller's
            package = package_of(caller_file)
            packages[package] += caller_own
            if package == "lightning_pipetx":
                ours[f"{Path(caller_file).name}:{caller_name}"] += caller_own
    return packages, ours


def largest_parts(stats: pstats.Stats, total: float, count: int = 15) -> dict[str, float]:
    """Seconds, callees included, of the costliest functions below the training loop itself
    (those under 80% of ``total``: the loop's own frames hold nearly all of it)."""
    parts = {
        f"{package_of(filename)}:{Path(filename).name}:{name}" if filename != "~" else name: cumulative
        for (filename, _, name), (_, _, _, cumulative, _) in stats.stats.items()  # type: ignore[attr-defined]
        if cumulative < 0.8 * total
    }
    return dict(sorted(parts.items(), key=lambda item: -item[1])[:count])


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from text_classification import SentimentDataModule, TextClassifier

    from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback

    class StepClock(pl.Callback):
        """Times the training steps of the last two epochs: plain, then profiled."""

        def __init__(self, epochs: int, device_steps: int) -> None:
            self.clean_epoch, self.last_epoch = epochs - 2, epochs - 1
            self.device_steps = device_steps if torch.cuda.is_available() else 0
            self.result: dict = {}
            self.cpu_profile = cProfile.Profile()

        def _now(self) -> float:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            epoch = trainer.current_epoch
            if batch_idx == 0 and epoch in (self.clean_epoch, self.last_epoch):
                self.started = self._now()
            if batch_idx == 0 and epoch == self.clean_epoch:  # what the timed epochs train with
                freeze = [c.frozen_blocks for c in trainer.callbacks if isinstance(c, FreezeCallback)]
                self.result["frozen_blocks"] = freeze[0] if freeze else 0
            if epoch == self.last_epoch and batch_idx == 0 and self.device_steps:
                activity = torch.profiler.ProfilerActivity.CUDA
                self.device_profile = torch.profiler.profile(activities=[activity])
                self.device_profile.start()
            if epoch == self.last_epoch and batch_idx == self.device_steps:
                self.cpu_started = self._now()
                self.cpu_profile.enable()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            epoch = trainer.current_epoch
            if epoch == self.last_epoch and batch_idx == self.device_steps - 1:
                torch.cuda.synchronize()
                self.device_profile.stop()
                wall = time.perf_counter() - self.started
                events = self.device_profile.key_averages()
                busy_us = sum(getattr(e, "self_device_time_total", 0) for e in events)
                self.result["profiled_step_ms"] = 1e3 * wall / self.device_steps
                self.result["device_busy_ms"] = busy_us / 1e3 / self.device_steps
            self.steps = batch_idx + 1

        def on_train_epoch_end(self, trainer, pl_module):
            # Lightning validates before this hook; the clock stopped at the last training batch
            epoch = trainer.current_epoch
            if epoch == self.clean_epoch:
                self.result["step_ms"] = 1e3 * (self.clean_end - self.started) / self.steps
                self.result["steps"] = self.steps
            if epoch == self.last_epoch:
                seconds, profiled_steps = self.cpu_end - self.cpu_started, self.steps - self.device_steps
                self.result["cprofile_step_ms"] = 1e3 * seconds / profiled_steps
                stats = pstats.Stats(self.cpu_profile)
                packages, ours = host_time_by_package(stats)
                self.result["host_ms_by_package"] = {k: 1e3 * v / profiled_steps for k, v in packages.most_common()}
                self.result["lightning_pipetx_ms_by_function"] = {
                    k: 1e3 * v / profiled_steps for k, v in ours.most_common(12)
                }
                self.result["largest_parts_ms"] = {
                    k: 1e3 * v / profiled_steps for k, v in largest_parts(stats, seconds).items()
                }

        def on_validation_start(self, trainer, pl_module):
            if trainer.current_epoch == self.clean_epoch:
                self.clean_end = self._now()
            if trainer.current_epoch == self.last_epoch:
                self.cpu_profile.disable()
                self.cpu_end = self._now()

    pl.seed_everything(args.seed)
    clock = StepClock(args.epochs, args.device_steps)
    callbacks: list[pl.Callback] = [clock]
    if args.worker == "full":
        strategy = ElasticPipelineStrategy()
        callbacks.insert(0, FreezeCallback())
    else:
        strategy = "ddp"
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        strategy=strategy,
        max_epochs=args.epochs,
        precision=args.precision,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    if args.tiny:  # the host's work without the arithmetic: a tiny BERT on synthetic sentences
        data = SentimentDataModule(
            pretrained="none", dataset="synthetic", num_samples=args.train + args.val, batch_size=args.batch,
            max_length=args.max_length, fixed_length=True, val_fraction=args.val / (args.train + args.val),
        )  # fmt: skip
        model = TextClassifier(pretrained="none", hidden_size=32, num_layers=6, num_heads=2, fused=FUSED[args.fused])
    else:
        data = SentimentDataModule(
            max_train_samples=args.train,
            max_val_samples=args.val,
            max_test_samples=64,
            max_length=args.max_length,
            batch_size=args.batch,
            pretrained=args.pretrained,
        )
        model = TextClassifier(lr=1e-4, pretrained=args.pretrained, fused=FUSED[args.fused])
    trainer.fit(model, data)
    clock.result["cache_hit_rate"] = trainer.callback_metrics.get("pipetx/cache_hit_rate")
    if clock.result["cache_hit_rate"] is not None:
        clock.result["cache_hit_rate"] = float(clock.result["cache_hit_rate"])
    Path(args.result_dir, f"{args.worker}_rank0.json").write_text(json.dumps(clock.result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"of {','.join(CONFIGS)}")
    parser.add_argument("--train", type=int, default=4096, help="training snippets (the steps per epoch)")
    parser.add_argument("--val", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--device-steps", type=int, default=20, help="last-epoch steps under torch.profiler")
    parser.add_argument("--pretrained", default="auto")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a 6-block BERT of width 32 on synthetic sentences instead: on CPU, a step that is mostly the host's work",
    )
    parser.add_argument("--fused", default="auto", choices=list(FUSED), help="AdamW's fused kernel (auto: on a GPU)")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/step_time.json")
    add_worker_options(parser)
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2: the next-to-last epoch is timed, the last one profiled")
    if args.worker:
        worker(args)
        return
    results = {}
    for config in args.configs.split(","):
        print(f"running {config} ...", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            results[config] = launch(__file__, config, 0, sys.argv[1:], tmp)[0]
    packages = sorted({p for r in results.values() for p in r["host_ms_by_package"]})
    print(f"\n{'config':<6} {'frozen':>6} {'step ms':>8} {'device ms':>10} {'cProfile ms':>12}  host share by package")
    for config, r in results.items():
        device = r.get("device_busy_ms")
        total = sum(r["host_ms_by_package"].values())
        shares = ", ".join(f"{p} {100 * r['host_ms_by_package'].get(p, 0) / total:.0f}%" for p in packages)
        print(
            f"{config:<6} {r['frozen_blocks']:>6} {r['step_ms']:>8.2f} "
            f"{'-' if device is None else f'{device:.2f}':>10} {r['cprofile_step_ms']:>12.2f}  {shares}"
        )
    for config, r in results.items():
        print(f"{config}: the costliest parts of a step under cProfile (ms, callees included):")
        for name, ms in r["largest_parts_ms"].items():
            print(f"  {ms:7.3f}  {name}")
    for config, r in results.items():
        print(f"{config}: lightning_pipetx per step under cProfile (ms, own time and the operators it calls):")
        for name, ms in r["lightning_pipetx_ms_by_function"].items():
            print(f"  {ms:7.3f}  {name}")
    write_json(args.out, {"command": " ".join([sys.executable, *sys.argv]), "settings": vars(args), **results})


if __name__ == "__main__":
    main()
