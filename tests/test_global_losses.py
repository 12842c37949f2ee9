"""Losses in kparallax's training step (step/global_losses.py). tf.nn.compute_average_loss on several workers or
micro-batches: without a global batch size the worker's mean (as TensorFlow computes it), with one scaled as a
summed loss (the workers times the micro-batches, over this worker's share), under every name (one bound before the
step too); TensorFlow's own outside the step and in compiled loss functions (which scale sums themselves). Under
backward_passes_per_step=2, summed losses (reduction "sum" and "none", a user's summing function,
compute_average_loss over a global batch size) train as one process on the update's 64 rows (before: 0.056 off, half
the gradient); a masked loss is refused. The compute_average_loss training on several workers is compared with one
process in test_keras_programs.py too (tf_distribute_average_loss, compiled_average_loss)."""

import os

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.nn import compute_average_loss as bound_before  # as a user's module binds it, before any step

from kparallax import testing
from kparallax._compat import keras_losses
from kparallax.step import global_losses

PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "accumulated_losses.py")

PER_EXAMPLE = tf.constant([1.0, 2.0, 3.0, 6.0])  # sum 12, mean 3


def test_it_is_tensorflows_outside_the_step_and_on_one_worker_and_scaled_under_every_name_on_several():
    own = tf.nn.compute_average_loss
    names = (tf.nn.compute_average_loss, tf.compat.v2.nn.compute_average_loss, bound_before)
    with global_losses.workers(1):
        assert [float(name(PER_EXAMPLE, global_batch_size=8)) for name in names] == [1.5] * 3
    with global_losses.workers(2):  # a name bound before the step too (before: TensorFlow's, 1/N of one process's)
        assert [float(name(PER_EXAMPLE, global_batch_size=8)) for name in names] == [3.0] * 3
        traced = tf.function(lambda: bound_before(PER_EXAMPLE, global_batch_size=8), autograph=False)()
        assert float(traced) == 3.0
    assert tf.nn.compute_average_loss is own and tf.compat.v2.nn.compute_average_loss is own
    assert [float(name(PER_EXAMPLE, global_batch_size=8)) for name in names] == [1.5] * 3


def test_on_several_workers_a_global_batch_size_scales_it_as_a_summed_loss():
    with global_losses.workers(2):
        assert float(tf.nn.compute_average_loss(PER_EXAMPLE)) == 3.0  # the worker's mean: averaged by the step
        assert float(tf.nn.compute_average_loss(PER_EXAMPLE, global_batch_size=8)) == 12 / 8 * 2
        weights = tf.constant([1.0, 0.0, 1.0, 0.0])
        assert float(tf.nn.compute_average_loss(PER_EXAMPLE, weights, 8)) == 4 / 8 * 2
    # Batches of different sizes: this worker has 4 of the 5 rows of 2 workers, a share of 2 * 4 / 5 = 1.6.
    with global_losses.workers(2, tf.constant(1.6)):
        np.testing.assert_allclose(float(tf.nn.compute_average_loss(PER_EXAMPLE, global_batch_size=5)),
                                   12 / 5 * 2 / 1.6, rtol=1e-6)


def test_compiled_loss_functions_get_tensorflows_own():
    with global_losses.workers(2), keras_losses._own_average_loss():  # pylint: disable=protected-access
        assert float(tf.nn.compute_average_loss(PER_EXAMPLE, global_batch_size=8)) == 1.5
    with global_losses.workers(2):
        assert float(tf.nn.compute_average_loss(PER_EXAMPLE, global_batch_size=8)) == 3.0


def test_micro_batches_count_in_a_summed_loss():
    with global_losses.workers(1, micro_batches=2):  # one worker accumulating: swapped too
        assert float(tf.nn.compute_average_loss(PER_EXAMPLE)) == 3.0
        assert float(tf.nn.compute_average_loss(PER_EXAMPLE, global_batch_size=8)) == 12 / 8 * 2
    with global_losses.workers(2, micro_batches=3):
        assert float(tf.nn.compute_average_loss(PER_EXAMPLE, global_batch_size=8)) == 12 / 8 * 6
    scales = keras_losses.LossScales(2, None, lambda count: count, micro_batches=3)
    summed = keras_losses._ScaledLoss(  # pylint: disable=protected-access
        tf.keras.losses.MeanSquaredError(reduction="sum"), lambda: scales)
    y_true, y_pred = tf.zeros((4, 1)), tf.reshape(tf.sqrt(PER_EXAMPLE), (4, 1))
    np.testing.assert_allclose(float(summed(y_true, y_pred)), 12 * 6, rtol=1e-6)



