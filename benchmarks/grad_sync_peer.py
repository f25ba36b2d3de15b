"""Gradient sync against torch's DDP reducer, step by step in the same processes.

The 1xN layout's ratio to Lightning's DDP (``pipeline_static.py --configs ddp,pipe_k1``) moves
by 5-15% from one round to the next on a shared 2-core machine, more than the two can differ.
This benchmark times the part that differs, paired: the ViT of ``pipeline_static.py`` twice
in the same ``--nprocs`` processes, from the same weights, on the same batches, one copy's
gradients reduced by :class:`~lightning_pipetx.strategy.grad_sync.GradientSync` (buckets
filled by post-accumulate-grad hooks during the backward, as ``ElasticPipelineStrategy`` does
in a 1xN layout), the other's by torch's ``DistributedDataParallel`` (Lightning's DDP
defaults), each with its own AdamW. The two take turns step by step (ABBA), so the machine's
drift falls on both alike. Prints the median of the paired ratios DDP step / our step (above
1: ours faster) with a distribution-free interval, the median step of each, and whether the
two copies' weights are still equal to the bit (the same sums in the same order: they
should be). Writes JSON.
Usage: python benchmarks/grad_sync_peer.py [--nprocs 2] [--pairs 100] [--bucket-cap-mb 25] [--out results/grad_sync_peer.json]
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

from _launch import add_worker_options, launch, median_interval, ratio_verdict, unfavourable, write_json


def worker(args: argparse.Namespace) -> None:
    import pipeline_static
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lightning_pipetx.blocks import find_blocks
    from lightning_pipetx.strategy.grad_sync import GradientSync
    from lightning_pipetx.strategy.host_memory import keep_freed_memory
    from lightning_pipetx.strategy.topology import Layout, Topology

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    keep_freed_memory()  # process-wide: both copies train under ElasticPipelineStrategy's CPU setting
    ours, theirs = pipeline_static.build_module(args).model, pipeline_static.build_module(args).model
    ddp = DistributedDataParallel(theirs, bucket_cap_mb=args.bucket_cap_mb)
    ours_opt, ddp_opt = torch.optim.AdamW(ours.parameters(), lr=1e-4), torch.optim.AdamW(theirs.parameters(), lr=1e-4)
    split = find_blocks(ours)  # a 1xN layout: one stage runs every block
    topology = Topology(Layout(1, world), rank)
    sync = GradientSync.for_stage(
        ours, split, range(split.num_blocks), topology, int(args.bucket_cap_mb * 2**20), lambda: [ours_opt]
    )
    generator = torch.Generator().manual_seed(rank)
    per_rank = args.batch // world
    batches = [
        (
            torch.randn(per_rank, 3, args.img_size, args.img_size, generator=generator),
            torch.randint(0, 10, (per_rank,), generator=generator),
        )
        for _ in range(8)
    ]

    def ours_step(images: torch.Tensor, labels: torch.Tensor) -> None:
        sync.begin_step(sync=True)  # in Lightning's order: the strategy's training_step runs the backward,
        sync.arm()
        torch.nn.functional.cross_entropy(ours(images), labels).backward()
        sync.end_step()
        ours_opt.zero_grad(set_to_none=True)  # then Lightning's zero_grad, then the strategy's backward
        sync.install()
        ours_opt.step()

    def ddp_step(images: torch.Tensor, labels: torch.Tensor) -> None:
        ddp_opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(ddp(images), labels).backward()
        ddp_opt.step()

    def timed(step, batch) -> float:
        dist.barrier()
        start = time.perf_counter()
        step(*batch)
        return time.perf_counter() - start

    for i in range(args.warmup):  # our first step finds who produces each gradient
        ours_step(*batches[i % 8])
        ddp_step(*batches[i % 8])
    times = torch.zeros(args.pairs, 2, dtype=torch.float64)
    for i in range(args.pairs):
        batch = batches[(args.warmup + i) % 8]
        if i % 2 == 0:
            times[i, 0] = timed(ours_step, batch)
            times[i, 1] = timed(ddp_step, batch)
        else:
            times[i, 1] = timed(ddp_step, batch)
            times[i, 0] = timed(ours_step, batch)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    equal = torch.tensor(float(all(torch.equal(p, q) for p, q in zip(ours.parameters(), theirs.parameters()))))
    dist.all_reduce(equal, op=dist.ReduceOp.MIN)
    if rank == 0:
        result = {"ours_s": times[:, 0].tolist(), "ddp_s": times[:, 1].tolist(), "weights_equal": bool(equal)}
        Path(args.result_dir, "peer_rank0.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=100, help="timed steps of each, taken in turn")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="both reducers' bucket size")
    parser.add_argument("--batch", type=int, default=32, help="global batch")
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--img-size", type=int, default=64)
    parser.add_argument("--out", default="results/grad_sync_peer.json")
    add_worker_options(parser)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    with tempfile.TemporaryDirectory() as tmp:
        (run,) = launch(__file__, "peer", args.nprocs, sys.argv[1:], tmp)
    ratios = [d / o for o, d in zip(run["ours_s"], run["ddp_s"])]
    ours_ms, ddp_ms = (1000 * statistics.median(run[key]) for key in ("ours_s", "ddp_s"))
    interval = median_interval(ratios)
    summary = {
        "command": " ".join([sys.executable, *sys.argv]),
        "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "result_dir")},
        "median_step_ms": {"ours": ours_ms, "ddp": ddp_ms},
        "ddp_over_ours_median": statistics.median(ratios),
        "ddp_over_ours_interval": interval,
        "ddp_over_ours_verdict": ratio_verdict(ratios),
        "ddp_over_ours_per_pair": ratios,
        "weights_equal": run["weights_equal"],
    }
    print(f"median step: ours {ours_ms:.1f} ms, DDP {ddp_ms:.1f} ms ({args.pairs} pairs, {args.nprocs} processes)")
    print(f"DDP step / our step, median of pairs: {unfavourable(summary['ddp_over_ours_median'], 3)} (ideal: >= 1.0)")
    print(f"  {summary['ddp_over_ours_verdict']}")
    print(f"weights equal to the bit after {args.warmup + args.pairs} steps: {run['weights_equal']}")
    write_json(args.out, summary)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
