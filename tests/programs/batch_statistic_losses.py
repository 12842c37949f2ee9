"""Losses of statistics of the batch other than its mean or sum: a root mean squared error and a mean over a mask
written by hand (TensorFlow's transformer tutorial's), each a compiled loss function, and a sparsity penalty on the
batch's mean activation added by a layer (``add_loss``: the Kullback-Leibler divergence of a target rate from each
unit's mean sigmoid activation over the batch, as a sparse autoencoder's). One process takes them of the global
batch's statistics. kparallax runs the compiled loss functions with the global batch's statistics itself; the
layer's penalty takes them of ``kp.all_gather``'s rows ("gathered"), or of the worker's own rows, as the reference
writes it ("own"), which kparallax refuses.

Usage: batch_statistic_losses.py OUT_DIR MODE [OPTION]
  MODE=reference: one plain process on the global batch (never imports kparallax).
  MODE=kparallax: under kparallax-run (2 workers), per-worker batch; OPTION "gathered" (the default) or "own".
Each model (``rmse``, ``masked_mean``, ``sparsity``) trains on 156 rows (a third of the targets 0, padding) with
validation_split=0.25 (117 rows: a last batch of 21, split 11 and 10) for 3 epochs, the root mean squared error
compiled as a metric too; writes OUT_DIR/<model>.npz (weights, then the epochs' logs: loss, rmse, val_loss,
val_rmse) from worker 0 (or the process), after the last model trained.
"""

import contextlib
import os
import sys

import numpy as np
import tensorflow as tf

VOCAB, EMB, LEN, ROWS, GLOBAL_BATCH, RATE = 120, 6, 5, 156, 32, 0.1
LOGS = ("loss", "rmse", "val_loss", "val_rmse")


def _rows(gather):
    """The rows a statistic is taken of: the worker's own, or every worker's (``gather``)."""
    return gather if gather is not None else (lambda value: value)


def rmse(y_true, y_pred):
    """A root mean squared error over the batch, one scalar."""
    return tf.sqrt(tf.reduce_mean(tf.square(y_pred - y_true)))


def masked_mean(y_true, y_pred):
    """Squared errors averaged over the targets that are not 0 (padding), as TensorFlow's transformer tutorial
    writes its masked loss."""
    mask = tf.cast(y_true != 0, y_pred.dtype)
    return tf.reduce_sum(tf.square(y_pred - y_true) * mask) / tf.reduce_sum(mask)


class Sparsity(tf.keras.layers.Layer):
    """Adds the divergence of ``RATE`` from each unit's mean sigmoid activation over the batch's rows."""

    def __init__(self, gather, **kwargs):
        super().__init__(**kwargs)
        self.gather = gather

    def call(self, x):
        rate = tf.reduce_mean(tf.sigmoid(_rows(self.gather)(x)), axis=0)
        self.add_loss(0.5 * tf.reduce_sum(RATE * tf.math.log(RATE / rate)
                                          + (1 - RATE) * tf.math.log((1 - RATE) / (1 - rate))))
        return x


def main(out_dir, mode, option="gathered"):
    rng = np.random.default_rng(3)
    ids = np.minimum(rng.zipf(1.4, size=(ROWS, LEN)) - 1, VOCAB - 1).astype(np.int32)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    y[rng.random(ROWS) < 1 / 3] = 0.0  # padding, which the masked mean leaves out
    if mode == "reference":
        scope, batch, chief, gather = contextlib.nullcontext, GLOBAL_BATCH, True, None
    else:
        import kparallax as kp  # pylint: disable=import-outside-toplevel
        strategy = kp.HybridStrategy()
        scope, batch, chief = strategy.scope, GLOBAL_BATCH // strategy.num_workers, strategy.is_chief
        gather = kp.all_gather if option == "gathered" else None
    results = {}
    for name, loss in (("rmse", rmse), ("masked_mean", masked_mean), ("sparsity", "mse")):
        with scope():
            layers = [tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.layers.Embedding(VOCAB, EMB),
                      tf.keras.layers.GlobalAveragePooling1D(), tf.keras.layers.Dense(3)]
            layers += [Sparsity(gather)] if name == "sparsity" else []
            model = tf.keras.Sequential(layers + [tf.keras.layers.Dense(1)])
            init = np.random.default_rng(21)
            model.set_weights([init.normal(scale=0.5, size=w.shape).astype(np.float32) for w in model.get_weights()])
            model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=loss, metrics=[rmse])
            history = model.fit(ids, y, batch_size=batch, epochs=3, shuffle=False, validation_split=0.25, verbose=0)
        results[name] = model.get_weights() + [np.array(history.history[k]) for k in LOGS]
    for name, arrays in results.items() if chief else ():
        np.savez(os.path.join(out_dir, f"{name}.npz"), *arrays)
    if mode == "reference":
        assert "kparallax" not in sys.modules, "the reference must not import kparallax"


if __name__ == "__main__":
    main(*sys.argv[1:])
