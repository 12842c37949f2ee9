"""Ordinary Keras programs, written as a user would. Each ``run(scope, batch)`` builds, compiles and fits its model
inside ``scope()`` (a plain ``contextlib.nullcontext`` in the single-process reference, ``strategy.scope`` under
kparallax) with ``batch`` rows per step (the global batch in the reference, the per-worker batch under kparallax),
and returns the trained model (with ``model.logged``, arrays of logged values, where a program checks its logs).
Never imports kparallax."""

import os
import tempfile
import time

import numpy as np
import tensorflow as tf
from tensorflow.nn import compute_average_loss  # AverageLossStep: a name bound before any training step

VOCAB, EMB, LEN, ROWS, WORKERS = 120, 6, 5, 128, 2
# This process's worker index and the job's worker count (strategy.worker_index / num_workers under kparallax; the
# runner sets them), for a program that feeds each worker its own batches.
RANK, RUN_WORKERS = 0, 1


def _weights_in_order(model):
    """``model``'s weights, one per value of ``model.get_weights()``: ``model.weights`` in one process. The runner
    replaces it under kparallax with partitioned tables, whose stripes ``model.weights`` lists one by one while
    ``get_weights`` gives each table whole."""
    return model.weights


WEIGHTS_IN_ORDER = _weights_in_order


def pair_weights_per_table(table_of):
    """Under kparallax: ``WEIGHTS_IN_ORDER`` takes a partitioned table's first stripe for the whole table
    (``table_of``: the strategy's ``registry.table_of``, (table, stripe index) of a stripe, else None)."""
    global WEIGHTS_IN_ORDER  # pylint: disable=global-statement
    WEIGHTS_IN_ORDER = lambda model: [v for v in model.weights if (table_of(v) or (0, 0))[1] == 0]


def _ids(seed):
    rng = np.random.default_rng(seed)
    return np.minimum(rng.zipf(1.4, size=(ROWS, LEN)) - 1, VOCAB - 1).astype(np.int32), rng


def _init(model, seed=21):
    """Fixed random values for the trainable weights (adapted preprocessing state is kept)."""
    rng = np.random.default_rng(seed)
    trainable = {id(v) for v in model.trainable_weights}
    model.set_weights([rng.normal(scale=0.2, size=w.shape).astype(w.dtype) if id(v) in trainable else w
                       for v, w in zip(WEIGHTS_IN_ORDER(model), model.get_weights())])


def _pooled_regressor():
    """ids -> Embedding -> GlobalAveragePooling1D -> Dense(1), at the fixed weights of ``_init``."""
    model = tf.keras.Sequential([tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.layers.Embedding(VOCAB, EMB),
                                 tf.keras.layers.GlobalAveragePooling1D(), tf.keras.layers.Dense(1)])
    _init(model)
    return model


def _fit_on_partial_batches(scope, batch, seed, make_model, learning_rate, loss=None):
    """``make_model()`` called on one row, set to fixed weights, compiled with SGD(``learning_rate``) (and ``loss``)
    and fit for 2 epochs on ids -> y from a dataset of ROWS - 10 rows batched by ``batch``, whose last batch is
    partial (16 + 6 rows on the workers in the last step, 22 in one process). Returns (model, History)."""
    ids, rng = _ids(seed)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    rows = ROWS - 10
    with scope():
        model = make_model()
        model(ids[:1])
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.SGD(learning_rate), loss=loss)
        history = model.fit(tf.data.Dataset.from_tensor_slices((ids[:rows], y[:rows])).batch(batch), epochs=2,
                            verbose=0)
    return model, history


def dict_inputs_auc(scope, batch):
    """Functional model with dict inputs, two towers, an AUC metric, binary cross-entropy."""
    ids, rng = _ids(1)
    dense = rng.normal(size=(ROWS, 3)).astype(np.float32)
    y = (rng.random(ROWS) < 0.4).astype(np.float32)
    with scope():
        inputs = {"ids": tf.keras.Input((LEN,), dtype=tf.int32, name="ids"),
                  "features": tf.keras.Input((3,), name="features")}
        x = tf.keras.layers.GlobalAveragePooling1D()(tf.keras.layers.Embedding(VOCAB, EMB)(inputs["ids"]))
        x = tf.keras.layers.Concatenate()([x, tf.keras.layers.Dense(4, activation="relu")(inputs["features"])])
        model = tf.keras.Model(inputs, tf.keras.layers.Dense(1, activation="sigmoid")(x))
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss="binary_crossentropy",
                      metrics=[tf.keras.metrics.AUC()])
        model.fit({"ids": ids, "features": dense}, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    return model


def tf_data_unknown_cardinality(scope, batch):
    """Sequential model fed a batched tf.data pipeline whose length TensorFlow cannot know (a filter)."""
    ids, rng = _ids(2)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        model = tf.keras.Sequential([tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.layers.Embedding(VOCAB, EMB),
                                     tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)])
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
        data = tf.data.Dataset.from_tensor_slices((ids, y)).batch(batch).filter(lambda a, b: True).repeat()
        model.fit(data, steps_per_epoch=3, epochs=2, verbose=0)
    return model


def tf_data_known_cardinality(scope, batch):
    """A batched tf.data pipeline of known length, with per-sample weights in the dataset."""
    ids, rng = _ids(11)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    weights = rng.uniform(0.5, 2.0, size=(ROWS,)).astype(np.float32)
    with scope():
        model = tf.keras.Sequential([tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.layers.Embedding(VOCAB, EMB),
                                     tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)])
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adagrad(0.3), loss="mse")
        model.fit(tf.data.Dataset.from_tensor_slices((ids, y, weights)).batch(batch), epochs=2, verbose=0)
    return model


def weighted_samples(scope, batch):
    """class_weight on a classifier, with a regularized table."""
    ids, rng = _ids(3)
    y = rng.integers(0, 3, size=ROWS).astype(np.int32)
    with scope():
        model = tf.keras.Sequential([
            tf.keras.Input((LEN,), dtype=tf.int32),
            tf.keras.layers.Embedding(VOCAB, EMB, embeddings_regularizer=tf.keras.regularizers.l2(1e-3)),
            tf.keras.layers.GlobalAveragePooling1D(), tf.keras.layers.Dense(3)])
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adagrad(0.3),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(ids, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, class_weight={0: 1.0, 1: 2.0, 2: 0.5})
    return model


def mask_zero_lstm_callbacks(scope, batch):
    """mask_zero Embedding + LSTM with validation_split, EarlyStopping(restore_best_weights) and
    ReduceLROnPlateau."""
    ids, rng = _ids(4)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        model = tf.keras.Sequential([tf.keras.Input((LEN,), dtype=tf.int32),
                                     tf.keras.layers.Embedding(VOCAB, EMB, mask_zero=True),
                                     tf.keras.layers.LSTM(4), tf.keras.layers.Dense(1)])
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss="mse")
        model.fit(ids, y, batch_size=batch, epochs=4, shuffle=False, verbose=0, validation_split=0.25,
                  callbacks=[tf.keras.callbacks.EarlyStopping(patience=1, restore_best_weights=True),
                             tf.keras.callbacks.ReduceLROnPlateau(patience=1, factor=0.5)])
    return model


class CustomStep(tf.keras.Model):
    """Subclassed model with lazily built weights and its own train_step."""

    def __init__(self):
        super().__init__()
        self.table = tf.keras.layers.Embedding(VOCAB, EMB)
        self.out = tf.keras.layers.Dense(1)

    def call(self, ids):
        return self.out(tf.reduce_sum(self.table(ids), axis=1))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables))
        return {"loss": loss}


def custom_train_step(scope, batch):
    ids, rng = _ids(5)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        model = CustomStep()
        model(ids[:1])
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.SGD(0.05))
        model.fit(ids, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    return model


class ClippedStep(tf.keras.Model):
    """A custom train_step that clips its gradients before applying them, as Keras' guides and many models (LM1B's
    LSTM) do: by their global norm (the replicated weights' only, or every gradient with the table's), or ``each``
    by its own norm (``"whole"``: the gradient's, ``"row"``: each row's), and the output bias's by value."""

    def __init__(self, clip_table, each=None, via_tf_gradients=False):
        super().__init__()
        self.clip_table = clip_table
        self.each = each
        self.via_tf_gradients = via_tf_gradients
        self.table = tf.keras.layers.Embedding(VOCAB, EMB)
        self.hidden = tf.keras.layers.Dense(8, activation="tanh")
        self.out = tf.keras.layers.Dense(1, dtype="float32")

    def call(self, ids):
        return self.out(self.hidden(tf.reduce_mean(self.table(ids), axis=1)))

    def train_step(self, data):
        x, y = data
        scaled = isinstance(self.optimizer, tf.keras.mixed_precision.LossScaleOptimizer)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(self(x, training=True), tf.float32) - y))
            target = self.optimizer.get_scaled_loss(loss) if scaled else loss
        variables = self.trainable_variables
        grads = tf.gradients(target, variables) if self.via_tf_gradients else tape.gradient(target, variables)
        if scaled:  # mixed precision's loss scale, as Keras' guide for a custom train_step does it
            grads = self.optimizer.get_unscaled_gradients(grads)
        if self.each:
            grads = [tf.clip_by_norm(g, 0.02, axes=[-1] if self.each == "row" else None) for g in grads]
        else:
            clipped = [i for i, v in enumerate(variables) if self.clip_table or "embedding" not in v.name]
            for i, g in zip(clipped, tf.clip_by_global_norm([grads[i] for i in clipped], 0.05)[0]):
                grads[i] = g
        grads[-1] = tf.clip_by_value(grads[-1], -0.004, 0.004)  # the output bias
        self.optimizer.apply_gradients(zip(grads, variables))
        return {"loss": loss}


def _clipped(scope, batch, clip_table, each=None, via_tf_gradients=False):
    ids, rng = _ids(19)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32) * 3
    data = tf.data.Dataset.from_tensor_slices((ids[:118], y[:118]))
    logged = _Logged()
    with scope():
        model = ClippedStep(clip_table, each, via_tf_gradients)
        model(ids[:1])
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.SGD(0.5))
        model.fit(data.batch(batch), epochs=2, verbose=0, callbacks=[logged])
    model.logged = [np.array(logged.batches)]
    return model


def clipped_gradients(scope, batch):
    """ClippedStep clipping the replicated weights' gradients by their global norm (binding at every step), with a
    table on the PS, on a dataset with a partial last batch (16 + 6 rows on the workers in the last step)."""
    return _clipped(scope, batch, clip_table=False)


def clipped_by_tf_gradients(scope, batch):
    """clipped_gradients, its gradients taken by tf.gradients instead of its tape."""
    return _clipped(scope, batch, clip_table=False, via_tf_gradients=True)


def clipped_with_table(scope, batch):
    """ClippedStep clipping every gradient by one global norm, the PS table's included."""
    return _clipped(scope, batch, clip_table=True)


def clipped_each(scope, batch):
    """ClippedStep clipping each gradient by its own norm (tf.clip_by_norm), the PS table's included. With the table
    in stripes that is each stripe's norm, so kparallax refuses it there (test_launcher.py)."""
    return _clipped(scope, batch, clip_table=True, each="whole")


def clipped_each_row(scope, batch):
    """ClippedStep clipping each row of each gradient by the row's norm (tf.clip_by_norm(g, c, axes=[-1])): one
    process's clip with the table in stripes too, since each row lies in one stripe."""
    return _clipped(scope, batch, clip_table=True, each="row")


def mixed_float16_clipped(scope, batch):
    """clipped_gradients under the mixed_float16 policy: the train_step scales its loss and unscales its gradients
    with Keras' loss-scale optimizer before clipping them."""
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        return _clipped(scope, batch, clip_table=False)
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")


def text_vectorization(scope, batch):
    """String input through an adapted TextVectorization layer into a table."""
    words = np.array(["red", "green", "blue", "cat", "dog", "runs", "sits", "the", "a", "far"])
    rng = np.random.default_rng(6)
    texts = np.array([" ".join(rng.choice(words, size=4)) for _ in range(ROWS)])
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        vectorize = tf.keras.layers.TextVectorization(max_tokens=16, output_sequence_length=4)
        vectorize.adapt(texts)
        text = tf.keras.Input((), dtype=tf.string)
        x = tf.keras.layers.Flatten()(tf.keras.layers.Embedding(16, EMB)(vectorize(text)))
        model = tf.keras.Model(text, tf.keras.layers.Dense(1)(x))
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss="mse")
        model.fit(texts, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    return model


def lookup_layers(scope, batch):
    """StringLookup, IntegerLookup, Hashing (each feeding a table), Normalization and Discretization, adapted."""
    rng = np.random.default_rng(7)
    colors = rng.choice(np.array(["red", "green", "blue", "cyan"]), size=(ROWS, 1))
    codes = rng.choice(np.array([3, 7, 11, 19, 23]), size=(ROWS, 1)).astype(np.int64)
    amount = rng.gamma(2.0, size=(ROWS, 1)).astype(np.float32)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        string_lookup, integer_lookup = tf.keras.layers.StringLookup(), tf.keras.layers.IntegerLookup()
        normalization = tf.keras.layers.Normalization()
        discretization = tf.keras.layers.Discretization(num_bins=4)
        string_lookup.adapt(colors)
        integer_lookup.adapt(codes)
        normalization.adapt(amount)
        discretization.adapt(amount)
        inputs = [tf.keras.Input((1,), dtype=tf.string), tf.keras.Input((1,), dtype=tf.int64), tf.keras.Input((1,))]
        parts = [tf.keras.layers.Flatten()(tf.keras.layers.Embedding(8, 3)(string_lookup(inputs[0]))),
                 tf.keras.layers.Flatten()(tf.keras.layers.Embedding(8, 3)(integer_lookup(inputs[1]))),
                 tf.keras.layers.Flatten()(tf.keras.layers.Embedding(5, 3)(tf.keras.layers.Hashing(5)(inputs[0]))),
                 tf.keras.layers.Flatten()(tf.keras.layers.Embedding(4, 3)(discretization(inputs[2]))),
                 normalization(inputs[2])]
        model = tf.keras.Model(inputs, tf.keras.layers.Dense(1)(tf.keras.layers.Concatenate()(parts)))
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss="mse")
        model.fit([colors, codes, amount], y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    return model


def encoded_features(scope, batch):
    """Keras' preprocessing layers encoding inside the model: a bag of words and bigrams (TextVectorization,
    tf_idf), StringLookup one_hot, IntegerLookup count, Hashing multi_hot, CategoryEncoding multi_hot (each a
    bincount per row, sized by the batch's largest id clamped to the layer's depth), a HashedCrossing into a table."""
    words = np.array(["red", "green", "blue", "cat", "dog", "runs", "sits", "the", "a", "far"])
    rng = np.random.default_rng(75)
    texts = np.array([" ".join(rng.choice(words, size=rng.integers(2, 6))) for _ in range(ROWS)])
    colors = rng.choice(np.array(["red", "green", "blue", "cyan"]), size=(ROWS, 1))
    codes = rng.choice(np.array([3, 7, 11, 19, 23]), size=(ROWS, 3)).astype(np.int64)
    first, second = (rng.integers(0, n, size=(ROWS, 1)).astype(np.int64) for n in (7, 5))
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        vectorize = tf.keras.layers.TextVectorization(max_tokens=24, ngrams=2, output_mode="tf_idf")
        string_lookup = tf.keras.layers.StringLookup(output_mode="one_hot")
        integer_lookup = tf.keras.layers.IntegerLookup(output_mode="count")
        vectorize.adapt(texts)
        string_lookup.adapt(colors)
        integer_lookup.adapt(codes)
        text, color = tf.keras.Input((), dtype=tf.string), tf.keras.Input((1,), dtype=tf.string)
        code, one, two = (tf.keras.Input((k,), dtype=tf.int64) for k in (3, 1, 1))
        crossed = tf.keras.layers.HashedCrossing(num_bins=30)((one, two))
        parts = [vectorize(text), string_lookup(color), integer_lookup(code),
                 tf.keras.layers.Hashing(9, output_mode="multi_hot")(code),
                 tf.keras.layers.CategoryEncoding(7, output_mode="multi_hot")(one),
                 tf.keras.layers.Flatten()(tf.keras.layers.Embedding(30, 4)(crossed))]
        h = tf.keras.layers.Dense(6, activation="relu")(tf.keras.layers.Concatenate()(parts))
        model = tf.keras.Model([text, color, code, one, two], tf.keras.layers.Dense(1)(h))
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="huber", metrics=["mae"])
        history = model.fit([texts, colors, codes, first, second], y, batch_size=batch, epochs=3, shuffle=False,
                            verbose=0)
    model.logged = [np.array(history.history["loss"]), np.array(history.history["mae"])]
    return model


