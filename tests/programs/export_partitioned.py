"""Trains a model with a partitioned table (run under kparallax-run, 2 PS tasks) and saves it every way Keras
offers; writes the expected weights and predictions, and the initial weights and data of a one-process reference, for
load_plain.py; then loads model.keras with strategy.load_model on both workers and trains one more epoch
(continued.npz). Usage: export_partitioned.py OUT_DIR"""

import os
import sys
import time

import numpy as np
import tensorflow as tf

import kparallax as kp

VOCAB, EMB, LEN = 101, 4, 3
REGULARIZATION = 1e-3


def build():
    ids = tf.keras.Input((LEN,), dtype=tf.int32, name="ids")
    # A regularized table: Keras keeps its loss per stripe, and a saved model holds one over the whole table (before,
    # the SavedModel was refused: its traced losses captured a stripe the saved object did not reach).
    x = tf.keras.layers.Flatten()(tf.keras.layers.Embedding(
        VOCAB, EMB, embeddings_regularizer=tf.keras.regularizers.l2(REGULARIZATION), name="table")(ids))
    return tf.keras.Model(ids, tf.keras.layers.Dense(1, name="out")(x))


def main(out):
    strategy = kp.HybridStrategy(partitions=2)
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(64, LEN)).astype(np.int32)
    y = rng.normal(size=(64, 1)).astype(np.float32)
    with strategy.scope():
        model = build()
        initial = model.get_weights()
        model.compile(optimizer=tf.keras.optimizers.Adagrad(0.5), loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert len(model.get_layer("table").weights) == 2, "the table must be partitioned for this test"
    model.save(os.path.join(out, "model.keras"))
    model.save(os.path.join(out, "model.h5"))
    model.save(os.path.join(out, "saved_model"))
    model.save_weights(os.path.join(out, "weights.h5"))
    # After the saves, the loss is the stripes' again (one each), of the whole table's value.
    table = model.get_layer("table").get_weights()[0]
    assert len(model.losses) == 2, model.losses
    np.testing.assert_allclose(float(tf.add_n(model.losses)), REGULARIZATION * float(np.sum(np.square(table))),
                               rtol=1e-5)
    with strategy.scope():
        again = build()
        again.compile(optimizer="sgd", loss="mse")
        again.load_weights(os.path.join(out, "weights.h5"))
    for a, b in zip(again.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    if strategy.is_chief:
        np.savez(os.path.join(out, "expected.npz"), *model.get_weights(), x=x[:8], predictions=model.predict(x[:8]),
                 x_train=x, y_train=y, regularization=REGULARIZATION,
                 **{f"initial_{i}": w for i, w in enumerate(initial)})
        print("exported", flush=True)
    # Saved just before the load, late (worker 0 writes, the others return at once): load_model's barrier keeps
    # worker 1 from reading the file before it is complete.
    if strategy.is_chief:
        time.sleep(2)
    model.save(os.path.join(out, "resumed.keras"))
    loaded = strategy.load_model(os.path.join(out, "resumed.keras"))  # every worker, as a resumed program would
    assert len(loaded.get_layer("table").weights) == 2 and strategy.is_ps_variable(loaded.get_layer("table").weights[0])
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations) == 4
    loaded.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    if strategy.is_chief:
        np.savez(os.path.join(out, "continued.npz"), *loaded.get_weights())
        print("continued", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
