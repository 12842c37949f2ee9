"""How kparallax tells a metric value given once per batch to be a sum or a mean over the batch
(``kparallax/_compat/repeated_rows.py``, for ``step/scalar_metrics.py``): the value recomputed, in the traced step,
on the batch's rows repeated twice.
Read from traced graphs and run in one process; that the weighted updates log one process's values on 2 workers is
checked by ``test_keras_programs.py`` (``added_metrics``, ``tracked_train_step``), the eager fallback's warning there
too (``run_eagerly_dense``)."""

import types

import numpy as np
import pytest
import tensorflow as tf

from kparallax._compat import repeated_rows


def _told(value_of, rows=None, batch=4):
    """Traces ``value_of(ids, features)`` (the step's batch: ids [B, 3], features [B, 2]; B unknown while tracing,
    or ``rows``), then runs it: (the value, whether kparallax takes it for a sum over the batch)."""
    ids = tf.constant(np.arange(batch * 3).reshape(batch, 3) % 5, tf.int32)
    features = tf.constant(np.linspace(0.5, 2.0, batch * 2).reshape(batch, 2), tf.float32)

    @tf.function(input_signature=[tf.TensorSpec([rows, 3], tf.int32), tf.TensorSpec([rows, 2], tf.float32)])
    def step(ids, features):
        value = value_of(ids, features)
        return value, repeated_rows.sums(value, (ids, features))

    value, sums = step(ids, features)
    # The check adds ops beside the value and leaves the value itself alone.
    assert float(value) == pytest.approx(float(value_of(ids, features)), rel=1e-6)
    return float(value), bool(sums)


V = types.SimpleNamespace()  # the variables the values read


@pytest.fixture(autouse=True)
def _variables():
    # Made for each test: another test file may change the eager context (an in-process server) around this one.
    V.table = tf.Variable(tf.reshape(tf.range(10, dtype=tf.float32), [5, 2]) / 10.0)
    V.kernel = tf.Variable(tf.ones([4, 1]))  # as many rows as the static batch below: not the batch's


def _prediction(ids, features):
    rows = tf.reduce_mean(tf.nn.embedding_lookup(V.table, ids), axis=1)
    return tf.reduce_sum(rows * features, axis=1, keepdims=True)


# (name, value, a sum with Keras' unknown batch size, a sum with a batch of static size: drop_remainder). With a
# static size TensorFlow folds the batch's shape into constants while tracing: a count read from it is a constant,
# and a division after the batch's rows (by a count, say) is taken for a mean.
CASES = [
    ("sum of predictions", lambda i, f: tf.reduce_sum(_prediction(i, f)), True, True),
    ("mean of predictions", lambda i, f: tf.reduce_mean(_prediction(i, f)), False, False),
    ("row count", lambda i, f: tf.cast(tf.shape(i)[0], tf.float32), True, False),
    ("element count", lambda i, f: tf.cast(tf.size(f), tf.float32), True, False),
    ("sum over a count (Keras' averaged loss)", lambda i, f: tf.math.divide_no_nan(
        tf.reduce_sum(tf.square(_prediction(i, f))), tf.cast(tf.size(f[:, 0]), tf.float32)), False, False),
    ("Keras' mean squared error", lambda i, f: tf.keras.losses.MeanSquaredError()(f[:, :1], _prediction(i, f)),
     False, False),
    ("Keras' summed loss", lambda i, f: tf.keras.losses.MeanSquaredError(reduction="sum")(
        f[:, :1], _prediction(i, f)), True, True),
    ("mean plus a weight penalty", lambda i, f: tf.reduce_mean(_prediction(i, f)) + tf.reduce_sum(V.kernel),
     False, False),
    ("sum over a transpose", lambda i, f: tf.reduce_sum(tf.transpose(f) * 2.0), True, True),
    ("sum of a flattened batch", lambda i, f: tf.reduce_sum(tf.reshape(f, [-1])), True, True),
]


@pytest.mark.parametrize("name, value_of, dynamic, static", CASES, ids=[c[0] for c in CASES])
def test_sums_and_means_are_told_apart(name, value_of, dynamic, static):
    for rows, sums in ((None, dynamic), (4, static)):
        assert _told(value_of, rows)[1] is sums, (name, rows)


def test_a_value_the_batch_does_not_reach_is_not_a_sum():
    # A weight of as many rows as the (static) batch is not the batch's: its sum stays what it is.
    assert _told(lambda i, f: tf.reduce_sum(V.kernel) * 3.0, rows=4) == (12.0, False)


def test_a_value_made_in_a_branch_reads_the_batch_through_its_captures():
    # A metric updated inside a tf.cond branch: its value lives in the branch's graph, the batch in the step's.
    def told_in_branch(value_of):
        @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32)])
        def step(features):
            return tf.cond(tf.reduce_sum(features) > 0,
                           lambda: repeated_rows.sums(value_of(features), features),
                           lambda: tf.constant(False))

        return bool(step(tf.ones([3, 2])))

    assert told_in_branch(lambda f: tf.reduce_sum(f) * 2.0) is True
    assert told_in_branch(tf.reduce_mean) is False


def test_an_op_that_could_fail_on_more_rows_is_not_copied():
    # A branch (its ops unknown here), a reshape to a fixed shape, a sparse op: the value keeps Keras' own count.
    with pytest.raises(ValueError, match="'cond' .*If"):
        _told(lambda i, f: tf.cond(tf.reduce_sum(f) > 0, lambda: tf.reduce_sum(f), lambda: tf.reduce_mean(f)))
    with pytest.raises(ValueError, match=r"\(Reshape\)"):
        _told(lambda i, f: tf.reduce_sum(tf.reshape(tf.reduce_sum(f, axis=0), [1, 2])))


def test_a_long_way_from_the_batch_is_not_copied():
    # More than 64 ops after the batch's rows: not copied (the metric then keeps Keras' own count, with a warning).
    def value_of(ids, features):
        value = tf.reduce_sum(features)
        for _ in range(70):
            value = tf.sqrt(value + 1.0)
        return value

    with pytest.raises(ValueError, match="ops lie between the value and the batch's rows"):
        _told(value_of)


def test_a_sparse_input_is_read_through_its_rows_only():
    # A tf.SparseTensor's parts are not rows of the batch (its dense_shape has a static size, [2]): a value read
    # from its per-row sums is told, one read through a sparse op is not copied.
    @tf.function(input_signature=[tf.SparseTensorSpec([None, 4], tf.float32), tf.TensorSpec([None, 2], tf.float32)])
    def step(sparse, features):
        assert not repeated_rows.Tail((sparse, features)).static
        rows = tf.sparse.reduce_sum(sparse, axis=1, output_is_sparse=False)
        rows = tf.ensure_shape(rows, [None])
        value = tf.reduce_sum(rows) + tf.reduce_sum(features)
        with pytest.raises(ValueError, match="SparseReduceSum"):
            repeated_rows.sums(tf.sparse.reduce_sum(sparse), (sparse, features))
        return repeated_rows.sums(value, (sparse, features))

    sparse = tf.sparse.from_dense(tf.constant([[1.0, 0, 0, 2], [0, 3, 0, 0]]))
    assert bool(step(sparse, tf.ones([2, 2])))