def padded_in_the_model(scope, batch):
    """Ragged inputs padded inside the model to each batch's longest row, read without a mask: TextVectorization
    (int, no output_sequence_length) into a table averaged over the padded steps, and a ragged id input made dense by
    ``to_tensor()`` into a table, a Conv1D and a max over the steps; long rows are rare (a worker's part of a batch
    is often padded shorter than the global batch), then evaluate."""
    words = np.array(["red", "green", "blue", "cat", "dog", "runs", "sits", "the", "a", "far"])
    rng = np.random.default_rng(76)
    lengths = rng.choice([1, 2, 3, 9], p=[0.3, 0.3, 0.33, 0.07], size=ROWS)
    texts = np.array([" ".join(rng.choice(words, size=n)) for n in lengths])
    ids = tf.ragged.constant([rng.integers(1, VOCAB, size=n).tolist() for n in lengths[::-1]], dtype=tf.int64)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        vectorize = tf.keras.layers.TextVectorization(max_tokens=16)
        vectorize.adapt(texts)
        text, ragged = tf.keras.Input((), dtype=tf.string), tf.keras.Input((None,), dtype=tf.int64, ragged=True)
        averaged = tf.keras.layers.GlobalAveragePooling1D()(tf.keras.layers.Embedding(16, EMB)(vectorize(text)))
        padded = tf.keras.layers.Lambda(lambda r: r.to_tensor())(ragged)
        h = tf.keras.layers.Conv1D(4, 2, padding="same", activation="relu")(tf.keras.layers.Embedding(VOCAB, 3)(padded))
        pooled = tf.keras.layers.GlobalMaxPooling1D()(h)
        joined = tf.keras.layers.Concatenate()([averaged, pooled])
        model = tf.keras.Model([text, ragged], tf.keras.layers.Dense(1)(joined))
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss="mse")
        history = model.fit([texts, ids], y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
        evaluated = model.evaluate([texts, ids], y, batch_size=32, verbose=0)  # the same batches in both
    model.logged = [np.array(history.history["loss"]), np.array([evaluated])]
    return model


def feature_columns(scope, batch):
    """A DenseFeatures layer of feature columns: embedding columns (mean and sqrtn combiners; int ids with missing
    entries, -1), an indicator column and a numeric one; Adagrad, AUC."""
    ids, rng = _ids(71)
    other = rng.integers(0, 40, size=(ROWS, 3)).astype(np.int64)
    other[rng.random((ROWS, 3)) < 0.3] = -1
    numbers = rng.normal(size=(ROWS, 2)).astype(np.float32)
    y = (rng.random((ROWS, 1)) < 0.4).astype(np.float32)
    fc = tf.feature_column
    columns = [fc.embedding_column(fc.categorical_column_with_identity("a", VOCAB), EMB, combiner="mean"),
               fc.embedding_column(fc.categorical_column_with_identity("b", 40), 3, combiner="sqrtn"),
               fc.indicator_column(fc.categorical_column_with_identity("c", 40)), fc.numeric_column("n", shape=(2,))]
    x = {"a": ids.astype(np.int64), "b": other, "c": other, "n": numbers}
    with scope():
        inputs = {name: tf.keras.Input(value.shape[1:], dtype=value.dtype, name=name) for name, value in x.items()}
        h = tf.keras.layers.Dense(8, activation="relu")(tf.keras.layers.DenseFeatures(columns)(inputs))
        model = tf.keras.Model(inputs, tf.keras.layers.Dense(1, activation="sigmoid")(h))
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adagrad(0.1), loss="binary_crossentropy",
                      metrics=[tf.keras.metrics.AUC()])
        logged = _Logged()
        model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, callbacks=[logged])
    model.logged = [np.array(logged.epochs)]
    return model


class WeightedBag(tf.keras.layers.Layer):
    """A user's layer: each row's weighted bag of ids (a SparseTensor of ids and one of their weights) by
    ``tf.nn.embedding_lookup_sparse`` from its own table."""

    def __init__(self, vocab, dim, combiner, **kwargs):
        super().__init__(**kwargs)
        self.vocab, self.dim, self.combiner = vocab, dim, combiner

    def build(self, input_shape):
        self.table = self.add_weight("table", (self.vocab, self.dim), initializer="uniform")

    def call(self, inputs):
        ids, weights = inputs
        return tf.nn.embedding_lookup_sparse(self.table, ids, weights, combiner=self.combiner)


