"""A retrieval model trained with in-batch negatives: each query scored against every candidate of the batch.

Usage: in_batch_negatives.py OUT_DIR MODE [SYNC [ARCHITECTURE]]
  MODE=reference: one plain process on the global batch, the candidates its own batch (never imports kparallax).
  MODE=kparallax: under kparallax-run, per-worker batch, the candidates gathered with kp.all_gather and the labels
  offset by kp.row_offset; SYNC ("sync" or "async") sets the strategy's sync option, ARCHITECTURE its architecture
  (default hybrid).
Writes OUT_DIR/in_batch_negatives.npz (weights, then the epoch losses) from worker 0 (or the one process).
"""

import contextlib
import os
import sys

import numpy as np
import tensorflow as tf

VOCAB, EMB, LEN, ROWS, WORKERS, PER_WORKER_BATCH = 120, 6, 5, 117, 2, 16  # 117 rows: a partial last batch


class Retrieval(tf.keras.Model):
    """Queries and candidates (id lists) pooled from one shared table into two Dense towers; logits are every
    query's scores against the candidates of the batch (``gather``ed), labels each query's own candidate."""

    def __init__(self, gather, offset):
        super().__init__()
        self.gather, self.offset = gather, offset
        self.table = tf.keras.layers.Embedding(VOCAB, EMB)
        self.pool = tf.keras.layers.GlobalAveragePooling1D()
        # No bias on the candidate tower: adding one vector to every candidate shifts a query's logits alike, so its
        # gradient is zero but for rounding, which Adam would blow up into steps of its learning rate.
        self.q, self.d = tf.keras.layers.Dense(4), tf.keras.layers.Dense(4, use_bias=False)

    def call(self, inputs):
        q = self.q(self.pool(self.table(inputs[0])))
        d = self.d(self.pool(self.table(inputs[1])))
        return tf.matmul(q, self.gather(d), transpose_b=True)

    def loss_fn(self, y_true, logits):
        del y_true
        labels = self.offset(logits) + tf.range(tf.shape(logits)[0])
        return tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)


def main(out_dir, mode, sync="sync", architecture="hybrid"):
    rng = np.random.default_rng(89)
    queries = np.minimum(rng.zipf(1.4, size=(ROWS, LEN)) - 1, VOCAB - 1).astype(np.int32)
    candidates = rng.integers(1, VOCAB, size=(ROWS, LEN)).astype(np.int32)
    if mode == "reference":
        scope, batch, chief = contextlib.nullcontext, PER_WORKER_BATCH * WORKERS, True
        gather, offset = (lambda d: d), (lambda logits: 0)
    else:
        import kparallax as kp  # pylint: disable=import-outside-toplevel
        strategy = kp.HybridStrategy(kp.Cluster.from_env(), sync=sync == "sync",
                                   architecture=architecture)
        scope, batch, chief = strategy.scope, PER_WORKER_BATCH, strategy.is_chief
        gather, offset = kp.all_gather, kp.row_offset
    with scope():
        model = Retrieval(gather, offset)
        model([queries[:2], candidates[:2]])
        init = np.random.default_rng(21)
        model.set_weights([init.normal(scale=0.3, size=w.shape).astype(np.float32) for w in model.get_weights()])
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss=model.loss_fn)
        history = model.fit([queries, candidates], np.zeros((ROWS,), np.float32), batch_size=batch, epochs=2,
                            shuffle=False, verbose=0)
        # evaluate sees the whole input on every worker: there the candidates are the batch's, as in one process.
        evaluated = model.evaluate([queries, candidates], np.zeros((ROWS,), np.float32), batch_size=32, verbose=0)
    if chief:
        np.savez(os.path.join(out_dir, "in_batch_negatives.npz"), *model.get_weights(),
                 np.array(history.history["loss"] + [evaluated]))


if __name__ == "__main__":
    main(*sys.argv[1:])
