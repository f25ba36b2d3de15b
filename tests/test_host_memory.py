"""Host memory freed by one training step is kept for the next (glibc's malloc), on CPU."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import lightning.pytorch as pl
import pytest
from tiny_models import build_task, task_loader

from lightning_pipetx import ElasticPipelineStrategy
from lightning_pipetx.strategy.host_memory import _glibc

pytestmark = pytest.mark.skipif(_glibc() is None, reason="glibc's malloc only (Linux with glibc)")

# A step-like pattern in a process that has imported Lightning, as a training process has:
# 80 MB of 100 KB tensors (below the mmap threshold: they come from the heap) written, then
# all freed. By default glibc hands the free memory at the top of its heap back to the system
# (it keeps at most 64 MB, however its thresholds adapt), so each round faults it in again.
FAULTS = textwrap.dedent(
    """
    import json, resource, sys
    import lightning.pytorch
    import torch
    from lightning_pipetx.strategy.host_memory import keep_freed_memory

    if json.loads(sys.argv[1]):
        assert keep_freed_memory()
    counts = []
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        tensors = [torch.ones(25_000) for _ in range(800)]
        del tensors
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps(counts[-1]))  # the first round grows the heap in either case
    """
)


def _faults_per_round(keep: bool) -> int:
    done = subprocess.run([sys.executable, "-c", FAULTS, json.dumps(keep)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kept_memory_is_not_faulted_in_again():
    given_back, kept = _faults_per_round(keep=False), _faults_per_round(keep=True)
    assert given_back > 10_000  # most of the 80 MB, as 4 KiB pages
    assert kept < given_back / 10


@pytest.mark.parametrize(("reuse", "kept"), [("auto", True), (False, False)])
def test_training_on_cpu_keeps_freed_memory_unless_told_not_to(reuse, kept, caplog):
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ElasticPipelineStrategy(reuse_host_memory=reuse),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with caplog.at_level(logging.INFO, logger="lightning_pipetx"):
        trainer.fit(build_task("sequential"), task_loader("sequential"))
    assert any("host memory freed by a training step is kept" in r.getMessage() for r in caplog.records) is kept
