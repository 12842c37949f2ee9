"""Builds a real English corpus, offline, in the LM1B layout (so the LM trains on real text out of the box).

    python scripts/make_lm1b_corpus.py --output_dir data/lm1b_offline

Source: text that ships with every CPython installation, under the Python Software Foundation License (which
allows copying and redistribution): the reference-manual topics of ``pydoc_data.topics`` (the text ``help()``
shows) and the docstrings of the standard library's modules, classes and functions (read with ``ast``; nothing is
imported or executed). Paragraphs are split into sentences, tokenized LM1B-style (words, numbers and punctuation
as separate tokens), filtered to prose (4-60 tokens, mostly words), de-duplicated, shuffled with a fixed seed and
written as ``training-monolingual.tokenized.shuffled/news.en-000NN-of-000MM`` and
``heldout-monolingual.tokenized.shuffled/news.en.heldout-000NN-of-000KK`` (one sentence per line), with
``1b_word_vocab.txt`` built from the training files. Deterministic: the same Python gives the same corpus.
"""

import argparse
import ast
import os
import random
import re
import sysconfig

from kparallax_models import lm1b_data

_TOKEN = re.compile(r"[A-Za-z]+(?:'[a-z]+)?|[0-9]+(?:\.[0-9]+)?|[^\sA-Za-z0-9]")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'])")


def _paragraphs(text):
    for block in re.split(r"\n\s*\n", text):
        lines = [l.strip() for l in block.splitlines()]
        if any(l.startswith((">>>", "...", "$")) for l in lines):
            continue  # code examples
        yield " ".join(l for l in lines if l and not set(l) <= set("*=-~^"))


def _docstrings(root):
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "ensurepip", "turtledemo"}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc:
                        yield doc


def sentences():
    import pydoc_data.topics  # pylint: disable=import-outside-toplevel
    texts = list(pydoc_data.topics.topics.values()) + list(_docstrings(sysconfig.get_paths()["stdlib"]))
    seen = set()
    for text in texts:
        for paragraph in _paragraphs(text):
            for sentence in _SENTENCE_END.split(paragraph):
                tokens = _TOKEN.findall(sentence)
                words = sum(t[0].isalpha() for t in tokens)
                if 4 <= len(tokens) <= 60 and words >= 0.7 * len(tokens):
                    line = " ".join(tokens)
                    if line not in seen:
                        seen.add(line)
                        yield line


def write(output_dir, train_shards, heldout_shards, heldout_fraction, seed):
    lines = list(sentences())
    random.Random(seed).shuffle(lines)
    heldout_n = max(heldout_shards, int(len(lines) * heldout_fraction))
    heldout, train = lines[:heldout_n], lines[heldout_n:]
    paths = {"train": [], "heldout": []}
    for split, items, shards, directory, fmt in (
            ("train", train, train_shards, lm1b_data.TRAIN_DIR, "news.en-{:05d}-of-{:05d}"),
            ("heldout", heldout, heldout_shards, lm1b_data.HELDOUT_DIR, "news.en.heldout-{:05d}-of-{:05d}")):
        os.makedirs(os.path.join(output_dir, directory), exist_ok=True)
        for i in range(shards):
            index = i + 1 if split == "train" else i
            path = os.path.join(output_dir, directory, fmt.format(index, shards + (1 if split == "train" else 0)))
            tmp = f"{path}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write("\n".join(items[i::shards]) + "\n")
            os.replace(tmp, path)
            paths[split].append(path)
    size = lm1b_data.build_vocabulary(paths["train"], os.path.join(output_dir, lm1b_data.VOCAB_FILE))
    tokens = sum(len(l.split()) for l in train)
    return len(train), len(heldout), tokens, size


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="data/lm1b_offline")
    parser.add_argument("--train_shards", type=int, default=8)
    parser.add_argument("--heldout_shards", type=int, default=2)
    parser.add_argument("--heldout_fraction", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    for flag in ("train_shards", "heldout_shards"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1. Received: --{flag}={getattr(args, flag)}.")
    if not 0 <= args.heldout_fraction < 1:
        parser.error(f"--heldout_fraction must be >= 0 and < 1. "
                     f"Received: --heldout_fraction={args.heldout_fraction}.")
    try:
        os.makedirs(args.output_dir, exist_ok=True)
    except OSError as e:
        parser.error(f"--output_dir cannot be created ({e.strerror}). Received: --output_dir={args.output_dir}.")
    try:
        train, heldout, tokens, vocab = write(args.output_dir, args.train_shards, args.heldout_shards,
                                              args.heldout_fraction, args.seed)
    except ValueError as e:
        parser.error(f"{e} Check --train_shards, --heldout_shards and --heldout_fraction.")
    print(f"wrote {train} training and {heldout} held-out sentences ({tokens} training tokens, vocabulary "
          f"{vocab} words) to {args.output_dir}")


if __name__ == "__main__":
    main()
