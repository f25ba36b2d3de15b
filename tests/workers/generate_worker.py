"""``generate()`` in ``validation_step`` of a tiny GPT-2 under a 2-stage pipeline (2x1).

Usage: torchrun --nproc_per_node=2 generate_worker.py OUT_DIR MODE, MODE one of cached, uncached,
epoch_end.
``cached``: generate's default ``use_cache=True``, whose cache each stage fills for its own blocks
only (refused); ``uncached``: ``use_cache=False``; ``epoch_end``: a sample generated in
``on_validation_epoch_end``, outside a pipelined step (refused on every stage). Every rank writes OUT_DIR/rank<N>.pt: the ids
generated for each prompt. :func:`generated` is also the one-process reference.
"""

import os
import sys

import lightning.pytorch as pl
import torch
from tiny_models import make_trainer, tiny_gpt2
from torch.utils.data import DataLoader
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy

NEW_TOKENS = 4


class Generating(pl.LightningModule):
    def __init__(self, use_cache: bool | None) -> None:
        super().__init__()
        self.model = tiny_gpt2(seed=0, dropout=0.0)
        self.options = {} if use_cache is None else {"use_cache": use_cache}
        self.generated: list[torch.Tensor] = []

    def validation_step(self, batch, batch_idx):
        ids = self.model.generate(
            input_ids=batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            **self.options,
        )
        self.generated.append(ids[:, batch.shape[1] :])


class GeneratingAtEpochEnd(Generating):
    def on_validation_epoch_end(self):
        self.model.generate(input_ids=torch.ones(1, 3, dtype=torch.long), max_new_tokens=2, pad_token_id=0)


def prompts() -> DataLoader:
    return DataLoader(torch.randint(2, 100, (8, 6), generator=torch.Generator().manual_seed(0)), batch_size=4)


def generated(devices: int, use_cache: bool | None, at_epoch_end: bool = False) -> torch.Tensor:
    """The new ids for every prompt, in order."""
    module = (GeneratingAtEpochEnd if at_epoch_end else Generating)(use_cache)
    strategy = ElasticPipelineStrategy(pipeline_length=2) if devices == 2 else "auto"
    trainer = make_trainer([], devices=devices, strategy=strategy)
    trainer.validate(module, prompts(), verbose=False)
    return torch.cat(module.generated)


def main() -> None:
    mode = sys.argv[2]
    ids = generated(devices=2, use_cache=None if mode == "cached" else False, at_epoch_end=mode == "epoch_end")
    torch.save(ids, os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.pt"))


if __name__ == "__main__":
    run_worker(main)
