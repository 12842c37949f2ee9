"""A compiled loss over pairs of consecutive rows (``tf.reshape(y_pred, [-1, 2])``: each pair one entry), fit on
arrays of 54 rows with a global batch of 32 (``shuffle=False``): a last global batch of 22 rows, 11 pairs. One
process trains on it; on 2 workers each worker's part of it has 11 rows, which do not fill whole pairs, and
kparallax refuses the step before the user's reshape would fail with TensorFlow's own error.

Usage: paired_parts.py OUT_DIR MODE
  MODE=reference: one plain process on the global batch (never imports kparallax).
  MODE=kparallax: under kparallax-run (2 workers), per-worker batch.
Writes OUT_DIR/paired.npz (the weights, then the epochs' losses) from worker 0 (or the process).
"""

import contextlib
import os
import sys

import numpy as np
import tensorflow as tf

ROWS, GLOBAL_BATCH = 54, 32


def pair_difference_loss(y_true, y_pred):
    """Each pair's predicted difference against its true one, one loss per pair."""
    true, pred = tf.reshape(y_true, [-1, 2]), tf.reshape(y_pred, [-1, 2])
    return tf.square((pred[:, 0] - pred[:, 1]) - (true[:, 0] - true[:, 1]))


def main(out_dir, mode):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(ROWS, 3)).astype(np.float32)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    if mode == "reference":
        scope, batch, chief = contextlib.nullcontext, GLOBAL_BATCH, True
    else:
        import kparallax as kp  # pylint: disable=import-outside-toplevel
        strategy = kp.HybridStrategy()
        scope, batch, chief = strategy.scope, GLOBAL_BATCH // strategy.num_workers, strategy.is_chief
    with scope():
        model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(1)])
        model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=pair_difference_loss)
        history = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    if chief:
        np.savez(os.path.join(out_dir, "paired.npz"), *model.get_weights(), np.array(history.history["loss"]))
    if mode == "reference":
        assert "kparallax" not in sys.modules, "the reference must not import kparallax"


if __name__ == "__main__":
    main(*sys.argv[1:])
