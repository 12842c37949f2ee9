"""LM1B data in its published layout, a vocabulary tool, and synthetic Zipf data.

Layout (as released with the One Billion Word Benchmark)::

    DATA_DIR/1b_word_vocab.txt                                            "word count" per line, with <S> and <UNK>
    DATA_DIR/training-monolingual.tokenized.shuffled/news.en-000NN-of-00100
    DATA_DIR/heldout-monolingual.tokenized.shuffled/news.en.heldout-000NN-of-00050

One tokenized sentence per line. Each sentence becomes ``<S> w1 ... wn <S>`` (unknown words -> ``<UNK>``), the
sentences of a file are concatenated into one id stream and cut into windows of ``num_steps + 1`` ids: inputs are
the first ``num_steps``, targets the last ``num_steps``. Training files are split among workers (worker i reads
files i, i+N, ...); ``kp.data.per_worker`` then keeps ``fit`` from sharding again.
"""

import collections
import glob
import os

import numpy as np

TRAIN_DIR = "training-monolingual.tokenized.shuffled"
HELDOUT_DIR = "heldout-monolingual.tokenized.shuffled"
VOCAB_FILE = "1b_word_vocab.txt"
BOS, UNK = "<S>", "<UNK>"


class Vocabulary:
    """Word <-> id, in file order (the published file is sorted by count, most frequent first)."""

    def __init__(self, words):
        self.words = list(words)
        self.ids = {w: i for i, w in enumerate(self.words)}
        for special in (BOS, UNK):
            if special not in self.ids:
                raise ValueError(f"The vocabulary has no {special} entry; LM1B vocabularies list <S> and <UNK>. "
                                 f"Received: {len(self.words)} words starting {self.words[:5]}.")
        self.bos, self.unk = self.ids[BOS], self.ids[UNK]

    def __len__(self):
        return len(self.words)

    @classmethod
    def load(cls, path, max_size=None):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"Vocabulary file {path!r} does not exist. Build one with "
                                    f"scripts/build_vocab.py or point --data_dir at an LM1B directory. Received: {path}.")
        words = []
        for number, line in enumerate(_lines(path), 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
                raise ValueError(f"{path}:{number}: expected 'word count'. Received: {line.strip()!r}.")
            words.append(parts[0])
        if not words:
            raise ValueError(f"Vocabulary file {path!r} is empty. Received: 0 words.")
        if max_size is not None and len(words) > max_size:
            keep = [w for w in words[:max_size] if w not in (BOS, UNK)]
            words = [BOS, UNK] + keep[:max_size - 2]
        return cls(words)

    def encode(self, sentence):
        return [self.bos] + [self.ids.get(w, self.unk) for w in sentence.split()] + [self.bos]


def build_vocabulary(paths, output, max_size=None):
    """Writes ``word count`` lines (``<S>``, ``</S>``, ``<UNK>`` first, then by count) for the text files."""
    counts = collections.Counter()
    sentences = 0
    for path in paths:
        for line in _lines(path):
            words = line.split()
            if words:
                counts.update(words)
                sentences += 1
    if not counts:
        raise ValueError(f"No words in {list(paths)}. Received: empty input.")
    top = counts.most_common(max_size)
    tmp = f"{output}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(f"<S> {sentences}\n</S> {sentences}\n<UNK> 0\n")
        for word, count in top:
            if word not in ("<S>", "</S>", "<UNK>"):
                f.write(f"{word} {count}\n")
    os.replace(tmp, output)
    return len(top) + 3


def files(data_dir, split):
    pattern = os.path.join(data_dir, TRAIN_DIR, "news.en-*-of-*") if split == "train" else \
        os.path.join(data_dir, HELDOUT_DIR, "news.en.heldout-*-of-*")
    found = sorted(glob.glob(pattern))
    if not found:
        raise FileNotFoundError(f"No LM1B {split} files match {pattern}. Create the offline corpus with "
                                f"scripts/make_lm1b_corpus.py, or use --data=synthetic. Received: --data_dir={data_dir}.")
    empty = [p for p in found if os.path.getsize(p) == 0]
    if empty:
        raise ValueError(f"LM1B {split} file {empty[0]} is empty. Received: {len(empty)} empty file(s).")
    return found


def windows(paths, vocab, num_steps):
    """(inputs, targets) int32 arrays [n, num_steps] from the sentences of ``paths``."""
    stream = []
    for path in paths:
        for line in _lines(path):
            if line.strip():
                stream.extend(vocab.encode(line))
    ids = np.asarray(stream, dtype=np.int32)
    n = (len(ids) - 1) // num_steps
    if n == 0:
        raise ValueError(f"{paths} hold {len(ids)} tokens, fewer than one window of {num_steps + 1}. Received: "
                         f"num_steps={num_steps}.")
    inputs = ids[:n * num_steps].reshape(n, num_steps)
    targets = ids[1:n * num_steps + 1].reshape(n, num_steps)
    return inputs, targets


def _lines(path):
    """The lines of the UTF-8 text file ``path``; a ``ValueError`` naming the file and line if it is not UTF-8."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{number} is not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                                 f"{e.start + 1}): LM1B files hold UTF-8 text, one tokenized sentence per line. "
                                 f"Received: {raw[:40]!r}.") from None


def synthetic(num_windows, num_steps, vocab_size, seed=0, exponent=1.2):
    """Zipf-distributed ids (frequent words dominate, as in text), for benchmarks."""
    rng = np.random.default_rng(seed)
    ids = np.minimum(rng.zipf(exponent, size=num_windows * num_steps + 1) - 1, vocab_size - 1).astype(np.int32)
    n = num_windows * num_steps
    return ids[:n].reshape(num_windows, num_steps), ids[1:n + 1].reshape(num_windows, num_steps)