def weighted_bags(scope, batch):
    """Two WeightedBag layers (sqrtn and sum) on SparseTensor ids and weights, fed to fit as tensors."""
    ids, rng = _ids(72)
    lengths = rng.integers(1, LEN + 1, size=ROWS)
    where = np.array([[r, c] for r in range(ROWS) for c in range(lengths[r])], np.int64)
    sparse_ids = tf.SparseTensor(where, np.array([ids[r, c] for r, c in where], np.int64), (ROWS, LEN))
    sparse_weights = tf.SparseTensor(where, rng.random(len(where)).astype(np.float32) + 0.5, (ROWS, LEN))
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        ids_in, weights_in = tf.keras.Input((LEN,), sparse=True, dtype=tf.int64), tf.keras.Input((LEN,), sparse=True)
        bags = [WeightedBag(VOCAB, EMB, "sqrtn")([ids_in, weights_in]),
                WeightedBag(VOCAB, 3, "sum")([ids_in, weights_in])]
        model = tf.keras.Model([ids_in, weights_in], tf.keras.layers.Dense(1)(tf.keras.layers.Concatenate()(bags)))
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss="mse")
        history = model.fit([sparse_ids, sparse_weights], y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    model.logged = [np.array(history.history["loss"])]
    return model


def shared_layer(scope, batch):
    """Two models in one scope sharing an Embedding layer, trained one after the other."""
    ids, rng = _ids(8)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        shared = tf.keras.layers.Embedding(VOCAB, EMB)
        models = []
        for _ in range(2):
            inputs = tf.keras.Input((LEN,), dtype=tf.int32)
            models.append(tf.keras.Model(inputs, tf.keras.layers.Dense(1)(tf.keras.layers.Flatten()(shared(inputs)))))
        _init(models[0])
        _init(models[1], seed=22)
        for model in models:
            model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
            model.fit(ids, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return models[1]


def keras_callbacks(scope, batch):
    """ModelCheckpoint (h5 weights-only and full TF format), CSVLogger, TensorBoard with histograms and
    BackupAndRestore around an ordinary fit: training is unchanged and the files load; only worker 0 writes model,
    CSV and TensorBoard files."""
    ids, rng = _ids(9)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    directory = tempfile.mkdtemp(prefix="kp_callbacks_")
    with scope():
        model = tf.keras.Sequential([tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.layers.Embedding(VOCAB, EMB),
                                     tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)])
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss="mse")
        model.fit(ids, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, callbacks=[
            tf.keras.callbacks.ModelCheckpoint(os.path.join(directory, "w.h5"), save_weights_only=True),
            tf.keras.callbacks.ModelCheckpoint(os.path.join(directory, "full_tf"), save_format="tf"),
            tf.keras.callbacks.CSVLogger(os.path.join(directory, "log.csv")),
            tf.keras.callbacks.TensorBoard(os.path.join(directory, "tb"), histogram_freq=1),
            tf.keras.callbacks.BackupAndRestore(os.path.join(directory, "backup"))])
    if os.path.exists(os.path.join(directory, "w.h5")):  # worker 0 (or the plain process) wrote them
        # Built outside the scope: a model only some workers build must hold no PS variables (the others' later
        # ones would be named or placed differently).
        again = tf.keras.models.clone_model(model)
        again.load_weights(os.path.join(directory, "w.h5"))
        for a, b in zip(again.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(a, b)
        assert len(open(os.path.join(directory, "log.csv"), encoding="utf-8").read().splitlines()) == 3
        assert os.listdir(os.path.join(directory, "tb", "train"))
    else:  # the other workers write no file of their logs either
        assert not os.path.exists(os.path.join(directory, "log.csv")) and not os.path.exists(
            os.path.join(directory, "tb")), os.listdir(directory)
    return model


def _fit_mixed_precision(scope, batch, seed, policy="mixed_float16", overflow=False):
    """A table, a hidden layer and a float32 output trained under a mixed-precision policy (float32 variables):
    with Adam under mixed_float16 (float16 compute, Keras' loss-scale optimizer), with SGD under mixed_bfloat16
    (bfloat16 compute, no loss scaling). With ``overflow``, the targets of the odd rows 33-63 (worker 1's whole
    second batch: arrays are sharded by stride) are 10^4. Returns (model, History)."""
    ids, rng = _ids(seed)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    if overflow:
        y[33:64:2] = 1e4
    tf.keras.mixed_precision.set_global_policy(policy)
    try:
        with scope():
            model = tf.keras.Sequential([tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.layers.Embedding(VOCAB, EMB),
                                         tf.keras.layers.Flatten(), tf.keras.layers.Dense(4, activation="relu"),
                                         tf.keras.layers.Dense(1, dtype="float32")])
            _init(model)
            optimizer = tf.keras.optimizers.Adam(0.02) if policy == "mixed_float16" else tf.keras.optimizers.SGD(0.05)
            model.compile(optimizer=optimizer, loss="mse")
            history = model.fit(ids, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
        assert model.layers[0].compute_dtype == policy[len("mixed_"):], model.layers[0].compute_dtype
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    return model, history


def mixed_float16(scope, batch):
    """The mixed_float16 policy (float16 compute, float32 variables, Keras' loss-scale optimizer)."""
    return _fit_mixed_precision(scope, batch, 10)[0]


def mixed_bfloat16(scope, batch):
    """The mixed_bfloat16 policy with SGD. Each worker's half-batch gradient is rounded to bfloat16 apart from the
    global batch's, so the weights agree to bfloat16 precision only; SGD keeps that rounding as small as it is
    (Adam's division by the root of its second moment would blow up the rounding of near-zero gradients)."""
    model, history = _fit_mixed_precision(scope, batch, 61, policy="mixed_bfloat16")
    model.logged = [np.array(history.history["loss"])]
    return model


def mixed_float16_overflow(scope, batch):
    """mixed_float16 where one worker's gradients overflow and the other's do not: worker 1's second batch has
    targets of 10^4, so that step's float16 gradients are infinite at the loss scales Keras tries, in one process
    and on worker 1. One process skips the step (and halves its loss scale); so must every worker. Adam: its step
    count includes skipped steps. The final loss scale and step count are kept with the epoch losses."""
    model, history = _fit_mixed_precision(scope, batch, 12, overflow=True)
    model.logged = [np.array(history.history["loss"]),
                    np.array([float(model.optimizer.loss_scale), float(model.optimizer.iterations)])]
    return model

def batch_normalization(scope, batch):
    """BatchNormalization built with Keras' synchronized=True on images, on a Dense layer's output, on a masked
    sequence of embeddings; inputs far from zero mean. One process normalizes the global batch; the synchronized
    layers normalize with statistics over every worker's batch (moving statistics included)."""
    ids, rng = _ids(11)
    ids[::3, -2:] = 0  # padding for mask_zero
    images = (rng.normal(size=(ROWS, 6, 6, 2)) * 2.0 + 3.0).astype(np.float32)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        image_in = tf.keras.Input((6, 6, 2), name="images")
        ids_in = tf.keras.Input((LEN,), dtype=tf.int32, name="ids")
        h = tf.keras.layers.Conv2D(4, 3, use_bias=False)(image_in)
        h = tf.keras.layers.BatchNormalization(momentum=0.7, synchronized=True)(h)
        h = tf.keras.layers.GlobalAveragePooling2D()(tf.keras.layers.ReLU()(h))
        e = tf.keras.layers.Embedding(VOCAB, EMB, mask_zero=True)(ids_in)
        e = tf.keras.layers.GlobalAveragePooling1D()(
            tf.keras.layers.BatchNormalization(momentum=0.5, synchronized=True)(e))
        h = tf.keras.layers.Dense(6, use_bias=False)(tf.keras.layers.Concatenate()([h, e]))
        h = tf.keras.layers.BatchNormalization(momentum=0.8, center=False, synchronized=True)(h)
        h = tf.keras.layers.BatchNormalization(synchronized=True, scale=False)(tf.keras.layers.ReLU()(h))
        model = tf.keras.Model({"images": image_in, "ids": ids_in}, tf.keras.layers.Dense(1)(h))
        _init(model)
        # SGD, not Adam: a BatchNormalization cancels some gradients exactly (e.g. a shift of the next one's input),
        # and Adam turns their float32 rounding noise into full-size steps.
        model.compile(optimizer=tf.keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
        model.fit({"images": images, "ids": ids}, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    return model


class _Logged(tf.keras.callbacks.Callback):
    """Keeps every batch's and epoch's logs, in key order, each flattened (a number, or a metric's array result)."""

    def __init__(self):
        super().__init__()
        self.batches, self.epochs = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(np.concatenate([np.ravel(logs[k]) for k in sorted(logs)]))

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(np.concatenate([np.ravel(logs[k]) for k in sorted(logs)]))


def bidirectional_tagger(scope, batch):
    """Sequence tagging: a mask_zero table, a Bidirectional LSTM, a Dense per token (TimeDistributed), temporal
    sample weights, weighted sparse categorical accuracy; every batch's logs."""
    ids, rng = _ids(73)
    lengths = rng.integers(2, LEN + 1, size=ROWS)
    ids = ids + 1
    for r in range(ROWS):
        ids[r, lengths[r]:] = 0
    tags = rng.integers(0, 4, size=(ROWS, LEN))
    weights = (ids > 0).astype(np.float32) * (1 + rng.random((ROWS, LEN)).astype(np.float32))
    with scope():
        inputs = tf.keras.Input((LEN,), dtype=tf.int32)
        h = tf.keras.layers.Embedding(VOCAB + 1, EMB, mask_zero=True)(inputs)
        h = tf.keras.layers.Bidirectional(tf.keras.layers.LSTM(5, return_sequences=True))(h)
        tags_out = tf.keras.layers.TimeDistributed(tf.keras.layers.Dense(4, activation="softmax"))(h)
        model = tf.keras.Model(inputs, tags_out)
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.RMSprop(0.01), loss="sparse_categorical_crossentropy",
                      weighted_metrics=["sparse_categorical_accuracy"])
        logged = _Logged()
        model.fit(ids, tags, sample_weight=weights, batch_size=batch, epochs=2, shuffle=False, verbose=0,
                  callbacks=[logged])
    model.logged = [np.array(logged.batches), np.array(logged.epochs)]
    return model


def _binary_data(seed):
    """Inputs (ids, 3 features) and 0/1 labels (40% ones) for ``_binary_classifier``."""
    ids, rng = _ids(seed)
    features = rng.normal(size=(ROWS, 3)).astype(np.float32)
    return (ids, features), (rng.random(ROWS) < 0.4).astype(np.float32)


def _binary_classifier():
    """Ids through a table, averaged, beside 3 features, into a sigmoid unit; fixed initial weights."""
    ids_in = tf.keras.Input((LEN,), dtype=tf.int32)
    features_in = tf.keras.Input((3,))
    h = tf.keras.layers.GlobalAveragePooling1D()(tf.keras.layers.Embedding(VOCAB, EMB)(ids_in))
    h = tf.keras.layers.Concatenate()([h, features_in])
    model = tf.keras.Model([ids_in, features_in], tf.keras.layers.Dense(1, activation="sigmoid")(h))
    _init(model)
    return model


def ratio_metrics(scope, batch):
    """AUC, precision, recall and accuracy: the logs of every batch and epoch equal one process's (a ratio of sums
    over the global batch is not the average of the workers' ratios), with validation (which resets the metrics
    before the epoch's end)."""
    (ids, features), y = _binary_data(14)
    logged = _Logged()
    with scope():
        model = _binary_classifier()
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss="binary_crossentropy",
                      metrics=[tf.keras.metrics.AUC(), tf.keras.metrics.Precision(thresholds=0.45),
                               tf.keras.metrics.Recall(thresholds=0.45), "accuracy"])
        model.fit([ids, features], y, batch_size=batch, epochs=2, shuffle=False, verbose=0, callbacks=[logged],
                  validation_split=0.25)
    model.logged = [np.array(logged.batches), np.array(logged.epochs)]
    return model


class F1(tf.keras.metrics.Metric):
    """A user's F1 metric: its own counts (add_weight states, summed across replicas as tf.distribute sums them)."""

    def __init__(self, threshold=0.5, name="f1", **kwargs):
        super().__init__(name=name, **kwargs)
        self.threshold = threshold
        self.tp, self.fp, self.fn = (self.add_weight(n, initializer="zeros") for n in ("tp", "fp", "fn"))

    def update_state(self, y_true, y_pred, sample_weight=None):
        predicted, y_true = tf.cast(y_pred > self.threshold, tf.float32), tf.cast(y_true, tf.float32)
        self.tp.assign_add(tf.reduce_sum(predicted * y_true))
        self.fp.assign_add(tf.reduce_sum(predicted * (1 - y_true)))
        self.fn.assign_add(tf.reduce_sum((1 - predicted) * y_true))

    def result(self):
        return 2 * self.tp / (2 * self.tp + self.fp + self.fn + 1e-7)


class RowsSeen(tf.keras.metrics.Metric):
    """A user's count of the rows trained on in the epoch."""

    def __init__(self, name="rows_seen", **kwargs):
        super().__init__(name=name, **kwargs)
        self.count = self.add_weight("count", initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.count.assign_add(tf.cast(tf.shape(y_true)[0], tf.float32))

    def result(self):
        return self.count


class PredictedTotal(tf.keras.metrics.Metric):
    """A user's sum of the predictions in the epoch, its state set to itself plus the batch's sum (an ``assign``
    that adds)."""

    def __init__(self, name="predicted_total", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_weight("total", initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign(self.total + tf.reduce_sum(y_pred))

    def result(self):
        return self.total


class LastBatchMean(tf.keras.metrics.Metric):
    """The last batch's mean prediction: a state aggregated as the MEAN over replicas."""

    def __init__(self, name="last_batch_mean", **kwargs):
        super().__init__(name=name, **kwargs)
        self.value = self.add_weight("value", initializer="zeros", aggregation=tf.VariableAggregation.MEAN)

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.value.assign(tf.reduce_mean(y_pred))

    def result(self):
        return self.value


class BatchesSeen(tf.keras.metrics.Metric):
    """A count of the steps in the epoch: the same on every replica, so taken from the first (ONLY_FIRST_REPLICA)."""

    def __init__(self, name="batches_seen", **kwargs):
        super().__init__(name=name, **kwargs)
        self.count = self.add_weight("count", initializer="zeros",
                                     aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.count.assign_add(1.0)

    def result(self):
        return self.count


class PositiveShareOfLabelOne(tf.keras.metrics.Metric):
    """Of the rows predicted positive, the share whose label is 1: counts per label kept with ``scatter_add``."""

    def __init__(self, name="positive_share_of_label_one", **kwargs):
        super().__init__(name=name, **kwargs)
        self.counts = self.add_weight("counts", shape=(2,), initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        positive = tf.cast(tf.reshape(y_pred, [-1]) > 0.5, tf.float32)
        self.counts.scatter_add(tf.IndexedSlices(positive, tf.cast(tf.reshape(y_true, [-1]), tf.int32)))

    def result(self):
        return tf.math.divide_no_nan(self.counts[1], tf.reduce_sum(self.counts))

    def reset_state(self):
        self.counts.assign(tf.zeros(2))


def custom_metric_classes(scope, batch):
    """Metric subclasses of a user's own (an F1 from its counts, a row count, a state averaged over replicas, a
    step count taken from the first replica, a sum of predictions assigned as itself plus the batch's, counts per
    label kept with scatter_add), with ReduceLROnPlateau watching the F1: every batch's and epoch's logs equal one
    process's."""
    (ids, features), y = _binary_data(41)
    logged = _Logged()
    with scope():
        model = _binary_classifier()
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss="binary_crossentropy",
                      metrics=[F1(threshold=0.45), RowsSeen(), LastBatchMean(), BatchesSeen(), PredictedTotal(),
                               PositiveShareOfLabelOne()])
        model.fit([ids, features], y, batch_size=batch, epochs=4, shuffle=False, verbose=0,
                  callbacks=[logged, tf.keras.callbacks.ReduceLROnPlateau("f1", mode="max", factor=0.5, patience=0)])
    model.logged = [np.array(logged.batches), np.array(logged.epochs)]
    return model


def vector_metric_results(scope, batch):
    """Keras' metrics whose result is not a scalar: F1Score per class (a vector of 3; a binary one's vector of 1)
    next to a macro F1, an IoU and an F-beta, with validation: every batch's and epoch's logs equal one process's."""
    ids, rng = _ids(35)
    labels = rng.integers(0, 3, size=(ROWS,))
    y = {"classes": np.eye(3, dtype=np.float32)[labels], "first": (labels == 0).astype(np.float32)[:, None]}
    logged = _Logged()
    with scope():
        ids_in = tf.keras.Input((LEN,), dtype=tf.int32)
        h = tf.keras.layers.GlobalAveragePooling1D()(tf.keras.layers.Embedding(VOCAB, EMB)(ids_in))
        model = tf.keras.Model(ids_in, {"classes": tf.keras.layers.Dense(3, activation="softmax", name="classes")(h),
                                        "first": tf.keras.layers.Dense(1, activation="sigmoid", name="first")(h)})
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.05),
                      loss={"classes": "categorical_crossentropy", "first": "binary_crossentropy"},
                      metrics={"classes": [tf.keras.metrics.F1Score(), tf.keras.metrics.F1Score(average="macro",
                                                                                                name="macro_f1"),
                                           tf.keras.metrics.OneHotIoU(3, [0, 1])],
                               "first": [tf.keras.metrics.F1Score(threshold=0.4),
                                         tf.keras.metrics.FBetaScore(beta=2.0, threshold=0.4)]})
        model.fit(ids, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, callbacks=[logged],
                  validation_split=0.25)
    model.logged = [np.array(logged.batches), np.array(logged.epochs)]
    return model


def sparse_and_ragged_inputs(scope, batch):
    """Wide and deep: a multi-hot tf.SparseTensor input into a Dense layer (wide) and ragged id lists into a table
    (deep), fed to fit as tensors."""
    ids, rng = _ids(51)
    lengths = rng.integers(1, LEN + 1, size=ROWS)
    hot = np.array([[r, c] for r in range(ROWS) for c in sorted(set(ids[r].tolist()))], np.int64)
    wide = tf.SparseTensor(hot, np.ones(len(hot), np.float32), (ROWS, VOCAB))
    deep = tf.ragged.constant([ids[r, :lengths[r]].tolist() for r in range(ROWS)], dtype=tf.int32)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        wide_in = tf.keras.Input((VOCAB,), sparse=True)
        deep_in = tf.keras.Input((None,), dtype=tf.int32, ragged=True)
        h = tf.keras.layers.Embedding(VOCAB, EMB)(deep_in)
        h = tf.keras.layers.Lambda(lambda t: tf.reduce_mean(t, axis=1))(h)
        out = tf.keras.layers.Add()([tf.keras.layers.Dense(1)(wide_in), tf.keras.layers.Dense(1)(h)])
        model = tf.keras.Model([wide_in, deep_in], out)
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss="mse")
        history = model.fit([wide, deep], y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    model.logged = [np.array(history.history["loss"])]
    return model


class ShuffledBatches(tf.keras.utils.Sequence):
    """A user's Sequence: batches of ``x`` and ``y`` (the last one partial), reshuffled at each epoch's end from
    its own seeded generator (the same order on every worker)."""

    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size
        self.order, self.rng = np.arange(len(x)), np.random.default_rng(5)

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, k):
        rows = self.order[k * self.batch_size:(k + 1) * self.batch_size]
        return self.x[rows], self.y[rows]

    def on_epoch_end(self):
        self.order = self.rng.permutation(len(self.x))


def _fit_sequence(scope, batch, seed, **fit_kwargs):
    """A table into a Dense output fit for 3 epochs on ShuffledBatches of 105 rows of ``_ids(seed)``, its epoch
    losses and MAEs logged."""
    ids, rng = _ids(seed)
    ids, y = ids[:105], rng.normal(size=(105, 1)).astype(np.float32)
    with scope():
        model = tf.keras.Sequential([tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.layers.Embedding(VOCAB, EMB),
                                     tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)])
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss="mse", metrics=["mae"])
        history = model.fit(ShuffledBatches(ids, y, batch), epochs=3, verbose=0, shuffle=False, **fit_kwargs)
    model.logged = [np.array([history.history["loss"], history.history["mae"]])]
    return model


def sequence_input(scope, batch):
    """fit on a keras.utils.Sequence of 105 rows, reshuffled by its on_epoch_end: 7 batches of 16 on the workers,
    an odd count, whose 7th (9 rows) the workers' last batches share (5 + 4), as one process's last batch of 32."""
    return _fit_sequence(scope, batch, 61)


class _SlowEpochEnd(tf.keras.callbacks.Callback):
    """Sleeps 0.3 s after each epoch's last batch, as a slow last step or epoch end (a collective, validation)
    would take."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.params["steps"] - 1:
            time.sleep(0.3)


def sequence_loader_threads(scope, batch):
    """sequence_input's Sequence loaded by 2 threads (fit(workers=2): Keras' OrderedEnqueuer) with each epoch's end
    slowed by 0.3 s, in which the enqueuer, having handed out the epoch's batches, calls on_epoch_end from its own
    thread before fit's call stops it: the Sequence must still reshuffle once per epoch. The reference loads with
    one thread (workers=1: no enqueuer), whose single call per epoch is the one a loader thread must not change."""
    return _fit_sequence(scope, batch, 65, workers=2 if RUN_WORKERS > 1 else 1, callbacks=[_SlowEpochEnd()])


def generator_input(scope, batch):
    """fit on an endless Python generator of batches, with steps_per_epoch (one process's steps)."""
    ids, rng = _ids(62)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)

    def batches():
        while True:
            for k in range(0, ROWS, batch):
                yield ids[k:k + batch], y[k:k + batch]

    with scope():
        model = tf.keras.Sequential([tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.layers.Embedding(VOCAB, EMB),
                                     tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)])
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.SGD(0.05), loss="mse")
        history = model.fit(batches(), steps_per_epoch=ROWS // (batch * RUN_WORKERS), epochs=2, verbose=0)
    model.logged = [np.array(history.history["loss"])]
    return model


def _summed_squares(y_true, y_pred):
    """A user's loss function summing over the batch: one scalar (Keras leaves it as it is, whatever the reduction)."""
    return tf.reduce_sum(tf.square(y_true - y_pred))


def _mean_absolute(y_true, y_pred):
    """A user's loss function averaging over the batch: one scalar."""
    return tf.reduce_mean(tf.abs(y_true - y_pred))


def scalar_loss_functions(scope, batch):
    """Loss functions of a user's own that return one scalar for the batch, one summing over it and one averaging,
    on two outputs, fed a dataset with a partial last batch (16 + 6 rows on the workers in the last step); SGD, whose
    step is proportional to the gradient."""
    ids, rng = _ids(71)
    y = (rng.normal(size=(118, 1)).astype(np.float32), rng.normal(size=(118, 2)).astype(np.float32))
    data = tf.data.Dataset.from_tensor_slices((ids[:118], {"summed": y[0], "averaged": y[1]})).batch(batch)
    with scope():
        inputs = tf.keras.Input((LEN,), dtype=tf.int32)
        h = tf.keras.layers.Flatten()(tf.keras.layers.Embedding(VOCAB, EMB)(inputs))
        model = tf.keras.Model(inputs, {"summed": tf.keras.layers.Dense(1, name="summed")(h),
                                        "averaged": tf.keras.layers.Dense(2, name="averaged")(h)})
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.SGD(0.002),
                      loss={"summed": _summed_squares, "averaged": _mean_absolute})
        history = model.fit(data, epochs=2, verbose=0)
    model.logged = [np.array([history.history[key] for key in sorted(history.history)])]
    return model


def _predicted_positives(y_true, y_pred):
    """A user's metric function counting the batch's predicted positives: one scalar, a sum over the batch."""
    return tf.reduce_sum(tf.cast(y_pred > 0.5, tf.float32))


def _mean_confidence(y_true, y_pred):
    """A user's metric function averaging over the batch: one scalar."""
    return tf.reduce_mean(tf.abs(y_pred - 0.5))


def scalar_metric_functions(scope, batch):
    """Metric functions of a user's own that return one scalar for the batch (a count, a mean) next to a Keras
    metric, on a dataset with a partial last batch (16 + 6 rows on the workers in the last step): every batch's
    and epoch's logs equal one process's."""
    (ids, features), y = _binary_data(73)
    data = tf.data.Dataset.from_tensor_slices(((ids[:118], features[:118]), y[:118])).batch(batch)
    logged = _Logged()
    with scope():
        model = _binary_classifier()
        model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="binary_crossentropy",
                      metrics=[_predicted_positives, _mean_confidence, "accuracy"])
        model.fit(data, epochs=2, verbose=0, callbacks=[logged])
    model.logged = [np.array(logged.batches), np.array(logged.epochs)]
    return model


class _AutoEncoder(tf.keras.Model):
    """Ids through a table, squeezed to 3 units and back, trained by an added loss alone (no compiled loss)."""

    def __init__(self):
        super().__init__()
        self.table = tf.keras.layers.Embedding(VOCAB, EMB)
        self.down, self.up = tf.keras.layers.Dense(3), tf.keras.layers.Dense(LEN * EMB)

    def call(self, ids):
        embedded = tf.reshape(self.table(ids), (-1, LEN * EMB))
        restored = self.up(self.down(embedded))
        self.add_loss(tf.reduce_mean(tf.square(restored - tf.stop_gradient(embedded))))
        return restored


def added_loss_only(scope, batch):
    """A model trained by add_loss alone, fed ids only, from a dataset with a partial last batch (16 + 6 rows on the
    workers in the last step): weights and the logged loss equal one process's."""
    ids, _ = _ids(112)
    data = tf.data.Dataset.from_tensor_slices(ids[:118]).batch(batch)
    with scope():
        model = _AutoEncoder()
        model(ids[:2])
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.SGD(0.1))
        history = model.fit(data, epochs=2, verbose=0)
    model.logged = [np.array(history.history["loss"])]
    return model


