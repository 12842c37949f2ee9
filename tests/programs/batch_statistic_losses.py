"""Losses of statistics of the batch other than its mean or sum: a root mean squared error, a mean over a mask
written by hand, and TensorFlow's transformer tutorial's masked loss and accuracy over per-token logits, each a
compiled loss (and metric) function, and a sparsity penalty on the batch's mean activation added by a layer
(``add_loss``: the Kullback-Leibler divergence of a target rate from each unit's mean sigmoid activation over the
batch, as a sparse autoencoder's), and a decorrelation penalty on the batch's Gram matrix of activations added by
a layer (the squared distance of ``h^T h / rows`` from the identity). One process takes them of the global batch's
statistics. kparallax runs the compiled functions with the global batch's statistics itself; the layers' penalties
take them of ``kp.all_gather``'s rows ("gathered"), or of the worker's own rows, as the reference writes them
("own": the sparsity model first; "own_gram": the Gram matrix's model alone), which kparallax refuses.

Usage: batch_statistic_losses.py OUT_DIR MODE [OPTION]
  MODE=reference: one plain process on the global batch (never imports kparallax).
  MODE=kparallax: under kparallax-run (2 workers), per-worker batch; OPTION "gathered" (the default), "own" or
    "own_gram".
Each model (``rmse``, ``masked_mean``, ``sparsity``, ``gram``: one regression target per row, a third of them 0,
padding; ``tutorial``: a token per step, 30% of them 0, padding) trains on 156 rows with validation_split=0.25 (117
rows: a last batch of 21, split 11 and 10) for 3 epochs, a metric compiled too (the root mean squared error; the
tutorial's masked accuracy); writes OUT_DIR/<model>.npz (weights, then the epochs' logs: loss, metric, val_loss,
val_metric) from worker 0 (or the process), after the last model trained.
"""

import contextlib
import os
import sys

import numpy as np
import tensorflow as tf

VOCAB, EMB, LEN, ROWS, GLOBAL_BATCH, RATE, TOKENS = 120, 6, 5, 156, 32, 0.1, 9


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


def masked_loss(label, pred):
    """TensorFlow's transformer tutorial's loss: per-token cross-entropies of [B, T, V] logits, padding (label 0)
    masked out, averaged over the batch's valid tokens."""
    mask = label != 0
    loss_object = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    loss = loss_object(label, pred)
    mask = tf.cast(mask, dtype=loss.dtype)
    loss *= mask
    return tf.reduce_sum(loss) / tf.reduce_sum(mask)


def masked_accuracy(label, pred):
    """The tutorial's metric: the share of the batch's valid tokens predicted right."""
    pred = tf.argmax(pred, axis=2)
    label = tf.cast(label, pred.dtype)
    match = label == pred
    mask = label != 0
    match = match & mask
    match = tf.cast(match, dtype=tf.float32)
    mask = tf.cast(mask, dtype=tf.float32)
    return tf.reduce_sum(match) / tf.reduce_sum(mask)


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


class Decorrelation(tf.keras.layers.Layer):
    """Adds the squared distance of the batch's Gram matrix of ``x`` (``x^T x`` over its rows, divided by their
    count) from the identity."""

    def __init__(self, gather, **kwargs):
        super().__init__(**kwargs)
        self.gather = gather

    def call(self, x):
        rows = _rows(self.gather)(x)
        gram = tf.matmul(rows, rows, transpose_a=True) / tf.cast(tf.shape(rows)[0], x.dtype)
        self.add_loss(0.05 * tf.reduce_sum(tf.square(gram - tf.eye(x.shape[-1]))))
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
    tokens = np.where(rng.random((ROWS, LEN)) < 0.3, 0, (ids * 7 + 3) % TOKENS).astype(np.int32)  # 0: padding
    results = {}
    models = (("rmse", rmse), ("masked_mean", masked_mean), ("sparsity", "mse"), ("gram", "mse"),
              ("tutorial", masked_loss))
    for name, loss in models:
        if option == "own_gram" and name != "gram":
            continue
        with scope():
            layers = [tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.layers.Embedding(VOCAB, EMB)]
            if name == "tutorial":  # per-token logits [B, LEN, TOKENS]
                model = tf.keras.Sequential(layers + [tf.keras.layers.Dense(TOKENS)])
                targets, metric = tokens, masked_accuracy
            else:
                layers += [tf.keras.layers.GlobalAveragePooling1D(), tf.keras.layers.Dense(3)]
                penalties = {"sparsity": Sparsity, "gram": Decorrelation}
                layers += [penalties[name](gather)] if name in penalties else []
                model, targets, metric = tf.keras.Sequential(layers + [tf.keras.layers.Dense(1)]), y, rmse
            init = np.random.default_rng(21)
            model.set_weights([init.normal(scale=0.5, size=w.shape).astype(np.float32) for w in model.get_weights()])
            model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=loss, metrics=[metric])
            history = model.fit(ids, targets, batch_size=batch, epochs=3, shuffle=False, validation_split=0.25,
                                verbose=0)
        logs = [key.format(metric.__name__) for key in ("loss", "{}", "val_loss", "val_{}")]
        results[name] = model.get_weights() + [np.array(history.history[key]) for key in logs]
    for name, arrays in results.items() if chief else ():
        np.savez(os.path.join(out_dir, f"{name}.npz"), *arrays)
    if mode == "reference":
        assert "kparallax" not in sys.modules, "the reference must not import kparallax"


if __name__ == "__main__":
    main(*sys.argv[1:])
