"""Block discovery: the block list, ``pre`` and ``post`` of every tiny model, overrides, errors."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch
from torch import nn

from lightning_pipetx import BlockListNotFoundError, BlockSplit, find_blocks

# name -> (block path, pre modules, post modules, pre parameters held directly on the chain)
EXPECTED = {
    "bert": ("bert.encoder.layer", ["bert.embeddings"], ["dropout", "classifier", "bert.pooler"], []),
    "roberta": ("roberta.encoder.layer", ["roberta.embeddings"], ["classifier"], []),
    # the relative position bias is computed by the encoder before the blocks, from a weight after them
    "mpnet": ("mpnet.encoder.layer", ["mpnet.embeddings"], ["classifier", "mpnet.encoder.relative_attention_bias"], []),
    "distilbert": (
        "distilbert.transformer.layer",
        ["distilbert.embeddings"],
        ["pre_classifier", "classifier", "dropout"],
        [],
    ),
    "gpt2": (
        "transformer.h",
        ["transformer.wte", "transformer.wpe", "transformer.drop"],
        ["lm_head", "transformer.ln_f"],
        [],
    ),
    "llama": ("model.layers", ["model.embed_tokens"], ["lm_head", "model.norm", "model.rotary_emb"], []),
    "timm_vit": (
        "blocks",
        ["patch_embed", "pos_drop", "patch_drop", "norm_pre"],
        ["norm", "fc_norm", "head_drop", "head"],
        ["cls_token", "pos_embed"],
    ),
    "timm_deit": (
        "blocks",
        ["patch_embed", "pos_drop", "patch_drop", "norm_pre"],
        ["norm", "fc_norm", "head_drop", "head"],
        ["cls_token", "pos_embed"],
    ),
    "timm_deit_distilled": (
        "blocks",
        ["patch_embed", "pos_drop", "patch_drop", "norm_pre"],
        ["norm", "fc_norm", "head_drop", "head", "head_dist"],
        ["cls_token", "pos_embed", "dist_token"],
    ),
    "sequential": ("blocks", ["embed"], ["norm", "head"], []),
}


def _hf_vit_expected(model: nn.Module) -> tuple[str, list[str], list[str], list[str]]:
    # transformers 5 moved ViT's layer list from ``vit.encoder.layer`` to ``vit.layers``.
    if hasattr(model.vit, "encoder"):
        return "vit.encoder.layer", ["vit.embeddings"], ["classifier", "vit.layernorm"], []
    return "vit.layers", ["vit.embeddings"], ["classifier", "vit.layernorm"], []


def _names(pairs) -> list[str]:
    return [name for name, _ in pairs]


def _expected(name: str, model: nn.Module):
    return _hf_vit_expected(model) if name == "hf_vit" else EXPECTED[name]


def _check_partition(split: BlockSplit) -> None:
    """pre + blocks + post + direct parameters cover every parameter of the model exactly."""
    covered: list[int] = [id(p) for _, p in split.pre_direct_params]
    for _, module in split.pre + split.post:
        covered += [id(p) for p in module.parameters()]
    for block in split.blocks:
        covered += [id(p) for p in block.parameters()]
    everything = {id(p) for p in split.root.parameters()}
    assert set(covered) == everything
    # Nothing counted twice, except parameters tied between pre and post (GPT-2's lm_head).
    pre_ids = {id(p) for p in split.pre_parameters()}
    post_ids = {id(p) for _, m in split.post for p in m.parameters()}
    block_ids = {id(p) for b in split.blocks for p in b.parameters()}
    assert not (block_ids & pre_ids) and not (block_ids & post_ids)


@pytest.mark.parametrize("name", tm.MODEL_NAMES)
def test_discovery_finds_block_list_pre_and_post(name):
    model = tm.build_model(name)
    path, pre, post, direct = _expected(name, model)
    split = find_blocks(model)

    assert split.path == path
    assert split.blocks is model.get_submodule(path)
    assert split.num_blocks == tm.LAYERS
    assert [split.block(i) for i in range(split.num_blocks)] == list(model.get_submodule(path))
    assert _names(split.pre) == pre
    assert _names(split.post) == post
    assert _names(split.pre_direct_params) == direct
    for module_name, module in split.pre + split.post:
        assert module is model.get_submodule(module_name)
    for param_name, param in split.pre_direct_params:
        assert param is model.get_parameter(param_name)
    _check_partition(split)


TASK_PRE_POST = {
    "bert": (["model.bert.embeddings"], ["model.dropout", "model.classifier", "model.bert.pooler"]),
    "mpnet": (["model.mpnet.embeddings"], ["model.classifier", "model.mpnet.encoder.relative_attention_bias"]),
    "timm_vit": (
        ["model.patch_embed", "model.pos_drop", "model.patch_drop", "model.norm_pre"],
        ["loss_fn", "model.norm", "model.fc_norm", "model.head_drop", "model.head"],
    ),
    "sequential": (["model.embed"], ["model.norm", "model.head"]),
    "batchnorm": (["model.embed"], ["model.norm", "model.head"]),
    "gpt2": (
        ["model.transformer.wte", "model.transformer.wpe", "model.transformer.drop"],
        ["model.lm_head", "model.transformer.ln_f"],
    ),
    # T5's decoder is the block list: the encoder runs whole in ``pre``.
    "t5": (
        ["model.shared", "model.encoder", "model.decoder.embed_tokens"],
        ["model.lm_head", "model.decoder.final_layer_norm", "model.decoder.dropout"],
    ),
    # RoFormer's rotary position table is registered on the encoder, before its layers.
    "roformer": (["model.roformer.embeddings", "model.roformer.encoder.embed_positions"], ["model.classifier"]),
}


@pytest.mark.parametrize("task", sorted(tm.TASKS))
def test_discovery_inside_lightning_module(task):
    module = tm.build_task(task)
    split = find_blocks(module)
    assert split.path == tm.TASKS[task].blocks_path
    assert split.root is module
    assert split.blocks is module.get_submodule(split.path)
    # Names are paths inside the LightningModule; its own modules are placed by position too.
    expected_pre, expected_post = TASK_PRE_POST[task]
    assert _names(split.pre) == expected_pre
    assert _names(split.post) == expected_post
    _check_partition(split)


def test_timm_vit_prefix_covers_embeddings_and_class_token():
    model = tm.tiny_timm_vit()
    split = find_blocks(model)
    pre_ids = {id(p) for p in split.pre_parameters()}
    assert id(model.cls_token) in pre_ids and id(model.pos_embed) in pre_ids
    assert all(id(p) in pre_ids for p in model.patch_embed.parameters())
    assert not any(id(p) in pre_ids for p in model.head.parameters())

    assert split.prefix_modules(0) == [] and split.prefix_parameters(0) == []
    modules = split.prefix_modules(2)
    assert modules[: len(split.pre)] == [m for _, m in split.pre]
    assert modules[len(split.pre) :] == [model.blocks[0], model.blocks[1]]
    prefix_ids = [id(p) for p in split.prefix_parameters(2)]
    assert len(prefix_ids) == len(set(prefix_ids))
    expected = pre_ids | {id(p) for b in model.blocks[:2] for p in b.parameters()}
    assert set(prefix_ids) == expected
    assert not any(id(p) in expected for p in model.blocks[2].parameters())


def test_bert_prefix_is_embeddings_then_leading_layers():
    model = tm.tiny_bert()
    split = find_blocks(model)
    assert [m for m in split.prefix_modules(1)] == [model.bert.embeddings, model.bert.encoder.layer[0]]
    ids = {id(p) for p in split.prefix_parameters(3)}
    for i in range(3):
        assert all(id(p) in ids for p in model.bert.encoder.layer[i].parameters())
    assert not any(id(p) in ids for p in model.bert.encoder.layer[3].parameters())
    assert not any(id(p) in ids for p in model.classifier.parameters())
    assert not any(id(p) in ids for p in model.bert.pooler.parameters())
    assert list(split.block_parameters(2)) == list(model.bert.encoder.layer[2].parameters())


def test_a_split_prints_as_the_split_not_the_model():
    split = find_blocks(tm.tiny_bert())
    assert repr(split) == (
        "BlockSplit(path='bert.encoder.layer', num_blocks=4, pre=['bert.embeddings'], "
        "post=['dropout', 'classifier', 'bert.pooler'])"
    )


def test_pre_parameters_are_unique_with_tied_weights():
    model = tm.tiny_gpt2()
    split = find_blocks(model)
    params = list(split.pre_parameters())
    assert len(params) == len({id(p) for p in params})
    assert any(p is model.transformer.wte.weight for p in params)


def test_a_pre_weight_tied_to_the_head_is_not_part_of_the_frozen_prefix():
    model = tm.tiny_gpt2()
    prefix = find_blocks(model).prefix_parameters(2)
    assert not any(p is model.lm_head.weight for p in prefix)  # the head keeps training
    assert any(p is model.transformer.wpe.weight for p in prefix)
    assert any(p is model.transformer.h[1].mlp.c_fc.weight for p in prefix)


def test_a_second_name_of_the_embeddings_after_the_blocks_does_not_keep_them_training():
    # Lightning's BackboneFinetuning asks for `self.backbone`; naming the embeddings so registers
    # them after the block list, as if the head used them.
    module = tm.TinySequentialRegressor()
    module.backbone = module.model.embed
    module.last_block = module.model.blocks[-1]
    module.whole = module.model  # a name for the module that holds the blocks
    split = find_blocks(module, "model.blocks")
    assert [name for name, _ in split.post] == ["model.norm", "model.head"]
    prefix = split.prefix_parameters(1)
    assert all(any(p is q for q in prefix) for p in module.model.embed.parameters())
    assert not any(p is q for p in module.model.head.parameters() for q in prefix)


def test_largest_block_list_wins_over_smaller_ones():
    class TwoStacks(nn.Module):
        def __init__(self):
            super().__init__()
            self.small = nn.ModuleList(nn.Linear(4, 4) for _ in range(6))  # 6 blocks, 120 params
            self.big = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))  # 2 blocks, 544 params
            self.out = nn.Linear(16, 1)

    split = find_blocks(TwoStacks())
    assert split.path == "big"
    assert _names(split.pre) == ["small"]
    assert _names(split.post) == ["out"]


def test_mixed_type_containers_and_parameterless_lists_are_not_block_lists():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.mixed = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
            self.acts = nn.ModuleList([nn.ReLU(), nn.ReLU(), nn.ReLU()])
            self.single = nn.ModuleList([nn.Linear(64, 64)])
            self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))

    assert find_blocks(Model()).path == "layers"


@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("bert", "bert.encoder.layer"),
        ("gpt2", "transformer.h"),
        ("timm_vit", "blocks"),
        # Not the largest list: the override is taken as given.
        ("sequential", "embed"),
    ],
)
def test_explicit_dotted_path_overrides_discovery(name, path):
    model = tm.build_model(name)
    split = find_blocks(model, path)
    assert split.path == path
    assert split.blocks is model.get_submodule(path)


def test_explicit_path_inside_lightning_module():
    module = tm.TinyBertClassifier()
    split = find_blocks(module, "model.bert.encoder.layer")
    assert split.blocks is module.model.bert.encoder.layer
    assert _names(split.pre) == ["model.bert.embeddings"]
    assert _names(split.post) == ["model.dropout", "model.classifier", "model.bert.pooler"]


def test_explicit_path_changes_the_pre_post_split():
    # A list nested inside block 1: block 1's own children before it are pre, later blocks post.
    model = tm.tiny_sequential()
    model.blocks[1].inner = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    split = find_blocks(model, "blocks.1.inner")
    assert split.blocks is model.blocks[1].inner
    assert _names(split.pre)[:1] == ["embed"]
    assert "blocks.0" in _names(split.pre) and "blocks.1.norm" in _names(split.pre)
    assert "blocks.2" in _names(split.post) and "head" in _names(split.post)


def test_no_block_list_raises_an_error_naming_the_fix():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(BlockListNotFoundError, match="blocks=") as info:
        find_blocks(model)
    assert "Sequential" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_no_block_list_in_lightning_module_raises():
    import lightning.pytorch as pl

    class Plain(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 2)

    with pytest.raises(BlockListNotFoundError, match=r"blocks="):
        find_blocks(Plain())


@pytest.mark.parametrize("path", ["bert.encoder.layers", "bert.decoder.layer", "nope", "bert..layer"])
def test_bad_path_raises(path):
    model = tm.tiny_bert()
    with pytest.raises(BlockListNotFoundError, match="blocks=") as info:
        find_blocks(model, path)
    assert repr(path) in str(info.value)


@pytest.mark.parametrize("path", ["bert.embeddings", "bert.encoder", "classifier", "config", "bert.encoder.layer.0"])
def test_path_to_something_that_is_not_a_block_list_raises(path):
    model = tm.tiny_bert()
    with pytest.raises(BlockListNotFoundError, match="nn.ModuleList or nn.Sequential"):
        find_blocks(model, path)


def test_path_to_an_empty_list_raises():
    model = tm.tiny_sequential()
    model.empty = nn.ModuleList()
    with pytest.raises(BlockListNotFoundError, match="non-empty"):
        find_blocks(model, "empty")


def test_split_is_frozen_dataclass_and_does_not_touch_the_model():
    model = tm.tiny_bert()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [p.requires_grad for p in model.parameters()]
    split = find_blocks(model)
    with pytest.raises(AttributeError):
        split.path = "x"  # type: ignore[misc]
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert flags == [p.requires_grad for p in model.parameters()]
    assert model.training


def test_the_backbone_is_the_block_list_when_only_adapters_in_it_train():
    # LoRA-style: the base weights are frozen, small adapters train; multi-task heads train too.
    model = tm.tiny_bert(seed=0, dropout=0.0)
    model.requires_grad_(False)
    for layer in model.bert.encoder.layer:
        layer.adapter = torch.nn.Linear(2, 2)
    model.heads = torch.nn.ModuleList([torch.nn.Linear(tm.HIDDEN, 8), torch.nn.Linear(tm.HIDDEN, 8)])
    assert find_blocks(model).path == "bert.encoder.layer"


def test_a_frozen_backbone_is_the_block_list_beside_trainable_linear_heads():
    # Linear probing: the heads are a list of Linear layers, not of blocks.
    model = tm.tiny_bert(seed=0, dropout=0.0)
    model.requires_grad_(False)
    model.heads = torch.nn.ModuleList([torch.nn.Linear(tm.HIDDEN, 8), torch.nn.Linear(tm.HIDDEN, 8)])
    assert find_blocks(model).path == "bert.encoder.layer"


def test_a_frozen_block_list_in_the_prefix_is_not_named():
    from lightning_pipetx.blocks import block_lists_in_pre

    root = torch.nn.Module()
    root.teacher = tm.tiny_bert(seed=1, dropout=0.0).requires_grad_(False)  # registered before the student
    root.student = tm.tiny_bert(seed=0, dropout=0.0)
    split = find_blocks(root, "student.bert.encoder.layer")
    assert block_lists_in_pre(split) == []
    root.teacher.requires_grad_(True)
    assert block_lists_in_pre(split) == ["teacher.bert.encoder.layer"]


def test_a_path_through_a_property_finds_the_blocks_registered_name():
    # Hugging Face's base_model is a property returning model.bert: the split is that of the registered path.
    module = tm.TinyBertClassifier(seed=0)
    through = find_blocks(module, "model.base_model.encoder.layer")
    registered = find_blocks(module, "model.bert.encoder.layer")
    assert through.path == "model.bert.encoder.layer"
    assert [n for n, _ in through.pre] == [n for n, _ in registered.pre] == ["model.bert.embeddings"]
    assert [n for n, _ in through.post] == [n for n, _ in registered.post]
