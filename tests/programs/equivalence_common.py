"""Model, data, initial weights and optimizers shared by the equivalence programs. Never imports kparallax."""

import os

import numpy as np
import tensorflow as tf

VOCAB, EMB, LEN = 1000, 8, 6
PER_WORKER_BATCH, STEPS = 16, 12
WORKERS = int(os.environ.get("KP_EQUIVALENCE_WORKERS", "2"))  # the multi-host tests also run 2 hosts x 2 workers

OPTIMIZERS = {
    "sgd": lambda: tf.keras.optimizers.SGD(0.1),
    "momentum": lambda: tf.keras.optimizers.SGD(0.2, momentum=0.9),
    "adagrad": lambda: tf.keras.optimizers.Adagrad(0.3),
    "adam": lambda: tf.keras.optimizers.Adam(0.01),
    "adam_string": lambda: "adam",
    "legacy_momentum": lambda: tf.keras.optimizers.legacy.SGD(0.2, momentum=0.9),
    "legacy_adam": lambda: tf.keras.optimizers.legacy.Adam(0.01),
    # Clipping that binds on this model's gradients (norms 1.2-2.7, largest entries 0.2-2.3 on the first step).
    "clipnorm": lambda: tf.keras.optimizers.Adam(0.01, clipnorm=0.5),
    "legacy_clip_both": lambda: tf.keras.optimizers.legacy.SGD(0.2, momentum=0.9, clipvalue=0.1, clipnorm=0.3),
    "adam_ema": lambda: tf.keras.optimizers.Adam(0.01, use_ema=True, ema_overwrite_frequency=5),
    # One norm over every gradient (the table's slices, the dense layers'); binds on the first steps.
    "global_clipnorm": lambda: tf.keras.optimizers.SGD(0.2, momentum=0.9, global_clipnorm=1.0),
    "legacy_clip_global": lambda: tf.keras.optimizers.legacy.SGD(0.2, momentum=0.9, clipvalue=0.1,
                                                                 global_clipnorm=0.3),
}


def data():
    """Token ids with many repeats (within and across workers' batches) and a regression target."""
    rng = np.random.default_rng(1234)
    n = PER_WORKER_BATCH * WORKERS * STEPS
    ids = np.minimum(rng.zipf(1.5, size=(n, LEN)) - 1, VOCAB - 1).astype(np.int32)
    y = rng.normal(size=(n, 1)).astype(np.float32)
    return ids, y


def build_model(name):
    """The equivalence model. With ``KP_EQUIVALENCE_TOKEN_BIAS=1`` in the environment (read at each call), a second
    table, one bias per token, is looked up with the same ids and added to the output, as lm1b's softmax biases
    are looked up with its softmax weights' ids: two tables whose gradients carry the same indices."""
    inputs = tf.keras.Input(shape=(LEN,), dtype=tf.int32)
    x = tf.keras.layers.Embedding(VOCAB, EMB, name=f"{name}_embedding")(inputs)   # [batch, LEN, EMB]
    x = tf.keras.layers.Flatten()(x)                                              # [batch, LEN*EMB]
    x = tf.keras.layers.Dense(16, activation="tanh", name=f"{name}_hidden")(x)
    outputs = tf.keras.layers.Dense(1, name=f"{name}_out")(x)
    if os.environ.get("KP_EQUIVALENCE_TOKEN_BIAS") == "1":
        bias = tf.keras.layers.Embedding(VOCAB, 1, name=f"{name}_token_bias")(inputs)  # [batch, LEN, 1]
        outputs = tf.keras.layers.Add()([outputs, tf.reduce_sum(bias, axis=1)])  # [batch, 1]
    return tf.keras.Model(inputs, outputs, name=name)


def initial_weights(model):
    rng = np.random.default_rng(99)
    return [rng.normal(scale=0.3, size=w.shape).astype(np.float32) for w in model.get_weights()]
