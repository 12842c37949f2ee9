"""Losses in kparallax's training step (step/global_losses.py, _compat/keras_losses.py): summed compiled losses
count the workers and micro-batches, masked means weigh this worker's valid count over the workers', a loss giving
one scalar is left as it is (a mean of the worker's batch, by contract), and a masked loss under micro-batches is
refused. Under backward_passes_per_step=2, summed losses (reduction "sum" and "none") and a train_step's
compute_average_loss train as one process on the update's 64 rows."""

import os

import numpy as np
import pytest
import tensorflow as tf

from kparallax import testing
from kparallax._compat import keras_losses

PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "accumulated_losses.py")

PER_EXAMPLE = tf.constant([1.0, 2.0, 3.0, 6.0])  # sum 12, mean 3


def _scaled(loss, workers=2, micro_batches=1, over_workers=lambda count: count):
    scales = keras_losses.LossScales(workers, None, over_workers, micro_batches=micro_batches)
    return keras_losses._ScaledLoss(loss, lambda: scales)  # pylint: disable=protected-access


def test_summed_losses_count_the_workers_and_the_micro_batches():
    y_true, y_pred = tf.zeros((4, 1)), tf.reshape(tf.sqrt(PER_EXAMPLE), (4, 1))
    summed = _scaled(tf.keras.losses.MeanSquaredError(reduction="sum"), micro_batches=3)
    np.testing.assert_allclose(float(summed(y_true, y_pred)), 12 * 6, rtol=1e-6)
    averaged = _scaled(tf.keras.losses.MeanSquaredError(), micro_batches=3)
    np.testing.assert_allclose(float(averaged(y_true, y_pred)), 3.0, rtol=1e-6)
    # reduction "none": Keras logs the per-example values' mean; the gradient of their sum counts the 2 workers.
    per_example = _scaled(tf.keras.losses.MeanSquaredError(reduction="none"))
    with tf.GradientTape() as tape:
        tape.watch(y_pred)
        value = per_example(y_true, y_pred)
    np.testing.assert_allclose(value.numpy(), PER_EXAMPLE.numpy(), rtol=1e-6)
    np.testing.assert_allclose(tape.gradient(value, y_pred).numpy()[:, 0], 2 * 2 * y_pred.numpy()[:, 0], rtol=1e-6)


def test_a_masked_mean_weighs_this_worker_s_valid_count_over_the_workers():
    # 3 valid labels here, 9 over the 2 workers: one process divides the global sum by 9, this worker's mean by 3.
    masked = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)
    labels, logits = tf.constant([0, 1, 2, 1]), tf.constant(np.random.default_rng(2).normal(size=(4, 3)), tf.float32)
    scaled = _scaled(masked, over_workers=lambda count: count * 3)
    np.testing.assert_allclose(float(scaled(labels, logits)), float(masked(labels, logits)) * 2 * 3 / 9, rtol=1e-6)


def test_a_loss_function_giving_one_scalar_is_left_as_it_is():
    scalar = tf.keras.losses.Loss()
    scalar.call = lambda y_true, y_pred: tf.reduce_sum(y_pred)
    y_pred = tf.reshape(PER_EXAMPLE, (4, 1))
    np.testing.assert_allclose(float(_scaled(scalar)(tf.zeros((4, 1)), y_pred)), 12.0, rtol=1e-6)


def test_a_masked_loss_under_micro_batches_is_refused():
    masked = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0, name="masked_xent")
    labels, logits = tf.constant([0, 1, 2, 1]), tf.zeros((4, 3))
    one_update = _scaled(masked, over_workers=lambda count: 2 * count)
    np.testing.assert_allclose(float(one_update(labels, logits)), float(masked(labels, logits)), rtol=1e-6)
    accumulated = _scaled(masked, workers=1, micro_batches=2)
    with pytest.raises(ValueError, match=r"A masked loss \(masked_xent\) under backward_passes_per_step=2 is not "
                                         r"supported.* Received: a loss averaged under a mask"):
        accumulated(labels, logits)


@pytest.mark.multiprocess
def test_summed_losses_under_gradient_accumulation_match_one_plain_process(tmp_path):
    ref, got, run = testing.reference_and_job(PROGRAM, tmp_path)
    assert run.returncode == 0, run.report()
    for name in ("mean", "sum", "none", "average"):
        a, b = np.load(os.path.join(ref, f"{name}.npz")), np.load(os.path.join(got, f"{name}.npz"))
        assert a.files == b.files, name
        # A train_step's own logged loss is its last micro-batch's, not the update's: weights only there.
        keys = a.files[:-1] if name == "average" else a.files
        for key in keys:
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-6, err_msg=f"{name}: {key}")
