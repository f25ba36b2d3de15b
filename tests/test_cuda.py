"""The CUDA path on one GPU (skipped on machines without one, such as CI's)."""

import lightning.pytorch as pl
import pytest
import tiny_models as tm
import torch

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("strategy", ["auto", "elastic"])
def test_freezing_trains_on_one_gpu(strategy, tmp_path):
    module = tm.TinyBertClassifier(seed=0, dropout=0.0)
    freeze = FreezeCallback(alpha=1 / 2, signal="schedule")
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=ElasticPipelineStrategy(cache_dir=str(tmp_path)) if strategy == "elastic" else "auto",
        precision="bf16-mixed",
        max_epochs=3,
        callbacks=[freeze],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    frozen_before = {n: p.detach().clone() for n, p in module.model.bert.embeddings.named_parameters()}
    trainer.fit(module, tm.task_loader("bert", size=32, batch_size=8, shuffle=True))
    assert freeze.frozen_blocks == 3
    # Lightning's teardown moves the module back to the CPU: check what training left, not where.
    assert all(torch.isfinite(p).all() for p in module.parameters())
    for name, param in module.model.bert.embeddings.named_parameters():
        assert not param.requires_grad, name  # frozen after epoch 0 ...
        assert not torch.equal(param.detach(), frozen_before[name]), name  # ... trained during it