class _InBatchLoss(tf.keras.losses.Loss):
    """A loss giving one scalar, ``reduce`` of the per-example losses of in-batch negatives: each row's label is its
    own position among the batch's candidates (one logit column each)."""

    def __init__(self, reduce):
        super().__init__()
        self.reduce = reduce

    def call(self, y_true, y_pred):
        del y_true
        labels = tf.range(tf.shape(y_pred)[0])
        return self.reduce(tf.keras.losses.sparse_categorical_crossentropy(labels, y_pred, from_logits=True))


@pytest.mark.parametrize("rows", [None, 4], ids=["unknown_batch", "static_batch"])
def test_a_loss_function_giving_one_scalar_of_rows_that_meet_is_told_from_its_per_example_values(rows):
    # Told a sum or a mean from the per-example losses repeated twice. Before, the whole function ran on the batch
    # repeated twice, 8 labels against 4 columns: "Received a label value of 7 which is outside the valid range".
    # The mean is left as it is, the sum multiplied by the 2 workers (as reduction="sum" is).
    scales = keras_losses.LossScales(2, None, lambda count: count)
    logits = tf.constant(np.random.default_rng(3).normal(size=(4, 4)), tf.float32)
    per_example = tf.keras.losses.sparse_categorical_crossentropy(tf.range(4), logits, from_logits=True)
    for reduce, factor in ((tf.reduce_mean, 1.0), (tf.reduce_sum, 2.0)):
        scaled = keras_losses._ScaledLoss(_InBatchLoss(reduce), lambda: scales)  # pylint: disable=protected-access
        np.testing.assert_allclose(float(_traced(scaled, rows)(tf.zeros([4]), logits)),
                                   factor * float(reduce(per_example)), rtol=1e-6, err_msg=reduce.__name__)


@pytest.mark.parametrize("rows", [None, 4], ids=["unknown_batch", "static_batch"])
def test_a_mean_over_the_rows_of_a_static_batch_as_wide_as_it_stays_a_mean(rows):
    # The rows' mean has the static batch's size (4 columns): it would be taken for rows, and its sum for a sum over
    # the batch. With a batch of static size such a tensor makes the whole function run on the doubled batch.
    scales = keras_losses.LossScales(2, None, lambda count: count)
    columns_mean = tf.keras.losses.Loss()
    columns_mean.call = lambda y_true, y_pred: tf.reduce_sum(tf.reduce_mean(y_pred, axis=0))
    scaled = keras_losses._ScaledLoss(columns_mean, lambda: scales)  # pylint: disable=protected-access
    y_pred = tf.reshape(tf.range(16, dtype=tf.float32), [4, 4])
    np.testing.assert_allclose(float(_traced(scaled, rows)(tf.zeros([4]), y_pred)), 30.0, rtol=1e-6)


def _traced(scaled, rows):
    """``scaled(y_true, y_pred)`` traced for a batch of ``rows`` rows (None: unknown) of 4 columns."""
    return tf.function(scaled, input_signature=[tf.TensorSpec([rows], tf.float32),
                                                tf.TensorSpec([rows, 4], tf.float32)])

def test_a_masked_loss_under_micro_batches_is_refused():
    masked = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0, name="masked_xent")
    labels, logits = tf.constant([0, 1, 2, 1]), tf.zeros((4, 3))
    one_update = keras_losses._ScaledLoss(  # pylint: disable=protected-access
        masked, lambda: keras_losses.LossScales(2, None, lambda count: 2 * count))
    np.testing.assert_allclose(float(one_update(labels, logits)), float(masked(labels, logits)), rtol=1e-6)
    accumulated = keras_losses._ScaledLoss(  # pylint: disable=protected-access
        masked, lambda: keras_losses.LossScales(1, None, lambda count: count, micro_batches=2))
    with pytest.raises(ValueError, match=r"A masked loss \(masked_xent\) under backward_passes_per_step=2 is not "
                                         r"supported.* Received: a loss averaged under a mask"):
        accumulated(labels, logits)


@pytest.mark.multiprocess
def test_summed_losses_under_gradient_accumulation_match_one_plain_process(tmp_path):
    ref, got, run = testing.reference_and_job(PROGRAM, tmp_path)
    assert run.returncode == 0, run.report()
    for name in ("mean", "sum", "none", "scalar", "average"):
        a, b = np.load(os.path.join(ref, f"{name}.npz")), np.load(os.path.join(got, f"{name}.npz"))
        assert a.files == b.files, name
        # A train_step's own logged loss is its last micro-batch's, not the update's: weights only there.
        keys = a.files[:-1] if name == "average" else a.files
        for key in keys:
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-6, err_msg=f"{name}: {key}")
