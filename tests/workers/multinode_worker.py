"""A 2-stage pipeline across 2 simulated nodes that becomes 2 replicas, with AutoCache.

Usage (on each node): torchrun --nnodes=2 --node_rank=N ... multinode_worker.py OUT_DIR SAMPLER
Writes OUT_DIR/node<N>_rank<R>.json: ranks, the layout and cache statistics of every epoch,
and the run's cache folders holding states while training.
"""

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import tiny_models as tm
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback


class Recorder(Callback):
    def __init__(self, cache_root: Path):
        self.cache_root = cache_root
        self.epochs = []

    def on_train_epoch_start(self, trainer, pl_module):
        layout = trainer.strategy.layout
        self.epochs.append({"layout": [layout.pipeline_length, layout.replicas]})

    def on_train_epoch_end(self, trainer, pl_module):
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("pipetx/")}
        self.epochs[-1].update(
            {
                "hit_rate": metrics.get("pipetx/cache_hit_rate"),
                "metrics": metrics,
                "folders": self._cache_folders(trainer.strategy._run_token),
            }
        )

    def _cache_folders(self, run_token):
        """The run's cache folders of each node that hold states: in RAM (``/dev/shm``), or under ``cache_dir``."""
        roots = (self.cache_root, Path("/dev/shm"))
        return sorted({p.name for root in roots for p in root.glob(f"pipetx-{run_token}-node*") if any(p.iterdir())})


def main():
    out_dir, sampler = Path(sys.argv[1]), sys.argv[2]
    nodes, per_node = int(os.environ["GROUP_WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    recorder = Recorder(out_dir / "cache")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=per_node,
        num_nodes=nodes,
        strategy=ElasticPipelineStrategy(
            pipeline_length=2,
            num_microbatches=2,
            profile_steps=0,
            cache=True,
            cache_dir=str(out_dir / "cache"),
            sampler=sampler,
        ),
        max_epochs=4,
        callbacks=[
            FreezeCallback(alpha=1 / 2, signal="schedule", freeze_interval=2),
            recorder,
            ModelCheckpoint(dirpath=out_dir / "checkpoints", save_top_k=-1, every_n_epochs=1),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    module = tm.TinyBertClassifier(seed=0, dropout=0.0)
    trainer.fit(module, DataLoader(tm.RandomTokenDataset(size=64, seed=1), batch_size=8, shuffle=True))
    report = {
        "global_rank": trainer.global_rank,
        "node_rank": trainer.node_rank,
        "local_rank": trainer.local_rank,
        "world_size": trainer.world_size,
        "epochs": recorder.epochs,
    }
    (out_dir / f"node{trainer.node_rank}_rank{trainer.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    run_worker(main)
