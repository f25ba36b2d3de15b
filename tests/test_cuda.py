"""The CUDA path on one GPU (skipped on machines without one, such as CI's)."""

import warnings

import lightning.pytorch as pl
import pytest
import tiny_models as tm
import torch

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu_trainer(callbacks, max_epochs=3, **kwargs) -> pl.Trainer:
    return tm.make_trainer(callbacks, max_epochs=max_epochs, accelerator="gpu", **kwargs)


@pytest.mark.parametrize("strategy", ["auto", "elastic"])
def test_freezing_trains_on_one_gpu(strategy, tmp_path):
    module = tm.TinyBertClassifier(seed=0, dropout=0.0)
    freeze = FreezeCallback(alpha=1 / 2, signal="schedule")
    trainer = gpu_trainer(
        [freeze],
        strategy=ElasticPipelineStrategy(cache_dir=str(tmp_path)) if strategy == "elastic" else "auto",
        precision="bf16-mixed",
        num_sanity_val_steps=2,
    )
    frozen_before = {n: p.detach().clone() for n, p in module.model.bert.embeddings.named_parameters()}
    trainer.fit(module, tm.task_loader("bert", size=32, batch_size=8, shuffle=True))
    assert freeze.frozen_blocks == 3
    # Lightning's teardown moves the module back to the CPU: check what training left, not where.
    assert all(torch.isfinite(p).all() for p in module.parameters())
    for name, param in module.model.bert.embeddings.named_parameters():
        assert not param.requires_grad, name  # frozen after epoch 0 ...
        assert not torch.equal(param.detach(), frozen_before[name]), name  # ... trained during it


def test_autocache_guards_raise_no_false_alarm_under_bf16_with_dropout(tmp_path):
    # Both guards fingerprint on the device in bf16: a batch that repeats must read as unchanged.
    module = tm.TinyBertClassifier(seed=0, dropout=0.1)
    rates = tm.HitRates()
    freeze = FreezeCallback(alpha=1 / 2, signal="schedule")
    trainer = gpu_trainer(
        [freeze, rates],
        max_epochs=5,
        strategy=ElasticPipelineStrategy(cache=True, profile_steps=0, cache_dir=str(tmp_path)),
        precision="bf16-mixed",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, tm.task_loader("bert", size=32, batch_size=8, shuffle=True))
    ours = [str(w.message) for w in caught if "lightning_pipetx" in w.filename]
    assert not ours, ours
    assert rates.rates[-1] == 1.0, rates.rates
