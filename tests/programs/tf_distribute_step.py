"""A train_step written for tf.distribute: a per-token loss under a padding mask, normalized by the valid tokens of
the global batch, which it counts with tf.distribute.get_replica_context().all_reduce (NORMALIZER=all_reduce), with
the strategy's reduce in a merge_call (NORMALIZER=merge_call), or as this replica's valid tokens times the replica
count, num_replicas_in_sync (NORMALIZER=replica_count).

Usage: tf_distribute_step.py OUT_DIR MODE NORMALIZER
  MODE=reference: one plain process (never imports kparallax): trains and writes OUT_DIR/model.npz.
  MODE=kparallax: the same program under kparallax-run's strategy: on several workers the replica context's
  all_reduce and the strategy's reduce would count this worker's tokens alone, and num_replicas_in_sync is 1, so
  kparallax refuses each at the first step (nothing written).
"""

import contextlib
import os
import sys

import numpy as np
import tensorflow as tf

VOCAB, EMB, LEN, ROWS, BATCH = 50, 4, 6, 64, 16


class TokenModel(tf.keras.Model):
    """A table into a per-token Dense regression; its loss: squared errors of the non-padding tokens, summed and
    divided by the global batch's count of such tokens, as tf.distribute's guides normalize a masked loss."""

    def __init__(self, normalizer):
        super().__init__()
        self.normalizer = normalizer
        self.table, self.out = tf.keras.layers.Embedding(VOCAB, EMB), tf.keras.layers.Dense(1)

    def call(self, ids):
        return tf.squeeze(self.out(self.table(ids)), axis=-1)

    def train_step(self, data):
        ids, y = data
        mask = tf.cast(ids > 0, tf.float32)
        count, context = tf.reduce_sum(tf.cast(mask, tf.int32)), tf.distribute.get_replica_context()
        if self.normalizer == "all_reduce":
            valid = context.all_reduce("sum", count)
        elif self.normalizer == "merge_call":  # the replicas' counts summed by their strategy in a merge_call
            valid = context.merge_call(lambda strategy, value: strategy.reduce("sum", value, axis=None), args=(count,))
        else:
            valid = count * context.num_replicas_in_sync
        with tf.GradientTape() as tape:
            per_token = tf.square(self(ids, training=True) - y) * mask
            loss = tf.nn.compute_average_loss(tf.reduce_sum(per_token, axis=1), global_batch_size=valid)
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables))
        return {"loss": loss}


def main(out_dir, mode, normalizer):
    rng = np.random.default_rng(11)
    ids = rng.integers(1, VOCAB, size=(ROWS, LEN)).astype(np.int32)
    ids[rng.random((ROWS, LEN)) < 0.4] = 0  # padding
    y = rng.normal(size=(ROWS, LEN)).astype(np.float32)
    if mode == "reference":
        scope, chief = contextlib.nullcontext, True
    else:
        import kparallax as kp  # pylint: disable=import-outside-toplevel
        strategy = kp.HybridStrategy()
        scope, chief = strategy.scope, strategy.is_chief
    with scope():
        model = TokenModel(normalizer)
        model.compile(optimizer=tf.keras.optimizers.SGD(0.1))
        model.fit(ids, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    if chief:
        np.savez(os.path.join(out_dir, "model.npz"), *model.get_weights())
    if mode == "reference":
        assert "kparallax" not in sys.modules, "the reference must not import kparallax"


if __name__ == "__main__":
    main(*sys.argv[1:])
