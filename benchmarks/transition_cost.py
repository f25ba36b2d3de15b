"""What one elastic transition costs: a BERT-base-sized model with AdamW state, 2x1 -> 1x2.

A BERT of BERT-base's size (12 blocks, hidden 768, randomly initialised: the cost does not
depend on the values) trains two steps as a 2-stage pipeline on ``--nprocs`` processes with
AdamW, then ``FreezeCallback(signal="schedule", alpha=1/2)`` freezes 6 blocks and AutoPipe /
AutoDP move to the layout it picks. Prints, per rank, the transition's seconds and the bytes
it received (weights, AdamW moments, buffers), and the transition against an epoch of the real
fine-tune (``--epoch-seconds``, or read from ``benchmarks/finetune.py``'s JSON); writes JSON.
Usage: python benchmarks/transition_cost.py [--nprocs 2] [--epoch-seconds S | --finetune-json results/finetune.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from _launch import add_worker_options, launch, unfavourable


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import BertConfig, BertForSequenceClassification

    from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = BertConfig(
                hidden_size=args.hidden, num_hidden_layers=args.blocks, num_attention_heads=args.hidden // 64,
                intermediate_size=4 * args.hidden, num_labels=2,
            )  # fmt: skip
            self.model = BertForSequenceClassification(config)

        def training_step(self, batch, batch_idx):
            ids, labels = batch
            return self.model(input_ids=ids, labels=labels).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-5)

    pl.seed_everything(0)
    world = int(os.environ["WORLD_SIZE"])
    samples = args.batch * args.steps
    data = TensorDataset(torch.randint(0, 30000, (samples, args.seq_len)), torch.randint(0, 2, (samples,)))
    strategy = ElasticPipelineStrategy(pipeline_length=world, cache=False, profile_steps=0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_epochs=2,
        callbacks=[FreezeCallback(alpha=0.5, signal="schedule")],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Classifier(), DataLoader(data, batch_size=args.batch))
    done = strategy.last_transition
    params = sum(p.numel() for p in trainer.lightning_module.parameters())
    result = {
        "rank": trainer.global_rank,
        "parameters": params,
        "transition": None
        if done is None
        else {
            "from": str(done.old_layout),
            "to": str(done.new_layout),
            "seconds": done.seconds,
            "blocks_received": done.blocks_received,
            "bytes_received": done.bytes_received,
        },
    }
    Path(args.result_dir, f"transition_rank{trainer.global_rank}.json").write_text(json.dumps(result))


def finetune_epoch_seconds(path: Path) -> float | None:
    """Mean epoch of the ``ddp`` runs in a benchmarks/finetune.py JSON (fit time / epochs)."""
    if not path.is_file():
        return None
    runs = json.loads(path.read_text())["runs"].get("ddp")
    if not runs:
        return None
    return statistics.mean(r["wall_seconds"] / len(r["epochs"]) for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="training steps per epoch")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--epoch-seconds", type=float, default=None, help="an epoch of the real fine-tune")
    parser.add_argument(
        "--finetune-json", default="results/finetune.json", help="benchmarks/finetune.py's JSON (its default --out)"
    )
    parser.add_argument("--out", default="results/transition_cost.json")
    add_worker_options(parser)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        ranks = launch(__file__, "transition", args.nprocs, sys.argv[1:], tmp)
    epoch = args.epoch_seconds or finetune_epoch_seconds(Path(args.finetune_json))
    print(f"model: {ranks[0]['parameters'] / 1e6:.1f}M parameters, AdamW, {args.nprocs} processes (gloo, CPU)")
    for rank in ranks:
        moved = rank["transition"]
        if moved is None:
            print(f"rank {rank['rank']}: no transition happened")
            continue
        print(
            f"rank {rank['rank']}: {moved['from']} -> {moved['to']}: {moved['seconds']:.2f} s, "
            f"{moved['blocks_received']} blocks, {moved['bytes_received'] / 2**20:.1f} MiB received"
        )
    measured = [r["transition"]["seconds"] for r in ranks if r["transition"] is not None]
    seconds = max(measured) if measured else None
    summary = {"command": " ".join([sys.executable, *sys.argv]), "settings": vars(args), "ranks": ranks}
    summary["transition_seconds"] = seconds
    if seconds is None:
        print("nothing measured: no rank moved (a model this small keeps its layout; give it more --blocks)")
    elif epoch:
        summary["finetune_epoch_seconds"] = epoch
        summary["fraction_of_epoch"] = seconds / epoch
        share = unfavourable(100 * seconds / epoch, 1, higher_is_better=False)
        print(f"transition {seconds:.2f} s = {share}% of a {epoch:.1f} s fine-tune epoch (target < 2%)")
    else:
        found = "has no ddp run" if Path(args.finetune_json).is_file() else "does not exist"
        print(
            f"no share of a fine-tune epoch: {args.finetune_json} {found} "
            "(run benchmarks/finetune.py first, or pass --epoch-seconds)"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2, default=str))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
