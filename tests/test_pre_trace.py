"""The first step's trace: weights registered after the blocks but read only before them are ``pre``."""

from __future__ import annotations

import json
import warnings

import lightning.pytorch as pl
import pytest
import tiny_models as tm
import torch
from distributed import run_workers
from elastic_cases import reference_run
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import default_collate

from lightning_pipetx import ElasticPipelineStrategy, FreezeCallback, find_blocks
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
    """What FreezeCallback.setup reads of a Trainer: its strategy and callbacks."""

    strategy = SingleDeviceStrategy(torch.device("cpu"))
    callbacks = []


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


def _traced_post(module) -> list[str]:
    trace = PreTrace(find_blocks(module))
    trace.start()
    module.training_step(_batch("bert"), 0).backward()
    trace.stop()
    return trace.post_names()


XLMR_HEAD = [f"model.classifier.{name}.{kind}" for name in ("dense", "out_proj") for kind in ("weight", "bias")]


def test_a_head_registered_before_the_backbone_is_not_pre():
    # XLM-R assigns its classifier before self.roberta: by position it would freeze with the prefix.
    module = tm.TinyXLMRobertaClassifier(seed=0, dropout=0.0)
    assert _traced_post(module) == XLMR_HEAD
    freeze = FreezeCallback()
    freeze.load_state_dict({"frozen_blocks": 0, "decisions": 0, "pre_weights": [], "post_weights": XLMR_HEAD})
    freeze.setup(_TrainerStub(), module, "fit")
    frozen = {id(p) for p in freeze.split.prefix_parameters(2)}
    assert not any(id(p) in frozen for p in module.model.classifier.parameters())
    assert any(id(p) in frozen for p in module.model.roberta.embeddings.parameters())
    assert module.model.classifier not in freeze.split.prefix_modules(2)  # keeps its dropout in training


class HeadFirst(tm.TinyBertClassifier):
    """A LightningModule with its own head and loss temperature registered before the backbone,
    and a learned shift added to the embeddings before the blocks."""

    def __init__(self):
        pl.LightningModule.__init__(self)
        self.head = torch.nn.Linear(tm.HIDDEN, tm.NUM_LABELS)
        self.temperature = torch.nn.Parameter(torch.ones(()))
        self.shift = torch.nn.Parameter(torch.zeros(tm.HIDDEN))
        self.model = tm.tiny_bert(seed=0, dropout=0.0).bert

    def training_step(self, batch, batch_idx):
        hidden = self.model.embeddings(input_ids=batch["input_ids"]) + self.shift
        for layer in self.model.encoder.layer:
            out = layer(hidden)
            hidden = out[0] if isinstance(out, tuple) else out
        logits = self.head(hidden[:, 0]) / self.temperature
        return torch.nn.functional.cross_entropy(logits, batch["labels"])


def test_weights_of_the_lightning_module_feeding_no_block_are_not_pre():
    module = HeadFirst()
    assert {name for name, _ in find_blocks(module).pre_direct_params} == {"temperature", "shift"}
    assert _traced_post(module) == ["temperature", "head.weight", "head.bias"]


def test_xlm_roberta_freezes_its_encoder_and_trains_its_head_with_the_cache_serving():
    module = tm.TinyXLMRobertaClassifier(seed=0, dropout=0.1)
    freeze, rates = FreezeCallback(alpha=1 / 3, signal="schedule"), tm.HitRates()
    trainer = tm.make_trainer([freeze, rates], max_epochs=4, strategy=ElasticPipelineStrategy(cache="auto"))
    head_before = {n: p.detach().clone() for n, p in module.model.classifier.named_parameters()}
    trainer.fit(module, tm.task_loader("bert", size=16))  # token ids of the same vocabulary
    assert freeze.post_weights == XLMR_HEAD and freeze.frozen_blocks == 3
    assert all(p.requires_grad for p in module.model.classifier.parameters())
    assert not any(p.requires_grad for p in module.model.roberta.embeddings.parameters())
    assert all(not torch.equal(p, head_before[n]) for n, p in module.model.classifier.named_parameters())
    assert rates.rates[-1] == 1.0  # every sample served once the deepest prefix is cached


