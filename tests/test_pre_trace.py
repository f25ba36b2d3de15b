"""The first step's trace: weights registered after the blocks but read only before them are ``pre``."""

from __future__ import annotations

import json

import pytest
import tiny_models as tm
import torch
from distributed import run_workers
from elastic_cases import reference_run
from torch.utils.data import default_collate

from lightning_pipetx import FreezeCallback, find_blocks
from lightning_pipetx.pre_trace import PreTrace

# The tests call training_step outside a Trainer.
pytestmark = pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")

BIAS = "model.mpnet.encoder.relative_attention_bias.weight"


def _batch(task: str, size: int = 4):
    dataset = tm.TASKS[task].dataset(size=size, seed=1)
    return default_collate([dataset[i] for i in range(size)])


def _traced(module, steps, microbatches: int = 1) -> list[str]:
    """Trace ``steps`` training steps of ``microbatches`` forwards each, with an AdamW update."""
    trace = PreTrace(find_blocks(module))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.1)
    trace.start()
    for batch in steps:
        losses = [module.training_step(batch, 0) for _ in range(microbatches)]
        for loss in losses:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    trace.stop()
    return trace.pre_names()


def test_mpnets_relative_position_bias_is_read_only_before_the_blocks():
    module = tm.TinyMPNetClassifier(seed=0, dropout=0.0)
    split = find_blocks(module)
    assert BIAS not in {n for n, p in module.named_parameters() if any(p is q for q in split.pre_parameters())}
    # The optimizer's in-place update of every weight, after the blocks, is not a read.
    assert _traced(module, [_batch("mpnet")]) == [BIAS]


def test_several_forwards_in_one_step_place_each_read_in_its_own_forward():
    # A pipeline's micro-batches: the head of one forward runs before the embeddings of the next.
    module = tm.TinyMPNetClassifier(seed=0, dropout=0.0)
    assert _traced(module, [_batch("mpnet")], microbatches=3) == [BIAS]


class BiasPenalty(tm.TinyMPNetClassifier):
    def training_step(self, batch, batch_idx):
        bias = self.model.mpnet.encoder.relative_attention_bias.weight
        return super().training_step(batch, batch_idx) + 1e-3 * bias.square().sum()


def test_a_weight_also_read_after_the_blocks_is_not_moved():
    assert _traced(BiasPenalty(seed=0, dropout=0.0), [_batch("mpnet")]) == []


def test_models_without_such_a_weight_move_nothing():
    # GPT-2's input embedding is pre already (and tied to its head); BERT's head reads its own weights.
    for task in ("gpt2", "bert", "timm_vit"):
        module = tm.TASKS[task].module(seed=0, dropout=0.0)
        assert _traced(module, [_batch(task)]) == [], task


def test_the_moved_weight_freezes_with_the_prefix_and_survives_a_checkpoint():
    module = tm.TinyMPNetClassifier(seed=0, dropout=0.0)
    split = find_blocks(module).with_pre_weights([BIAS])
    bias = module.get_parameter(BIAS)
    assert any(p is bias for p in split.prefix_parameters(1))
    assert not any(p is bias for p in split.prefix_parameters(0))

    freeze = FreezeCallback()
    freeze.load_state_dict({"frozen_blocks": 0, "decisions": 0, "pre_weights": [BIAS]})
    assert freeze.state_dict()["pre_weights"] == [BIAS]
    restored = FreezeCallback()
    restored.load_state_dict(freeze.state_dict())
    restored.setup(_TrainerStub(), module, "fit")
    assert any(p is bias for p in restored.split.prefix_parameters(2))


class _TrainerStub:
    strategy = None


def test_a_pipeline_agrees_over_its_ranks_and_trains_as_one_process(tmp_path):
    # 2 processes, 2 stages: the last stage sees the reads after the blocks, the first does not.
    run_workers("elastic_worker.py", 2, str(tmp_path), "mpnet")
    report = json.loads((tmp_path / "report.json").read_text())
    assert [e[0] for e in report["epochs"]] == [0, 2, 3]
    assert report["metrics"]["pipetx/cache_ram_bytes"] > 0  # the frozen prefix was cached
    result = torch.load(tmp_path / "final.pt", weights_only=True)["state"]
    reference = reference_run("mpnet")
    assert reference["pre_weights"] == [BIAS]
    for key, expected in reference["state"].items():
        torch.testing.assert_close(result[key], expected, atol=1e-5, rtol=1e-4, msg=key)


@pytest.mark.parametrize(
    ("norm_rel_ebd", "moved"),
    [
        # DeBERTa-v3 normalises its relative embeddings once, before the blocks
        (
            "layer_norm",
            [
                "deberta.encoder.rel_embeddings.weight",
                "deberta.encoder.LayerNorm.weight",
                "deberta.encoder.LayerNorm.bias",
            ],
        ),
        ("none", []),  # every attention layer slices the weight itself: it is read inside the blocks
    ],
)
def test_debertas_relative_embeddings(norm_rel_ebd, moved):
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    config = DebertaV2Config(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=64,
        relative_attention=True,
        position_buckets=16,
        norm_rel_ebd=norm_rel_ebd,
        pos_att_type=["p2c", "c2p"],
    )
    torch.manual_seed(0)
    model = DebertaV2ForSequenceClassification(config)
    trace = PreTrace(find_blocks(model))
    trace.start()
    model(input_ids=torch.randint(0, 100, (2, 10)), labels=torch.tensor([0, 1])).loss.backward()
    trace.stop()
    assert trace.pre_names() == moved


def test_a_callback_reused_on_another_model_traces_it_again():
    freeze = FreezeCallback()
    freeze.load_state_dict({"frozen_blocks": 0, "decisions": 0, "pre_weights": [BIAS]})
    freeze.setup(_TrainerStub(), tm.TinyBertClassifier(seed=0, dropout=0.0), "fit")
    assert freeze.pre_weights is None
