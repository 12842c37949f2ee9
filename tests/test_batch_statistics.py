"""step/batch_statistics.py: which compiled loss functions are run with the global batch's statistics (a nonlinear
function of a sum or mean over the batch's rows, or such a statistic combined with the rows) and which are left as
they are; outside a training step (gathering is the identity) the replacement gives the function's own value and
gradient. On 2 workers its losses equal one process's: ``test_rows.py``."""

import numpy as np
import pytest
import tensorflow as tf

from kparallax.step import batch_statistics
from kparallax.step import rows
from tensorflow.python.ops import gen_math_ops  # pylint: disable=no-name-in-module

GLOBAL = {  # loss functions of (y_true, y_pred) taking statistics of the batch other than by sums and scalings
    "root_mean_squared_error": lambda t, p: tf.sqrt(tf.reduce_mean(tf.square(p - t))),
    "masked_mean": lambda t, p: tf.reduce_sum(tf.square(p - t) * tf.cast(t != 0, p.dtype)) / tf.reduce_sum(
        tf.cast(t != 0, p.dtype)),
    "masked_mean_divided_no_nan": lambda t, p: tf.math.divide_no_nan(
        tf.reduce_sum(tf.abs(p - t) * tf.cast(t > 0, p.dtype)), tf.reduce_sum(tf.cast(t > 0, p.dtype))),
    "errors_over_the_batch_deviation": lambda t, p: tf.square(p - t) / tf.math.reduce_std(t, axis=0),
    "squared_mean_error": lambda t, p: tf.square(tf.reduce_mean(p - t)),
    # the errors cut into entries of 3 across the rows ([B, 2] -> [-1, 3]; before, not followed: left as it was)
    "root_mean_squared_error_of_entries_across_rows": lambda t, p: tf.sqrt(tf.reduce_mean(
        tf.reduce_sum(tf.square(tf.reshape(p - t, [-1, 3])), axis=1))),
}


def _tutorial_masked_loss(label, pred):
    """TensorFlow's transformer tutorial's loss: per-token cross-entropies of [B, T, V] logits, padding masked out,
    averaged over the batch's valid tokens."""
    mask = label != 0
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")(label, pred)
    mask = tf.cast(mask, dtype=loss.dtype)
    return tf.reduce_sum(loss * mask) / tf.reduce_sum(mask)


def _tutorial_masked_accuracy(label, pred):
    """Its metric: the share of valid tokens predicted right."""
    pred = tf.argmax(pred, axis=2)
    label = tf.cast(label, pred.dtype)
    mask = label != 0
    return tf.reduce_sum(tf.cast((label == pred) & mask, tf.float32)) / tf.reduce_sum(tf.cast(mask, tf.float32))


def test_the_transformer_tutorial_s_masked_loss_and_accuracy_are_replaced():
    # The cross-entropy reshapes the logits to [B * T, V] and back: its rows are followed through (row_axes.entries).
    replaced = []

    @tf.function(input_signature=[tf.TensorSpec([None, 7], tf.int64), tf.TensorSpec([None, 7, 11], tf.float32)])
    def step(t, p):
        replaced.extend(batch_statistics.globalized(fn, t, p) for fn in (_tutorial_masked_loss,
                                                                          _tutorial_masked_accuracy))
        return t

    step.get_concrete_function()
    assert all(r is not None for r in replaced)
LEFT = {  # sums, means and scalings of statistics, per-row values, and what gathered sums and means cannot fix
    "mean_squared_error": lambda t, p: tf.reduce_mean(tf.square(p - t)) * 0.5 + 1.0,
    "sum": lambda t, p: tf.reduce_sum(tf.abs(p - t)),
    "per_row": lambda t, p: tf.keras.losses.mean_squared_error(t, p),
    "sum_over_the_size": lambda t, p: tf.reduce_sum(tf.square(p - t)) / tf.cast(tf.size(t), p.dtype),
    "root_of_a_maximum": lambda t, p: tf.sqrt(tf.reduce_max(tf.square(p - t))),
    "softmax_over_the_batch": lambda t, p: tf.reduce_mean(tf.nn.softmax(p - t, axis=0)),
    "cumulative": lambda t, p: tf.sqrt(tf.reduce_sum(tf.cumsum(tf.square(p - t), axis=0))),
    "gram_matrix": lambda t, p: tf.reduce_sum(tf.square(tf.matmul(p - t, p - t, transpose_a=True))),  # rows_meet's
    # a root of a mean in a function of its own: not made global (rows_meet refuses it, naming the call)
    "root_mean_in_a_function": tf.function(lambda t, p: tf.sqrt(tf.reduce_mean(tf.square(p - t)))),
}


def _batch(rows=6):
    rng = np.random.default_rng(5)
    y_true = rng.normal(size=(rows, 2)).astype(np.float32)
    y_true[::3] = 0.0
    return tf.constant(y_true), tf.constant(rng.normal(size=(rows, 2)).astype(np.float32))


@pytest.mark.parametrize("name", sorted(GLOBAL) + sorted(LEFT))
def test_only_functions_of_statistics_other_than_sums_are_replaced(name):
    y_true, y_pred = _batch()
    replaced = []

    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32)] * 2)
    def step(t, p):
        replaced.append(batch_statistics.globalized((GLOBAL.get(name) or LEFT[name]), t, p))
        return t

    step(y_true, y_pred)
    assert (replaced[0] is not None) == (name in GLOBAL), name


@pytest.mark.parametrize("name", sorted(GLOBAL))
def test_outside_a_step_the_replacement_gives_the_function_s_value_and_gradient(name):
    fn, (y_true, y_pred) = GLOBAL[name], _batch()

    @tf.function
    def both(t, p):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(p)
            own, other = fn(t, p), batch_statistics.globalized(fn, t, p)(t, p)
        return own, other, tape.gradient(own, p), tape.gradient(other, p)

    own, other, own_gradient, other_gradient = both(y_true, y_pred)
    np.testing.assert_allclose(other.numpy(), own.numpy(), rtol=1e-6)
    np.testing.assert_allclose(other_gradient.numpy(), own_gradient.numpy(), rtol=1e-6, atol=1e-7)
    assert gen_math_ops._sum.__name__ == "_sum" and gen_math_ops.mean.__name__ == "mean"  # TensorFlow's again


@pytest.mark.parametrize("fn, gathered", [
    (lambda t, p: tf.sqrt(tf.reduce_mean(tf.reduce_sum(tf.square(p - t), axis=1))), ["mean", "count"]),
    (GLOBAL["masked_mean"], ["sum", "sum"]),
    (lambda t, p: tf.reduce_sum(tf.square(p - t) / tf.math.reduce_std(t, axis=0)), ["mean", "count"] * 2 + ["sum"]),
], ids=["root_of_a_mean_of_row_sums", "masked_mean", "sum_over_the_batch_deviation"])
def test_the_replacement_gathers_the_sums_and_means_over_the_rows_only(monkeypatch, fn, gathered):
    # What it hands kp.all_gather (the identity outside a step): each sum over the rows, and each mean's value and
    # count of elements; a sum per row (axis=1) stays the worker's.
    calls, kinds = [], {"Sum": "sum", "MulNoNan": "mean", "RealDiv": "count"}

    def all_gather(value):  # value: x[None] of a sum, of a mean times its count, or of the count
        calls.append(kinds.get(value.op.inputs[0].op.type, value.op.inputs[0].op.type))
        return value

    monkeypatch.setattr(rows, "all_gather", all_gather)

    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32)] * 2)
    def step(t, p):
        return batch_statistics.globalized(fn, t, p)(t, p)

    step(*_batch())
    assert calls == gathered
