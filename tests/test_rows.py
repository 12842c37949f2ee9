"""kp.all_gather / kp.row_offset (in-batch negatives, step/rows.py): a retrieval model scoring each query against
every candidate of the batch (subclassed, and functional: called on a Keras tensor, a Lambda layer), on 2 workers +
1 PS with a partial last batch, equals one plain process on the global batch under each architecture, also with a
loss function giving one scalar (a mean, a sum) of the per-example losses; without them it does not (measured: 0.11
off, the loss 2.70 against 3.39). Outside kparallax's training step they are the
identity and 0; an asynchronous step refuses them. Without a gather the batch's rows scored against each other
(``step/rows_meet.py``) are refused on several workers. A tf.distribute program's gather
(``tf.distribute.get_replica_context().all_gather``, the default context's identity under kparallax) is refused in
the training step of several workers."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import kparallax as kp
from kparallax import testing
from kparallax.step import batch_norm
from kparallax.step import rows_meet

PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "in_batch_negatives.py")
STATISTICS_PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "batch_statistic_losses.py")
PAIRS_PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "paired_parts.py")
JOINED_PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "joined_rows.py")


def test_outside_a_training_step_all_gather_is_the_identity_and_the_offset_zero():
    value = tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    np.testing.assert_array_equal(kp.all_gather(value).numpy(), value.numpy())
    assert int(kp.row_offset(value)) == 0
    with tf.GradientTape() as tape:
        tape.watch(value)
        total = tf.reduce_sum(tf.function(kp.all_gather)(value) * 2.0)
    np.testing.assert_array_equal(tape.gradient(total, value).numpy(), np.full((3, 2), 2.0))
    assert int(tf.function(kp.row_offset)(value)) == 0


def test_on_a_keras_tensor_they_are_layers_of_the_functional_model():
    q_in, d_in = tf.keras.Input((3,)), tf.keras.Input((3,))
    q, d = tf.keras.layers.Dense(4)(q_in), tf.keras.layers.Dense(4)(d_in)
    model = tf.keras.Model([q_in, d_in], [tf.matmul(q, kp.all_gather(d), transpose_b=True), kp.row_offset(q)])
    assert [type(layer).__name__ for layer in model.layers].count("Lambda") == 2
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    logits, offset = model([x, x])
    assert logits.shape == (5, 5) and int(offset) == 0



def _refusal(product, rows=None, workers=2, micro_batches=1, gathered=False):
    """Runs ``product(q, d)`` of a batch (q, d) of 4 rows x 3, traced with ``rows`` rows (None: unknown) under
    ``rows_meet.refused`` for ``workers`` workers and ``micro_batches`` (``d`` marked as kp.all_gather's output if
    ``gathered``): the check's message, or None when the step runs."""
    kernel = tf.Variable(tf.ones([3, 3]))

    @tf.function(input_signature=[tf.TensorSpec([rows, 3], tf.float32)] * 2)
    def step(q, d):
        with rows_meet.refused(workers, micro_batches, (q, d)):
            return product(q, rows_meet.gathered(d) if gathered else d, kernel)

    try:
        step(tf.ones([4, 3]), tf.fill([4, 3], 2.0))
    except tf.errors.InvalidArgumentError as error:
        return error.message
    return None


SCORED = {
    "matmul_transpose_b": lambda q, d, w: tf.matmul(q, d, transpose_b=True),
    "matmul_adjoint_b": lambda q, d, w: tf.linalg.matmul(q, d, adjoint_b=True),
    "matmul_of_a_transpose": lambda q, d, w: q @ tf.transpose(d),
    "einsum": lambda q, d, w: tf.einsum("id,jd->ij", q, d),
    "towers": lambda q, d, w: tf.matmul(tf.tanh(q @ w), tf.nn.relu(d @ w), transpose_b=True),
    # pairs laid out row after row, each pair's first row scored against every pair's second (before: not seen)
    "pairs_joined_by_a_reshape": lambda q, d, w: tf.matmul(tf.reshape(q, [-1, 2, 3])[:, 0],
                                                           tf.reshape(d, [-1, 2, 3])[:, 1], transpose_b=True),
    # two views of the batch joined along the rows, scored against each other (SimCLR's loss; before: not seen)
    "two_views_joined": lambda q, d, w: tf.matmul(tf.concat([q, d], 0), tf.concat([q, d], 0), transpose_b=True),
    "two_views_stacked": lambda q, d, w: tf.matmul(tf.reshape(tf.stack([q, d]), [-1, 3]) @ w,
                                                   tf.reshape(tf.stack([q, d]), [-1, 3]), transpose_b=True),
    # the batch tiled, scored against two views of it joined (before: not seen)
    "a_tiled_batch_against_two_views": lambda q, d, w: tf.matmul(tf.tile(q, [2, 1]), tf.concat([q, d], 0),
                                                                 transpose_b=True),
    # the batch's keys joined to a memory bank's rows (before: not seen, the side had more rows than the batch)
    "keys_joined_to_a_memory_bank": lambda q, d, w: tf.matmul(q, tf.concat([d, tf.ones([5, 3])], 0), transpose_b=True),
    "a_memory_bank_joined_to_the_keys": lambda q, d, w: tf.einsum("id,jd->ij", q @ w, tf.concat([w, d @ w], axis=0)),
}


@pytest.mark.parametrize("name", sorted(SCORED))
def test_rows_scored_against_each_other_are_refused_on_several_workers(name):
    for rows in (None, 4):
        message = _refusal(SCORED[name], rows)
        assert message is not None and "The rows of the batch are scored against each other in " in message, rows
        assert ("Received: that product in the training step of a job of 2 workers. Gather the candidate rows over "
                "the workers with kp.all_gather(value)") in message
    assert _refusal(SCORED[name], workers=1) is None
    assert "a job of 1 worker(s) accumulating backward_passes_per_step=2 micro-batches" in _refusal(
        SCORED[name], workers=1, micro_batches=2)
    assert _refusal(SCORED[name], gathered=True) is None


def test_products_that_do_not_score_the_batch_against_itself_run():
    # A layer's kernel; sampled candidates (fewer rows than the batch: a weight's rows at the batch's distinct ids);
    # rows summed over (a Gram matrix of the batch, a statistic: a loss nonlinear in it is refused, below); each row
    # against its own candidate; against a memory bank's rows alone (MoCo's negatives), and joined to them.
    for product in (lambda q, d, w: q @ w,
                    lambda q, d, w: tf.matmul(q, tf.concat([w, tf.ones([5, 3])], 0), transpose_b=True),
                    lambda q, d, w: tf.matmul(q, tf.gather(w, tf.unique(tf.cast(d[:, 0], tf.int32))[0]),
                                              transpose_b=True),
                    lambda q, d, w: tf.matmul(q, d, transpose_a=True),
                    lambda q, d, w: tf.reduce_sum(q * d, axis=1)):
        assert _refusal(product) is None