def summed_losses(scope, batch):
    """Two outputs, one loss summed over the batch (reduction "sum") and one averaged, with loss weights and a
    regularized table: one process sums over the global batch."""
    ids, rng = _ids(12)
    y_a = rng.normal(size=(ROWS, 1)).astype(np.float32)
    y_b = rng.normal(size=(ROWS, 2)).astype(np.float32)
    with scope():
        ids_in = tf.keras.Input((LEN,), dtype=tf.int32)
        h = tf.keras.layers.Embedding(VOCAB, EMB, embeddings_regularizer=tf.keras.regularizers.l2(1e-3))(ids_in)
        h = tf.keras.layers.Dense(4, activation="tanh")(tf.keras.layers.Flatten()(h))
        model = tf.keras.Model(ids_in, {"a": tf.keras.layers.Dense(1, name="a")(h),
                                        "b": tf.keras.layers.Dense(2, name="b")(h)})
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.SGD(0.002, momentum=0.5),
                      loss={"a": tf.keras.losses.MeanSquaredError(reduction="sum"), "b": "mae"},
                      loss_weights={"a": 1.0, "b": 0.5})
        model.fit(ids, {"a": y_a, "b": y_b}, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    return model


def unreduced_loss(scope, batch):
    """A loss with reduction "none": Keras differentiates the sum of the per-example values (and logs their mean)."""
    ids, rng = _ids(13)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        model = tf.keras.Sequential([tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.layers.Embedding(VOCAB, EMB),
                                     tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)])
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.SGD(0.002), loss=tf.keras.losses.Huber(reduction="none"))
        model.fit(ids, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    return model


SHARED_DIR = None  # a directory every worker sees (set by train_keras_programs.py)


class _Interrupted(Exception):
    pass


class _InterruptAtEpoch(tf.keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self._epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self._epoch:
            raise _Interrupted()


def backup_and_restore_resume(scope, batch):
    """fit with BackupAndRestore is interrupted as epoch 3 begins; a new model with the same backup_dir resumes:
    Keras restores weights, optimizer state and epoch, and the resumed fit ends as the one process's."""
    ids, rng = _ids(12)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    directory = os.path.join(SHARED_DIR or tempfile.mkdtemp(prefix="kp_backup_"), "backup")

    def fit(callbacks):
        with scope():
            model = tf.keras.Sequential([tf.keras.Input((LEN,), dtype=tf.int32),
                                         tf.keras.layers.Embedding(VOCAB, EMB), tf.keras.layers.Flatten(),
                                         tf.keras.layers.Dense(1)])
            _init(model)
            model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss="mse")
            model.fit(ids, y, batch_size=batch, epochs=4, shuffle=False, verbose=0,
                      callbacks=[tf.keras.callbacks.BackupAndRestore(directory)] + callbacks)
        return model

    try:
        fit([_InterruptAtEpoch(2)])
        raise AssertionError("the first fit was not interrupted")
    except _Interrupted:
        pass
    model = fit([])
    assert int(model.optimizer.iterations) == 16, int(model.optimizer.iterations)  # 4 epochs of 4 global batches
    return model


def partial_last_batch(scope, batch):
    """A batched dataset (no drop_remainder) whose last batch is partial: 118 rows, so the last step's batches are
    16 and 6 rows on the workers, 22 in one process. Two outputs, one loss averaged over the batch and one summed,
    and a regularized table; the epoch losses are kept."""
    ids, rng = _ids(17)
    features = rng.normal(size=(ROWS, 3)).astype(np.float32)
    y = [rng.normal(size=(ROWS, 1)).astype(np.float32) for _ in range(2)]
    rows = ROWS - 10
    with scope():
        inputs = [tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.Input((3,))]
        x = tf.keras.layers.Flatten()(tf.keras.layers.Embedding(
            VOCAB, EMB, embeddings_regularizer=tf.keras.regularizers.l2(1e-3))(inputs[0]))
        x = tf.keras.layers.Concatenate()([x, tf.keras.layers.Dense(4, activation="relu")(inputs[1])])
        model = tf.keras.Model(inputs, [tf.keras.layers.Dense(1)(x), tf.keras.layers.Dense(1)(x)])
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.SGD(0.05),
                      loss=["mse", tf.keras.losses.MeanSquaredError(reduction="sum")], loss_weights=[1.0, 0.02])
        data = tf.data.Dataset.from_tensor_slices(((ids[:rows], features[:rows]), (y[0][:rows], y[1][:rows])))
        history = model.fit(data.batch(batch), epochs=2, verbose=0)
    model.logged = [np.array(history.history["loss"])]
    return model


def self_sharded_dataset(scope, batch):
    """A dataset each worker shards itself (Horovod's dataset.shard(size, rank), RANK of RUN_WORKERS here; one
    process keeps it whole) with tf.distribute's auto-sharding turned off in its options, so fit uses it as it is:
    worker i keeps rows i, i+N, ..., and each step's batches make one process's global batch (118 rows: 16 + 16 rows
    per step, 11 + 11 in the last). Adam, a table; every epoch's logs are kept."""
    ids, rng = _ids(19)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    rows = ROWS - 10
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    data = tf.data.Dataset.from_tensor_slices((ids[:rows], y[:rows])).shard(RUN_WORKERS, RANK)
    with scope():
        model = _pooled_regressor()
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss="mse", metrics=["mae"])
        history = model.fit(data.batch(batch).with_options(options), epochs=2, verbose=0)
    model.logged = [np.array([history.history[key] for key in sorted(history.history)])]
    return model


def partial_last_batch_arrays(scope, batch):
    """fit on NumPy arrays of 117 rows (with per-row sample weights): one process's last batch has 21 rows, which the
    workers' last batches share unevenly (11 + 10). A table, BatchNormalization, Adam, a metric; every epoch's logs
    are kept."""
    ids, rng = _ids(23)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    weights = rng.uniform(0.5, 2.0, size=ROWS).astype(np.float32)
    rows = 117
    with scope():
        model = tf.keras.Sequential([tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.layers.Embedding(VOCAB, EMB),
                                     tf.keras.layers.GlobalAveragePooling1D(), tf.keras.layers.Dense(4, use_bias=False),
                                     tf.keras.layers.BatchNormalization(synchronized=True), tf.keras.layers.Dense(1)])
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss="mse", metrics=["mae"])
        history = model.fit(ids[:rows], y[:rows], sample_weight=weights[:rows], batch_size=batch, epochs=2,
                            shuffle=False, verbose=0)
    model.logged = [np.array([history.history[key] for key in sorted(history.history)])]
    return model


def odd_batch_count_dataset(scope, batch):
    """A tutorial's pipeline, shuffled with a seed and batched by the per-worker batch (16; no drop_remainder) with
    prefetch, over 105 rows: 7 batches, an odd count on 2 workers. One process's last global batch (9 rows) is the
    7th batch, whose rows the workers' last batches share (5 + 4). A sparse feature beside the ids,
    BatchNormalization, Adam and a metric; every epoch's logs are kept."""
    ids, rng = _ids(29)
    features = rng.normal(size=(ROWS, 3)).astype(np.float32)
    features[rng.uniform(size=(ROWS, 3)) < 0.5] = 0.0
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    rows = 105
    data = tf.data.Dataset.from_tensor_slices(((ids[:rows], tf.sparse.from_dense(features[:rows])), y[:rows]))
    data = data.shuffle(rows, seed=3).batch(batch).prefetch(tf.data.AUTOTUNE)
    with scope():
        ids_in, sparse_in = tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.Input((3,), sparse=True)
        x = tf.keras.layers.GlobalAveragePooling1D()(tf.keras.layers.Embedding(VOCAB, EMB)(ids_in))
        x = tf.keras.layers.Concatenate()([x, tf.keras.layers.Dense(3, use_bias=False)(sparse_in)])
        x = tf.keras.layers.BatchNormalization(synchronized=True)(tf.keras.layers.Dense(4, use_bias=False)(x))
        model = tf.keras.Model([ids_in, sparse_in], tf.keras.layers.Dense(1)(x))
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss="mse", metrics=["mae"])
        history = model.fit(data, epochs=3, verbose=0)
    model.logged = [np.array([history.history[key] for key in sorted(history.history)])]
    return model


def padded_sequences(scope, batch):
    """Sequences of 2 to 11 ids over 105 rows, padded_batch to each batch's longest (7 batches of 16 on the workers,
    an odd count). No mask: an Embedding, a Conv1D and GlobalAveragePooling1D see the padding, so each worker's batch
    must be padded as one process pads its global batch. Adam; every epoch's loss is kept."""
    rng = np.random.default_rng(31)
    ids, lengths = rng.integers(1, VOCAB, size=(105, 11)), rng.integers(2, 12, size=105)
    y = rng.normal(size=(105, 1)).astype(np.float32)
    data = tf.data.Dataset.from_tensor_slices((ids, lengths, y)).map(lambda row, length, target: (row[:length], target))
    data = data.padded_batch(batch)
    with scope():
        ids = tf.keras.Input((None,), dtype=tf.int64)
        x = tf.keras.layers.Conv1D(4, 3, padding="same", activation="relu")(tf.keras.layers.Embedding(VOCAB, EMB)(ids))
        model = tf.keras.Model(ids, tf.keras.layers.Dense(1)(tf.keras.layers.GlobalAveragePooling1D()(x)))
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss="mse")
        history = model.fit(data, epochs=2, verbose=0)
    model.logged = [np.array(history.history["loss"])]
    return model


def vectorized_after_batch(scope, batch):
    """Texts vectorized by a map after batch (TextVectorization without output_sequence_length: each batch padded to
    its longest text) over 105 rows (an odd batch count), cached and prefetched, with a parallel map of the labels
    before the batch. No mask: an Embedding averaged over the padded steps and a Conv1D see the padding, so each
    worker's batch must be padded as one process pads its global batch. Adam; every epoch's loss is kept."""
    words = np.array(["red", "green", "blue", "cat", "dog", "runs", "sits", "the", "a", "far"])
    rng = np.random.default_rng(88)
    lengths = rng.choice([1, 2, 3, 9], p=[0.3, 0.3, 0.33, 0.07], size=105)
    texts = np.array([" ".join(rng.choice(words, size=n)) for n in lengths])
    y = rng.normal(size=(105, 1)).astype(np.float32)
    with scope():
        vectorize = tf.keras.layers.TextVectorization(max_tokens=16)
        vectorize.adapt(texts)
        data = (tf.data.Dataset.from_tensor_slices((texts, y)).map(lambda t, v: (t, 2 * v), num_parallel_calls=2)
                .batch(batch).map(lambda t, v: (vectorize(t), v)).cache().prefetch(tf.data.AUTOTUNE))
        ids = tf.keras.Input((None,), dtype=tf.int64)
        e = tf.keras.layers.Embedding(16, EMB)(ids)
        h = tf.keras.layers.Conv1D(4, 2, padding="same", activation="relu")(e)
        joined = tf.keras.layers.Concatenate()([tf.keras.layers.GlobalAveragePooling1D()(e),
                                                tf.keras.layers.GlobalAveragePooling1D()(h)])
        model = tf.keras.Model(ids, tf.keras.layers.Dense(1)(joined))
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss="mse")
        history = model.fit(data, epochs=2, verbose=0)
    model.logged = [np.array(history.history["loss"])]
    return model


class OwnLossStep(tf.keras.Model):
    """A subclassed model whose own train_step computes its loss (no compiled loss): a mean squared error plus the
    model's losses (an activity regularizer's), through BatchNormalization on images (Keras' fused kernel) and on a
    Dense layer's output (the unfused path)."""

    def __init__(self):
        super().__init__()
        self.table = tf.keras.layers.Embedding(VOCAB, EMB)
        self.conv = tf.keras.layers.Conv2D(3, 2)
        self.image_norm = tf.keras.layers.BatchNormalization(synchronized=True)
        self.hidden = tf.keras.layers.Dense(6, activity_regularizer=tf.keras.regularizers.l2(0.05))
        self.hidden_norm = tf.keras.layers.BatchNormalization(synchronized=True)
        self.out = tf.keras.layers.Dense(1)

    def call(self, inputs, training=False):
        ids, images = inputs
        pictures = tf.keras.layers.Flatten()(self.image_norm(self.conv(images), training=training))
        x = tf.concat([tf.reduce_sum(self.table(ids), axis=1), pictures], axis=1)
        return self.out(tf.nn.relu(self.hidden_norm(self.hidden(x), training=training)))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y)) + tf.add_n(self.losses)
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables))
        return {"loss": loss}


def own_loss_partial_batch(scope, batch):
    """OwnLossStep fed a batched dataset (no drop_remainder) whose last batch is partial: 16 and 6 rows on the
    workers in the last step, 22 in one process. The logged loss of each epoch (its last, partial batch's) is
    kept."""
    ids, rng = _ids(19)
    images = rng.normal(size=(ROWS, 3, 3, 2)).astype(np.float32)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    rows = ROWS - 10
    with scope():
        model = OwnLossStep()
        model((ids[:1], images[:1]))
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.SGD(0.05))
        data = tf.data.Dataset.from_tensor_slices(((ids[:rows], images[:rows]), y[:rows]))
        history = model.fit(data.batch(batch), epochs=2, verbose=0)
    model.logged = [np.array(history.history["loss"])]
    return model


GLOBAL_BATCH = 32  # tf.distribute's global batch size: one process's batch (2 workers x 16)


class PenalizedStep(tf.keras.Model):
    """A train_step with a gradient penalty on its inputs (WGAN-GP's pattern: a tape inside the tape) minimized
    through ``optimizer.minimize(loss, variables, tape=tape)``."""

    def __init__(self):
        super().__init__()
        self.table = tf.keras.layers.Embedding(VOCAB, EMB)
        self.hidden = tf.keras.layers.Dense(4, activation="tanh")
        self.out = tf.keras.layers.Dense(1)

    def call(self, inputs):
        ids, features = inputs
        return self.out(self.hidden(tf.concat([tf.reduce_mean(self.table(ids), axis=1), features], axis=1)))

    def train_step(self, data):
        (ids, features), y = data
        with tf.GradientTape() as tape:
            with tf.GradientTape() as inner:
                inner.watch(features)
                prediction = self((ids, features), training=True)
            penalty = tf.reduce_mean(tf.square(tf.norm(inner.gradient(prediction, features), axis=1) - 1.0))
            loss = tf.reduce_mean(tf.square(prediction - y)) + 0.5 * penalty
        self.optimizer.minimize(loss, self.trainable_variables, tape=tape)
        return {"loss": loss, "penalty": penalty}


def gradient_penalty(scope, batch):
    """PenalizedStep with Adam on a dataset with a partial last batch: weights and epoch logs equal one
    process's."""
    (ids, features), _ = _binary_data(31)
    y = np.random.default_rng(31).normal(size=(ROWS, 1)).astype(np.float32)
    logged, rows = _Logged(), ROWS - 10
    with scope():
        model = PenalizedStep()
        model((ids[:1], features[:1]))
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02))
        model.fit(tf.data.Dataset.from_tensor_slices(((ids[:rows], features[:rows]), y[:rows])).batch(batch),
                  epochs=2, verbose=0, callbacks=[logged])
    model.logged = [np.array(logged.epochs)]
    return model


class AverageLossStep(tf.keras.Model):
    """A train_step written as tf.distribute's guides write one: the per-example losses averaged over the global
    batch size by tf.nn.compute_average_loss, imported by name (a partial last batch's sum is divided by GLOBAL_BATCH
    too, in one process as well), the regularization losses by tf.nn.scale_regularization_loss."""

    def __init__(self):
        super().__init__()
        self.table = tf.keras.layers.Embedding(VOCAB, EMB)
        self.pool = tf.keras.layers.GlobalAveragePooling1D()
        self.hidden = tf.keras.layers.Dense(4, activation="relu", kernel_regularizer=tf.keras.regularizers.l2(0.01))
        self.out = tf.keras.layers.Dense(1)

    def call(self, ids):
        return self.out(self.hidden(self.pool(self.table(ids))))

    def train_step(self, data):
        ids, y = data
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(self(ids, training=True) - y), axis=1)
            loss = (compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
                    + tf.nn.scale_regularization_loss(tf.add_n(self.losses)))
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables))
        return {"loss": loss}


def tf_distribute_average_loss(scope, batch):
    """AverageLossStep on a dataset with a partial last batch (16 + 6 rows on the workers in the last step, 22 in one
    process); each epoch's logged loss (its last batch's) is kept."""
    model, history = _fit_on_partial_batches(scope, batch, 43, AverageLossStep, 0.1)
    model.logged = [np.array(history.history["loss"])]
    return model


def _global_average_squares(y_true, y_pred):
    """A user's loss function averaging over tf.distribute's global batch size: one scalar, a sum over the batch."""
    return tf.nn.compute_average_loss(tf.reduce_mean(tf.square(y_pred - y_true), axis=1),
                                      global_batch_size=GLOBAL_BATCH)


