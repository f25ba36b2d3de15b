"""benchmarks/freeze_diagnostics.py: the optimizer skips exactly what each diagnostic keeps from training."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from tiny_models import RandomTokenDataset, TinyBertClassifier, make_loader

from lightning_pipetx import find_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from freeze_diagnostics import gradient_drop  # noqa: E402


class Snapshots(pl.Callback):
    """The weights of ``pre`` and of each block at the start of every epoch, and at the end."""

    def __init__(self) -> None:
        self.taken: list[dict[str, list[torch.Tensor]]] = []

    def _take(self, module: pl.LightningModule) -> None:
        split = find_blocks(module)
        parts = {"pre": list(split.pre_parameters())}
        parts.update({f"block{i}": list(split.block_parameters(i)) for i in range(split.num_blocks)})
        self.taken.append({name: [p.detach().clone() for p in params] for name, params in parts.items()})

    def on_train_epoch_start(self, trainer, pl_module):
        self._take(pl_module)

    def on_fit_end(self, trainer, pl_module):
        self._take(pl_module)


def _changed_per_epoch(config: str, schedule: list[int]) -> list[set[str]]:
    """The parts whose weights changed in each of 3 epochs."""
    snapshots = Snapshots()
    trainer = pl.Trainer(
        max_epochs=3, accelerator="cpu", devices=1, callbacks=[gradient_drop(config, schedule), snapshots],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    loader = make_loader(RandomTokenDataset(size=16), batch_size=8)
    trainer.fit(TinyBertClassifier(), loader)
    taken = snapshots.taken
    return [
        {name for name in before if any(not torch.equal(a, b) for a, b in zip(before[name], after[name]))}
        for before, after in zip(taken, taken[1:])
    ]


def test_ddp_frozen_pre_trains_everything_but_the_embeddings_after_epoch_0():
    changed = _changed_per_epoch("ddp_frozen_pre", [0, 0, 0])
    blocks = {name for name in changed[0] if name.startswith("block")}
    assert "pre" in changed[0] and len(blocks) == 4
    assert changed[1] == changed[2] == blocks


def test_ddp_frozen_blocks_trains_everything_but_the_scheduled_blocks():
    changed = _changed_per_epoch("ddp_frozen_blocks", [0, 1, 2])
    every_block = {f"block{i}" for i in range(4)}
    assert changed[0] == {"pre"} | every_block
    assert changed[1] == {"pre"} | every_block - {"block0"}
    assert changed[2] == {"pre"} | every_block - {"block0", "block1"}


def test_a_schedule_shorter_than_the_run_is_refused():
    with pytest.raises(ValueError, match="names 2 epochs; the run has 3"):
        _changed_per_epoch("ddp_frozen_blocks", [0, 1])
