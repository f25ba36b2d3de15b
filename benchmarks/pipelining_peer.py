"""Our static pipeline against torch.distributed.pipelining on the same model and processes.

The timm ViT of ``benchmarks/pipeline_static.py`` (same width, depth, image size, global batch,
micro-batches, AdamW), split into ``--nprocs`` stages, fixed shapes, on gloo (CPU):

* ``ours_gpipe`` / ``ours_1f1b``: ``ElasticPipelineStrategy(pipeline_length=N, schedule=...)``
  under Lightning, the LightningModule unchanged;
* ``torch_gpipe`` / ``torch_1f1b``: ``torch.distributed.pipelining``'s ``PipelineStage`` with
  ``ScheduleGPipe`` / ``Schedule1F1B``, the model split by hand at ours' first block boundaries (checked), in a
  plain training loop (no Lightning);
* ``fused_gpipe`` / ``fused_1f1b`` (not run by default): ours with ``split_backward=False``.

Prints samples/s of each (timed steps after warm-up, the slowest rank's) and the ratios
ours / torch per schedule; writes JSON. On a shared 2-core machine one run of each varies by
10%: ``--repeats R`` runs the configurations R times in turn and compares medians, with the
ratio of every round beside it and whether the rounds resolve the median ratio from 1 (a
distribution-free interval); every other round runs the configurations in reverse order.
On CPU ours keeps host memory freed by a step for the next (``reuse_host_memory``);
``--baselines-keep-freed-memory`` gives torch's loop the same setting.
Usage: python benchmarks/pipelining_peer.py [--nprocs 2] [--steps 12] [--repeats 1] [--baselines-keep-freed-memory]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pipeline_static
from _launch import add_worker_options, in_turn, launch, ratio_verdict, unfavourable

CONFIGS = ("ours_gpipe", "torch_gpipe", "ours_1f1b", "torch_1f1b")


def torch_worker(args: argparse.Namespace, schedule_name: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from lightning_pipetx import find_blocks
    from lightning_pipetx.strategy.autopipe import block_costs
    from lightning_pipetx.strategy.partition import partition

    pipeline_static.keep_freed_memory_if_asked(args)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    vit = pipeline_static.build_module(args).model
    bounds = partition(block_costs(find_blocks(vit)), world)  # ours' first split, by the same cost model
    blocks = vit.blocks[bounds[rank][0] : bounds[rank][1]]

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vit, self.blocks = vit, blocks

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if rank == 0:
                x = self.vit.norm_pre(self.vit.patch_drop(self.vit._pos_embed(self.vit.patch_embed(x))))
            x = self.blocks(x)
            if rank == world - 1:
                x = self.vit.forward_head(self.vit.norm(x))
            return x

    stage_module = Stage()
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    schedule = schedule_class(stage, args.microbatches, loss_fn=nn.functional.cross_entropy)
    params = [p for p in stage_module.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch, 3, args.img_size, args.img_size, generator=g)
    labels = torch.randint(0, 10, (args.batch,), generator=g)
    start = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
            start = time.perf_counter()
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(images)
        elif rank == world - 1:
            schedule.step(target=labels, losses=[])
        else:
            schedule.step()
        optimizer.step()
    seconds = time.perf_counter() - start
    result = {"rank": rank, "samples_per_sec": args.batch * args.steps / seconds, "stage_bounds": bounds}
    Path(args.result_dir, f"torch_{schedule_name}_rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="global batch")
    parser.add_argument("--steps", type=int, default=12, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--img-size", type=int, default=64)
    parser.add_argument("--accelerator", default="cpu", choices=["cpu"])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration, in turn (median)")
    pipeline_static.add_keep_freed_memory_option(parser, "torch.distributed.pipelining")
    parser.add_argument("--out", default="results/pipelining_peer.json")
    add_worker_options(parser)
    args = parser.parse_args()
    if args.worker:
        system, schedule = args.worker.split("_")
        if system == "torch":
            torch_worker(args, schedule)
        else:
            args.split_backward = system == "ours"  # "fused": one fused backward per micro-batch
            args.schedule, args.worker = schedule, f"pipe_k{int(os.environ['WORLD_SIZE'])}"
            pipeline_static.worker(args)
            rank = os.environ["RANK"]
            Path(args.result_dir, f"{args.worker}_rank{rank}.json").rename(
                Path(args.result_dir, f"{system}_{schedule}_rank{rank}.json")
            )
        return

    rounds: dict[str, list[float]] = {}
    splits: dict[str, list] = {}  # each configuration's stages, (first block, end) each
    configs = args.configs.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        for repeat, config in in_turn(configs, args.repeats):
            print(f"running {config} on {args.nprocs} processes ({repeat + 1}/{args.repeats}) ...", flush=True)
            results = launch(__file__, config, args.nprocs, sys.argv[1:], tmp)
            rounds.setdefault(config, []).append(min(r["samples_per_sec"] for r in results))
            splits.setdefault(config, results[0]["stage_bounds"])
    runs = {config: statistics.median(rates) for config, rates in rounds.items()}
    pairs = [s for s in ("gpipe", "1f1b") if f"ours_{s}" in runs and f"torch_{s}" in runs]
    ratios = {s: runs[f"ours_{s}"] / runs[f"torch_{s}"] for s in pairs}
    per_round = {s: [o / t for o, t in zip(rounds[f"ours_{s}"], rounds[f"torch_{s}"])] for s in pairs}
    verdicts = {s: ratio_verdict(r) for s, r in per_round.items()}
    for s in pairs:
        if [list(b) for b in splits[f"ours_{s}"]] != [list(b) for b in splits[f"torch_{s}"]]:
            print(f"warning: {s}: the two split the blocks differently: {splits}")
    print(f"\n{'config':<12} {'samples/s':>10}  (median of {args.repeats}; each round)")
    for config, rate in runs.items():
        print(f"{config:<12} {rate:>10.1f}  " + " ".join(f"{r:.1f}" for r in rounds[config]))
    for schedule, ratio in ratios.items():
        each = " ".join(unfavourable(r, 3) for r in per_round[schedule])
        print(
            f"ours / torch.distributed.pipelining, {schedule}, ratio of the median throughputs: "
            f"{unfavourable(ratio, 3)} (target >= 1.0); each round: {each}"
        )
        print(f"  {verdicts[schedule]}")
    summary = {"command": " ".join([sys.executable, *sys.argv]), "settings": vars(args), "samples_per_sec": runs}
    summary["samples_per_sec_per_round"] = rounds
    summary["ours_over_torch"] = ratios
    summary["ours_over_torch_per_round"] = per_round
    summary["ours_over_torch_verdict"] = verdicts
    summary["stage_bounds"] = splits
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2, default=str))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