# Rows of the batch that meet in other ways (step/row_axes.py): each form, and a fragment of its message.
MEETINGS = {
    "centered": (lambda q, d, w: q - tf.reduce_mean(q, axis=0),
                 "with Mean over the rows of the batch in Mean, a statistic of the batch, as centering"),
    "tiled_and_centered": (lambda q, d, w: tf.tile(q, [2, 1]) - tf.reduce_mean(tf.tile(q, [2, 1]), axis=0),
                           "with Mean over the rows of the batch in Mean, a statistic of the batch, as centering"),
    "standardized": (lambda q, d, w: (q @ w) / tf.math.reduce_std(q @ w, axis=0, keepdims=True),
                     "with Mean over the rows of the batch in reduce_std/reduce_variance/Mean"),
    "moments": (lambda q, d, w: tf.nn.batch_normalization(q, *tf.nn.moments(q, axes=[0]), None, None, 1e-3),
                "Rows of the batch meet in moments/SquaredDifference (SquaredDifference combines rows"),
    "normalized_columns": (lambda q, d, w: tf.math.l2_normalize(q, axis=0), "with Sum over the rows of the batch"),
    "scaled_by_the_batch_maximum": (lambda q, d, w: q / tf.reduce_max(tf.abs(q)),
                                    "with Max over the rows of the batch"),
    "a_scalar_centered": (lambda q, d, w: q[:, 0] - tf.reduce_mean(q[:, 0]), "with Mean over the rows of the batch"),
    "log_sum_exp": (lambda q, d, w: q - tf.reduce_logsumexp(q, axis=0), "with Max over the rows of the batch"),
    "mean_beside_rows": (lambda q, d, w: tf.concat([q, tf.zeros_like(q) + tf.reduce_mean(d, axis=0)], axis=1),
                         "with Mean over the rows of the batch"),
    "softmax": (lambda q, d, w: tf.nn.softmax(q @ w, axis=0),
                "Rows of the batch meet in Softmax (Softmax along the rows of the batch, axis 1 of its input (3, "),
    "pairwise_differences": (lambda q, d, w: q[:, None, :] - d[None, :, :],
                             "(axis 1), pairing every row of the batch with every other, as pairwise differences or"),
    "pairwise_distances": (lambda q, d, w: tf.norm(tf.expand_dims(q, 1) - tf.expand_dims(d, 0), axis=-1),
                           "pairing every row of the batch with every other"),
    "cumulative": (lambda q, d, w: tf.cumsum(q, axis=0), "(Cumsum along the rows of the batch, axis 0"),
    "hardest_examples_kept": (
        lambda q, d, w: tf.reduce_mean(tf.math.top_k(tf.reduce_sum(tf.square(q @ w - d), axis=1), k=2).values),
        "Rows of the batch meet in TopKV2 (TopKV2 ranks the rows of the batch by value, axis 0 of its input ("),
    "negatives_by_rolling_the_batch": (
        lambda q, d, w: tf.reduce_sum(q * tf.roll(d, shift=1, axis=0), axis=1),
        "Rows of the batch meet in Roll (Roll reorders the rows of the batch along axis 0 of its input ("),
    "the_batch_reversed": (lambda q, d, w: q - tf.reverse(d, axis=[0]), "(ReverseV2 reorders the rows of the batch"),
    "sorted_over_the_batch": (lambda q, d, w: tf.sort(q, axis=0), "ranks the rows of the batch by value, axis 1"),
    "gathered_in_the_order_of_an_argsort": (lambda q, d, w: tf.gather(q, tf.argsort(q[:, 0])),
                                            "ranks the rows of the batch by value, axis 0"),
    "whitened_by_the_gram_matrix": (lambda q, d, w: q @ tf.matmul(q, q, transpose_a=True),
                                    "with MatMul over the rows of the batch in MatMul, a statistic of the batch"),
    "an_einsum_with_a_statistic": (lambda q, d, w: tf.einsum("bi,ij->bj", q, tf.einsum("bi,bj->ij", d, d)),
                                   "(Einsum combines rows of ("),
    # entries cut across rows ([B, 3] -> [-1, 2]: an entry holds the end of one row and the start of the next),
    # normalized over the batch's entries (before: not seen)
    "entries_across_rows_normalized_over_the_batch": (
        lambda q, d, w: tf.reshape(tf.nn.softmax(tf.reshape(q @ w, [-1, 2]), axis=0), [-1, 3]),
        "(Softmax along the rows of the batch"),
    # the same in a count of entries computed from the batch's size (before: not seen)
    "entries_in_a_computed_count_normalized_over_the_batch": (
        lambda q, d, w: tf.nn.softmax(tf.reshape(q @ w, tf.stack([tf.shape(q)[0] * 3 // 2, 2])), axis=0),
        "(Softmax along the rows of the batch"),
    "pairs_joined_by_a_reshape_against_every_pair": (
        lambda q, d, w: tf.reduce_min(tf.norm(tf.reshape(q, [-1, 2, 3])[:, 0][:, None]
                                              - tf.reshape(q, [-1, 2, 3])[None, :, 1], axis=-1), axis=1),
        "pairing every row of the batch with every other")}


@pytest.mark.parametrize("name", sorted(MEETINGS))
def test_rows_meeting_otherwise_are_refused_on_several_workers(name):
    # One process takes these over the global batch, each worker over its own rows. Before, they trained silently
    # apart from one process.
    meet, fragment = MEETINGS[name]
    for rows in (None, 4):
        message = _refusal(meet, rows)
        assert message is not None and fragment in message, (rows, message)
        assert ("Received: that op in the training step of a job of 2 workers. Compute it per row, or over every "
                "worker: gather the rows with kp.all_gather(value) first") in message
    assert _refusal(meet, workers=1) is None
    assert "a job of 1 worker(s) accumulating backward_passes_per_step=2 micro-batches" in _refusal(
        meet, workers=1, micro_batches=2)


def test_rows_meeting_a_gathered_side_or_each_alone_run():
    # Over kp.all_gather's rows (the fix the message gives); per row (a softmax, a norm, a centering across the
    # columns); per row and step (attention scores, a position added to each row); a layer normalization; a
    # per-worker BatchNormalization (Keras' own statistics, as sync_batch_norm=False asks); a loss's mean; Keras'
    # losses, a masked one too (the step counts its valid entries over the workers itself); a top-k and a sort of
    # each row's values, Keras' top-k accuracy; each row's values rolled and reversed; a distance within each pair of
    # rows laid out row after row (joined by a reshape); as many rows as another tensor of the batch has, sliced;
    # two views joined along the rows through a layer and split back, each row against its other view.
    norm = tf.keras.layers.LayerNormalization()
    rows_meet.install()  # as a strategy does
    masked_loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)
    batch_norm.install()  # kparallax's hook, as a strategy installs it: outside global_statistics Keras' own
    own_statistics = tf.keras.layers.BatchNormalization()
    assert _refusal(lambda q, d, w: d - tf.reduce_mean(d, axis=0), gathered=True) is None
    assert _refusal(lambda q, d, w: q[:, None, :] - d[None, :, :], gathered=True) is None
    for alone in (lambda q, d, w: tf.nn.softmax(q @ w, axis=1), lambda q, d, w: tf.math.l2_normalize(q, axis=1),
                  lambda q, d, w: q - tf.reduce_mean(q, axis=1, keepdims=True),
                  lambda q, d, w: tf.matmul(q[:, :, None], d[:, :, None], transpose_b=True),
                  lambda q, d, w: q[:, :, None] + tf.range(3.0)[None, :, None],
                  lambda q, d, w: norm(q @ w), lambda q, d, w: own_statistics(q @ w, training=True),
                  lambda q, d, w: tf.reduce_mean(q) + tf.reduce_sum(q * d),
                  lambda q, d, w: masked_loss(d[:, 0], q @ w),
                  lambda q, d, w: tf.keras.losses.cosine_similarity(q, d),
                  lambda q, d, w: tf.keras.losses.categorical_crossentropy(tf.nn.softmax(d), q @ w),
                  lambda q, d, w: tf.math.top_k(q @ w, k=2).values - tf.sort(d, axis=1)[:, :2],
                  lambda q, d, w: tf.keras.metrics.top_k_categorical_accuracy(d, q, k=2),
                  lambda q, d, w: tf.roll(q, shift=1, axis=1) * tf.reverse(d, axis=[-1]),
                  lambda q, d, w: tf.reduce_sum(tf.square(tf.reduce_sum(tf.reshape(q, [-1, 2, 3]) * [[1.0], [-1.0]],
                                                                         axis=1)), axis=1),
                  lambda q, d, w: q[:tf.shape(d)[0]] - d, lambda q, d, w: tf.slice(q, [0, 0], [tf.shape(d)[0], 2]),
                  lambda q, d, w: tf.reshape(tf.nn.softmax(tf.reshape(q @ w, [-1, 2])) - tf.reshape(d, [-1, 2]),
                                             [-1, 3]),
                  lambda q, d, w: tf.reduce_sum(tf.math.reduce_prod(tf.split(tf.nn.relu(tf.concat([q, d], 0) @ w), 2),
                                                                    axis=0), axis=1)):
        assert _refusal(alone) is None


def _center(t):
    return t - tf.reduce_mean(t, axis=0)


# Rows meeting inside a function the step calls (row_axes follows the call into its body): each form, and the
# names its message gives (the meeting's op, then the calls it is in).
MEETINGS_INSIDE = {
    "a_tf_function": (lambda q, d, w: tf.function(_center)(q) @ w,
                      "Rows of the batch meet in sub, in the function called by PartitionedCall, (Sub combines rows"),
    "a_function_capturing_a_weight": (
        lambda q, d, w: tf.function(lambda t: _center(t @ w))(q),
        "Rows of the batch meet in sub, in the function called by StatefulPartitionedCall, (Sub combines rows"),
    "a_function_in_a_function": (
        lambda q, d, w: tf.function(lambda t: tf.function(_center)(t * 2.0))(q),
        "meet in sub, in the function called by PartitionedCall, in the function called by PartitionedCall, ("),
    "a_statistic_from_a_function": (lambda q, d, w: q - tf.function(lambda t: tf.reduce_mean(t, axis=0))(d),
                                    "Rows of the batch meet in sub (Sub combines rows of ("),
    "a_cond_s_branch": (lambda q, d, w: tf.cond(tf.reduce_sum(w) > 0, lambda: _center(q), lambda: q),
                        "Rows of the batch meet in cond/sub, in the function called by cond, (Sub combines rows"),
    "a_cond_on_a_flag_passed_into_a_function": (
        lambda q, d, w: tf.function(lambda t, flag: tf.cond(flag, lambda: _center(t), lambda: t))(
            q, tf.reduce_sum(w) > 0),
        "Rows of the batch meet in cond/sub, in the function called by cond, in the function called by "
        "PartitionedCall"),
    "pairwise_in_a_function": (lambda q, d, w: tf.function(lambda a, b: a[:, None, :] - b[None, :, :])(q, d),
                               "pairing every row of the batch with every other"),
    "a_softmax_in_a_function": (lambda q, d, w: tf.function(lambda t: tf.nn.softmax(t, axis=0))(q @ w),
                                "(Softmax along the rows of the batch"),
    "a_while_loop_s_body": (lambda q, d, w: tf.while_loop(lambda i, h: i < 2, lambda i, h: (i + 1, _center(h)),
                                                          (0, q))[1],
                            "Rows of the batch meet in while/sub, in the body of the loop while, (Sub combines"),
}


def _sequence(t, steps=5):
    """The rows ``t`` [B, 3] repeated over ``steps`` time steps: [B, steps, 3]."""
    return t[:, None, :] * tf.ones([1, steps, 1])


RNNS = {}  # the layers of the test running (``rnns``)


@pytest.fixture(name="rnns")
def _rnns():
    """A Keras LSTM, GRU and bidirectional GRU of 3 units made by each test, eagerly: made at import, another test's
    tf.compat.v1 graph would leave them invalid; made in the step, tf.function's second trace would refuse their
    variables."""
    RNNS.update(lstm=tf.keras.layers.LSTM(3), gru=tf.keras.layers.GRU(3, return_sequences=True),
                bidirectional=tf.keras.layers.Bidirectional(tf.keras.layers.GRU(3, return_sequences=True)))
    yield RNNS
    RNNS.clear()


def _lstm(t):
    """The LSTM's last output [B, 3] over ``t`` [B, 3] repeated over 5 time steps."""
    return RNNS["lstm"](_sequence(t))


def _gru_sequences(t):
    """The GRU's outputs at every time step, [B, 5, 3], of ``t`` repeated over 5 time steps."""
    return RNNS["gru"](_sequence(t))


def _by_batch_maximum(t):
    return t / tf.reduce_max(t, axis=0)


# Rows meeting past a Keras RNN, whose loop over the time steps (a while loop over lists of the steps' rows)
# row_axes follows: its outputs keep the batch's rows.
MEETINGS_PAST_A_LOOP = {
    "an_lstm_s_output_centered": (lambda q, d, w: _center(_lstm(q)),
                                  "Rows of the batch meet in sub (Sub combines rows of ("),
    "a_gru_s_sequences_normalized_by_their_batch_maximum": (
        lambda q, d, w: _by_batch_maximum(_gru_sequences(q)),
        "Rows of the batch meet in truediv (RealDiv combines rows of ("),
    "a_softmax_over_an_lstm_s_rows": (lambda q, d, w: tf.nn.softmax(_lstm(q), axis=0),
                                      "(Softmax along the rows of the batch"),
    # two views of the batch joined along the rows through one GRU (before: its lists of time steps did not keep
    # the blocks, not seen)
    "two_views_through_a_gru_centered": (lambda q, d, w: _center(_gru_sequences(tf.concat([q, d], 0))),
                                         "Rows of the batch meet in sub (Sub combines rows of ("),
    "a_state_summed_over_a_while_loop_then_centered": (
        lambda q, d, w: _center(tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, h + q @ w),
                                              (0, tf.zeros([tf.shape(q)[0], 3])))[1]),
        "Rows of the batch meet in sub (Sub combines rows of ("),
}


# Rows meeting over or past tf.map_fn and tf.scan (a loop over a list of the batch's rows, each element one row).
_ONE_ROW = "one row of the batch ((3,): an element of a list of its rows, as the function of tf.map_fn gets)"
MEETINGS_OVER_A_MAP = {
    "a_map_s_output_centered": (lambda q, d, w: _center(tf.map_fn(lambda r: tf.tanh(r), q)),
                                "Rows of the batch meet in sub (Sub combines rows of ("),
    "each_row_centered_by_the_batch_mean_in_a_map": (
        lambda q, d, w: tf.map_fn(lambda r: r - tf.reduce_mean(q, axis=0), q),
        f"in the body of the loop map/while, (Sub combines {_ONE_ROW} with Mean over the rows of the batch"),
    "each_row_scored_against_every_candidate_in_a_map": (
        lambda q, d, w: tf.map_fn(lambda r: tf.reduce_sum(r * d, axis=-1), q),
        f"3) (axis 0) with {_ONE_ROW}, pairing every row of the batch with every other"),
    "a_scan_over_the_rows": (
        lambda q, d, w: tf.scan(lambda total, r: total + r, q),
        "Rows of the batch meet in scan/while (a loop over the rows of the batch carries a value computed from one "
        "row on to the next, as the accumulator of tf.scan does)"),
    "a_scan_from_an_initializer": (lambda q, d, w: tf.scan(lambda h, r: tf.tanh(h[None] @ w)[0] + r, q, tf.zeros([3])),
                                   "Rows of the batch meet in scan/while (a loop over the rows of the batch carries"),
}


@pytest.mark.usefixtures("rnns")
@pytest.mark.parametrize("name", sorted(MEETINGS_INSIDE) + sorted(MEETINGS_PAST_A_LOOP) + sorted(MEETINGS_OVER_A_MAP))
def test_rows_meeting_inside_a_function_the_step_calls_or_past_a_loop_are_refused_on_several_workers(name):
    # Before, a call and a loop were tensors of unknown rows: these trained silently apart from one process (and
    # tf.map_fn's or tf.scan's loop over the rows until this change).
    meet, fragment = {**MEETINGS_INSIDE, **MEETINGS_PAST_A_LOOP, **MEETINGS_OVER_A_MAP}[name]
    for rows in (None, 4):
        message = _refusal(meet, rows)
        assert message is not None and fragment in message, (rows, message)
        assert "Received: that op in the training step of a job of 2 workers. Compute it per row" in message
    assert _refusal(meet, workers=1) is None


@pytest.mark.usefixtures("rnns")
def test_two_views_encoded_by_one_lstm_and_scored_against_each_other_are_refused():
    # SimCLR's loss over sequences: both views joined along the rows, one LSTM over them, z @ z^T. Before, the LSTM's
    # lists of time steps did not keep the views' blocks: not seen (the product's side had twice the batch's rows).
    # Split back into its views, each row scored against its other view alone, it runs.
    def scored(q, d, w):
        z = _lstm(tf.concat([q, d], 0))
        return tf.matmul(z, z, transpose_b=True)

    def each_against_its_other_view(q, d, w):
        z1, z2 = tf.split(_lstm(tf.concat([q, d], 0)), 2)
        return tf.reduce_sum(z1 * z2, axis=1)

    for rows in (None, 4):
        message = _refusal(scored, rows)
        assert message is not None and "The rows of the batch are scored against each other in MatMul" in message
        assert _refusal(each_against_its_other_view, rows) is None
    assert _refusal(scored, workers=1) is None


def _ctc_loss(q, d, w):
    """Keras' CTC loss of a batch of 3 time steps of 4 classes, labels of 2 (its tf.scan over the label lengths
    reads its accumulator's shape only)."""
    del w
    y_pred = tf.nn.softmax(q[:, :, None] * tf.ones([1, 1, 4]))
    y_true = tf.cast(tf.abs(d[:, :2]) > 0, tf.int32) + 1
    return tf.keras.backend.ctc_batch_cost(y_true, y_pred, tf.cast(q[:, :1] * 0 + 3, tf.int32),
                                           tf.cast(d[:, :1] * 0 + 2, tf.int32))


@pytest.mark.usefixtures("rnns")
def test_per_row_work_past_a_keras_rnn_or_a_while_loop_runs():
    # An RNN's outputs per row (a dense layer, a loss's mean, its sequences' per-step softmax; a bidirectional one
    # reversing its time steps), a loop over the
    # columns' lists, tf.map_fn's function of each row alone (with a weight, a scan and a list of its own), each
    # row's own value past it, Keras' CTC loss (a tf.scan over the rows reading its accumulator's shape alone: it
    # was refused before that was told apart) meet nothing.
    dense = tf.keras.layers.Dense(2)
    for alone in (lambda q, d, w: tf.reduce_mean(tf.square(dense(_lstm(q)) - d[:, :2])),
                  lambda q, d, w: tf.nn.softmax(_gru_sequences(q), axis=-1),
                  lambda q, d, w: tf.keras.losses.cosine_similarity(_lstm(q), d),
                  lambda q, d, w: RNNS["bidirectional"](_sequence(q)),
                  lambda q, d, w: tf.map_fn(lambda r: r - tf.reduce_mean(r), q),
                  lambda q, d, w: tf.nn.softmax(tf.map_fn(lambda r: tf.nn.softmax(r[None] @ w)[0], q)),
                  lambda q, d, w: tf.map_fn(lambda r: tf.scan(lambda a, v: a * v, r), q) - d,
                  lambda q, d, w: tf.map_fn(lambda r: tf.TensorArray(tf.float32, 2).write(0, r).write(1, -r).stack()
                                            - tf.reduce_mean(r), q),
                  lambda q, d, w: tf.reduce_sum(tf.map_fn(lambda r: r * w[0], q) * d, axis=1),
                  _ctc_loss,
                  lambda q, d, w: tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, tf.nn.softmax(h @ w)),
                                                (0, q))[1]):
        assert _refusal(alone) is None


