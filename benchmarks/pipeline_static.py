"""Static-layout throughput and memory: ElasticPipelineStrategy against Lightning's DDP.

One run measures, on the same model, data and global batch, with ``--nprocs`` processes:

* ``ddp``: Lightning's own DDP strategy (the baseline);
* ``pipe_k1``: ElasticPipelineStrategy(pipeline_length=1), pure data parallel: target >= 1.0x ddp;
* ``pipe_kN``: ElasticPipelineStrategy(pipeline_length=N) with M micro-batches, compared with
  the bubble model ``pipe_k1 * M / (M + N - 1)``;
* ``single``: one process, for the memory comparison.

It prints samples/s, ratios, memory per rank and each step's time split at Lightning's hooks
(``training_step``, ``backward``, the rest), and writes them to ``--out`` (JSON). On a
shared machine a single run of each varies by 10%: ``--repeats R`` runs the configurations R
times in turn (every other round in reverse order), takes the median of each, and says whether
the rounds resolve the pipe_k1 / ddp ratio from 1.
On CPU ElasticPipelineStrategy keeps host memory freed by a step for the next
(``reuse_host_memory``); ``--baselines-keep-freed-memory`` gives the baselines the same setting.
Usage: python benchmarks/pipeline_static.py [--nprocs 2] [--steps 12] [--repeats 1] [--configs ddp,pipe_k1,pipe_k2,single]
[--baselines-keep-freed-memory] [--out results/pipeline_static.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _launch import add_worker_options, in_turn, launch, ratio_verdict, unfavourable


def build_module(args: argparse.Namespace):
    import lightning.pytorch as pl
    import timm
    import torch

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = timm.create_model(
                "vit_tiny_patch16_224",
                pretrained=False,
                img_size=args.img_size,
                patch_size=8,
                embed_dim=args.width,
                depth=args.depth,
                num_heads=max(1, args.width // 64),
                num_classes=10,
            )

        def training_step(self, batch, batch_idx):
            images, labels = batch
            return torch.nn.functional.cross_entropy(self.model(images), labels)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Classifier()


def add_keep_freed_memory_option(parser: argparse.ArgumentParser, baselines: str) -> None:
    parser.add_argument(
        "--baselines-keep-freed-memory",
        action="store_true",
        help=f"give {baselines} the host allocator setting ours applies on CPU (reuse_host_memory)",
    )


def keep_freed_memory_if_asked(args: argparse.Namespace) -> None:
    """With --baselines-keep-freed-memory, give a baseline's process what
    ElasticPipelineStrategy(reuse_host_memory="auto") does on CPU."""
    if args.baselines_keep_freed_memory:
        from lightning_pipetx.strategy.host_memory import keep_freed_memory

        keep_freed_memory()


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipetx import ElasticPipelineStrategy

    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = args.worker
    if not config.startswith("pipe_k"):
        keep_freed_memory_if_asked(args)
    if config == "ddp":
        strategy, replicas = "ddp", world
    elif config == "single":
        strategy, replicas = "auto", 1
    else:
        length = int(config.removeprefix("pipe_k"))
        microbatches = 1 if length == 1 else args.microbatches  # no pipeline, no reason to split
        schedule = getattr(args, "schedule", "gpipe")  # benchmarks/pipelining_peer.py runs both
        strategy = ElasticPipelineStrategy(
            pipeline_length=length,
            num_microbatches=microbatches,
            schedule=schedule,
            split_backward=getattr(args, "split_backward", True),
        )
        replicas = world // length

    class Timer(Callback):
        """The timed steps' wall time, and each step split at Lightning's hooks: ``training_step``
        (DDP: the forward; ElasticPipelineStrategy: forward and backward), ``backward`` (DDP: the
        backward and its gradient wait; ours: the wait for the last buckets), and the rest
        (optimizer step and loop), in milliseconds, medians over the timed steps."""

        def __init__(self) -> None:
            self.start = self.end = 0.0
            self.marks: dict[str, float] = {}
            self.phases: list[tuple[float, float, float]] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == args.warmup:
                self.start = time.perf_counter()
            self.marks["start"] = time.perf_counter()

        def on_before_backward(self, trainer, pl_module, loss):
            self.marks["backward"] = time.perf_counter()

        def on_after_backward(self, trainer, pl_module):
            self.marks["rest"] = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.end = time.perf_counter()
            if batch_idx >= args.warmup:
                start, backward, rest = self.marks["start"], self.marks["backward"], self.marks["rest"]
                self.phases.append((backward - start, rest - backward, self.end - rest))

        def phase_ms(self) -> dict[str, float]:
            columns = zip(*self.phases)
            return {n: 1000 * statistics.median(c) for n, c in zip(("training_step", "backward", "rest"), columns)}

    g = torch.Generator().manual_seed(0)
    total = args.batch * (args.steps + args.warmup)
    data = TensorDataset(
        torch.randn(total, 3, args.img_size, args.img_size, generator=g), torch.randint(0, 10, (total,), generator=g)
    )
    timer = Timer()
    module = build_module(args)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=world if config != "single" else 1,
        strategy=strategy,
        max_steps=args.steps + args.warmup,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    held = {"params": 0}

    class Memory(Callback):
        def on_train_end(self, trainer, pl_module):
            # storage actually held: a released weight is a 1-element storage expanded to its shape
            held["params"] = sum(p.untyped_storage().nbytes() for p in pl_module.parameters())
            engine = getattr(trainer.strategy, "engine", None)  # ElasticPipelineStrategy's: its stages' blocks
            held["bounds"] = None if engine is None else [list(b) for b in engine.bounds]

    trainer.callbacks.append(Memory())
    trainer.fit(module, DataLoader(data, batch_size=args.batch // replicas))
    result = {
        "rank": trainer.global_rank,
        "samples_per_sec": args.batch * args.steps / (timer.end - timer.start),
        "param_mb_held": held["params"] / 2**20,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "phase_ms": timer.phase_ms(),
        "stage_bounds": held["bounds"],
    }
    if args.accelerator == "gpu":
        result["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    Path(args.result_dir, f"{config}_rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--pipeline-length", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="global batch")
    parser.add_argument("--steps", type=int, default=12, help="timed steps")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration, in turn (median)")
    parser.add_argument("--configs", default=None, help="default: ddp,pipe_k1,pipe_k<N>,single")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--img-size", type=int, default=64)
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    add_keep_freed_memory_option(parser, "ddp and single")
    parser.add_argument("--out", default="results/pipeline_static.json")
    add_worker_options(parser)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    argv = [a for a in sys.argv[1:]]
    pipe = f"pipe_k{args.pipeline_length}"
    configs = args.configs.split(",") if args.configs else ["ddp", "pipe_k1", pipe, "single"]
    runs: dict[str, list] = {}
    repeats: dict[str, list[float]] = {}
    for repeat, config in in_turn(configs, args.repeats):
        print(f"running {config} ({repeat + 1}/{args.repeats}) ...", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            runs[config] = launch(__file__, config, 0 if config == "single" else args.nprocs, argv, tmp)
        # the slowest rank sets the pace
        repeats.setdefault(config, []).append(min(r["samples_per_sec"] for r in runs[config]))

    def throughput(config: str) -> float:
        return statistics.median(repeats[config])

    m, k = args.microbatches, args.pipeline_length
    summary = {
        "command": " ".join([sys.executable, *sys.argv]),
        "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "result_dir")},
        "samples_per_sec": {c: throughput(c) for c in runs},
        "samples_per_sec_per_repeat": repeats,
        "memory_per_rank": {c: runs[c] for c in runs},
    }
    if "ddp" in runs and "pipe_k1" in runs:
        summary["pipe_k1_over_ddp"] = throughput("pipe_k1") / throughput("ddp")
        pairs = [p / d for p, d in zip(repeats["pipe_k1"], repeats["ddp"])]
        summary["pipe_k1_over_ddp_per_repeat"] = pairs
        summary["pipe_k1_over_ddp_verdict"] = ratio_verdict(pairs)
    if pipe in runs and "pipe_k1" in runs:
        bubble = throughput("pipe_k1") * m / (m + k - 1)
        summary["bubble_model_samples_per_s"] = bubble
        summary[f"{pipe}_over_bubble_model"] = throughput(pipe) / bubble
    if pipe in runs and "ddp" in runs:
        summary[f"{pipe}_over_ddp"] = throughput(pipe) / throughput("ddp")
    print(f"\n{'config':<10} {'samples/s':>10} {'param MB/rank':>14} {'peak RSS MB/rank':>17}")
    for config, ranks in runs.items():
        params = max(r["param_mb_held"] for r in ranks)
        rss = max(r["peak_rss_mb"] for r in ranks)
        print(f"{config:<10} {throughput(config):>10.1f} {params:>14.2f} {rss:>17.0f}")
    print("\nper step, ms (the last repeat, each rank): training_step / backward / optimizer and loop")
    for config, ranks in runs.items():
        phases = "  ".join("{training_step:.1f} / {backward:.1f} / {rest:.1f}".format(**r["phase_ms"]) for r in ranks)
        print(f"{config:<10} {phases}")
    if "pipe_k1_over_ddp" in summary:
        per_repeat = " ".join(unfavourable(r, 3) for r in summary["pipe_k1_over_ddp_per_repeat"])
        ratio = unfavourable(summary["pipe_k1_over_ddp"], 3)
        print(f"\npipe_k1 / ddp, ratio of the median throughputs: {ratio} (target >= 1.0; run by run: {per_repeat})")
        print(f"  {summary['pipe_k1_over_ddp_verdict']}")
    if f"{pipe}_over_bubble_model" in summary:
        ratio, bubble = summary[f"{pipe}_over_bubble_model"], summary["bubble_model_samples_per_s"]
        print(
            f"{pipe} / bubble model pipe_k1*M/(M+K-1): {unfavourable(ratio, 3)} "
            f"({throughput(pipe):.1f} vs {bubble:.1f} samples/s)"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
