"""Ordinary Keras programs, written as a user would. Each ``run(scope, batch)`` builds, compiles and fits its model
inside ``scope()`` (a plain ``contextlib.nullcontext`` in the single-process reference, ``strategy.scope`` under
kparallax) with ``batch`` rows per step (the global batch in the reference, the per-worker batch under kparallax),
and returns the trained model. Never imports kparallax."""

import numpy as np
import tensorflow as tf

VOCAB, EMB, LEN, ROWS, WORKERS = 120, 6, 5, 128, 2


def _ids(seed):
    rng = np.random.default_rng(seed)
    return np.minimum(rng.zipf(1.4, size=(ROWS, LEN)) - 1, VOCAB - 1).astype(np.int32), rng


def _init(model, seed=21):
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(scale=0.2, size=w.shape).astype(w.dtype) if w.dtype.kind == "f" else w
                       for w in model.get_weights()])


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


PROGRAMS = {f.__name__: f for f in (dict_inputs_auc, tf_data_unknown_cardinality, weighted_samples,
                                    mask_zero_lstm_callbacks, custom_train_step, text_vectorization)}