def compiled_average_loss(scope, batch):
    """_global_average_squares as the compiled loss, on a dataset with a partial last batch; the epochs' logged losses
    are kept."""
    model, history = _fit_on_partial_batches(scope, batch, 47, _pooled_regressor, 0.1, loss=_global_average_squares)
    model.logged = [np.array(history.history["loss"])]
    return model


class CriticAndModel(tf.keras.Model):
    """A custom train_step with two optimizers, as a GAN's: a critic (Dense) trained first by its own optimizer, then
    the model (a table and a head) by the compiled one on a loss through the updated critic."""

    def __init__(self, clip=False):
        super().__init__()
        self.table = tf.keras.layers.Embedding(VOCAB, EMB)
        self.head = tf.keras.layers.Dense(1)
        self.critic = tf.keras.layers.Dense(1)
        self.critic_optimizer = None
        self.clip = clip

    def compile(self, critic_optimizer, **kwargs):  # pylint: disable=arguments-differ
        super().compile(**kwargs)
        self.critic_optimizer = critic_optimizer

    def call(self, ids):
        return self.head(tf.reduce_sum(self.table(ids), axis=1))

    def train_step(self, data):
        x, y = data
        features = tf.reduce_sum(self.table(x), axis=1)
        with tf.GradientTape() as tape:
            critic_loss = tf.reduce_mean(tf.square(self.critic(features) - y))
        variables = self.critic.trainable_variables
        grads = tape.gradient(critic_loss, variables)
        if self.clip:  # the critic's by value, the head's by their global norm
            grads = [tf.clip_by_value(g, -0.02, 0.02) for g in grads]
        self.critic_optimizer.apply_gradients(zip(grads, variables))
        with tf.GradientTape() as tape:
            features = tf.reduce_sum(self.table(x), axis=1)
            loss = tf.reduce_mean(tf.square(self(x, training=True) + 0.5 * self.critic(features) - y))
        variables = self.table.trainable_variables + self.head.trainable_variables
        grads = tape.gradient(loss, variables)
        if self.clip:
            grads = grads[:1] + tf.clip_by_global_norm(grads[1:], 0.05)[0]
        self.optimizer.apply_gradients(zip(grads, variables))
        return {"loss": loss, "critic_loss": critic_loss}


def two_optimizers(scope, batch, clip=False):
    """CriticAndModel (Adam for the critic, SGD compiled) on a dataset with a partial last batch; the logged losses
    are kept."""
    ids, rng = _ids(38)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32) * (3 if clip else 1)
    rows = ROWS - 10
    with scope():
        model = CriticAndModel(clip)
        model(ids[:1])
        model.critic(tf.zeros((1, EMB)))
        _init(model)
        model.compile(critic_optimizer=tf.keras.optimizers.Adam(0.01), optimizer=tf.keras.optimizers.SGD(0.05))
        data = tf.data.Dataset.from_tensor_slices((ids[:rows], y[:rows]))
        history = model.fit(data.batch(batch), epochs=2, verbose=0)
    model.logged = [np.array([history.history[key] for key in sorted(history.history)])]
    return model


def clipped_two_optimizers(scope, batch):
    """two_optimizers with both optimizers' gradients clipped in the train_step: the critic's by value (its own
    optimizer), the head's by their global norm (the compiled one)."""
    return two_optimizers(scope, batch, clip=True)


class OwnEmbedding(tf.keras.layers.Layer):
    """A user's own embedding layer, not Keras' Embedding: a table and a per-id bias made with add_weight, read with
    tf.nn.embedding_lookup and tf.gather, so their gradients are tf.IndexedSlices."""

    def __init__(self, vocab, width, **kwargs):
        super().__init__(**kwargs)
        self.vocab, self.width = vocab, width

    def build(self, input_shape):
        self.table = self.add_weight("table", [self.vocab, self.width], initializer="glorot_uniform")
        self.bias = self.add_weight("bias", [self.vocab], initializer="zeros")

    def call(self, ids):
        return tf.nn.embedding_lookup(self.table, ids) + tf.gather(self.bias, ids)[..., None]


def own_embedding_layer(scope, batch):
    """OwnEmbedding's rows averaged into a Dense head, Adam, a dataset with a partial last batch, then evaluate."""
    ids, rng = _ids(41)
    y = rng.normal(size=(ROWS - 10, 1)).astype(np.float32)
    data = tf.data.Dataset.from_tensor_slices((ids[:ROWS - 10], y)).batch(batch)
    with scope():
        inputs = tf.keras.Input((LEN,), dtype=tf.int32)
        pooled = tf.keras.layers.GlobalAveragePooling1D()(OwnEmbedding(VOCAB, EMB, name="own_embedding")(inputs))
        model = tf.keras.Model(inputs, tf.keras.layers.Dense(1)(tf.keras.layers.Dense(4, activation="tanh")(pooled)))
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.05), loss="mse", metrics=["mae"])
        history = model.fit(data, epochs=2, verbose=0)
        evaluated = model.evaluate(ids[:64], y[:64], batch_size=batch, verbose=0)
    model.logged = [np.array([history.history[key] for key in sorted(history.history)]), np.array(evaluated)]
    return model


def fine_tuning(scope, batch):
    """Transfer learning: the base (a table and a Dense layer) frozen while the head trains with Adam, then unfrozen
    and the model compiled again with a new optimizer (momentum SGD) to train all of it; both fits' losses are
    kept."""
    ids, rng = _ids(41)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        base = tf.keras.Sequential([tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.layers.Embedding(VOCAB, EMB),
                                    tf.keras.layers.Flatten(), tf.keras.layers.Dense(4, activation="relu")])
        model = tf.keras.Sequential([base, tf.keras.layers.Dense(1)])
        _init(model)
        base.trainable = False
        model.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="mse")
        frozen = model.fit(ids, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
        base.trainable = True
        model.compile(optimizer=tf.keras.optimizers.SGD(0.01, momentum=0.9), loss="mse")
        tuned = model.fit(ids, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    model.logged = [np.array(frozen.history["loss"] + tuned.history["loss"])]
    return model


class OwnComputeLoss(tf.keras.Model):
    """A subclassed model overriding compute_loss (Keras 2.11+) with its own mean losses, no compiled loss."""

    def __init__(self):
        super().__init__()
        self.table = tf.keras.layers.Embedding(VOCAB, EMB)
        self.out = tf.keras.layers.Dense(1)

    def call(self, ids):
        return self.out(tf.reduce_mean(self.table(ids), axis=1))

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
        return tf.reduce_mean(tf.abs(y_pred - y)) + 0.1 * tf.reduce_mean(tf.square(y_pred))


def own_compute_loss(scope, batch):
    """OwnComputeLoss on a dataset with a partial last batch (16 + 6 rows on the workers in the last step)."""
    return _fit_on_partial_batches(scope, batch, 43, OwnComputeLoss, 0.1)[0]


def weighted_metrics_sample_weights(scope, batch):
    """Per-sample weights given to fit, with metrics both plain and weighted (weighted accuracy and AUC); every
    epoch's logs are kept."""
    ids, rng = _ids(32)
    y = (rng.random(size=(ROWS, 1)) > 0.5).astype(np.float32)
    weights = rng.random(size=(ROWS,)).astype(np.float32)
    with scope():
        model = tf.keras.Sequential([tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.layers.Embedding(VOCAB, EMB),
                                     tf.keras.layers.Flatten(), tf.keras.layers.Dense(1, activation="sigmoid")])
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="binary_crossentropy", metrics=["accuracy"],
                      weighted_metrics=["accuracy", tf.keras.metrics.AUC()])
        history = model.fit(ids, y, sample_weight=weights, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    model.logged = [np.array([history.history[key] for key in sorted(history.history)])]
    return model


def gru_conv1d_evaluate(scope, batch):
    """Conv1D and GRU over embedded ids, RMSprop, validation_data in fit, then evaluate; the fit's logs and the
    evaluate results are kept."""
    ids, rng = _ids(34)
    y = rng.integers(0, 3, size=(ROWS,)).astype(np.int32)
    with scope():
        inputs = tf.keras.Input((LEN,), dtype=tf.int32)
        x = tf.keras.layers.Conv1D(4, 2, padding="same")(tf.keras.layers.Embedding(VOCAB, EMB)(inputs))
        model = tf.keras.Model(inputs, tf.keras.layers.Dense(3)(tf.keras.layers.GRU(5)(x)))
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.RMSprop(0.01),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        history = model.fit(ids, y, batch_size=batch, epochs=2, shuffle=False, verbose=0,
                            validation_data=(ids[:40], y[:40]))
        results = model.evaluate(ids, y, batch_size=batch, verbose=0)
    model.logged = [np.array([history.history[key] for key in sorted(history.history)]), np.array(results)]
    return model


def seq2seq_gru(scope, batch):
    """Keras' translation example's encoder-decoder: two mask_zero tables, a GRU encoder whose state starts the GRU
    decoder (initial_state), a softmax over the vocabulary at every step, padding masked out of the loss and
    accuracy, validation_split (a masked mean per batch: one process's validation batches are the global batch)."""
    source, rng = _ids(8)
    target = np.minimum(rng.zipf(1.5, size=(ROWS, LEN + 1)) - 1, VOCAB - 1).astype(np.int32)
    with scope():
        encoder_inputs = tf.keras.Input((None,), dtype="int64", name="encoder_inputs")
        embedded = tf.keras.layers.Embedding(VOCAB, EMB, mask_zero=True)(encoder_inputs)
        _, state = tf.keras.layers.GRU(4, return_state=True)(embedded)
        decoder_inputs = tf.keras.Input((None,), dtype="int64", name="decoder_inputs")
        embedded = tf.keras.layers.Embedding(VOCAB, EMB, mask_zero=True)(decoder_inputs)
        decoded = tf.keras.layers.GRU(4, return_sequences=True)(embedded, initial_state=state)
        model = tf.keras.Model([encoder_inputs, decoder_inputs],
                               tf.keras.layers.Dense(VOCAB, activation="softmax")(decoded))
        _init(model)
        model.compile(optimizer="rmsprop", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        history = model.fit([source, target[:, :-1]], target[:, 1:], batch_size=batch, epochs=3, shuffle=False,
                            verbose=0, validation_split=0.25)
    model.logged = [np.array([history.history[key] for key in sorted(history.history)])]
    return model


def validation_summed_loss(scope, batch):
    """A loss summed over the batch (reduction "sum") with validation_data arrays: the validation loss is a mean of
    per-batch sums, so it depends on the validation batch size, which is one process's batch_size by default."""
    ids, rng = _ids(14)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        model = _pooled_regressor()
        model.compile(optimizer=tf.keras.optimizers.SGD(0.001),
                      loss=tf.keras.losses.MeanSquaredError(reduction="sum"), metrics=["mae"])
        history = model.fit(ids[:96], y[:96], batch_size=batch, epochs=2, shuffle=False, verbose=0,
                            validation_data=(ids[96:], y[96:]))
    model.logged = [np.array([history.history[key] for key in sorted(history.history)])]
    return model


def learning_rate_callbacks(scope, batch):
    """fit from initial_epoch=1 with validation every second epoch (validation_freq=2), a LearningRateScheduler
    halving the rate from epoch 3 on and a ReduceLROnPlateau on the training loss that halves it after every epoch
    (min_delta so large that no epoch counts as an improvement): the logged loss, mae and lr, and the validation
    logs, of every epoch."""
    ids, rng = _ids(57)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        model = _pooled_regressor()
        model.compile(optimizer=tf.keras.optimizers.Adam(0.05), loss="mse", metrics=["mae"])
        halve_late = tf.keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.5 if epoch >= 3 else rate)
        plateau = tf.keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=1e9)
        history = model.fit(ids[:96], y[:96], batch_size=batch, epochs=6, initial_epoch=1, shuffle=False, verbose=0,
                            validation_data=(ids[96:], y[96:]), validation_freq=2, callbacks=[halve_late, plateau])
    model.logged = [np.array(history.history[key]) for key in sorted(history.history)]
    return model


class _StopOnOneWorker(tf.keras.callbacks.Callback):
    """Stops training on one worker only (``rank``; one process is rank 0 of 1): after batch ``batch`` of the first
    epoch, or (``batch=None``) at the end of the first epoch, as a wall-clock budget or a check of the worker's
    own would."""

    def __init__(self, rank, batch=None):
        super().__init__()
        self._rank, self._batch = rank, batch

    def on_train_batch_end(self, batch, logs=None):
        if self._batch is not None and RANK == self._rank and batch == self._batch:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if self._batch is None and RANK == self._rank:
            self.model.stop_training = True


def stop_on_one_worker(scope, batch):
    """Two fits of 3 epochs: the first stopped by worker 0's callback after the 4th batch of the first epoch, the
    second by the last worker's at the end of the first epoch. One process stops at the same places; every worker
    must too (a worker leaving fit alone would leave the others waiting in a collective)."""
    ids, rng = _ids(62)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        model = _pooled_regressor()
        model.compile(optimizer=tf.keras.optimizers.Adam(0.05), loss="mse")
        first = model.fit(ids, y, batch_size=batch, epochs=3, shuffle=False, verbose=0,
                          callbacks=[_StopOnOneWorker(0, batch=3)])
        second = model.fit(ids, y, batch_size=batch, epochs=3, shuffle=False, verbose=0,
                           callbacks=[_StopOnOneWorker(RUN_WORKERS - 1)])
    model.logged = [np.array(first.history["loss"]), np.array(second.history["loss"]),
                    np.array([model.optimizer.iterations.numpy()])]
    return model


def stateful_lstm(scope, batch):
    """A stateful LSTM (fixed batch size; its state carries over from batch to batch within each epoch)."""
    ids, rng = _ids(33)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        model = tf.keras.Sequential([tf.keras.Input((LEN,), dtype=tf.int32, batch_size=batch),
                                     tf.keras.layers.Embedding(VOCAB, EMB), tf.keras.layers.LSTM(4, stateful=True),
                                     tf.keras.layers.Dense(1)])
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.SGD(0.05), loss="mse")
        history = model.fit(ids, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    model.logged = [np.array(history.history["loss"])]
    return model


class MeanOutput(tf.keras.layers.Layer):
    """Passes its input on, and adds the batch's mean of it as a metric (add_metric: one value per batch)."""

    def call(self, inputs):
        self.add_metric(tf.reduce_mean(inputs), name="mean_output")
        return inputs


def run_eagerly_dense(scope, batch):
    """compile(run_eagerly=True) on a model without tables (Dense, BatchNormalization, Adam, a metric, a metric
    added in a layer's call: a mean over batches of one size)."""
    rng = np.random.default_rng(35)
    x = rng.normal(size=(ROWS, 4)).astype(np.float32)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(8, activation="relu"),
                                     tf.keras.layers.BatchNormalization(synchronized=True), tf.keras.layers.Dense(1), MeanOutput()])
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"], run_eagerly=True)
        history = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    model.logged = [np.array([history.history[key] for key in sorted(history.history)])]
    return model


