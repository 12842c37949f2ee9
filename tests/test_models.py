"""Reference models and their data: parameter counts, config round trips, loss math, data formats (one process)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

ROOT = os.path.join(os.path.dirname(__file__), "..")
from kparallax_models import imagenet_data, lm1b, lm1b_data, presets, resnet


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


def test_lm1b_softmax_weights_of_its_own_are_the_same_parameters_with_sparse_gradients():
    model = lm1b.LM1B(lm1b.preset("lm1b_tiny", softmax="weights"))
    assert _trainable(model) == 148688 and lm1b.LM1B.from_config(model.get_config()).config.softmax == "weights"
    ids = tf.constant(np.arange(20).reshape(2, 10), tf.int32)
    with tf.GradientTape() as tape:
        candidates = lm1b.log_uniform_candidates(tf.reshape(tf.cast(ids, tf.int64), [-1, 1]), 16,
                                                 model.config.vocab_size, tf.constant([0, 0], tf.int64))
        loss = lm1b.sampled_softmax_loss(*model.softmax_tables(), ids, model(ids), candidates)
    assert all(isinstance(g, tf.IndexedSlices) for g in tape.gradient(loss, list(model.softmax_tables())))
    with pytest.raises(ValueError, match=r"softmax must be 'embedding' or 'weights'. Received: softmax='dense'"):
        lm1b.preset("lm1b_tiny", softmax="dense")


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
    samples = tf.random.log_uniform_candidate_sampler(tf.reshape(targets, [-1, 1]), 1, sampled, True, vocab)
    ours = lm1b.sampled_softmax_loss(weights, biases, targets, hidden, samples)
    theirs = tf.reduce_mean(tf.nn.sampled_softmax_loss(weights, tf.reshape(biases, [-1]), tf.reshape(targets, [-1, 1]),
                                                       hidden, sampled, vocab, sampled_values=samples,
                                                       remove_accidental_hits=True))
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5)


@pytest.mark.parametrize("vocab, sampled", [(2000, 128), (100_000, 8192)])
def test_stateless_sampler_draws_like_tensorflows_and_only_from_its_seed(vocab, sampled):
    labels = tf.constant([[0], [7], [vocab - 1]], tf.int64)
    draw = lambda a, b: lm1b.log_uniform_candidates(labels, sampled, vocab, tf.constant([a, b], tf.int64))
    ids, true_expected, sampled_expected = draw(1, 2)
    assert len(np.unique(ids.numpy())) == sampled and 0 <= ids.numpy().min() and ids.numpy().max() < vocab
    again = draw(1, 2)
    assert all(np.array_equal(x.numpy(), y.numpy()) for x, y in zip(again, (ids, true_expected, sampled_expected)))
    assert not np.array_equal(draw(1, 3)[0].numpy(), ids.numpy())
    # expected counts: the same distribution as tf.random.log_uniform_candidate_sampler(unique=True) ...
    ours = np.mean([draw(k, 9)[1].numpy()[:, 0] for k in range(30)], axis=0)
    theirs = np.mean([tf.random.log_uniform_candidate_sampler(labels, 1, sampled, True, vocab, seed=k)[1].numpy()[:, 0]
                      for k in range(30)], axis=0)
    np.testing.assert_allclose(ours, theirs, rtol=0.05)
    # ... and they are what they claim: how often an id is drawn, over many seeds
    rare = np.int64(vocab // 3)
    hits = np.mean([rare in draw(k, 11)[0].numpy() for k in range(400)])
    rare_expected = np.mean([lm1b.log_uniform_candidates(tf.constant([[rare]]), sampled, vocab,
                                                         tf.constant([k, 11], tf.int64))[1].numpy()[0, 0]
                             for k in range(400)])
    assert abs(hits - rare_expected) < 4 * np.sqrt(rare_expected * (1 - rare_expected) / 400) + 0.01, (hits, rare_expected)


def test_stateless_sampler_in_a_graph_equals_eager_when_it_needs_several_chunks():
    """2000 distinct of 3000 ids take several chunks of draws; in a tf.function, Grappler once folded the size of the
    loop's draws to the first chunk's (an INVALID_ARGUMENT in lm1b_sparse's training step)."""
    labels = tf.constant([[1], [2999]], tf.int64)
    seed = tf.constant([1, 2], tf.int64)
    eager = lm1b.log_uniform_candidates(labels, 2000, 3000, seed)
    graph = tf.function(lambda s: lm1b.log_uniform_candidates(labels, 2000, 3000, s))(seed)
    for got, want in zip(graph, eager):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    p = np.log(3001 / 3000) / np.log(3001)  # id 2999's probability; its expected count is 1 - (1 - p)^draws
    draws = np.log1p(-float(eager[1].numpy()[1, 0])) / np.log1p(-p)
    assert draws > 4000, draws  # more than one chunk (4000 draws) was needed


def test_lm1b_training_randomness_follows_the_step_only():
    config = lm1b.preset("lm1b_tiny", dropout=0.5)
    ids = tf.constant(np.arange(20).reshape(2, 10), tf.int32)

    def masks(stream, step):
        tf.keras.utils.set_random_seed(1)
        model = lm1b.LM1B(config, seed=3, stream=stream)
        model.compile(optimizer=lm1b.make_optimizer(config))
        model.optimizer.iterations.assign(step)
        return model(ids, training=True).numpy()

    assert np.array_equal(masks(0, 5), masks(0, 5))
    assert not np.array_equal(masks(0, 5), masks(0, 6)) and not np.array_equal(masks(0, 5), masks(1, 5))
    model = lm1b.LM1B(config, seed=3, stream=1)
    assert lm1b.LM1B.from_config(model.get_config()).stream == 1


def test_lm1b_gradients_of_tables_are_sparse():
    model = lm1b.LM1B(lm1b.preset("lm1b_tiny"))
    ids = tf.constant(np.arange(20).reshape(2, 10), tf.int32)
    with tf.GradientTape() as tape:
        candidates = lm1b.log_uniform_candidates(tf.reshape(tf.cast(ids, tf.int64), [-1, 1]), 16,
                                                 model.config.vocab_size, tf.constant([0, 0], tf.int64))
        loss = lm1b.sampled_softmax_loss(model.softmax_w.embeddings, model.softmax_b.embeddings, ids, model(ids),
                                         candidates)
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
    (tmp_path / "latin1.txt").write_bytes("<S> 1\ncaf\xe9 2\n".encode("latin-1"))
    vocab = lm1b_data.Vocabulary(["<S>", "<UNK>"])
    for read in (lm1b_data.Vocabulary.load, lambda path: lm1b_data.windows([path], vocab, 2),
                 lambda path: lm1b_data.build_vocabulary([path], str(tmp_path / "out.txt"))):
        with pytest.raises(ValueError, match=r"latin1.txt:2 is not UTF-8 text \(byte 0xe9 at column 4\)"):
            read(str(tmp_path / "latin1.txt"))


def test_bad_config_files_are_named(tmp_path):
    cases = {"broken": ('{"model": "lm1b", "batch_size": ', r"broken.json is not valid JSON: Expecting value at line 1"),
             "array": ('["lm1b"]', r"must hold one JSON object of fields .*Received: a JSON array"),
             "unnamed": ('{"batch_size": 4}', r'"model": "lm1b" .*Received: "model": null'),
             "typo": ('{"model": "lm1b", "batch_sz": 4}', r"field\(s\) that LMConfig does not know: .*'batch_size'.*"
                                                          r"Received: \['batch_sz'\]")}
    for name, (text, message) in cases.items():
        (tmp_path / f"{name}.json").write_text(text)
        with pytest.raises(ValueError, match=message):
            lm1b.preset(str(tmp_path / f"{name}.json"))
    (tmp_path / "r.json").write_text('{"model": "resnet", "blockz": [1]}')
    with pytest.raises(ValueError, match=r"field\(s\) that ResNetConfig does not know: .*Received: \['blockz'\]"):
        resnet.preset(str(tmp_path / "r.json"))
    with pytest.raises(ValueError, match=r"Unknown preset 'lm2b'; choose one of \['lm1b', .*'resnet50_tiny'\]"):
        presets.model_of("lm2b")
    assert presets.model_of("lm1b_tiny") == "lm1b" and presets.model_of(str(tmp_path / "r.json")) == "resnet"


def test_a_file_that_is_not_a_tfrecord_is_named(tmp_path):
    good = str(tmp_path / "train-00000-of-00002")
    with tf.io.TFRecordWriter(good) as writer:
        imagenet_data.write_example(writer, tf.io.encode_jpeg(np.zeros((8, 8, 3), np.uint8)).numpy(), 1)
    bad = tmp_path / "train-00001-of-00002"
    bad.write_bytes(b"not a record file, just text that happens to be here\n" * 20)
    assert imagenet_data.count_records([good]) == 1
    with pytest.raises(ValueError, match=r"train-00001-of-00002 is not a readable TFRecord file \(corrupted record "
                                         r"at 0 .*\)\. Rewrite it or move it out of --data_dir"):
        imagenet_data.count_records([good, str(bad)])


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
    with pytest.raises(ValueError, match=r'must say which model it configures with "model": "resnet" .*Received: '
                                         r'"model": "lm1b"'):
        resnet.preset(str(custom))
    assert lm1b.make_optimizer(lm1b.preset("lm1b_tiny")).global_clipnorm is None
    assert lm1b.make_optimizer(lm1b.preset("lm1b_tiny", global_clipnorm=2.5)).global_clipnorm == 2.5
    with pytest.raises(ValueError, match=r"global_clipnorm must be a number > 0, or null for none. Received: "
                                         r"global_clipnorm=0"):
        lm1b.preset("lm1b_tiny", global_clipnorm=0)
