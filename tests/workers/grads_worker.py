"""Train the cases of grads_cases.py under ElasticPipelineStrategy; every rank writes what it saw.

Usage: torchrun --nproc_per_node=N grads_worker.py OUT_DIR CASE_JSON [CASE_JSON ...]
Writes OUT_DIR/<case>_rank<R>.pt: the recorded hooks, the gradient sync's findings and (global rank 0) the trained weights; for "overlap" cases, which blocks' buckets
had started their all-reduce when the word embedding's gradient arrived.
"""

import json
import os
import re
import sys

import lightning.pytorch as pl
import torch
from grads_cases import BackwardHooks, build_module, dataset, trainer_options
from torch.utils.data import DataLoader
from worker_exit import run_worker

from lightning_pipetx import ElasticPipelineStrategy


class LaunchProbe(pl.Callback):
    """When the word embedding's gradient is accumulated (near the end of a backward), note
    the blocks all of whose parameters sit in buckets whose all-reduce has started."""

    def __init__(self):
        self.seen: list[tuple[int, list[int]]] = []

    def on_train_start(self, trainer, pl_module):
        blocks = {}
        for name, param in pl_module.named_parameters():
            match = re.search(r"encoder\.layer\.(\d+)\.", name)
            if match:
                blocks[id(param)] = int(match.group(1))

        def probe(param):
            sync = trainer.strategy.engine.grad_sync
            started = {id(p) for b in sync.buckets if b.work is not None for p in b.params}
            done = sorted(
                {i for i in set(blocks.values()) if all(pid in started for pid, j in blocks.items() if j == i)}
            )
            self.seen.append((trainer.global_step, done))

        pl_module.model.bert.embeddings.word_embeddings.weight.register_post_accumulate_grad_hook(probe)


class Findings(pl.Callback):
    """What gradient sync found at the end of training: who produces each weight outside the
    block list, and how many buckets this rank reduces."""

    def __init__(self):
        self.found = {}

    def on_train_end(self, trainer, pl_module):
        sync = trainer.strategy.engine.grad_sync
        names = {id(p): n for n, p in pl_module.named_parameters()}
        self.found["producers"] = {names[k]: sorted(v) for k, v in sync.producers.items()}
        self.found["buckets"] = len(sync.buckets)
        self.found["late_buckets"] = len(sync.late_buckets)


def main() -> None:
    out_dir, cases = sys.argv[1], [json.loads(arg) for arg in sys.argv[2:]]
    world = int(os.environ["WORLD_SIZE"])
    for case in cases:
        replicas = world // case["pipeline_length"]
        module = build_module(case)
        hooks, probe, findings = BackwardHooks(), LaunchProbe(), Findings()
        strategy = ElasticPipelineStrategy(
            pipeline_length=case["pipeline_length"],
            num_microbatches=case["microbatches"],
            bucket_cap_mb=case["bucket_cap_mb"],
        )
        callbacks = [hooks, findings] + ([probe] if case["model"] == "bert" and case["pipeline_length"] == 1 else [])
        trainer = pl.Trainer(devices=world, strategy=strategy, callbacks=callbacks, **trainer_options(case))
        loader = DataLoader(dataset(), batch_size=case["global_batch"] // replicas, shuffle=True)
        trainer.fit(module, loader)
        result = {"losses": hooks.losses, "grads": hooks.grads, "launched": probe.seen, "grad_sync": findings.found}
        if trainer.is_global_zero:
            result["state"] = module.state_dict()
        torch.save(result, os.path.join(out_dir, f"{case['name']}_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    run_worker(main)