def masked_sequence_losses(scope, batch):
    """Sequence tagging: a mask_zero Embedding, an LSTM over the sequence and two per-step outputs, one with a
    plain sparse cross-entropy and one with ``ignore_class=0``. Keras averages each over the valid (unmasked, not
    ignored) steps, whose count differs from worker to worker; the epoch losses and accuracies are kept."""
    rng = np.random.default_rng(18)
    lengths = rng.integers(1, LEN + 1, size=ROWS)
    ids = np.zeros((ROWS, LEN), np.int32)
    for row, length in enumerate(lengths):
        ids[row, :length] = rng.integers(1, VOCAB, size=length)
    tags = [rng.integers(0, 4, size=(ROWS, LEN)).astype(np.int32) for _ in range(2)]
    with scope():
        inputs = tf.keras.Input((LEN,), dtype=tf.int32)
        embedded = tf.keras.layers.Embedding(VOCAB, EMB, mask_zero=True)(inputs)
        x = tf.keras.layers.LSTM(6, return_sequences=True)(embedded)
        model = tf.keras.Model(inputs, [tf.keras.layers.Dense(4)(x), tf.keras.layers.Dense(4)(x)])
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.SGD(0.5),
                      loss=[tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                            tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)],
                      metrics=["accuracy"])
        history = model.fit(ids, tags, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    model.logged = [np.array([history.history[key] for key in sorted(history.history)])]
    return model


def train_on_batch_loop(scope, batch):
    """A loop of train_on_batch calls, each worker with its own part of every global batch, from Keras' own random
    initialization seeded differently on each worker (worker 0's seed is the one process's): worker 0's weights
    must reach every worker before the first step, and again after worker 0 alone sets new weights. The last call's
    batches differ in size (10 and 22 rows). The returned logs of every call are kept (the first two calls reset the
    metrics, the later ones do not: running values from the second call on)."""
    ids, rng = _ids(16)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    tf.keras.utils.set_random_seed(40 + RANK)
    with scope():
        model = tf.keras.Sequential([tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.layers.Embedding(VOCAB, EMB),
                                     tf.keras.layers.Flatten(), tf.keras.layers.Dense(4, activation="relu"),
                                     tf.keras.layers.Dense(1)])
        model.compile(optimizer=tf.keras.optimizers.Adam(0.05), loss="mse", metrics=["mae"])
    logged, step_rows, steps = [], batch * RUN_WORKERS, ROWS // (batch * RUN_WORKERS)
    for step in range(steps):
        if step == 2 and RANK == 0:
            _init(model, seed=5)  # new weights set on worker 0 only: the next call broadcasts them again
        # Each worker's part of the global batch; in the last step, 10 rows on worker 0 and the rest on worker 1.
        cuts = [0, 10, step_rows] if step == steps - 1 and RUN_WORKERS == 2 else [0, batch, 2 * batch]
        rows = slice(step * step_rows + cuts[RANK], step * step_rows + cuts[RANK + 1])
        logs = model.train_on_batch(ids[rows], y[rows], reset_metrics=step < 2, return_dict=True)
        logged.append([logs["loss"], logs["mae"]])
    model.logged = [np.array(logged)]
    return model


def _predictions_with_added_metrics():
    """A functional model (ids through a table, averaged, into a Dense unit) with metrics added on its output
    (Keras' add_metric): the batch's sum and mean of the predictions, one value per batch each."""
    inputs = tf.keras.Input((LEN,), dtype=tf.int32)
    prediction = tf.keras.layers.Dense(1)(tf.reduce_mean(tf.keras.layers.Embedding(VOCAB, EMB)(inputs), axis=1))
    model = tf.keras.Model(inputs, prediction)
    model.add_metric(tf.reduce_sum(prediction), name="prediction_sum")
    model.add_metric(tf.reduce_mean(prediction), name="prediction_mean")
    return model


def added_metrics(scope, batch):
    """_predictions_with_added_metrics with a mean squared error, on a dataset with a partial last batch; every
    epoch's logs are kept."""
    model, history = _fit_on_partial_batches(scope, batch, 29, _predictions_with_added_metrics, 0.05, loss="mse")
    model.logged = [np.array(history.history[key]) for key in ("loss", "prediction_sum", "prediction_mean")]
    return model


class TrackedStep(tf.keras.Model):
    """Keras' guide to a custom train_step: the loss tracked by a Mean fed the batch's loss, a mean absolute error,
    and here also a Sum of the rows trained on and the row count added in call (add_metric)."""

    def __init__(self):
        super().__init__()
        self.table = tf.keras.layers.Embedding(VOCAB, EMB)
        self.out = tf.keras.layers.Dense(1)
        self.loss_tracker = tf.keras.metrics.Mean(name="loss")
        self.mae_metric = tf.keras.metrics.MeanAbsoluteError(name="mae")
        self.rows_seen = tf.keras.metrics.Sum(name="rows_seen")

    def call(self, ids):
        self.add_metric(tf.cast(tf.shape(ids)[0], tf.float32), name="rows")
        return self.out(tf.reduce_mean(self.table(ids), axis=1))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = tf.reduce_mean(tf.keras.losses.mean_squared_error(y, y_pred))
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        self.rows_seen.update_state(tf.cast(tf.shape(x)[0], tf.float32))
        return {m.name: m.result() for m in self.metrics}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric, self.rows_seen] + [
            m for layer in self._flatten_layers() for m in layer._metrics]  # pylint: disable=protected-access

    def compared_weights(self):
        """The trained weights: its metrics' variables hold, under kparallax, each worker's own part of the epoch's
        states (the logs are their sums over the workers)."""
        return [v.numpy() for v in self.trainable_weights]


def tracked_train_step(scope, batch):
    """TrackedStep on a dataset with a partial last batch; every epoch's logs are kept."""
    model, history = _fit_on_partial_batches(scope, batch, 31, TrackedStep, 0.05)
    model.logged = [np.array(history.history[key]) for key in ("loss", "mae", "rows_seen", "rows")]
    return model


def _two_heads():
    """Functional model: a table and a hidden layer shared by a regression head and a 3-class head."""
    ids = tf.keras.Input((LEN,), dtype=tf.int32, name="ids")
    h = tf.keras.layers.Dense(8, activation="tanh")(
        tf.keras.layers.Flatten()(tf.keras.layers.Embedding(VOCAB, EMB)(ids)))
    score = tf.keras.layers.Dense(1, name="score")(h)
    label = tf.keras.layers.Dense(3, activation="softmax", name="label")(h)
    return tf.keras.Model(ids, {"score": score, "label": label})


def multi_output(scope, batch):
    """Two outputs with their own losses, loss_weights, per-output metrics (one weighted by per-row sample
    weights), Adam with global_clipnorm, on a dataset with a partial last batch; every epoch's logs are kept."""
    ids, rng = _ids(37)
    y = {"score": rng.normal(size=(ROWS, 1)).astype(np.float32),
         "label": rng.integers(0, 3, size=(ROWS,)).astype(np.int32)}
    weights = {"score": np.ones(ROWS, np.float32), "label": rng.uniform(0.2, 2.0, size=ROWS).astype(np.float32)}
    rows = ROWS - 10
    data = tf.data.Dataset.from_tensor_slices((ids[:rows], {k: v[:rows] for k, v in y.items()},
                                               {k: v[:rows] for k, v in weights.items()}))
    with scope():
        model = _two_heads()
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02, global_clipnorm=0.5),
                      loss={"score": "mse", "label": "sparse_categorical_crossentropy"},
                      loss_weights={"score": 0.3, "label": 1.0},
                      metrics={"score": ["mae"], "label": ["accuracy"]},
                      weighted_metrics={"label": ["accuracy"]})
        history = model.fit(data.batch(batch), epochs=2, verbose=0)
    model.logged = [np.array(history.history[key]) for key in sorted(history.history)]
    return model


class TokenAndPosition(tf.keras.layers.Layer):
    """Keras' transformer examples' input layer: a token table (``mask_zero``) plus a position table read at
    ``tf.range(length)``; the padding mask goes on."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tokens = tf.keras.layers.Embedding(VOCAB, EMB, mask_zero=True)
        self.positions = tf.keras.layers.Embedding(LEN, EMB)

    def call(self, ids):
        return self.tokens(ids) + self.positions(tf.range(tf.shape(ids)[-1]))

    def compute_mask(self, ids, mask=None):
        return self.tokens.compute_mask(ids)


class DecoderBlock(tf.keras.layers.Layer):
    """Keras' examples' transformer block with a causal self-attention: attention and a feed-forward net, each
    with dropout, a residual and a LayerNormalization (dropout 0 here: one process's masks cannot be the
    workers')."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True
        self.attention = tf.keras.layers.MultiHeadAttention(num_heads=2, key_dim=EMB)
        self.feed = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="relu"), tf.keras.layers.Dense(EMB)])
        self.norms = [tf.keras.layers.LayerNormalization(epsilon=1e-6) for _ in range(2)]
        self.drops = [tf.keras.layers.Dropout(0.0) for _ in range(2)]

    def call(self, x, training=False):
        x = self.norms[0](x + self.drops[0](self.attention(x, x, use_causal_mask=True), training=training))
        return self.norms[1](x + self.drops[1](self.feed(x), training=training))


class WarmUp(tf.keras.optimizers.schedules.LearningRateSchedule):
    """A user's schedule as TensorFlow's transformer tutorial writes one (constructor arguments, no
    ``get_config``, not registered with Keras): a linear warm-up, then inverse square-root decay."""

    def __init__(self, peak, warmup_steps):
        super().__init__()
        self.peak, self.warmup_steps = peak, warmup_steps

    def __call__(self, step):
        step = (tf.cast(step, tf.float32) + 1.0) / self.warmup_steps
        return self.peak * tf.minimum(step, tf.math.rsqrt(step))


