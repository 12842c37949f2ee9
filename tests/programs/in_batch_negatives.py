"""A retrieval model trained with in-batch negatives: each query scored against every candidate of the batch.

Usage: in_batch_negatives.py OUT_DIR MODE [OPTION...]
  MODE=reference: one plain process on the global batch, the candidates its own batch (never imports kparallax).
  MODE=kparallax: under kparallax-run, per-worker batch, the candidates gathered with kp.all_gather and the labels
  offset by kp.row_offset. OPTIONs: "async" (the strategy's sync=False; default "sync"), an architecture ("hybrid",
  the default, "ps", "allreduce"), "no_gather" (the candidates the worker's own batch, as recommender libraries'
  retrieval tasks score them: trained per worker, by contract; every worker writes its weights).
OPTION "centered" (both modes): the queries' embeddings are centered by their mean over the global batch, taken from
kp.all_gather's rows under kparallax.
The model is built twice, subclassed and functional; writes OUT_DIR/subclassed.npz and OUT_DIR/functional.npz
(weights, then the epoch losses and the evaluated loss) from worker 0 (or the one process); with "no_gather",
OUT_DIR/subclassed-<worker>.npz from every worker.
"""

import contextlib
import os
import sys

import numpy as np
import tensorflow as tf

VOCAB, EMB, LEN, ROWS, WORKERS, PER_WORKER_BATCH = 120, 6, 5, 117, 2, 16  # 117 rows: a partial last batch


class Retrieval(tf.keras.Model):
    """Queries and candidates (id lists) pooled from one shared table into two Dense towers; logits are every
    query's scores against the candidates of the batch (``gather``ed)."""

    def __init__(self, gather, center=None):
        super().__init__()
        self.gather, self.center = gather, center
        self.table = tf.keras.layers.Embedding(VOCAB, EMB)
        self.pool = tf.keras.layers.GlobalAveragePooling1D()
        # No bias on the candidate tower: adding one vector to every candidate shifts a query's logits alike, so its
        # gradient is zero but for rounding, which Adam would blow up into steps of its learning rate.
        # Nor on the query tower when its rows are centered, which cancels it.
        self.q, self.d = tf.keras.layers.Dense(4, use_bias=center is None), tf.keras.layers.Dense(4, use_bias=False)

    def call(self, inputs):
        q = self.q(self.pool(self.table(inputs[0])))
        q = q if self.center is None else self.center(q)
        d = self.d(self.pool(self.table(inputs[1])))
        return tf.matmul(q, self.gather(d), transpose_b=True)


def functional(gather, center=None):
    """The same towers as a functional model: ``gather`` applied to a Keras tensor while it is built, ``center`` in a
    Lambda layer."""
    queries, candidates = tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.Input((LEN,), dtype=tf.int32)
    table, pool = tf.keras.layers.Embedding(VOCAB, EMB), tf.keras.layers.GlobalAveragePooling1D()
    q = tf.keras.layers.Dense(4, use_bias=center is None)(pool(table(queries)))
    q = q if center is None else tf.keras.layers.Lambda(center)(q)
    d = tf.keras.layers.Dense(4, use_bias=False)(pool(table(candidates)))
    return tf.keras.Model([queries, candidates], tf.matmul(q, gather(d), transpose_b=True))


def in_batch_loss(offset):
    """Each query's own candidate as its label: ``offset(logits)`` (where this worker's rows are among the
    candidates) plus its row."""
    def loss(y_true, logits):
        del y_true
        labels = offset(logits) + tf.range(tf.shape(logits)[0])
        return tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    return loss


def _identity(value):
    """The reference's gather: on a Keras tensor a Lambda layer, as kp.all_gather adds one to a functional model in
    one process too (a layer of its own, which comes first in the model's layers and weights: it deepens its
    branch)."""
    return tf.keras.layers.Lambda(lambda t: t)(value) if tf.keras.backend.is_keras_tensor(value) else value


def main(out_dir, mode, *options):
    sync = "async" not in options
    architecture = next((o for o in options if o in ("hybrid", "ps", "allreduce")), "hybrid")
    rng = np.random.default_rng(89)
    queries = np.minimum(rng.zipf(1.4, size=(ROWS, LEN)) - 1, VOCAB - 1).astype(np.int32)
    candidates = rng.integers(1, VOCAB, size=(ROWS, LEN)).astype(np.int32)
    if mode == "reference":
        scope, batch, chief, suffix = contextlib.nullcontext, PER_WORKER_BATCH * WORKERS, True, ""
        gather, offset = _identity, (lambda logits: 0)
    else:
        import kparallax as kp  # pylint: disable=import-outside-toplevel
        strategy = kp.HybridStrategy(kp.Cluster.from_env(), sync=sync, architecture=architecture)
        scope, batch, chief, suffix = strategy.scope, PER_WORKER_BATCH, strategy.is_chief, ""
        gather, offset = (_identity, lambda logits: 0) if "no_gather" in options else (kp.all_gather, kp.row_offset)
        if "no_gather" in options:
            chief, suffix = True, f"-{strategy.worker_index}"
    models = (("subclassed", Retrieval),) if "no_gather" in options else (
        ("subclassed", Retrieval), ("functional", functional))
    center = (lambda value: value - tf.reduce_mean(gather(value), axis=0)) if "centered" in options else None
    for name, build in models:
        with scope():
            model = build(gather, center)
            model([queries[:2], candidates[:2]])
            init = np.random.default_rng(21)
            model.set_weights([init.normal(scale=0.3, size=w.shape).astype(np.float32) for w in model.get_weights()])
            model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss=in_batch_loss(offset))
            history = model.fit([queries, candidates], np.zeros((ROWS,), np.float32), batch_size=batch, epochs=2,
                                shuffle=False, verbose=0)
            # evaluate sees the whole input on every worker: the candidates are the batch's, as in one process.
            evaluated = model.evaluate([queries, candidates], np.zeros((ROWS,), np.float32), batch_size=32,
                                       verbose=0)
        if chief:
            np.savez(os.path.join(out_dir, f"{name}{suffix}.npz"), *model.get_weights(),
                     np.array(history.history["loss"] + [evaluated]))


if __name__ == "__main__":
    main(*sys.argv[1:])
