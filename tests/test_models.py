"""Reference models and their data: parameter counts, config round trips, loss math, data formats (one process)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

ROOT = os.path.join(os.path.dirname(__file__), "..")
from kparallax_models import imagenet_data, lm1b, lm1b_data, resnet


def _lm1b_params(c):
    lstm = (c.embedding_dim + c.projection_dim) * 4 * c.lstm_units + 4 * c.lstm_units + c.lstm_units * c.projection_dim
    return c.vocab_size * c.embedding_dim + lstm + c.vocab_size * c.projection_dim + c.vocab_size


def _trainable(model):
    return sum(int(np.prod(w.shape)) for w in model.trainable_weights)


@pytest.mark.parametrize("name, expected", [("lm1b_tiny", 148688), ("lm1b_small", 52481696),
                                                   ("lm1b_sparse", 102795168)])
def test_lm1b_parameter_counts_and_config_round_trip(name, expected):
    model = lm1b.LM1B(lm1b.preset(name))
    assert _trainable(model) == expected == _lm1b_params(model.config)
    again = lm1b.LM1B.from_config(model.get_config())
    assert again.config == model.config and _trainable(again) == expected


def test_full_lm1b_size():
    c = lm1b.preset("lm1b")
    assert (c.vocab_size, c.embedding_dim, c.lstm_units, c.projection_dim, c.num_sampled) == (793471, 512, 2048, 512, 8192)
    assert _lm1b_params(c) == 2 * 793471 * 512 + 793471 + 1024 * 8192 + 8192 + 2048 * 512 == 822_753_151


def test_sampled_softmax_matches_tensorflows_on_the_same_samples():
    tf.random.set_seed(3)
    vocab, dim, n, sampled = 50, 8, 12, 10
    weights = tf.random.normal([vocab, dim])
    biases = tf.random.normal([vocab, 1])
    hidden = tf.random.normal([n, dim])
    targets = tf.random.uniform([n], 0, vocab, tf.int64)
    tf.random.set_seed(7)
    ours = lm1b.sampled_softmax_loss(weights, biases, targets, hidden, sampled, vocab)
    tf.random.set_seed(7)
    samples = tf.random.log_uniform_candidate_sampler(tf.reshape(targets, [-1, 1]), 1, sampled, True, vocab)
    theirs = tf.reduce_mean(tf.nn.sampled_softmax_loss(weights, tf.reshape(biases, [-1]), tf.reshape(targets, [-1, 1]),
                                                       hidden, sampled, vocab, sampled_values=samples,
                                                       remove_accidental_hits=True))
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5)


def test_lm1b_gradients_of_tables_are_sparse():
    model = lm1b.LM1B(lm1b.preset("lm1b_tiny"))
    ids = tf.constant(np.arange(20).reshape(2, 10), tf.int32)
    with tf.GradientTape() as tape:
        loss = lm1b.sampled_softmax_loss(model.softmax_w.embeddings, model.softmax_b.embeddings, ids, model(ids),
                                         16, model.config.vocab_size)
    grads = tape.gradient(loss, [model.word_embedding.embeddings, model.softmax_w.embeddings])
    assert all(isinstance(g, tf.IndexedSlices) for g in grads)


@pytest.mark.parametrize("name, trainable, total", [("resnet50", 25_557_032, 25_610_152),
                                                    ("resnet50_small", 23_712_932, 23_766_052),
                                                    ("resnet50_tiny", 130_962, 133_378)])
def test_resnet_parameter_counts_and_config_round_trip(name, trainable, total):
    model = resnet.build(resnet.preset(name))
    assert sum(int(np.prod(w.shape)) for w in model.trainable_weights) == trainable  # TF official v1.5: 25,557,032
    assert model.count_params() == total
    assert tf.keras.Model.from_config(model.get_config()).count_params() == total


def test_resnet_v15_puts_the_stride_in_the_3x3_convolution():
    model = resnet.build(resnet.preset("resnet50_tiny"))
    assert model.get_layer("stage2_block1_conv1").strides == (1, 1)
    assert model.get_layer("stage2_block1_conv2").strides == (2, 2)


def test_vocabulary_and_windows(tmp_path):
    (tmp_path / "text").write_text("the cat sat\nthe dog sat down\n")
    size = lm1b_data.build_vocabulary([str(tmp_path / "text")], str(tmp_path / "vocab.txt"))
    vocab = lm1b_data.Vocabulary.load(str(tmp_path / "vocab.txt"))
    assert size == len(vocab) == 8 and vocab.words[:3] == ["<S>", "</S>", "<UNK>"] and set(vocab.words[3:5]) == {"the", "sat"}
    assert vocab.encode("the bird sat") == [vocab.bos, vocab.ids["the"], vocab.unk, vocab.ids["sat"], vocab.bos]
    x, y = lm1b_data.windows([str(tmp_path / "text")], vocab, num_steps=3)
    stream = vocab.encode("the cat sat") + vocab.encode("the dog sat down")
    assert x.shape == (3, 3) and list(x.ravel()) == stream[:9] and list(y.ravel()) == stream[1:10]


def test_bad_vocabulary_and_missing_files_are_clear(tmp_path):
    (tmp_path / "v.txt").write_text("a 1\nb 2\n")
    with pytest.raises(ValueError, match=r"has no <S> entry"):
        lm1b_data.Vocabulary.load(str(tmp_path / "v.txt"))
    (tmp_path / "w.txt").write_text("<S> 1\n<UNK> x\n")
    with pytest.raises(ValueError, match=r"w.txt:2: expected 'word count'"):
        lm1b_data.Vocabulary.load(str(tmp_path / "w.txt"))
    with pytest.raises(FileNotFoundError, match=r"No LM1B train files match .*make_lm1b_corpus.py"):
        lm1b_data.files(str(tmp_path), "train")


def test_offline_corpus_is_real_text_in_the_lm1b_layout(tmp_path):
    out = tmp_path / "corpus"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_lm1b_corpus.py"), "--output_dir", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    train = lm1b_data.files(str(out), "train")
    heldout = lm1b_data.files(str(out), "heldout")
    assert len(train) == 8 and len(heldout) == 2 and os.path.basename(train[0]) == "news.en-00001-of-00009"
    vocab = lm1b_data.Vocabulary.load(str(out / lm1b_data.VOCAB_FILE))
    assert len(vocab) > 5000 and {"the", "function", "object", "returns"} <= set(vocab.words)
    lines = open(train[0], encoding="utf-8").read().splitlines()
    assert len(lines) > 1000 and all(4 <= len(l.split()) <= 60 for l in lines)


def test_imagenet_records_round_trip_through_preprocessing(tmp_path):
    path = str(tmp_path / "train-00000-of-00001")
    with tf.io.TFRecordWriter(path) as writer:
        for label in (1, 2, 3, 1000):
            image = np.random.default_rng(label).integers(0, 255, (48, 64, 3), dtype=np.uint8)
            imagenet_data.write_example(writer, tf.io.encode_jpeg(image).numpy(), label)
    assert imagenet_data.files(str(tmp_path), "train") == [path]
    images, labels = next(iter(imagenet_data.dataset([path], 32, 4, training=True)))
    assert images.shape == (4, 32, 32, 3) and images.dtype == tf.float32
    assert sorted(labels.numpy().tolist()) == [0, 1, 2, 999]
    evaluation = next(iter(imagenet_data.dataset([path], 32, 4, training=False)))[0]
    assert evaluation.shape == (4, 32, 32, 3) and abs(float(tf.reduce_mean(evaluation))) < 3


def test_presets_are_the_json_files_in_configs(tmp_path):
    assert lm1b.preset("lm1b_small").vocab_size == 100000
    assert resnet.preset("resnet50").blocks == (3, 4, 6, 3)
    custom = tmp_path / "mine.json"
    custom.write_text('{"model": "lm1b", "vocab_size": 500, "num_sampled": 50}')
    assert lm1b.preset(str(custom)).vocab_size == 500
    with pytest.raises(ValueError, match=r"Unknown lm1b preset 'lm2b'; choose one of \['lm1b', 'lm1b_small', 'lm1b_sparse', 'lm1b_tiny'\]"):
        lm1b.preset("lm2b")
    with pytest.raises(ValueError, match=r"is not a resnet config"):
        resnet.preset(str(custom))