class PreWeightsSeenOrNot(pl.LightningModule):
    """A weight before the blocks that the traced step does not read (used from a later batch on),
    and one that the last block takes as it is, not through an op."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x, bias=None):
            return x + self.linear(x) + (0 if bias is None else bias)

    def __init__(self):
        super().__init__()
        self.later = torch.nn.Parameter(torch.zeros(4))
        self.bias = torch.nn.Parameter(torch.zeros(4))
        self.blocks = torch.nn.ModuleList([self.Block(), self.Block()])

    def training_step(self, batch, batch_idx):
        x = batch + (self.later if batch_idx > 0 else 0)
        x = self.blocks[0](x)
        return self.blocks[1](x, bias=self.bias).square().mean()


def test_a_weight_is_moved_out_of_pre_only_on_evidence():
    module = PreWeightsSeenOrNot()
    trace = PreTrace(find_blocks(module))
    trace.start()
    module.training_step(torch.randn(2, 4), 0).backward()
    trace.stop()
    assert trace.post_names() == []  # "later" was not read; "bias" feeds the last block as it is


class AdaptersBeforeTheModel(pl.LightningModule):
    """Low-rank adapters held in a list registered before the model, added inside each block's
    ``fc2`` (a hand-written LoRA); the blocks' own weights train too. ``boundary_after``: the step
    cuts the graph after that block, as a pipeline stage's received input does."""

    def __init__(self, boundary_after: int | None = None):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            self.adapters = torch.nn.ModuleList([torch.nn.Linear(32, 16, bias=False) for _ in range(tm.LAYERS)])
        self.model = tm.tiny_sequential(seed=0, dropout=0.0)
        self.boundary_after = boundary_after
        for block, adapter in zip(self.model.blocks, self.adapters):
            fc = block.fc2
            fc.forward = lambda x, fc=fc, adapter=adapter: (
                torch.nn.functional.linear(x, fc.weight, fc.bias) + adapter(x)
            )

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.boundary_after is None:
            return torch.nn.functional.mse_loss(self.model(x), y)
        h = self.model.embed(x)
        for index, block in enumerate(self.model.blocks):
            h = block(h)
            if index == self.boundary_after:
                h = h.detach().requires_grad_()
        return torch.nn.functional.mse_loss(self.model.head(self.model.norm(h)), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_a_weight_read_in_the_last_block_of_a_stage_feeds_the_next_stage():
    # The received input of a later stage carries no graph back to the weights the stage before read.
    module = AdaptersBeforeTheModel(boundary_after=1)
    trace = PreTrace(find_blocks(module))
    trace.start()
    module.training_step(_batch("sequential"), 0).backward()
    trace.stop()
    assert trace.post_names() == ["adapters.3.weight"]  # read in the last block only


def test_weights_that_train_on_inside_a_frozen_prefix_module_leave_its_cache_serving():
    def fit(cache):
        module, freeze, rates = AdaptersBeforeTheModel(), FreezeCallback(alpha=1 / 2, signal="schedule"), tm.HitRates()
        trainer = tm.make_trainer([freeze, rates], max_epochs=4, strategy=ElasticPipelineStrategy(cache=cache))
        trainer.fit(module, tm.task_loader("sequential", size=16, batch_size=4))
        return module.state_dict(), rates.rates, freeze.post_weights

    reference, _, post_weights = fit(False)
    assert post_weights == ["adapters.3.weight"]
    state, rates, _ = fit(True)
    assert rates[-1] == 1.0
    assert all(torch.equal(state[name], reference[name]) for name in reference)


class DropoutsAroundTheBlocks(pl.LightningModule):
    """Two dropouts registered before the block list: one applied to the blocks' input, one in the head."""

    def __init__(self):
        super().__init__()
        self.input_drop, self.head_drop = torch.nn.Dropout(0.1), torch.nn.Dropout(0.1)
        self.model = tm.tiny_sequential(seed=0, dropout=0.0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.model.blocks(self.input_drop(self.model.embed(x)))
        return torch.nn.functional.mse_loss(self.model.head(self.head_drop(h)), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class TrainingModes(pl.Callback):
    """The training mode of the named modules at each epoch's first training step."""

    def __init__(self, *names: str):
        self.names, self.modes = names, []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == 0:
            self.modes.append([module.get_submodule(name).training for name in self.names])


def test_a_dropout_registered_before_the_blocks_but_called_after_them_keeps_training():
    module, freeze = DropoutsAroundTheBlocks(), FreezeCallback(alpha=1 / 3, signal="schedule")
    modes = TrainingModes("input_drop", "head_drop", "model.blocks.0")
    tm.make_trainer([freeze, modes], max_epochs=3).fit(module, tm.task_loader("sequential", size=16, batch_size=4))
    assert [name for name, _ in freeze.split.pre] == ["input_drop", "head_drop", "model.embed"]
    assert modes.modes == [[True, True, True], [False, True, False], [False, True, False]]
    state = freeze.state_dict()
    assert state["post_modules"] == ["head_drop"]
    resumed = FreezeCallback()
    resumed._split = find_blocks(DropoutsAroundTheBlocks())
    resumed.load_state_dict(state)
    assert [name for name, _ in resumed.split.post_modules] == ["head_drop"]


class DropoutsAfterTheBlocks(pl.LightningModule):
    """A model that registers two dropouts after its block list: one applied to the blocks' input
    (as Phi's embedding dropout), one in the head."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(8, 16)
            self.blocks = torch.nn.Sequential(*[tm.ResidualMLPBlock(16, dropout=0.0) for _ in range(4)])
            self.head = torch.nn.Linear(16, 2)
            self.input_drop, self.head_drop = torch.nn.Dropout(0.1), torch.nn.Dropout(0.1)

        def forward(self, x):
            return self.head(self.head_drop(self.blocks(self.input_drop(self.embed(x)))))

    def __init__(self):
        super().__init__()
        self.model = tm._seeded(0, self.Net)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.model(x), y)

    configure_optimizers = DropoutsAroundTheBlocks.configure_optimizers


def test_a_dropout_registered_after_the_blocks_but_called_before_them_freezes_with_the_prefix():
    module, freeze = DropoutsAfterTheBlocks(), FreezeCallback(alpha=1 / 3, signal="schedule")
    modes = TrainingModes("model.input_drop", "model.head_drop", "model.blocks.0")
    tm.make_trainer([freeze, modes], max_epochs=3).fit(module, tm.task_loader("sequential", size=16, batch_size=4))
    assert [name for name, _ in freeze.split.post] == ["model.head", "model.input_drop", "model.head_drop"]
    assert modes.modes == [[True, True, True], [False, True, False], [False, True, False]]
    state = freeze.state_dict()
    assert state["pre_modules"] == ["model.input_drop"] and state["post_modules"] == []
    resumed = FreezeCallback()
    resumed._split = find_blocks(DropoutsAfterTheBlocks())
    resumed.load_state_dict(state)
    assert [name for name, _ in resumed.split.pre_modules] == ["model.input_drop"]


def tiny_funnel(seed: int = 0, dropout: float = 0.1, num_labels: int = tm.NUM_LABELS):
    """A tiny HF Funnel Transformer: its block list ``funnel.encoder.blocks`` holds lists of layers."""
    from transformers import FunnelConfig, FunnelForSequenceClassification

    config = FunnelConfig(
        vocab_size=tm.VOCAB,
        d_model=tm.HIDDEN,
        block_sizes=[1, 1, 1, 1],
        n_head=tm.HEADS,
        d_head=tm.HIDDEN // tm.HEADS,
        d_inner=tm.INTERMEDIATE,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        num_labels=num_labels,
    )
    return tm._seeded(seed, lambda: FunnelForSequenceClassification(config))


class TinyFunnelClassifier(tm.TinyBertClassifier):
    factory = staticmethod(tiny_funnel)


def test_blocks_the_model_never_calls_themselves_leave_the_prefix_as_registered():
    module, freeze = TinyFunnelClassifier(), FreezeCallback(alpha=1 / 2, signal="schedule")
    head = module.model.classifier
    trainer = tm.make_trainer([freeze], max_epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, tm.task_loader("bert", size=16, batch_size=4))
    head_before = {name: p.detach().clone() for name, p in head.named_parameters()}
    trainer = tm.make_trainer([freeze], max_epochs=2)
    trainer.fit(module, tm.task_loader("bert", size=16, batch_size=4))  # an epoch with 2 blocks frozen
    assert not any(p.requires_grad for p in module.model.funnel.embeddings.parameters())
    assert all(p.requires_grad and not torch.equal(p, head_before[name]) for name, p in head.named_parameters())
    assert freeze.frozen_blocks == 3 and freeze.pre_weights == [] and freeze.post_weights == []
    assert any("called no module of the block list 'model.funnel.encoder.blocks'" in str(w.message) for w in caught)


class TinyPhiLM(tm.TinyGPT2LM):
    """A tiny HF Phi with its embedding dropout on: Phi registers ``embed_dropout`` after its layers."""

    def __init__(self):
        from transformers import PhiConfig, PhiForCausalLM

        pl.LightningModule.__init__(self)
        self.save_hyperparameters({"lr": 1e-3})
        config = PhiConfig(
            vocab_size=tm.VOCAB,
            hidden_size=tm.HIDDEN,
            intermediate_size=tm.INTERMEDIATE,
            num_hidden_layers=tm.LAYERS,
            num_attention_heads=tm.HEADS,
            max_position_embeddings=tm.MAX_POSITIONS,
            embd_pdrop=0.1,
            resid_pdrop=0.0,
            attention_dropout=0.0,
            attn_implementation="eager",
        )
        self.model = tm._seeded(0, lambda: PhiForCausalLM(config))


@pytest.mark.parametrize("cache", [True, "auto"])
def test_phis_embedding_dropout_stops_with_the_frozen_prefix_and_the_cache_serves_it_exactly(cache):
    def fit(cache):
        pl.seed_everything(0, verbose=False)
        module, freeze, rates = TinyPhiLM(), FreezeCallback(alpha=1 / 2, signal="schedule"), tm.HitRates()
        modes = TrainingModes("model.model.embed_dropout")
        trainer = tm.make_trainer([freeze, rates, modes], max_epochs=4, strategy=ElasticPipelineStrategy(cache=cache))
        trainer.fit(module, tm.task_loader("bert", size=16, batch_size=4))
        return module.state_dict(), rates.rates, modes.modes, freeze.state_dict().get("pre_modules")

    reference, _, modes, found = fit(False)
    assert modes == [[True], [False], [False], [False]]
    state, rates, _, _ = fit(cache)
    assert rates[-1] == 1.0
    assert all(torch.equal(state[name], reference[name]) for name in reference)
    assert "model.model.embed_dropout" in found


def test_xlm_roberta_token_classifiers_dropout_keeps_training_as_the_encoder_freezes():
    from transformers import XLMRobertaConfig, XLMRobertaForTokenClassification

    class TokenTagger(pl.LightningModule):
        def __init__(self):
            super().__init__()
            config = XLMRobertaConfig(**tm._offset_position_sizes(0.1, 3), attn_implementation="eager")
            self.model = tm._seeded(0, lambda: XLMRobertaForTokenClassification(config))

        def training_step(self, batch, batch_idx):
            labels = batch["labels"][:, None].expand_as(batch["input_ids"]).contiguous()
            return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    freeze = FreezeCallback(alpha=1 / 3, signal="schedule")
    modes = TrainingModes("model.dropout", "model.roberta.embeddings")
    tm.make_trainer([freeze, modes], max_epochs=2).fit(TokenTagger(), tm.task_loader("bert", size=16, batch_size=4))
    assert freeze.frozen_blocks > 0 and freeze.state_dict()["post_modules"] == ["model.dropout"]
    assert modes.modes == [[True, True], [True, False]]  # XLM-R registers the classifier's dropout before roberta


class DropoutBetweenBlocks(pl.LightningModule):
    """A dropout registered before the block list and applied after every block, the frozen ones too."""

    def __init__(self):
        super().__init__()
        self.drop = torch.nn.Dropout(0.1)
        self.model = tm.tiny_sequential(seed=0, dropout=0.0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.model.embed(x)
        for block in self.model.blocks:
            h = self.drop(block(h))
        return torch.nn.functional.mse_loss(self.model.head(h), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_a_dropout_called_between_the_blocks_freezes_with_the_prefix():
    module, freeze = DropoutBetweenBlocks(), FreezeCallback(alpha=1 / 3, signal="schedule")
    modes = TrainingModes("drop")
    tm.make_trainer([freeze, modes], max_epochs=2).fit(module, tm.task_loader("sequential", size=16, batch_size=4))
    assert freeze.state_dict()["post_modules"] == [] and modes.modes == [[True], [False]]
