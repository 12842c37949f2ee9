"""Losses summed over the batch under gradient accumulation: each trains a small model (a table, pooled, into one
unit; SGD) on 128 rows for 2 epochs.

Usage: accumulated_losses.py OUT_DIR MODE
  MODE=reference: one plain process, batches of 64 (never imports kparallax).
  MODE=kparallax: under kparallax-run (2 workers), batches of 16, backward_passes_per_step=2: each update averages
  2 micro-batches of 2 workers, 64 rows, as one process's batch.
Writes OUT_DIR/<loss>.npz (weights, then the epochs' logged losses) from worker 0 (or the one process), for each
loss: "mean" (Keras' default, the control), "sum" (reduction "sum"), "none" (reduction "none"), "average" (a
train_step averaging with tf.nn.compute_average_loss, the worker's mean, as under Horovod).
"""

import contextlib
import os
import sys

import numpy as np
import tensorflow as tf

VOCAB, EMB, LEN, ROWS, GLOBAL_BATCH = 120, 6, 5, 128, 64


class AverageLossStep(tf.keras.Sequential):
    """Its own train_step: squared errors averaged with tf.nn.compute_average_loss (the batch's mean)."""

    def train_step(self, data):
        ids, y = data
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(self(ids, training=True) - y), axis=1)
            loss = tf.nn.compute_average_loss(per_example)
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables))
        return {"loss": loss}


LOSSES = {
    "mean": lambda: "mse",
    "sum": lambda: tf.keras.losses.MeanSquaredError(reduction="sum"),
    "none": lambda: tf.keras.losses.MeanSquaredError(reduction="none"),
    "average": lambda: None,
}


def main(out_dir, mode):
    rng = np.random.default_rng(3)
    ids = np.minimum(rng.zipf(1.4, size=(ROWS, LEN)) - 1, VOCAB - 1).astype(np.int32)
    y = rng.normal(size=(ROWS, 1)).astype(np.float32)
    if mode == "reference":
        scope, batch, chief = contextlib.nullcontext, GLOBAL_BATCH, True
    else:
        import kparallax as kp  # pylint: disable=import-outside-toplevel
        strategy = kp.HybridStrategy(backward_passes_per_step=2)
        scope, batch, chief = strategy.scope, GLOBAL_BATCH // 4, strategy.is_chief
    for name, loss in LOSSES.items():
        with scope():
            layers = [tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.layers.Embedding(VOCAB, EMB),
                      tf.keras.layers.GlobalAveragePooling1D(), tf.keras.layers.Dense(1)]
            model = AverageLossStep(layers) if name == "average" else tf.keras.Sequential(layers)
            init = np.random.default_rng(21)
            model.set_weights([init.normal(scale=0.2, size=w.shape).astype(np.float32) for w in model.get_weights()])
            model.compile(optimizer=tf.keras.optimizers.SGD(0.004), loss=loss())
            history = model.fit(ids, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
        if chief:
            np.savez(os.path.join(out_dir, f"{name}.npz"), *model.get_weights(), np.array(history.history["loss"]))
    if mode == "reference":
        assert "kparallax" not in sys.modules, "the reference must not import kparallax"


if __name__ == "__main__":
    main(*sys.argv[1:])
