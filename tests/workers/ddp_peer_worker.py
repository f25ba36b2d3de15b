"""Train a tiny ViT twice side by side: gradients reduced by GradientSync, and by torch's DDP.

Usage: torchrun --nproc_per_node=N ddp_peer_worker.py OUT_DIR BUCKET_BYTES ACCUMULATE
Lightning's order of a step, with no Lightning around it: the loss divided by the window's
length, ``.grad`` zeroed at the first batch of each accumulation window only (for GradientSync
between the schedule and ``install``, as Lightning zeroes between ``training_step`` and
``backward``), the reduction on the window's last batch; DDP skips it with ``no_sync``,
GradientSync with ``begin_step(sync=False)``. Writes
OUT_DIR/rank<R>.json: whether every weight is equal to the bit, and how many buckets started
their all-reduce during a backward.
"""

import contextlib
import json
import sys
from pathlib import Path

import timm
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from worker_exit import run_worker

from lightning_pipetx.blocks import find_blocks
from lightning_pipetx.strategy.grad_sync import GradientSync
from lightning_pipetx.strategy.topology import Layout, Topology


def tiny_vit() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=16,
        patch_size=4,
        embed_dim=32,
        depth=3,
        num_heads=2,
        num_classes=5,
    )


def main() -> None:
    out, bucket_bytes, accumulate = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ours, theirs = tiny_vit(), tiny_vit()
    ddp = DistributedDataParallel(theirs, bucket_cap_mb=bucket_bytes / 2**20)
    ours_opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    ddp_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    split = find_blocks(ours)  # a 1xN layout: one stage runs every block
    topology = Topology(Layout(1, world), rank)
    sync = GradientSync.for_stage(ours, split, range(split.num_blocks), topology, bucket_bytes, lambda: [ours_opt])
    generator = torch.Generator().manual_seed(rank)
    for batch in range(4 * accumulate):
        images, labels = torch.randn(3, 3, 16, 16, generator=generator), torch.randint(0, 5, (3,), generator=generator)
        first, reduce = batch % accumulate == 0, (batch + 1) % accumulate == 0
        sync.begin_step(sync=reduce)  # the engine's training_step: the schedule's backwards
        sync.arm()
        (torch.nn.functional.cross_entropy(ours(images), labels) / accumulate).backward()
        sync.end_step()
        if first:  # Lightning's zero_grad, between training_step and backward
            ours_opt.zero_grad(set_to_none=True)
        sync.install()  # the strategy's backward
        if first:
            ddp_opt.zero_grad(set_to_none=True)
        with contextlib.nullcontext() if reduce else ddp.no_sync():
            (torch.nn.functional.cross_entropy(ddp(images), labels) / accumulate).backward()
        if reduce:
            ours_opt.step()
            ddp_opt.step()
    unequal = [name for (name, p), q in zip(ours.named_parameters(), theirs.parameters()) if not torch.equal(p, q)]
    result = {"unequal": unequal, "buckets": len(sync.buckets), "launched": sync.launched_during_backward}
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    run_worker(main)
