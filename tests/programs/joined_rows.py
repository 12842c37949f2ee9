"""A custom ``train_step`` whose loss is the mean over the batch's per-example losses joined along the rows to a
fixed set of prior terms (``tf.concat([per_example, prior], 0)``: entries of something else than the batch after its
rows). One process takes that mean over the global batch's rows and the prior once; each worker over its own rows
and the prior, so the averaged gradient is not one process's. kparallax refuses it on several workers; joined to the
rows gathered over every worker (``kp.all_gather``, the refusal's fix), it is one process's.

Usage: joined_rows.py OUT_DIR MODE [VARIANT]
  MODE=reference: one plain process on the global batch (never imports kparallax).
  MODE=kparallax: under kparallax-run (2 workers), per-worker batch.
  VARIANT=gathered: the prior joined to kp.all_gather(per_example) under kparallax (the reference is unchanged).
  VARIANT=replayed: no prior; 4 fixed replayed examples joined to each batch (inputs and labels) and the compiled
  mean squared error of the model on them (``compute_loss``), in the reference too.
  VARIANT=replayed_lstm: as replayed, the model an LSTM of 2 units over each example's 3 values as time steps (its
  loop over the time steps reads the joined rows from a list), then the dense layer.
64 rows, a global batch of 32, 3 epochs, SGD; writes OUT_DIR/joined.npz (the weights) from worker 0 (or the
process).
"""

import contextlib
import os
import sys

import numpy as np
import tensorflow as tf

ROWS, GLOBAL_BATCH = 64, 32


class PriorJoined(tf.keras.Model):
    """A dense regressor whose loss joins each example's squared error to the squared kernel entries (a prior)."""

    def __init__(self, gather=None, replayed=None, lstm=False):
        super().__init__()
        self.dense = tf.keras.layers.Dense(1)
        self.lstm = tf.keras.layers.LSTM(2) if lstm else None
        self.gather = gather or (lambda rows: rows)
        self.replayed = replayed

    def call(self, x):
        return self.dense(x if self.lstm is None else self.lstm(x[:, :, None]))

    def train_step(self, data):
        x, y = data
        if self.replayed is not None:
            replay_x, replay_y = self.replayed
            x, y = tf.concat([x, replay_x], 0), tf.concat([y, replay_y], 0)  # [B + 4, 3], [B + 4, 1]
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x, y, self(x, training=True))
            self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables),
                                               self.trainable_variables))
            return {"loss": loss}
        with tf.GradientTape() as tape:
            per_example = self.gather(tf.square(self(x, training=True) - y)[:, 0])
            prior = tf.reshape(tf.square(self.dense.kernel), [-1])
            loss = tf.reduce_mean(tf.concat([per_example, prior], 0))
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables))
        return {"loss": loss}


def main(out_dir, mode, variant=""):
    rng = np.random.default_rng(9)
    x = rng.normal(size=(ROWS, 3)).astype(np.float32)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    replayed = None
    if variant.startswith("replayed"):
        replayed = (tf.constant(rng.normal(size=(4, 3)), tf.float32), tf.constant(rng.normal(size=(4, 1)), tf.float32))
    if mode == "reference":
        scope, batch, chief = contextlib.nullcontext, GLOBAL_BATCH, True
    else:
        import kparallax as kp  # pylint: disable=import-outside-toplevel
        strategy = kp.HybridStrategy()
        scope, batch, chief = strategy.scope, GLOBAL_BATCH // strategy.num_workers, strategy.is_chief
    with scope():
        model = PriorJoined(kp.all_gather if variant == "gathered" else None, replayed, variant == "replayed_lstm")
        model.build((None, 3))
        model.set_weights([np.full(w.shape, 0.5 if w.ndim > 1 else 0.0, np.float32) for w in model.get_weights()])
        model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse" if replayed is not None else None)
        model.fit(x, y, batch_size=batch, epochs=3, shuffle=False, verbose=0)
    if chief:
        np.savez(os.path.join(out_dir, "joined.npz"), *model.get_weights())
    if mode == "reference":
        assert "kparallax" not in sys.modules, "the reference must not import kparallax"


if __name__ == "__main__":
    main(*sys.argv[1:])