class _PerRowMap(tf.keras.layers.Layer):
    """A layer of a user's own working on each row of its batch with tf.map_fn: the running maximum over the row's
    embedded ids (tf.scan) averaged, through a weight."""

    def build(self, input_shape):
        self.scale = self.add_weight("scale", shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return tf.map_fn(lambda row: tf.reduce_mean(tf.scan(tf.maximum, row * self.scale), axis=0), x)


def per_row_map(scope, batch):
    """Embedded ids through _PerRowMap into a Dense output, on a dataset with a partial last batch: the rows of the
    batch are the elements of tf.map_fn's list and each row's ids those of tf.scan's (neither refused)."""
    model, history = _fit_on_partial_batches(
        scope, batch, 59, lambda: tf.keras.Sequential([tf.keras.layers.Embedding(VOCAB, EMB), _PerRowMap(),
                                                      tf.keras.layers.Dense(1)]), 0.1, loss="mse")
    model.logged = [np.array(history.history["loss"])]
    return model


def _pair_difference_loss(y_true, y_pred):
    """Pairs laid out row after row (rows 0-1, 2-3, ... of the batch): each pair's predicted difference against its
    true one, one loss per pair."""
    true, pred = tf.reshape(y_true, [-1, 2]), tf.reshape(y_pred, [-1, 2])
    return tf.square((pred[:, 0] - pred[:, 1]) - (true[:, 0] - true[:, 1]))


def paired_rows(scope, batch):
    """A compiled loss over pairs of consecutive rows (each reshaped into one entry: [B, 1] -> [-1, 2]), on a dataset
    with a partial last batch whose parts (16 + 6 rows on the workers, 22 in one process) hold whole pairs; then on
    arrays (``shuffle=False``; 120 rows: a last step of 12 + 12 rows, one process's 24), which each worker keeps
    its part of each global batch of, in order, so that its pairs are one process's (before, worker i kept rows i,
    i+N, ...: other pairs)."""
    model, history = _fit_on_partial_batches(
        scope, batch, 61, lambda: tf.keras.Sequential([tf.keras.layers.Embedding(VOCAB, EMB),
                                                      tf.keras.layers.GlobalAveragePooling1D(),
                                                      tf.keras.layers.Dense(1)]), 0.1, loss=_pair_difference_loss)
    ids, rng = _ids(62)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        arrays = model.fit(ids[:120], y[:120], batch_size=batch, epochs=2, shuffle=False, verbose=0)
    model.logged = [np.array(history.history["loss"]), np.array(arrays.history["loss"])]
    return model


class TableUpkeep(tf.keras.callbacks.Callback):
    """Writes the model's table between steps, as users do: the padding row zeroed at each epoch's start (a scatter),
    noise from a seeded generator added after every batch (weight noise: an ``assign_add``), every weight halved at
    each epoch's end (``set_weights`` of ``get_weights``)."""

    def __init__(self):
        super().__init__()
        self.noise = tf.random.Generator.from_seed(7)

    def on_epoch_begin(self, epoch, logs=None):
        self.model.layers[0].embeddings.scatter_update(tf.IndexedSlices(tf.zeros([1, EMB]), tf.constant([0])))

    def on_train_batch_end(self, batch, logs=None):
        table = self.model.layers[0].embeddings
        table.assign_add(self.noise.normal(table.shape, stddev=0.05))

    def on_epoch_end(self, epoch, logs=None):
        self.model.set_weights([w * 0.5 for w in self.model.get_weights()])


def callback_writes(scope, batch):
    """A table loaded from pretrained values by ``assign`` before ``fit`` (on every worker), then written between
    steps by a callback (``TableUpkeep``), on a dataset with a partial last batch. Every worker runs the callback with
    the same generator, so each draws the same noise."""
    ids, rng = _ids(62)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    pretrained = rng.normal(scale=0.3, size=(VOCAB, EMB)).astype(np.float32)
    rows = ROWS - 10
    with scope():
        model = _pooled_regressor()
        model.layers[0].embeddings.assign(pretrained)
        model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
        history = model.fit(tf.data.Dataset.from_tensor_slices((ids[:rows], y[:rows])).batch(batch), epochs=2,
                            verbose=0, callbacks=[TableUpkeep()])
    model.logged = [np.array(history.history["loss"])]
    return model


def transformer_lm(scope, batch):
    """A causal transformer language model as Keras' examples write one: token and position tables, a decoder
    block (multi-head attention with a causal mask, LayerNormalization, a feed-forward net), next-token logits on
    padded sequences whose padding is masked out of the loss and accuracy; AdamW with a user's warm-up schedule and
    LayerNormalization and biases excluded from weight decay; a partial last batch; every epoch's logs kept."""
    rng = np.random.default_rng(43)
    lengths = rng.integers(2, LEN + 2, size=ROWS)
    ids = np.zeros((ROWS, LEN + 1), np.int32)
    for row, length in enumerate(lengths):
        ids[row, :length] = np.minimum(rng.zipf(1.4, size=length), VOCAB - 1)
    rows = ROWS - 10
    data = tf.data.Dataset.from_tensor_slices((ids[:rows, :-1], ids[:rows, 1:]))
    with scope():
        inputs = tf.keras.Input((LEN,), dtype=tf.int32)
        logits = tf.keras.layers.Dense(VOCAB)(DecoderBlock()(TokenAndPosition()(inputs)))
        model = tf.keras.Model(inputs, logits)
        _init(model)
        optimizer = tf.keras.optimizers.AdamW(WarmUp(0.02, 4.0), weight_decay=0.05)
        optimizer.exclude_from_weight_decay(var_names=["layer_normalization", "bias"])
        model.compile(optimizer=optimizer, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        history = model.fit(data.batch(batch), epochs=2, verbose=0)
    model.logged = [np.array(history.history[key]) for key in sorted(history.history)]
    return model


class RunningStatistics(tf.keras.layers.Layer):
    """A layer of the user's that keeps, in training, a moving average of its input's batch mean (MEAN), a count
    of the rows it has seen (SUM) and the first row of the last batch (ONLY_FIRST_REPLICA), with the aggregations
    TensorFlow's distribution strategies ask of a variable assigned in a training step (``synchronization``: theirs,
    ON_READ as BatchNormalization's statistics are, or Keras' default); and a count of its calls (Keras' default
    aggregation, NONE: the same on every worker). The moving average feeds the output."""

    def __init__(self, synchronization=tf.VariableSynchronization.AUTO, **kwargs):
        super().__init__(**kwargs)
        self.synchronization = synchronization

    def build(self, shape):
        sync = self.synchronization
        self.moving = self.add_weight("moving", shape[-1:], initializer="zeros", trainable=False,
                                      synchronization=sync, aggregation=tf.VariableAggregation.MEAN)
        self.rows = self.add_weight("rows", [], dtype=tf.int64, initializer="zeros", trainable=False,
                                    synchronization=sync, aggregation=tf.VariableAggregation.SUM)
        self.first = self.add_weight("first", shape[-1:], initializer="zeros", trainable=False,
                                     synchronization=sync, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self.calls = self.add_weight("calls", [], initializer="zeros", trainable=False)

    def call(self, x, training=None):
        if training:
            self.moving.assign(0.8 * self.moving + 0.2 * tf.reduce_mean(x, axis=0))
            self.rows.assign_add(tf.cast(tf.shape(x)[0], tf.int64))
            self.first.assign(x[0])
            self.calls.assign_add(1.0)
        return x - self.moving


class _RowsSeen(tf.keras.layers.Layer):
    """The identity, with a metric of its own (a ``Sum`` of the rows it saw in training, logged by fit)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = tf.keras.metrics.Sum(name="rows_seen")

    def call(self, x, training=None):
        if training:
            self.seen.update_state(tf.cast(tf.shape(x)[0], tf.float32))
        return x


def layer_running_statistics(scope, batch):
    """RunningStatistics between a table's pooled rows and the output, on 117 rows (a partial last batch: the
    workers' last batches differ in size, so the mean is weighted by their rows); then the same with the layer's
    aggregated variables ON_READ (one per replica under TensorFlow's strategies, combined when read), beside a
    BatchNormalization layer and a layer's own metric (ON_READ too: neither is combined in the step), and
    the model evaluated in inference mode, where the moving average is read."""
    ids, rng = _ids(86)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        model = tf.keras.Sequential([tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.layers.Embedding(VOCAB, EMB),
                                     tf.keras.layers.GlobalAveragePooling1D(), RunningStatistics(),
                                     tf.keras.layers.Dense(1)])
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
        history = model.fit(ids[:ROWS - 11], y[:ROWS - 11], batch_size=batch, epochs=2, shuffle=False, verbose=0)
        on_read = tf.keras.Sequential([
            tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.layers.Embedding(VOCAB, EMB),
            tf.keras.layers.GlobalAveragePooling1D(), tf.keras.layers.BatchNormalization(synchronized=True), _RowsSeen(),
            RunningStatistics(synchronization=tf.VariableSynchronization.ON_READ), tf.keras.layers.Dense(1)])
        _init(on_read)
        on_read.compile(optimizer=tf.keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
        on_read_history = on_read.fit(ids[:ROWS - 11], y[:ROWS - 11], batch_size=batch, epochs=2, shuffle=False,
                                      verbose=0)
        evaluated = on_read.evaluate(ids[:64], y[:64], batch_size=batch, verbose=0)
    metric = {v.ref() for v in on_read.layers[3].seen.variables}  # each worker's own, combined when logged
    model.logged = [np.array([history.history[key] for key in sorted(history.history)])] + [
        v.numpy() for v in on_read.weights if v.ref() not in metric] + [
        np.array([on_read_history.history[key] for key in sorted(on_read_history.history)]), np.array(evaluated)]
    return model


class _BuiltByItsFirstCall(tf.keras.Model):
    """A subclassed model without ``build``: an embedding table, a Dense layer on the features, RunningStatistics
    on their concatenation, a Dense output; Keras creates its variables in its first call."""

    def __init__(self):
        super().__init__()
        self.table = tf.keras.layers.Embedding(VOCAB, EMB)
        self.hidden = tf.keras.layers.Dense(4, activation="tanh")
        self.statistics = RunningStatistics()
        self.out = tf.keras.layers.Dense(1)

    def call(self, inputs, training=None):
        ids, features = inputs
        pooled = tf.reduce_mean(self.table(ids), axis=1)
        return self.out(self.statistics(tf.concat([pooled, self.hidden(features)], 1), training=training))


def wide_deep_premade(scope, batch):
    """Keras' premade WideDeepModel: a LinearModel on dense features and a DNN over a table, both built by the
    first step from seeded initializers; a sigmoid output with accuracy and AUC, and one optimizer per part as Keras
    documents it: Ftrl for the linear model (replicated; its gradients averaged over the workers), Adagrad for the
    DNN (its table on the PS). One optimizer for both: test_in_process_ps.py. ModelCheckpoint writes a
    TensorFlow-format checkpoint (both optimizers' state, the table's slots joined from the PS) at each epoch's end;
    after one more epoch, load_weights goes back to it, and training goes on from there."""
    ids, rng = _ids(71)
    features = rng.normal(size=(ROWS, 5)).astype(np.float32)
    y = (rng.uniform(size=(ROWS, 1)) > 0.5).astype(np.float32)
    seeded = tf.keras.initializers.GlorotUniform
    with scope():
        linear = tf.keras.experimental.LinearModel(units=1, kernel_initializer=seeded(1))
        dnn = tf.keras.Sequential([
            tf.keras.layers.Embedding(VOCAB, EMB, embeddings_initializer=tf.keras.initializers.RandomNormal(seed=3)),
            tf.keras.layers.GlobalAveragePooling1D(), tf.keras.layers.Dense(4, "relu", kernel_initializer=seeded(2)),
            tf.keras.layers.Dense(1, kernel_initializer=seeded(4))])
        model = tf.keras.experimental.WideDeepModel(linear, dnn, activation="sigmoid")
        model.compile([tf.keras.optimizers.Ftrl(0.05, l1_regularization_strength=0.01),
                       tf.keras.optimizers.Adagrad(0.1)], "binary_crossentropy",
                      metrics=["accuracy", tf.keras.metrics.AUC()])
        path = os.path.join(SHARED_DIR or tempfile.mkdtemp(prefix="kp_wide_deep_"), "wide_deep_ckpt")
        history = model.fit([features, ids], y, batch_size=batch, epochs=2, verbose=0, shuffle=False,
                            callbacks=[tf.keras.callbacks.ModelCheckpoint(path, save_weights_only=True)])
        model.fit([features, ids], y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
        model.load_weights(path)
        model.fit([features, ids], y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    model.logged = [np.array([history.history[key] for key in sorted(history.history)])]
    return model


def built_by_first_step(scope, batch):
    """Models whose variables Keras creates in fit's first step, from its own random initialization seeded
    differently on each worker (worker 0's seed is the one process's): a Sequential model without an input shape
    (compile refused it before: Keras' 'Weights for model ... have not yet been created') and the subclassed
    _BuiltByItsFirstCall, whose table moves onto the PS and whose RunningStatistics' aggregated variables appear
    only while its step is traced; then a Sequential model without an input shape trained with run_eagerly=True by
    fit and by train_on_batch (no trace: the step creates the variables as it runs). Worker 0's initial values must
    reach every worker before the first step runs. The Sequential models' weights are returned as logs."""
    ids, rng = _ids(17)
    features = rng.normal(size=(ROWS, 3)).astype(np.float32)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    tf.keras.utils.set_random_seed(50 + RANK)
    with scope():
        plain = tf.keras.Sequential([tf.keras.layers.Dense(4, activation="tanh"), tf.keras.layers.Dense(1)])
        plain.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
        plain.fit(features, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
        model = _BuiltByItsFirstCall()
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss="mse")
        model.fit((ids, features), y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
        eager = tf.keras.Sequential([tf.keras.layers.Dense(4, activation="tanh"), tf.keras.layers.Dense(1)])
        eager.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse", run_eagerly=True)
        eager.fit(features, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        looped = tf.keras.Sequential([tf.keras.layers.Dense(4, activation="tanh"), tf.keras.layers.Dense(1)])
        looped.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse", run_eagerly=True)
    step_rows = batch * RUN_WORKERS
    for step in range(2):  # each worker its own part of each global batch
        rows = slice(step * step_rows + RANK * batch, step * step_rows + (RANK + 1) * batch)
        looped.train_on_batch(features[rows], y[rows])
    model.logged = plain.get_weights() + eager.get_weights() + looped.get_weights()
    return model


def steps_per_execution_partial(scope, batch):
    """compile(steps_per_execution=2) on NumPy arrays of 117 rows with validation_split=0.2: 94 training rows, 3
    steps per epoch run as executions of 2 and 1 steps, the last step's batches 15 + 15 rows (one process's 30). A
    table, BatchNormalization, a sigmoid output with accuracy and AUC, Adam; every epoch's logs (validation too)."""
    ids, rng = _ids(41)
    y = (rng.uniform(size=(ROWS, 1)) > 0.5).astype(np.float32)
    with scope():
        model = tf.keras.Sequential([tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.layers.Embedding(VOCAB, EMB),
                                     tf.keras.layers.GlobalAveragePooling1D(), tf.keras.layers.Dense(4, use_bias=False),
                                     tf.keras.layers.BatchNormalization(synchronized=True),
                                     tf.keras.layers.Dense(1, activation="sigmoid")])
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss="binary_crossentropy",
                      metrics=["accuracy", tf.keras.metrics.AUC()], steps_per_execution=2)
        history = model.fit(ids[:117], y[:117], batch_size=batch, epochs=2, shuffle=False, verbose=0,
                            validation_split=0.2)
    model.logged = [np.array([history.history[key] for key in sorted(history.history)])]
    return model


def second_fit_other_batch(scope, batch):
    """Two fits of one compiled model: one epoch on 128 rows, then two on 100 rows with half the batch and a
    class_weight (the step traced again), then evaluate. A table, logits with SparseCategoricalCrossentropy,
    RMSprop; both fits' losses, the second's accuracy and evaluate's results are kept."""
    ids, rng = _ids(43)
    y = rng.integers(0, 3, size=(ROWS,)).astype(np.int32)
    with scope():
        model = tf.keras.Sequential([tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.layers.Embedding(VOCAB, EMB),
                                     tf.keras.layers.GlobalAveragePooling1D(), tf.keras.layers.Dense(3)])
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.RMSprop(0.01),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        first = model.fit(ids, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        second = model.fit(ids[:100], y[:100], batch_size=batch // 2, epochs=2, shuffle=False, verbose=0,
                           class_weight={0: 1.0, 1: 2.0, 2: 0.5})
        evaluated = model.evaluate(ids, y, verbose=0)
    model.logged = [np.array(first.history["loss"] + second.history["loss"] + second.history["accuracy"]
                             + list(evaluated))]
    return model


def restore_best_weights(scope, batch):
    """EarlyStopping(patience=2, restore_best_weights=True) next to ModelCheckpoint(save_best_only=True, an h5 weights
    file in a directory every worker sees): the validation loss is best after the first of 8 epochs, so fit stops
    after the third with that epoch's weights, tables included. Then evaluate, load_weights of the best file (worker
    0 wrote it), evaluate, and one more epoch from there (Adam keeps its state). Losses and results are kept."""
    ids, rng = _ids(59)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    path = os.path.join(SHARED_DIR or tempfile.mkdtemp(prefix="kp_best_"), "best.h5")
    with scope():
        model = _pooled_regressor()
        model.compile(optimizer=tf.keras.optimizers.Adam(0.2), loss="mse")
        history = model.fit(ids[:96], y[:96], batch_size=batch, epochs=8, shuffle=False, verbose=0,
                            validation_data=(ids[96:], y[96:]),
                            callbacks=[tf.keras.callbacks.EarlyStopping(patience=2, restore_best_weights=True),
                                       tf.keras.callbacks.ModelCheckpoint(path, save_best_only=True,
                                                                          save_weights_only=True)])
        restored = model.evaluate(ids[96:], y[96:], verbose=0)
        model.load_weights(path)
        loaded = model.evaluate(ids[96:], y[96:], verbose=0)
        after = model.fit(ids[:96], y[:96], batch_size=batch, epochs=1, shuffle=False, verbose=0)
    if len(history.history["loss"]) != 3:
        raise AssertionError(f"EarlyStopping should stop after 3 epochs; ran {len(history.history['loss'])}")
    model.logged = [np.array(history.history["loss"] + history.history["val_loss"] + [restored, loaded]
                             + after.history["loss"])]
    return model


class TiedLogits(tf.keras.layers.Layer):
    """Next-token logits from a table's own rows (weight tying, as GPT-2 and Keras' examples of it write it):
    ``h @ table^T`` over the embedding layer's table, plus a bias."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def build(self, shape):
        self.bias = self.add_weight("bias", [VOCAB], initializer="zeros")

    def call(self, h):
        return tf.matmul(h, self.embedding.embeddings, transpose_b=True) + self.bias


def tied_embeddings(scope, batch):
    """A language model whose output layer is its input table transposed (one table read by a lookup and by a
    product with every row): the table's gradient is the lookup's rows plus a dense product's."""
    ids, _ = _ids(47)
    data = tf.data.Dataset.from_tensor_slices((ids[:, :-1], ids[:, 1:]))
    with scope():
        inputs = tf.keras.Input((LEN - 1,), dtype=tf.int32)
        embedding = tf.keras.layers.Embedding(VOCAB, EMB)
        h = tf.keras.layers.Dense(EMB, activation="tanh")(embedding(inputs))
        model = tf.keras.Model(inputs, TiedLogits(embedding)(h))
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.01),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(data.batch(batch), epochs=2, verbose=0)
    model.logged = [np.array(history.history["loss"])]
    return model


class DotInteraction(tf.keras.layers.Layer):
    """DLRM's feature interaction: every pair of a row's feature vectors dotted (a batched ``f @ f^T`` per row),
    the strictly upper triangle kept, next to the dense features' vector."""

    def call(self, features):
        stacked = tf.stack(features, axis=1)  # [B, F, d]
        dots = tf.matmul(stacked, stacked, transpose_b=True)  # [B, F, F], each row's own pairs
        count = len(features)
        upper = [i * count + j for i in range(count) for j in range(i + 1, count)]
        pairs = tf.gather(tf.reshape(dots, [-1, count * count]), upper, axis=1)
        return tf.concat([features[0], pairs], axis=1)


def dlrm(scope, batch):
    """A DLRM-style click model as recommendation code writes one: three categorical features, each its own table
    (two with mask-free single ids, one a bag of ids averaged), dense features through a bottom MLP, their dot
    interactions, a top MLP, binary cross-entropy with AUC, Adagrad; a partial last batch."""
    ids, rng = _ids(53)
    dense = rng.normal(size=(ROWS - 11, 4)).astype(np.float32)
    y = (rng.uniform(size=(ROWS - 11, 1)) > 0.6).astype(np.float32)
    ids = ids[:ROWS - 11]
    inputs = {"numeric": dense, "user": ids[:, :1], "item": (ids[:, 1:2] * 7) % VOCAB, "tags": ids[:, 2:]}
    with scope():
        dense_in = tf.keras.Input((4,), name="numeric")
        user_in, item_in = tf.keras.Input((1,), name="user", dtype=tf.int32), tf.keras.Input((1,), name="item",
                                                                                         dtype=tf.int32)
        tags_in = tf.keras.Input((LEN - 2,), name="tags", dtype=tf.int32)
        bottom = tf.keras.layers.Dense(EMB, activation="relu")(dense_in)
        user = tf.keras.layers.Flatten()(tf.keras.layers.Embedding(VOCAB, EMB, name="users")(user_in))
        item = tf.keras.layers.Flatten()(tf.keras.layers.Embedding(VOCAB, EMB, name="items")(item_in))
        tags = tf.keras.layers.GlobalAveragePooling1D()(tf.keras.layers.Embedding(VOCAB, EMB, name="tag_table")(tags_in))
        joined = DotInteraction()([bottom, user, item, tags])
        out = tf.keras.layers.Dense(1, activation="sigmoid")(tf.keras.layers.Dense(8, activation="relu")(joined))
        model = tf.keras.Model([dense_in, user_in, item_in, tags_in], out)
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adagrad(0.1), loss="binary_crossentropy",
                      metrics=[tf.keras.metrics.AUC(name="auc")])
        history = model.fit(inputs, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    model.logged = [np.array([history.history[key] for key in sorted(history.history)])]
    return model



class RecomputedBlock(tf.keras.layers.Layer):
    """Gradient checkpointing as users write it: a table's lookup (averaged), and a Dense layer on the features,
    each under ``tf.recompute_grad`` (the forward pass runs with the tapes stopped; backprop runs it again under a
    tape of its own to take the gradients, from inputs it makes depend on the upstream gradient's first value)."""

    def build(self, shapes):
        self.table = tf.keras.layers.Embedding(VOCAB, EMB)
        self.table.build(shapes[0])
        self.dense = tf.keras.layers.Dense(4, activation="tanh")
        self.dense.build(shapes[1])

    def call(self, inputs):
        ids, features = inputs
        return (tf.recompute_grad(lambda x: tf.reduce_mean(self.table(x), axis=1))(ids),
                tf.recompute_grad(self.dense)(features))


def recomputed_block(scope, batch):
    """RecomputedBlock's two outputs, each into a Dense unit, added; Adam, NumPy arrays of 128 rows in whole batches
    (the step traced for a batch of a known size); every epoch's logs kept."""
    ids, rng = _ids(59)
    features = rng.normal(size=(ROWS, 3)).astype(np.float32)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        inputs = [tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.Input((3,))]
        pooled, hidden = RecomputedBlock()(inputs)
        model = tf.keras.Model(inputs, tf.keras.layers.Add()([tf.keras.layers.Dense(1)(pooled),
                                                              tf.keras.layers.Dense(1)(hidden)]))
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.05), loss="mse", metrics=["mae"])
        history = model.fit((ids, features), y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    model.logged = [np.array([history.history[key] for key in sorted(history.history)])]
    return model


def float64_model(scope, batch):
    """A model in float64 (``tf.keras.backend.set_floatx("float64")``, restored after): per-step labels under a
    ``mask_zero`` table (a loss averaged over each batch's valid steps), Adam, a dataset with a partial last batch
    (16 + 6 rows on the workers in the last step); every epoch's logs kept. Compared at float64 precision."""
    ids, rng = _ids(71)
    labels = rng.integers(0, 3, size=(ROWS, LEN)).astype(np.int32)
    data = tf.data.Dataset.from_tensor_slices((ids[:ROWS - 10], labels[:ROWS - 10])).batch(batch)
    floatx = tf.keras.backend.floatx()
    tf.keras.backend.set_floatx("float64")
    try:
        with scope():
            inputs = tf.keras.Input((LEN,), dtype=tf.int32)
            hidden = tf.keras.layers.Dense(4, activation="tanh")(tf.keras.layers.Embedding(VOCAB, EMB,
                                                                                          mask_zero=True)(inputs))
            model = tf.keras.Model(inputs, tf.keras.layers.Dense(3)(hidden))
            _init(model)
            model.compile(optimizer=tf.keras.optimizers.Adam(0.05),
                          loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])
            history = model.fit(data, epochs=2, verbose=0)
    finally:
        tf.keras.backend.set_floatx(floatx)
    assert all(w.dtype == np.float64 for w in model.get_weights())
    model.logged = [np.array([history.history[key] for key in sorted(history.history)])]
    return model


class _EmbeddingCell(tf.keras.layers.Layer):
    """An RNN cell embedding its own input ids: a table's lookup inside Keras' loop over time steps."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units, self.state_size = units, units
        self.embedding = tf.keras.layers.Embedding(VOCAB, EMB)

    def build(self, input_shape):
        self.kernel = self.add_weight("kernel", (EMB, self.units))
        self.recurrent_kernel = self.add_weight("recurrent_kernel", (self.units, self.units))

    def call(self, inputs, states):
        ids = tf.cast(tf.reshape(inputs, [-1]), tf.int32)  # a float step input (an RNN's state takes its dtype)
        h = tf.tanh(self.embedding(ids) @ self.kernel + states[0] @ self.recurrent_kernel)
        return h, [h]


class _ScannedLookup(tf.keras.layers.Layer):
    """A table of the layer's own, looked up inside ``tf.scan``'s function: a decaying sum over the positions."""

    def build(self, input_shape):
        self.table = self.add_weight("table", (VOCAB, EMB))

    def call(self, ids):
        return tf.scan(lambda total, column: 0.5 * total + tf.nn.embedding_lookup(self.table, column),
                       tf.transpose(ids), initializer=tf.zeros([tf.shape(ids)[0], EMB]))[-1]


def lookups_in_loops(scope, batch):
    """Tables looked up inside loops: an RNN cell embedding its own ids (Keras' RNN loop over the time steps) and
    ``tf.scan`` over the positions with a lookup in its function, both into a Dense head; Adam, a dataset with a
    partial last batch (16 + 6 rows on the workers in the last step)."""
    ids, rng = _ids(75)
    y = rng.normal(size=(ROWS - 10, 1)).astype(np.float32)
    data = tf.data.Dataset.from_tensor_slices((ids[:ROWS - 10], y)).batch(batch)
    with scope():
        inputs = tf.keras.Input((LEN,), dtype=tf.int32)
        recurrent = tf.keras.layers.RNN(_EmbeddingCell(4))(tf.cast(inputs[..., None], tf.float32))
        joined = tf.keras.layers.Concatenate()([recurrent, _ScannedLookup()(inputs)])
        model = tf.keras.Model(inputs, tf.keras.layers.Dense(1)(joined))
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.05), loss="mse", metrics=["mae"])
        history = model.fit(data, epochs=2, verbose=0)
    model.logged = [np.array([history.history[key] for key in sorted(history.history)])]
    return model


class _AccumulatedByHand(tf.keras.Model):
    """Gradient accumulation written in a custom ``train_step``, as users write it: each step adds its gradients
    into variables of their own (``aggregation=MEAN``: each step's sum over the workers' rows, as one process's on
    the global batch), every second step applies their sum with the compiled optimizer inside a ``tf.cond`` and
    zeroes them."""

    def make_accumulators(self):
        self.accumulators = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                         aggregation=tf.VariableAggregation.MEAN) for v in self.trainable_variables]
        self.micro_steps = tf.Variable(0, trainable=False)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compiled_loss(y, self(x, training=True))
        for accumulator, grad in zip(self.accumulators, tape.gradient(loss, self.trainable_variables)):
            accumulator.assign_add(tf.convert_to_tensor(grad) / 2.0)
        self.micro_steps.assign_add(1)

        def apply():
            self.optimizer.apply_gradients(zip([a.read_value() for a in self.accumulators], self.trainable_variables))
            for accumulator in self.accumulators:
                accumulator.assign(tf.zeros_like(accumulator))
            return tf.constant(True)

        tf.cond(self.micro_steps % 2 == 0, apply, lambda: tf.constant(False))
        return {"loss": loss}


def accumulated_by_hand(scope, batch):
    """_AccumulatedByHand (a table and two Dense layers, Adam) on arrays, 4 steps per epoch: 2 updates."""
    ids, rng = _ids(74)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        inputs = tf.keras.Input((LEN,), dtype=tf.int32)
        pooled = tf.keras.layers.GlobalAveragePooling1D()(tf.keras.layers.Embedding(VOCAB, EMB)(inputs))
        hidden = tf.keras.layers.Dense(4, activation="tanh")(pooled)
        model = _AccumulatedByHand(inputs, tf.keras.layers.Dense(1)(hidden))
        _init(model)
        model.make_accumulators()
        model.compile(optimizer=tf.keras.optimizers.Adam(0.05), loss="mse")
        history = model.fit(ids, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    model.logged = [np.array(history.history["loss"])]
    return model


class _Distiller(tf.keras.Model):
    """Keras' knowledge distillation example: a student trained on the labels and on a trained teacher's softened
    predictions (the teacher is read in the step, never updated)."""

    def __init__(self, student, teacher):
        super().__init__()
        self.teacher, self.student = teacher, student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1, temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn, self.distillation_loss_fn = student_loss_fn, distillation_loss_fn
        self.alpha, self.temperature = alpha, temperature

    def train_step(self, data):
        x, y = data
        teacher_predictions = self.teacher(x, training=False)
        with tf.GradientTape() as tape:
            student_predictions = self.student(x, training=True)
            student_loss = self.student_loss_fn(y, student_predictions)
            distillation_loss = self.distillation_loss_fn(
                tf.nn.softmax(teacher_predictions / self.temperature, axis=1),
                tf.nn.softmax(student_predictions / self.temperature, axis=1)) * self.temperature ** 2
            loss = self.alpha * student_loss + (1 - self.alpha) * distillation_loss
        trainable_vars = self.student.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(loss, trainable_vars), trainable_vars))
        self.compiled_metrics.update_state(y, student_predictions)
        results = {m.name: m.result() for m in self.metrics}
        results.update({"student_loss": student_loss, "distillation_loss": distillation_loss})
        return results

    def call(self, x):
        return self.student(x)


def distillation(scope, batch):
    """Keras' knowledge distillation example: a teacher (a table, two Dense layers) trained by its own fit, then
    a smaller student trained by _Distiller on the labels and the teacher's predictions at temperature 10 (Adam),
    every epoch's logs (the student's and distillation losses of the last batch, accuracy) kept."""
    ids, rng = _ids(76)
    y = rng.integers(0, 3, size=(ROWS,)).astype(np.int32)

    def classifier(width):
        inputs = tf.keras.Input((LEN,), dtype=tf.int32)
        pooled = tf.keras.layers.GlobalAveragePooling1D()(tf.keras.layers.Embedding(VOCAB, width)(inputs))
        return tf.keras.Model(inputs, tf.keras.layers.Dense(3)(tf.keras.layers.Dense(8, activation="relu")(pooled)))

    with scope():
        teacher = classifier(EMB)
        _init(teacher, 5)
        teacher.compile(optimizer=tf.keras.optimizers.Adam(0.02),
                        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        teacher.fit(ids, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
        student = classifier(3)
        _init(student, 6)
        distiller = _Distiller(student, teacher)
        distiller.compile(optimizer=tf.keras.optimizers.Adam(0.02), metrics=["sparse_categorical_accuracy"],
                          student_loss_fn=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          distillation_loss_fn=tf.keras.losses.KLDivergence(), alpha=0.1, temperature=10)
        history = distiller.fit(ids, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    student.logged = teacher.get_weights() + [np.array([history.history[k] for k in sorted(history.history)])]
    return student


def sparse_id_tables(scope, batch):
    """Keras' Embedding called on SparseTensor id lists of different lengths (Keras' own
    ``safe_embedding_lookup_sparse``: the mean of each row's vectors), two tables, Adam."""
    ids, rng = _ids(88)
    lengths = rng.integers(1, LEN + 1, size=ROWS)
    where = np.array([[r, c] for r in range(ROWS) for c in range(lengths[r])], np.int64)
    sparse_ids = tf.SparseTensor(where, np.array([ids[r, c] for r, c in where], np.int64), (ROWS, LEN))
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    with scope():
        ids_in = tf.keras.Input((LEN,), sparse=True, dtype=tf.int64)
        first = tf.keras.layers.Embedding(VOCAB, EMB)(ids_in)
        second = tf.keras.layers.Embedding(VOCAB, 4)(ids_in)
        out = tf.keras.layers.Dense(1)(tf.keras.layers.Concatenate()([first, second]))
        model = tf.keras.Model(ids_in, out)
        _init(model)
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss="mse")
        history = model.fit(sparse_ids, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    model.logged = [np.array(history.history["loss"])]
    return model


PROGRAMS = {f.__name__: f for f in (clipped_gradients, clipped_by_tf_gradients, clipped_with_table, clipped_each,
                                    clipped_each_row, mixed_float16_clipped,
                                    clipped_two_optimizers, ratio_metrics, custom_metric_classes, vector_metric_results,
                                    sparse_and_ragged_inputs,
                                    sequence_input, sequence_loader_threads, generator_input,
                                    summed_losses, scalar_loss_functions, scalar_metric_functions, added_loss_only,
                                    unreduced_loss, batch_normalization, mixed_float16, mixed_float16_overflow,
                                    mixed_bfloat16, dict_inputs_auc, tf_data_unknown_cardinality, weighted_samples,
                                    mask_zero_lstm_callbacks,
                                    custom_train_step, text_vectorization, lookup_layers, shared_layer, keras_callbacks,
                                    tf_data_known_cardinality, backup_and_restore_resume, partial_last_batch,
                                    self_sharded_dataset, partial_last_batch_arrays, odd_batch_count_dataset,
                                    padded_sequences, vectorized_after_batch,
                                    masked_sequence_losses, own_loss_partial_batch, gradient_penalty,
                                    tf_distribute_average_loss,
                                    compiled_average_loss, weighted_metrics_sample_weights,
                                    gru_conv1d_evaluate, seq2seq_gru, validation_summed_loss, learning_rate_callbacks,
                                    stop_on_one_worker, layer_running_statistics, stateful_lstm,
                                    run_eagerly_dense, two_optimizers,
                                    fine_tuning, own_compute_loss, own_embedding_layer,
                                    added_metrics, tracked_train_step, multi_output, transformer_lm, per_row_map,
                                    paired_rows, callback_writes,
                                    steps_per_execution_partial, second_fit_other_batch, restore_best_weights,
                                    wide_deep_premade, tied_embeddings, dlrm, recomputed_block, float64_model,
                                    lookups_in_loops, accumulated_by_hand, distillation, encoded_features,
                                    padded_in_the_model,
                                    feature_columns, weighted_bags, bidirectional_tagger, sparse_id_tables,
                                    built_by_first_step, train_on_batch_loop)}  # last two: they seed Keras' RNG


# Run again with every table in 3 stripes over 2 PS tasks (partitions=3): programs reading only what Keras gives a
# user (get_weights, logs), not indexing a model's variables by position (stripes are separate variables there).
STRIPED = ("clipped_with_table", "clipped_each_row", "sparse_and_ragged_inputs", "sequence_input",
           "batch_normalization", "mixed_float16", "weighted_samples", "mask_zero_lstm_callbacks", "text_vectorization",
           "lookup_layers", "shared_layer", "keras_callbacks", "backup_and_restore_resume", "partial_last_batch_arrays",
           "odd_batch_count_dataset", "masked_sequence_losses", "own_loss_partial_batch", "stateful_lstm",
           "two_optimizers", "fine_tuning", "own_embedding_layer", "transformer_lm", "steps_per_execution_partial",
           "restore_best_weights", "wide_deep_premade", "callback_writes", "tied_embeddings", "dlrm",
           "lookups_in_loops", "sparse_id_tables", "built_by_first_step", "train_on_batch_loop")


# Run again under architecture="ps" (the dense variables on the PS too, read once per step, updated there): programs
# whose step the ps path builds differently (custom train_steps transforming gradients or taking them by nested
# tapes, recomputation, loops, running statistics, several outputs, steps_per_execution). Every program was run so
# by hand on 2026-12-06: equal to one process but for the refusals the README lists (run_eagerly with PS variables,
# a second optimizer updating PS variables).
ON_PS = ("clipped_gradients", "clipped_each", "mixed_float16_clipped", "batch_normalization",
         "mask_zero_lstm_callbacks", "custom_train_step", "own_loss_partial_batch", "gradient_penalty", "stateful_lstm",
         "fine_tuning", "multi_output", "transformer_lm", "steps_per_execution_partial", "dlrm", "recomputed_block",
         "lookups_in_loops", "accumulated_by_hand")


# Programs whose result follows the per-worker batch by the training contract (docs/training-contract.md): custom
# train_steps transforming each worker's gradients before apply_gradients (a clip by a norm), loss and metric
# functions returning one scalar for the batch, metrics fed one value per batch (add_metric, a loss tracker),
# tf.nn.compute_average_loss over tf.distribute's global batch size, batches padded to their own longest row without
# a mask (after the batch in the pipeline, or in the model). Under kparallax every worker writes its trainable weights (<name>.w<rank>.npz): the test asserts that the workers'
# replicas agree and are finite. Every other program equals one process on the global batch.
PER_WORKER = ("clipped_gradients", "clipped_by_tf_gradients", "clipped_with_table", "clipped_each", "clipped_each_row",
              "mixed_float16_clipped", "clipped_two_optimizers", "scalar_loss_functions", "scalar_metric_functions",
              "vectorized_after_batch", "padded_in_the_model", "tf_distribute_average_loss", "compiled_average_loss",
              "added_metrics", "tracked_train_step")


def in_order(names):
    """``names`` (``STRIPED``, ``ON_PS``) in the order of ``PROGRAMS``."""
    return [name for name in PROGRAMS if name in names]


def shard(index, count):
    """The names of the programs in part ``index`` of ``count`` contiguous parts of ``PROGRAMS`` (in order, so the
    last two, which seed Keras' RNG, stay last): the test runs each part in its own job, under its own timeout."""
    if not 0 <= index < count:
        raise ValueError(f"A shard index must be in [0, {count}). Received: {index}")
    names = list(PROGRAMS)
    return names[index * len(names) // count:(index + 1) * len(names) // count]

