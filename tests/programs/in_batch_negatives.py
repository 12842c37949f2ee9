"""A retrieval model trained with in-batch negatives: each query scored against every candidate of the batch.

Usage: in_batch_negatives.py OUT_DIR MODE [OPTION...]
  MODE=reference: one plain process on the global batch, the candidates its own batch (never imports kparallax).
  MODE=kparallax: under kparallax-run, per-worker batch, the candidates gathered with kp.all_gather and the labels
  offset by kp.row_offset. OPTIONs: "async" (the strategy's sync=False; default "sync"), an architecture ("hybrid",
  the default, "ps", "allreduce"), "no_gather" (the candidates the worker's own batch, as in the reference: kparallax
  refuses it).
  MODE=tf-distribute: under kparallax-run, the subclassed model gathering as a program written for tf.distribute
  does (tf.distribute.get_replica_context().all_gather, labels offset by its replica id): kparallax refuses it.
OPTION "scalar_losses" (both modes): the loss function gives one scalar for the batch, the mean of the per-example
losses for the subclassed model and their sum for the functional one (default: the per-example losses).
OPTION "centered" (both modes): the queries' embeddings are centered by their mean over the global batch, taken from
kp.all_gather's rows under kparallax; "centered_own" (MODE=kparallax): by their mean over the worker's own rows
(kparallax refuses it); "centered_in_function" (MODE=kparallax): the same, in a tf.function of its own that the
training step calls (refused too); "lstm_centered" (MODE=kparallax): the towers pool with a Keras LSTM instead of a
mean, and the queries are centered over the worker's own rows (refused too).
The model is built twice, subclassed and functional; writes OUT_DIR/subclassed.npz and OUT_DIR/functional.npz
(weights, then the epoch losses and the evaluated loss) from worker 0 (or the one process).
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

    def __init__(self, gather, center=None, pool=tf.keras.layers.GlobalAveragePooling1D):
        super().__init__()
        self.gather, self.center = gather, center
        self.table = tf.keras.layers.Embedding(VOCAB, EMB)
        self.pool = pool()
        # No bias on the candidate tower: adding one vector to every candidate shifts a query's logits alike, so its
        # gradient is zero but for rounding, which Adam would blow up into steps of its learning rate.
        # Nor on the query tower when its rows are centered, which cancels it.
        self.q, self.d = tf.keras.layers.Dense(4, use_bias=center is None), tf.keras.layers.Dense(4, use_bias=False)

    def call(self, inputs):
        q = self.q(self.pool(self.table(inputs[0])))
        q = q if self.center is None else self.center(q)
        d = self.d(self.pool(self.table(inputs[1])))
        return tf.matmul(q, self.gather(d), transpose_b=True)


def functional(gather, center=None, pool=tf.keras.layers.GlobalAveragePooling1D):
    """The same towers as a functional model: ``gather`` applied to a Keras tensor while it is built, ``center`` in a
    Lambda layer."""
    queries, candidates = tf.keras.Input((LEN,), dtype=tf.int32), tf.keras.Input((LEN,), dtype=tf.int32)
    table, pool = tf.keras.layers.Embedding(VOCAB, EMB), pool()
    q = tf.keras.layers.Dense(4, use_bias=center is None)(pool(table(queries)))
    q = q if center is None else tf.keras.layers.Lambda(center)(q)
    d = tf.keras.layers.Dense(4, use_bias=False)(pool(table(candidates)))
    return tf.keras.Model([queries, candidates], tf.matmul(q, gather(d), transpose_b=True))


def in_batch_loss(offset, reduce=None):
    """Each query's own candidate as its label: ``offset(logits)`` (where this worker's rows are among the
    candidates) plus its row. ``reduce``: a reduction of the per-example losses to one scalar (``tf.reduce_mean``,
    ``tf.reduce_sum``) in the function itself, or None (Keras reduces them)."""
    def loss(y_true, logits):
        del y_true
        labels = offset(logits) + tf.range(tf.shape(logits)[0])
        per_example = tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        return per_example if reduce is None else reduce(per_example)
    return loss


def _identity(value):
    """The reference's gather: on a Keras tensor a Lambda layer, as kp.all_gather adds one to a functional model in
    one process too (a layer of its own, which comes first in the model's layers and weights: it deepens its
    branch)."""
    return tf.keras.layers.Lambda(lambda t: t)(value) if tf.keras.backend.is_keras_tensor(value) else value


def _replica_gather(value):
    """A tf.distribute program's gather: every replica's rows of ``value`` along the batch."""
    return tf.distribute.get_replica_context().all_gather(value, axis=0)


def _replica_offset(logits):
    """A tf.distribute program's label offset: its replica's position times the per-replica batch."""
    return tf.distribute.get_replica_context().replica_id_in_sync_group * tf.shape(logits)[0]


def main(out_dir, mode, *options):
    sync = "async" not in options
    architecture = next((o for o in options if o in ("hybrid", "ps", "allreduce")), "hybrid")
    reductions = ({"subclassed": tf.reduce_mean, "functional": tf.reduce_sum} if "scalar_losses" in options
                  else {"subclassed": None, "functional": None})
    rng = np.random.default_rng(89)
    queries = np.minimum(rng.zipf(1.4, size=(ROWS, LEN)) - 1, VOCAB - 1).astype(np.int32)
    candidates = rng.integers(1, VOCAB, size=(ROWS, LEN)).astype(np.int32)
    if mode == "reference":
        scope, batch, chief = contextlib.nullcontext, PER_WORKER_BATCH * WORKERS, True
        gather, offset = _identity, (lambda logits: 0)
    else:
        import kparallax as kp  # pylint: disable=import-outside-toplevel
        strategy = kp.HybridStrategy(kp.Cluster.from_env(), sync=sync, architecture=architecture)
        scope, batch, chief = strategy.scope, PER_WORKER_BATCH, strategy.is_chief
        gather, offset = ((_replica_gather, _replica_offset) if mode == "tf-distribute"
                          else (_identity, lambda logits: 0) if "no_gather" in options
                          else (kp.all_gather, kp.row_offset))
    models = (("subclassed", Retrieval),) if mode == "tf-distribute" else (
        ("subclassed", Retrieval), ("functional", functional))
    row_gather = gather if "centered" in options else (lambda value: value)
    center = ((lambda value: value - tf.reduce_mean(row_gather(value), axis=0))
              if {"centered", "centered_own", "lstm_centered"} & set(options) else None)
    pool = (lambda: tf.keras.layers.LSTM(EMB)) if "lstm_centered" in options else tf.keras.layers.GlobalAveragePooling1D
    if "centered_in_function" in options:
        center = tf.function(lambda value: value - tf.reduce_mean(value, axis=0))
    for name, build in models:
        with scope():
            model = build(gather, center, pool)
            model([queries[:2], candidates[:2]])
            init = np.random.default_rng(21)
            model.set_weights([init.normal(scale=0.3, size=w.shape).astype(np.float32) for w in model.get_weights()])
            model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss=in_batch_loss(offset, reductions[name]))
            history = model.fit([queries, candidates], np.zeros((ROWS,), np.float32), batch_size=batch, epochs=2,
                                shuffle=False, verbose=0)
            # evaluate sees the whole input on every worker: the candidates are the batch's, as in one process.
            evaluated = model.evaluate([queries, candidates], np.zeros((ROWS,), np.float32), batch_size=32,
                                       verbose=0)
        if chief:
            np.savez(os.path.join(out_dir, f"{name}.npz"), *model.get_weights(),
                     np.array(history.history["loss"] + [evaluated]))


if __name__ == "__main__":
    main(*sys.argv[1:])
