"""Tables whose gradient is dense (a regularizer, a tied output layer), and several steps per execution: models,
data, initial weights.

Written as a user would (plain Keras); never imports kparallax. ``train_dense_tables.py`` trains them in one plain
process or under kparallax.
"""

import numpy as np
import tensorflow as tf

VOCAB, EMB, LEN = 200, 8, 5
PER_WORKER_BATCH, WORKERS, STEPS, EPOCHS = 8, 2, 8, 2


def data():
    rng = np.random.default_rng(7)
    n = PER_WORKER_BATCH * WORKERS * STEPS
    ids = np.minimum(rng.zipf(1.4, size=(n, LEN)) - 1, VOCAB - 1).astype(np.int32)
    return ids, ids[:, -1].copy(), rng.normal(size=(n, 1)).astype(np.float32)


def regularized():
    """Sequential; the table has an L2 regularizer (its gradient is dense plus the lookup's rows). SGD."""
    model = tf.keras.Sequential([
        tf.keras.Input((LEN,), dtype=tf.int32),
        tf.keras.layers.Embedding(VOCAB, EMB, embeddings_regularizer=tf.keras.regularizers.l2(1e-2),
                                  name="reg_embedding"),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(1, name="reg_out")], name="regularized")
    return model, tf.keras.optimizers.SGD(0.2), "mse", {}


class Tied(tf.keras.Model):
    """Subclassed; the output layer is the table transposed (``logits = h @ embeddings^T``)."""

    def __init__(self, name="tied"):
        super().__init__(name=name)
        self.embedding = tf.keras.layers.Embedding(VOCAB, EMB, name=f"{name}_embedding")
        self.hidden = tf.keras.layers.Dense(EMB, activation="tanh", name=f"{name}_hidden")

    def call(self, ids):
        h = self.hidden(tf.reduce_mean(self.embedding(ids[:, :-1]), axis=1))
        return tf.matmul(h, self.embedding.embeddings, transpose_b=True)


def tied():
    model = Tied()
    model.build((None, LEN))
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, tf.keras.optimizers.Adagrad(0.3), loss, {}


def tied_clipped():
    """``tied`` trained with ``global_clipnorm`` (binding at every step): the norm spans the replicated hidden layer,
    the table's dense gradient and, under ``ps``, everything on the PS. Momentum SGD, whose step scales with it."""
    model = Tied("tied_clipped")
    model.build((None, LEN))
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, tf.keras.optimizers.SGD(0.3, momentum=0.9, global_clipnorm=0.2), loss, {}


def multi_step():
    """Functional wide-and-deep with two tables, compiled with ``steps_per_execution=3`` (8 steps per epoch: the
    last execution of each epoch is shorter). Adam."""
    ids = tf.keras.Input((LEN,), dtype=tf.int32)
    wide = tf.keras.layers.Flatten()(tf.keras.layers.Embedding(VOCAB, 1, name="wide_embedding")(ids))
    deep = tf.keras.layers.Flatten()(tf.keras.layers.Embedding(VOCAB, EMB, name="deep_embedding")(ids))
    deep = tf.keras.layers.Dense(8, activation="relu", name="deep_hidden")(deep)
    out = tf.keras.layers.Dense(1, name="multi_out")(tf.keras.layers.Concatenate()([wide, deep]))
    return tf.keras.Model(ids, out, name="multi_step"), tf.keras.optimizers.Adam(0.02), "mse", \
        {"steps_per_execution": 3}


MODELS = {"regularized": regularized, "tied": tied, "tied_clipped": tied_clipped, "multi_step": multi_step}


def targets(name, tokens, regression):
    return tokens if name.startswith("tied") else regression


def initial_weights(model):
    rng = np.random.default_rng(3)
    return [rng.normal(scale=0.3, size=w.shape).astype(np.float32) for w in model.get_weights()]