_ORDER_PROGRAM = """
import tensorflow as tf, horovod.tensorflow as hvd
from kparallax.step import rows_meet
hvd.init()

@tf.function
def step(q, d, extra):
    with rows_meet.checked_first():
        read = hvd.allreduce(q, op=hvd.Sum, name="read_by_the_check")
        with rows_meet.refused(2, 1, (q, d)):
            scores = tf.matmul(read, d, transpose_b=True)
        after = hvd.allreduce(extra, op=hvd.Sum, name="after")
        called = tf.function(lambda t: hvd.allgather(t, name="called"))(extra)
    return scores, after, called

graph = step.get_concrete_function(*[tf.TensorSpec([None, 3])] * 3).graph
for op in graph.get_operations():
    if op.type.startswith("Horovod") or op.type in ("Assert", "PartitionedCall", "StatefulPartitionedCall"):
        print(op.name, op.type, sorted(c.type for c in op.control_inputs))
"""


def test_the_step_s_collectives_wait_for_its_checks():
    # Before, a worker whose check failed left Horovod while the other, its check not yet run, waited in a
    # collective of the step and failed naming the other worker (a model whose rows meet past a Keras LSTM: 3 of 6
    # runs). A collective the check reads runs before it (no cycle). Horovod initialized alone, in a process of its
    # own (not this test process).
    done = subprocess.run([sys.executable, "-c", _ORDER_PROGRAM], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["read_by_the_check"] == "HorovodAllreduce []", lines
    assert lines["after"] == "HorovodAllreduce ['Assert']", lines
    assert lines["PartitionedCall"] == "PartitionedCall ['Assert']", lines  # an allgather in a function it calls


def _parted(reshape, rows, workers=2, micro_batches=1):
    """``reshape(x)`` of a batch x of ``rows`` rows x 3 (its size unknown while tracing), traced under
    ``rows_meet.refused`` for ``workers`` and ``micro_batches``: the error's message, or None when the step runs."""

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
    def step(x):
        with rows_meet.refused(workers, micro_batches, (x,)):
            return reshape(x)

    try:
        step(tf.ones([rows, 3]))
    except tf.errors.InvalidArgumentError as error:
        return error.message
    return None


ENTRIES = {  # a reshape into entries holding k whole rows, or parts of consecutive rows, its first size left
    "pairs": (lambda x: tf.reduce_sum(tf.reshape(x, [-1, 2, 3]), axis=1),
              "(a reshape of (None, 3) into (None, 2, 3): 1/2 entries per row of the batch, whole on a multiple of 2 "
              "rows)", "Make every global batch a multiple of 4 rows (a per-worker batch_size a multiple of 2"),
    "values_cut_across_rows": (lambda x: tf.reshape(tf.reshape(x, [-1, 2]) * 2.0, [-1, 3]),
                               "(a reshape of (None, 3) into (None, 2): 3/2 entries per row of the batch, whole on a "
                               "multiple of 2 rows)", "Make every global batch a multiple of 4 rows"),
    "triplets": (lambda x: tf.reshape(x, [-1, 3, 3])[:, 0],
                 "1/3 entries per row of the batch, whole on a multiple of 3 rows", "a multiple of 6 rows"),
}


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_a_worker_s_part_that_does_not_fill_whole_entries_is_refused_before_its_reshape(name):
    # A global batch of 22 rows in pairs is split 11 + 11 on 2 workers: before, each worker's reshape failed with
    # TensorFlow's error about value counts ("Input to reshape is a tensor with 33 values ..."), on a batch one
    # process trains on. Now kparallax's check runs before the reshape and says why and what to change.
    reshape, shape, fix = ENTRIES[name]
    rows = 6 if name == "triplets" else 4
    assert _parted(reshape, rows) is None
    message = _parted(reshape, rows + 1)
    assert message is not None and "The part of the batch on this worker does not fill whole entries of " in message
    assert shape in message and fix in message, message
    assert "Received: a part of the rows below in the training step of a job of 2 workers." in message
    assert f"] [{rows + 1}]" in message  # the part's rows
    alone = _parted(reshape, rows + 1, workers=1)  # one process: the reshape's own error, no check of kparallax's
    assert "Input to reshape is a tensor with" in alone and "does not fill whole entries" not in alone
    accumulating = _parted(reshape, rows + 1, workers=1, micro_batches=2)  # each micro-batch a part
    multiple = 3 if name == "triplets" else 2
    assert (f"a job of 1 worker(s) accumulating backward_passes_per_step=2 micro-batches. Make every global batch a "
            f"multiple of {2 * multiple} rows (a per-worker batch_size a multiple of {2 * multiple}") in accumulating


@pytest.mark.multiprocess
def test_a_pair_loss_whose_last_global_batch_leaves_a_worker_half_a_pair_is_refused(tmp_path):
    # 54 rows, a global batch of 32: one process trains on a last batch of 22 rows (11 pairs); each of 2 workers
    # gets 11 of them. Before, both failed in the loss's reshape with TensorFlow's error about value counts.
    plain = subprocess.run([sys.executable, PAIRS_PROGRAM, str(tmp_path), "reference"], capture_output=True,
                           text=True, timeout=240)
    assert plain.returncode == 0 and os.path.exists(tmp_path / "paired.npz"), plain.stderr[-3000:]
    os.remove(tmp_path / "paired.npz")
    _assert_refused(tmp_path, ["kparallax"], (
        "The part of the batch on this worker does not fill whole entries of pair_difference_loss/Reshape",  # or _1
        "(a reshape of (None, 1) into (None, 2): 1/2 entries per row of the batch, whole on a multiple of 2 rows)",
        "Received: a part of the rows below in the training step of a job of 2 workers. Make every global batch a "
        "multiple of 4 rows", "] [11]"), program=PAIRS_PROGRAM)


def test_rows_meeting_in_a_branch_not_taken_or_alone_in_a_function_run():
    # The check of a cond's branch holds when that branch runs; per-row functions, and a function of the gathered
    # rows, meet nothing; a function of sampled rows (fewer than the batch's) neither.
    assert _refusal(lambda q, d, w: tf.cond(tf.reduce_sum(w) < 0, lambda: _center(q), lambda: q * 2.0)) is None
    assert _refusal(lambda q, d, w: tf.cond(tf.reduce_sum(w) > 0, lambda: q * 2.0, lambda: _center(q))) is None
    # So does a cond's inside a function of the step, on a flag passed in (before: checked in every step, refused).
    assert _refusal(lambda q, d, w: tf.function(lambda t, flag: tf.cond(flag, lambda: _center(t), lambda: t))(
        q, tf.reduce_sum(w) < 0)) is None
    assert _refusal(lambda q, d, w: tf.function(lambda t, flag: tf.function(
        lambda u, on: tf.cond(on, lambda: u, lambda: _center(u)))(t * 2.0, flag))(q, tf.reduce_sum(w) > 0)) is None
    for alone in (lambda q, d, w: tf.function(lambda t: tf.nn.softmax(t, axis=1))(q @ w),
                  lambda q, d, w: tf.function(lambda t: t - tf.reduce_mean(t, axis=1, keepdims=True))(q),
                  lambda q, d, w: tf.function(lambda t: tf.reduce_mean(tf.square(t)))(q @ w),
                  lambda q, d, w: tf.function(lambda t: tf.reduce_mean(t[:, :2], axis=0))(q) + 1.0):
        assert _refusal(alone) is None
    assert _refusal(lambda q, d, w: tf.function(_center)(d), gathered=True) is None


def _loss_refusal(loss, rows=None, workers=2, micro_batches=1, logged=None, graph_gradients=False):
    """Trains a [3, 1] kernel ``w`` one step on ``loss(q, d, w)`` of a batch (q, d) of 4 rows x 3, traced with ``rows``
    rows (None: unknown) under ``rows_meet.refused`` (returning ``logged(q, d, w)`` too, if given): the check's
    message, or None when the step runs. Its gradient taken by a tape, or by ``tf.gradients`` if
    ``graph_gradients``."""
    kernel = tf.Variable(tf.fill([3, 1], 0.3))

    @tf.function(input_signature=[tf.TensorSpec([rows, 3], tf.float32)] * 2)
    def step(q, d):
        with rows_meet.refused(workers, micro_batches, (q, d)):
            with tf.GradientTape() as tape:
                value = loss(q, d, kernel)
            gradient = tf.gradients(value, kernel)[0] if graph_gradients else tape.gradient(value, kernel)
            kernel.assign_sub(0.1 * gradient)
            return value if logged is None else (value, logged(q, d, kernel))

    try:
        step(tf.ones([4, 3]), tf.fill([4, 3], 2.0))
    except tf.errors.InvalidArgumentError as error:
        return error.message
    return None


# Losses taking rows by their place in the batch (row_axes' ``sliced``): each form, and its message's fragment.
# Before: not seen.
TAKEN_LOSSES = {
    "the_first_row_as_an_anchor": (lambda q, d, w: tf.reduce_mean(tf.square((q - q[:1]) @ w)),
                                   "(StridedSlice takes rows of the batch by their place in it, axis 0 of its input ("),
    "a_batch_in_halves_split": (lambda q, d, w: tf.reduce_mean(tf.square((tf.split(q, 2)[0] - tf.split(q, 2)[1]) @ w)),
                                "(Split takes rows of the batch by their place in it, axis 0 of its input ("),
    "as_many_rows_as_fewer_candidates": (lambda q, d, w: tf.reduce_mean(q[:tf.shape(d)[0] // 2] @ w),
                                         "(StridedSlice takes rows of the batch by their place in it"),
    "shuffled_negatives": (lambda q, d, w: tf.reduce_mean((q * tf.random.shuffle(d)) @ w),
                           "(RandomShuffle takes rows of the batch by their place in it"),
    "the_first_row_of_the_batch_tiled": (
        lambda q, d, w: tf.reduce_mean(tf.square(tf.tile(q, [2, 1])[:1] @ w)),
        "(StridedSlice takes rows of the batch by their place in it, axis 0 of its input ("),
    "consecutive_rows_differenced_by_pads": (
        lambda q, d, w: tf.reduce_mean(tf.square((tf.pad(q, [[1, 0], [0, 0]]) - tf.pad(q, [[0, 1], [0, 0]])) @ w)),
        "(Pad adds rows before or after the rows of the batch, axis 0 of its input ("),
    "the_batch_padded_to_a_fixed_size": (
        lambda q, d, w: tf.reduce_mean(tf.square(tf.pad(q, [[0, 6 - tf.shape(q)[0]], [0, 0]], constant_values=1.0)
                                                 @ w)),
        "(PadV2 adds rows before or after the rows of the batch, axis 0 of its input ("),
    "the_batch_in_two_groups": (lambda q, d, w: tf.reduce_sum(tf.square(tf.reduce_mean(tf.reshape(q @ w, [2, -1]),
                                                                                       axis=1))),
                                "(Reshape joins the rows of the batch, axis 0 of its input (")}


@pytest.mark.parametrize("name", sorted(TAKEN_LOSSES))
def test_losses_taking_rows_by_their_place_in_the_batch_are_refused_on_several_workers(name):
    # One process counts those places in the global batch, each worker in its own part.
    loss, fragment = TAKEN_LOSSES[name]
    for rows in (None, 4):
        message = _loss_refusal(loss, rows)
        assert message is not None and "Rows of the batch meet in " in message and fragment in message, (rows, message)
        assert "Received: that op in the training step of a job of 2 workers." in message
    assert _loss_refusal(loss, workers=1) is None
    assert "a job of 1 worker(s) accumulating backward_passes_per_step=2 micro-batches" in _loss_refusal(
        loss, workers=1, micro_batches=2)


# Losses reducing the batch's rows joined by tf.concat to entries of something else than the batch (row_axes'
# ``joined``): each form, and its message's fragment. Before: not seen (a mean over [per_example; prior]: 0.010 off
# one process after 3 epochs on 2 workers, silently).
_JOINED = "runs along the axis where concat (ConcatV2) joins the rows of the batch, axis 0 of ("
JOINED_LOSSES = {
    "a_weight_joined_after_the_rows": (
        lambda q, d, w: tf.reduce_mean(tf.concat([tf.reduce_sum(q @ w, axis=1), tf.reshape(w, [-1])], 0)),
        "(Mean " + _JOINED),
    "a_prior_joined_before_the_rows": (
        lambda q, d, w: tf.reduce_sum(tf.concat([tf.reshape(tf.square(w), [-1]), (q @ w)[:, 0] * 0.5], 0)),
        "(Sum " + _JOINED),
    # replayed examples joined to the batch, their squared errors' mean (labels joined alike)
    "replayed_examples_joined_to_the_batch": (
        lambda q, d, w: tf.reduce_mean(tf.square(tf.concat([q, tf.ones([2, 3])], 0) @ w
                                                 - tf.concat([d[:, :1], tf.zeros([2, 1])], 0))),
        "(Mean " + _JOINED),
    # the join made, or averaged, in a function the step calls
    "a_prior_joined_in_a_function": (
        lambda q, d, w: tf.function(lambda a, b: tf.reduce_mean(tf.concat([a, b], 0)))(tf.reduce_sum(q @ w, axis=1),
                                                                                      tf.reshape(w, [-1])),
        "(Mean " + _JOINED),
    "a_join_averaged_in_a_function": (
        lambda q, d, w: tf.function(tf.reduce_mean)(tf.concat([tf.reduce_sum(q @ w, axis=1), tf.reshape(w, [-1])], 0)),
        "(Mean " + _JOINED),
    # tf.map_fn over replayed examples joined to the batch (each entry's own), their mean
    "a_map_over_replayed_examples_averaged": (
        lambda q, d, w: tf.reduce_mean(tf.map_fn(lambda e: tf.reduce_sum(tf.square(e)),
                                                 tf.concat([q, tf.ones([2, 3])], 0) @ w)),
        "(Mean " + _JOINED),
    # a value carried along the rows and a prior joined after them (tf.scan), the rows' part kept
    "a_scan_along_the_rows_and_a_prior": (
        lambda q, d, w: tf.reduce_sum(tf.scan(lambda a, e: a * 0.5 + e, tf.concat([(q @ w)[:, 0], w[:, 0]], 0))[
            :tf.shape(q)[0]]), "runs along the axis where concat (ConcatV2) joins the rows of the batch"),
    "a_softmax_over_the_rows_and_the_weight_s": (
        lambda q, d, w: tf.reduce_sum(tf.square(tf.nn.softmax(tf.concat([(q @ w)[:, 0], w[:, 0]], 0)))),
        "(Softmax " + _JOINED),
}


@pytest.mark.parametrize("name", sorted(JOINED_LOSSES))
def test_losses_reducing_the_rows_joined_to_other_entries_are_refused_on_several_workers(name):
    # One process joins those entries to the global batch once, each worker to its own part.
    loss, fragment = JOINED_LOSSES[name]
    for rows in (None, 4):
        message = _loss_refusal(loss, rows)
        assert message is not None and fragment in message, (rows, message)
        assert "Received: that op in the training step of a job of 2 workers." in message
        assert "to entries of something else than the batch" in message and "kp.all_gather(value)" in message
    assert _loss_refusal(loss, workers=1) is None
    assert "a job of 1 worker(s) accumulating backward_passes_per_step=2 micro-batches" in _loss_refusal(
        loss, workers=1, micro_batches=2)


def test_rows_joined_to_other_entries_through_a_keras_rnn_meet_where_averaged_and_run_split_back(rnns):
    # A Keras RNN reads its time steps from a list in a while loop and writes its outputs to another: before, a join
    # passed through it was lost, and a mean over replayed sequences' outputs beside the batch's trained silently
    # apart from one process (an LSTM on 2 workers: 0.023 off after 3 epochs).
    del rnns
    replayed = lambda q, w: tf.concat([q, tf.ones([2, 3])], 0) * tf.transpose(w)  # pylint: disable=C3001
    for rows in (None, 4):
        message = _loss_refusal(lambda q, d, w: tf.reduce_mean(_lstm(replayed(q, w))), rows)
        assert message is not None and "(Mean " + _JOINED in message, (rows, message)
        message = _loss_refusal(lambda q, d, w: tf.reduce_sum(tf.reduce_mean(_gru_sequences(replayed(q, w)), 1)), rows)
        assert message is not None and "(Sum " + _JOINED in message, (rows, message)
        assert _loss_refusal(lambda q, d, w: tf.reduce_mean(tf.split(_lstm(replayed(q, w)), [tf.shape(q)[0], -1])[0]),
                             rows) is None
        # masked (the replayed sequences end early): the mask joined alike, tiled over the units in the loop
        masked = lambda q, w: RNNS["lstm"](_sequence(replayed(q, w)), mask=tf.concat(  # pylint: disable=C3001
            [tf.reduce_sum(_sequence(q), 2) > -1e9, tf.sequence_mask([3, 2], 5)], 0))
        message = _loss_refusal(lambda q, d, w: tf.reduce_mean(masked(q, w)), rows)
        assert message is not None and "(Mean " + _JOINED in message, (rows, message)
        assert _loss_refusal(lambda q, d, w: tf.reduce_mean(masked(q, w)[:tf.shape(q)[0]]), rows) is None


def _sampled_softmax(q, d, w):
    """A sampled softmax as LM1B's: the batch's true ids and 2 sampled ids looked up in one gather, the rows split
    back, each row's true logit against the sampled ones."""
    ids = tf.cast(tf.abs(d[:, 0]), tf.int64) % 3
    sampled = tf.constant([0, 2], tf.int64)
    table = w @ tf.ones([1, 2])  # [3, 2] (a product: the kernel's gradient dense)
    true_w, sampled_w = tf.split(tf.gather(table, tf.concat([ids, sampled], 0)), tf.stack([tf.shape(ids)[0], 2]))
    hidden = q[:, :2]
    logits = tf.concat([tf.reduce_sum(hidden * true_w, 1, keepdims=True), hidden @ tf.transpose(sampled_w)], 1)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(tf.zeros_like(ids, tf.int32), logits))


def test_rows_joined_to_other_entries_and_split_back_or_logged_alone_run():
    # Split back at the parts' edges (a sampled softmax's true and sampled ids looked up in one gather), the rows
    # are the batch's again: per-row work past them meets nothing (refusing every such join refused LM1B's sampled
    # softmax); a softmax over the rows split back still meets them. A mean over a join logged beside the loss
    # changes no weight.
    split_back = lambda q, d, w: tf.reduce_sum(  # pylint: disable=unnecessary-lambda-assignment
        [tf.reduce_mean(part) for part in tf.split(tf.concat([(q @ w)[:, 0], w[:, 0]], 0), [tf.shape(q)[0], -1])])
    sliced_back = lambda q, d, w: tf.reduce_mean(  # pylint: disable=unnecessary-lambda-assignment
        tf.concat([q @ w, tf.transpose(w)[:, :1]], 0)[:tf.shape(d)[0]])
    for rows in (None, 4):
        for loss in (split_back, sliced_back, _sampled_softmax):
            assert _loss_refusal(loss, rows) is None, rows
        assert _loss_refusal(lambda q, d, w: tf.reduce_mean(q @ w), rows, logged=lambda q, d, w: tf.reduce_mean(
            tf.concat([q @ w, w], 0))) is None
        met = _loss_refusal(lambda q, d, w: tf.reduce_mean(tf.nn.softmax(tf.split(
            tf.concat([q @ w, w], 0), [tf.shape(q)[0], -1])[0] * 3.0, axis=0)[:, 0] * tf.range(1.0, 1.0 + tf.cast(
                tf.shape(q)[0], tf.float32))), rows)
        assert met is not None and "(Softmax along the rows of the batch, axis 1 of its input" in met, met


def test_rows_taken_by_their_place_for_a_write_or_a_logged_value_alone_run():
    # A variable's write of the batch's first row (its aggregation combines the workers' writes: ONLY_FIRST_REPLICA
    # keeps worker 0's, the global batch's first); a value logged beside the loss; as many rows as another tensor
    # of the batch, sliced (checked on its size at run time).
    first = tf.Variable(tf.zeros([3]))

    def written(q, d, w):
        first.assign(q[0])
        return tf.reduce_mean(q @ w)

    assert _loss_refusal(written) is None
    np.testing.assert_array_equal(first.numpy(), np.ones(3))
    assert _loss_refusal(lambda q, d, w: tf.reduce_mean(q @ w), logged=lambda q, d, w: q[:1] - d) is None
    assert _loss_refusal(lambda q, d, w: tf.reduce_mean(q[:tf.shape(d)[0]] @ w)) is None
    # padded up to the size it has (paddings read while the step runs, adding no row)
    assert _loss_refusal(lambda q, d, w: tf.reduce_mean(tf.pad(q, [[0, 4 - tf.shape(d)[0]], [0, 0]]) @ w)) is None


def test_a_recomputed_gradient_runs_and_rows_its_function_takes_by_place_are_refused():
    # tf.recompute_grad's gradient recomputes its function under a tape of its own, from inputs made to depend on the
    # upstream gradient's first value (reshape(dresult[0], [-1])[:1]): that tape's target is the backward pass's, not
    # a loss of the step. Before: refused as the first row of the batch taken as an anchor.
    assert _loss_refusal(lambda q, d, w: tf.reduce_mean(tf.square(tf.recompute_grad(lambda x: tf.tanh(x @ w))(q)))) \
        is None
    anchored = _loss_refusal(lambda q, d, w: tf.reduce_mean(tf.square(tf.recompute_grad(lambda x: (x - x[:1]) @ w)(q))))
    assert anchored is not None and "(StridedSlice takes rows of the batch by their place in it" in anchored


def _b(t):
    return tf.shape(t)[0]


def _pair_scores(q, d, w):
    """A score [B * B] of every pair (query i, candidate j): both rows side by side in one entry, through ``w``."""
    pairs = tf.concat([tf.repeat(q, _b(d), axis=0), tf.tile(d, [_b(q), 1])], axis=1)  # [B * B, 6]
    return tf.squeeze(pairs @ tf.concat([w, w], 0), -1)


# Losses over every pair of the batch's rows (a ranking loss's pairs, a relation network's): each form and its
# message's fragment with the batch's size unknown and static (then tf.shape(q)[0] is a constant: a tile of the
# batch, as tf.tile(q, [4, 1]), is not refused alone). Before: not seen.
PAIR_LOSSES = {
    "every_pair_by_repeat_and_tile": (
        lambda q, d, w: tf.reduce_mean(tf.square(_pair_scores(q, d, w))),
        {None: "(Tile copies the rows of the batch, axis 0 of its input (None, 1, 3), once per row of the batch",
         4: "(ConcatV2 combines the entries of (16, 3) with those of (16, 3) in order, along axis 0"}),
    "every_pair_differenced": (
        lambda q, d, w: tf.reduce_mean(tf.square((tf.repeat(q, _b(d), axis=0) - tf.tile(d, [_b(q), 1])) @ w)),
        {None: "as building every pair of the batch's rows with tf.tile or tf.repeat does",
         4: "pairing rows of the batch with other rows"}),
    "pairs_side_by_side_in_a_grid": (
        lambda q, d, w: tf.reduce_mean(tf.square(tf.concat(
            [tf.broadcast_to(q[:, None], tf.stack([_b(q), _b(d), 3])),
             tf.broadcast_to(d[None], tf.stack([_b(q), _b(d), 3]))], -1) @ tf.concat([w, w], 0))),
        {None: "pairing every row of the batch with every other, as pairwise differences or pairs of rows joined side",
         4: "(ConcatV2 combines the rows of (4, 4, 3) (axis 0) with those of (4, 4, 3) (axis 1)"}),
}


@pytest.mark.parametrize("name", sorted(PAIR_LOSSES))
def test_losses_over_every_pair_of_the_batch_s_rows_are_refused_on_several_workers(name):
    # One process pairs every row of the global batch with every other, each worker its own rows only.
    loss, fragments = PAIR_LOSSES[name]
    for rows in (None, 4):
        message = _loss_refusal(loss, rows)
        assert message is not None and fragments[rows] in message.replace("\\'", "'"), (rows, message)
        assert "Received: that op in the training step of a job of 2 workers." in message
    assert _loss_refusal(loss, workers=1) is None


def test_tiles_by_a_count_read_that_build_no_pairs_run():
    # A weight tiled by the batch's size (a position's embedding added to each row), each row's values tiled by a
    # count read, each row repeated in place on both sides; a tile by the batch's size for a logged value alone;
    # pairs of the worker's rows with kp.all_gather's rows.
    for rows in (None, 4):
        for alone in (lambda q, d, w: tf.reduce_mean((q + tf.tile(tf.ones([1, 3]), [_b(q), 1])) @ w),
                      lambda q, d, w: tf.reduce_mean(tf.tile(q, tf.stack([1, tf.shape(d)[1] // 3])) @ w),
                      lambda q, d, w: tf.reduce_mean((tf.repeat(q, 2, axis=0) - tf.repeat(d, 2, axis=0)) @ w)):
            assert _loss_refusal(alone, rows) is None, rows
        assert _loss_refusal(lambda q, d, w: tf.reduce_mean(q @ w), rows,
                             logged=lambda q, d, w: tf.reduce_mean(tf.tile(q, [_b(d), 1]))) is None, rows
        # every pair of a worker's rows with the rows gathered over the workers (the fix the message gives)
        assert _loss_refusal(lambda q, d, w: tf.reduce_mean(tf.square(_pair_scores(q, rows_meet.gathered(d), w))),
                             rows) is None, rows


def _sparsity(q, d, w):
    rate = tf.reduce_mean(tf.sigmoid(q @ w), axis=0)
    return tf.reduce_sum(0.1 * tf.math.log(0.1 / rate) + 0.9 * tf.math.log(0.9 / (1 - rate)))


# Losses taking a statistic of the batch through a function other than a sum or a scaling: each form, and the op
# and statistic its message names.
NONLINEAR_LOSSES = {
    "root_mean_squared_error": (lambda q, d, w: tf.sqrt(tf.reduce_mean(tf.square(q @ w - d[:, :1]))),
                                "through Sqrt (Sqrt of Mean over the rows of the batch in Mean:"),
    "log_of_a_mean": (lambda q, d, w: -tf.math.log(tf.reduce_mean(tf.sigmoid(q @ w))), "through Log (Log of Mean"),
    "divided_by_a_batch_statistic": (
        lambda q, d, w: tf.reduce_mean(tf.square(q @ w)) / tf.stop_gradient(tf.reduce_mean(tf.abs(d))),
        "through truediv (RealDiv of Mean over the rows of the batch in Mean_1:"),
    "square_of_the_mean_error": (lambda q, d, w: tf.square(tf.reduce_mean(q @ w - d[:, :1])), "through Square"),
    "sparsity_penalty": (_sparsity, "through truediv (RealDiv of Mean over the rows of the batch in Mean:"),
    "chosen_by_the_batch_mean": (
        lambda q, d, w: tf.where(tf.reduce_mean(q @ w) > 1.0, tf.reduce_mean(tf.square(q @ w)), tf.reduce_mean(q @ w)),
        "through SelectV2 (SelectV2 of Mean over the rows of the batch in Mean:"),
    "gram_matrix_penalty": (
        lambda q, d, w: tf.reduce_sum(tf.square(tf.matmul(q * tf.transpose(w), q, transpose_a=True) / 4 - tf.eye(3))),
        "through Square (Square of MatMul over the rows of the batch in MatMul:"),
    "an_einsum_gram_matrix_s_root": (
        lambda q, d, w: tf.sqrt(tf.reduce_sum(tf.einsum("bi,bj->ij", q @ w, d))),
        "through Sqrt (Sqrt of Einsum over the rows of the batch in einsum/Einsum:"),
    "a_root_mean_squared_error_in_a_function": (
        lambda q, d, w: tf.function(lambda e: tf.sqrt(tf.reduce_mean(tf.square(e))))(q @ w - d[:, :1]),
        "through Sqrt, in the function called by PartitionedCall, (Sqrt of Mean over the rows of the batch in Mean:"),
}


@pytest.mark.parametrize("name", sorted(NONLINEAR_LOSSES))
def test_a_nonlinear_function_of_a_batch_statistic_in_the_loss_is_refused_on_several_workers(name):
    # One process differentiates it at the global batch's statistic, each worker at its own rows'. Before, such a
    # loss trained silently apart from one process (a sparsity penalty on the batch's mean activation: 7.5e-5 off
    # after 3 epochs on 2 workers). Outside compiled loss functions, which run with global statistics, it is refused.
    loss, fragment = NONLINEAR_LOSSES[name]
    for rows, graph_gradients in ((None, False), (4, False), (None, True)):
        # a tf.gradients target too (before, only a tape's were seen: such a loss trained silently)
        message = _loss_refusal(loss, rows, graph_gradients=graph_gradients)
        assert message is not None and "A statistic of the batch reaches the loss " + fragment in message, (
            rows, message)
        assert ("Received: that op in the training step of a job of 2 workers. Take the statistic over every "
                "worker: of the rows of kp.all_gather(value)") in message
        compiled = "a loss function compiled with the model (of its targets and predictions) gets its sums"
        # not for a product's statistic, nor one in a function of its own (batch_statistics makes neither global)
        assert (compiled in message) == ("gram" not in name and "function" not in name), (rows, message)
    assert _loss_refusal(loss, workers=1) is None
    assert "a job of 1 worker(s) accumulating backward_passes_per_step=2 micro-batches" in _loss_refusal(
        loss, workers=1, micro_batches=2)


def test_a_batch_statistic_off_the_loss_or_only_summed_in_it_runs():
    # Logged beside the loss (a root mean squared error, Keras' metric of it); sums, means and scalings of the
    # batch's statistics (Keras' losses, a sum over the batch's size, tf.nn.compute_average_loss over a global batch,
    # a weight decay, a loss weight); over kp.all_gather's rows (the fix the message gives); a masked mean loss.
    rows_meet.install()  # as a strategy does
    masked_loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)
    root = tf.keras.metrics.RootMeanSquaredError()

    def metric(q, d, w):
        root.update_state(d[:, :1], q @ w)
        return root.result()

    mse = lambda q, d, w: tf.keras.losses.MeanSquaredError()(d[:, :1], q @ w)  # noqa: E731
    assert _loss_refusal(mse, logged=lambda q, d, w: tf.sqrt(tf.reduce_mean(tf.square(q @ w - d[:, :1])))) is None
    assert _loss_refusal(mse, logged=metric) is None
    for summed in (lambda q, d, w: 0.5 * mse(q, d, w) + 1e-3 * tf.reduce_sum(tf.square(w)),
                   lambda q, d, w: tf.reduce_sum(tf.square(q @ w)) / tf.cast(tf.shape(q)[0], tf.float32),
                   lambda q, d, w: tf.nn.compute_average_loss(tf.reduce_sum(q @ w, axis=1), global_batch_size=8),
                   lambda q, d, w: tf.add_n([mse(q, d, w), tf.reduce_mean(q @ w) * 3.0 - tf.reduce_sum(d) / 8.0]),
                   lambda q, d, w: masked_loss(tf.cast(d[:, 0], tf.int32), tf.concat([q @ w, q @ w * 2.0, -q @ w], 1)),
                   lambda q, d, w: tf.sqrt(tf.reduce_mean(tf.square(rows_meet.gathered(q @ w - d[:, :1]))))):
        assert _loss_refusal(summed) is None


@pytest.mark.multiprocess
def test_losses_of_batch_statistics_match_one_plain_process(tmp_path):
    # A root mean squared error, a mean over a mask written by hand and TensorFlow's transformer tutorial's masked
    # loss over per-token logits, compiled as the loss (kparallax takes their sums and means over every worker), and
    # a layer's sparsity penalty on the batch's mean activation and another's decorrelation penalty on the batch's
    # Gram matrix, taken of kp.all_gather's rows, on a last batch of 21 rows split 11 and 10; the root mean squared
    # error and the tutorial's masked accuracy compiled as metrics too. Before: 2.1e-3, 1.5e-3, 1.4e-3, 7.5e-5 and
    # (over each worker's own rows) 4.2e-4 off one process's weights after 3 epochs, the metrics' logs up to 1.9e-3
    # off, silently.
    ref, got, run = testing.reference_and_job(STATISTICS_PROGRAM, tmp_path, args=["gathered"])
    assert run.returncode == 0, run.report()
    _assert_equal(ref, got, names=("rmse", "masked_mean", "sparsity", "gram", "tutorial"))  # weights, epochs' logs


@pytest.mark.multiprocess
def test_a_penalty_on_each_worker_s_batch_statistic_is_refused(tmp_path):
    # The sparsity penalty taken of the worker's own rows (a layer's add_loss: no compiled loss function kparallax
    # could run with the global batch's statistics). Before: 7.5e-5 off one process after 3 epochs, silently.
    _assert_refused(tmp_path, ["kparallax", "own"], (
        "A statistic of the batch reaches the loss through sequential_2/sparsity/truediv (RealDiv of Mean over the "
        "rows of the batch in sequential_2/sparsity/Mean:",
        "Received: that op in the training step of a job of 2 workers. Take the statistic over every worker: of the "
        "rows of kp.all_gather(value)"), program=STATISTICS_PROGRAM)


@pytest.mark.multiprocess
def test_a_penalty_on_each_worker_s_gram_matrix_is_refused(tmp_path):
    # A decorrelation penalty on the Gram matrix of the worker's own rows (h^T h over the batch, a layer's add_loss).
    # Before: the weights 4.2e-4 off one process after 3 epochs, the logged loss 2.5e-4, silently (the product
    # summing over the rows was not followed).
    _assert_refused(tmp_path, ["kparallax", "own_gram"], (
        "A statistic of the batch reaches the loss through sequential/decorrelation/Square (Square of MatMul over the "
        "rows of the batch in sequential/decorrelation/MatMul:",
        "Received: that op in the training step of a job of 2 workers. Take the statistic over every worker: of the "
        "rows of kp.all_gather(value) (with sync=True and backward_passes_per_step=1); or make the loss"),
        program=STATISTICS_PROGRAM)


@pytest.mark.multiprocess
@pytest.mark.parametrize("architecture", ["hybrid", "ps", "allreduce"])
def test_in_batch_negatives_gathered_over_the_workers_match_one_plain_process(tmp_path, architecture):
    ref, got, run = testing.reference_and_job(PROGRAM, tmp_path, ["sync", architecture])
    assert run.returncode == 0, run.report()
    # The shared table is on the PS (replicated under allreduce): the candidates' gradients reach it through the
    # gather's.
    where = "replicated" if architecture == "allreduce" else "ps[0]"
    assert f"placement: retrieval/embedding/embeddings [120, 6] -> {where}" in run.logs()["worker-0.log"]
    _assert_equal(ref, got)


@pytest.mark.multiprocess
def test_a_loss_function_giving_one_scalar_of_in_batch_negatives_matches_one_plain_process(tmp_path):
    # The loss function reduces the per-example losses itself: their mean (subclassed), their sum (functional).
    # kparallax tells a sum from a mean by the value on the batch repeated twice, recomputed from the per-example
    # losses. Before, it ran the whole function on the doubled batch, whose labels (tf.range over the rows) ran past
    # the candidates' columns: "Received a label value of 63 which is outside the valid range of [0, 32)".
    ref, got, run = testing.reference_and_job(PROGRAM, tmp_path, args=["scalar_losses"])
    assert run.returncode == 0, run.report()
    _assert_equal(ref, got)


@pytest.mark.multiprocess
def test_queries_centered_over_the_gathered_batch_match_one_plain_process(tmp_path):
    # The fix the refusal below gives: the mean over kp.all_gather's rows is one process's mean over the global batch
    # (the last batch's 21 rows too), and gradients flow back to every worker's rows through it.
    ref, got, run = testing.reference_and_job(PROGRAM, tmp_path, args=["centered"])
    assert run.returncode == 0, run.report()
    _assert_equal(ref, got)


@pytest.mark.multiprocess
def test_queries_centered_over_the_worker_s_own_rows_are_refused(tmp_path):
    # Before, each worker centered its queries by the mean of its own 16 rows and trained silently apart from one
    # process.
    _assert_refused(tmp_path, ["kparallax", "centered_own"], (
        "Rows of the batch meet in retrieval/sub (Sub combines rows of (None, 4) with Mean over the rows of the batch "
        "in retrieval/Mean, a statistic of the batch",
        "Received: that op in the training step of a job of 2 workers. Compute it per row, or over every worker: "
        "gather the rows with kp.all_gather(value) first"))


@pytest.mark.multiprocess
def test_queries_centered_in_a_function_of_their_own_are_refused(tmp_path):
    # The same centering in a tf.function the model calls: before, the call hid it and each worker trained silently
    # apart from one process.
    _assert_refused(tmp_path, ["kparallax", "centered_in_function"], (
        "Rows of the batch meet in sub, in the function called by retrieval/",
        "Received: that op in the training step of a job of 2 workers. Compute it per row, or over every worker: "
        "gather the rows with kp.all_gather(value) first"))


def _assert_equal(ref, got, names=("subclassed", "functional")):
    """The models' weights, epoch losses and evaluated loss in ``got`` (``names``.npz) equal one plain process's in
    ``ref``."""
    for name in names:
        a, b = np.load(os.path.join(ref, f"{name}.npz")), np.load(os.path.join(got, f"{name}.npz"))
        assert a.files == b.files, name
        for key in a.files:  # weights, then both epochs' losses and the evaluated loss
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-6, err_msg=f"{name}: {key}")


@pytest.mark.multiprocess
def test_queries_of_an_lstm_tower_centered_over_the_worker_s_own_rows_are_refused(tmp_path):
    # Past the LSTM's loop over the time steps: before, its outputs had unknown rows, and each worker trained
    # silently apart from one process.
    _assert_refused(tmp_path, ["kparallax", "lstm_centered"], (
        "Rows of the batch meet in retrieval/sub (Sub combines rows of (None, 4) with Mean over the rows of the batch",
        "Received: that op in the training step of a job of 2 workers. Compute it per row, or over every worker: "
        "gather the rows with kp.all_gather(value) first"))


@pytest.mark.multiprocess
def test_in_batch_negatives_without_a_gather_are_refused(tmp_path):
    # Before, each worker scored its 16 queries against its own 16 candidates and trained silently apart from one
    # process (0.11 off on this program).
    _assert_refused(tmp_path, ["kparallax", "no_gather"], (
        "The rows of the batch are scored against each other in retrieval/MatMul (MatMul of (None, 4) and (None, 4) "
        "transposed",
        "Received: that product in the training step of a job of 2 workers. Gather the candidate rows over the "
        "workers with kp.all_gather(value)"))


@pytest.mark.multiprocess
def test_all_gather_in_an_asynchronous_step_is_refused(tmp_path):
    _assert_refused(tmp_path, ["kparallax", "async"], (
        "kp.all_gather / kp.row_offset in an asynchronous training step (sync=False), where the workers do not step "
        "together is not supported",))


@pytest.mark.multiprocess
def test_a_tf_distribute_replica_gather_in_the_training_step_is_refused(tmp_path):
    _assert_refused(tmp_path, ["tf-distribute"], (
        "tf.distribute.get_replica_context().all_gather in kparallax's training step gathers nothing",
        "Received: all_gather of a value of shape (None, 4) along axis 0 in the training step of a job of 2 workers. "
        "Gather the rows with kp.all_gather(value)"))


@pytest.mark.multiprocess
def test_a_loss_joining_a_prior_to_the_batch_s_rows_is_refused(tmp_path):
    # A custom train_step's mean over tf.concat([per_example, prior], 0): before, each worker took it over its own
    # rows and the prior, and trained silently apart from one process (2 workers x 16 rows against one process x
    # 32: the weights 0.010 off after 3 epochs).
    _assert_refused(tmp_path, ["kparallax"], (
        "Rows of the batch meet in Mean (Mean runs along the axis where concat (ConcatV2) joins the rows of the "
        "batch, axis 0 of", "Received: that op in the training step of a job of 2 workers."), program=JOINED_PROGRAM)


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["replayed", "replayed_lstm"])
def test_examples_replayed_into_each_batch_with_a_compiled_loss_are_refused(tmp_path, variant):
    # 4 fixed examples joined to each batch (inputs and labels) and Keras' compiled mean squared error over both:
    # before, each worker replayed them beside its own 16 rows and trained silently apart from one process (the
    # kernel 0.023 off after 3 epochs of 2 workers against one process of 32 rows; through an LSTM, whose loop
    # over the time steps lost the join until it was followed through loops and lists, the dense bias 0.023 off).
    _assert_refused(tmp_path, ["kparallax", variant], (
        "Rows of the batch meet in mean_squared_error/weighted_loss/Sum (Sum runs along the axis where concat "
        "(ConcatV2) joins the rows of the batch, axis 0 of (16, 3)",
        "Received: that op in the training step of a job of 2 workers."), program=JOINED_PROGRAM)


@pytest.mark.multiprocess
def test_a_prior_joined_to_the_rows_gathered_over_the_workers_matches_one_plain_process(tmp_path):
    # The refusal's fix: the prior joined to kp.all_gather's rows is one process's join of it to the global batch.
    ref, got, run = testing.reference_and_job(JOINED_PROGRAM, tmp_path, job_args=["gathered"])
    assert run.returncode == 0, run.report()
    a, b = np.load(os.path.join(ref, "joined.npz")), np.load(os.path.join(got, "joined.npz"))
    assert a.files == b.files
    for key in a.files:
        np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-6, err_msg=key)


def _assert_refused(tmp_path, args, expected, program=PROGRAM):
    """``program`` run with ``args`` on 2 workers + 1 PS fails with the refusal (``RunResult.assert_refused``: every
    ``expected`` line in each worker's log that holds an error), and nothing is written."""
    run = testing.run_local([sys.executable, program, str(tmp_path), *args], log_dir=str(tmp_path / "logs"),
                            workers=2, ps=1, timeout=240)
    run.assert_refused(expected)
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".npz")]
