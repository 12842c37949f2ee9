"""tf.nn.compute_average_loss in kparallax's training step of several workers (step/global_losses.py): without a
global batch size the worker's mean (as TensorFlow computes it), with one scaled as a summed loss (the workers, over
this worker's share), refused under backward_passes_per_step > 1; TensorFlow's own outside the step and in compiled
loss functions (which scale sums themselves). The training it gives is compared with one process in
test_keras_programs.py (tf_distribute_average_loss, compiled_average_loss)."""

import numpy as np
import pytest
import tensorflow as tf

from kparallax._compat import keras_losses
from kparallax.step import global_losses

PER_EXAMPLE = tf.constant([1.0, 2.0, 3.0, 6.0])  # sum 12, mean 3


def test_outside_the_step_and_on_one_worker_it_is_tensorflows():
    own = tf.nn.compute_average_loss
    with global_losses.workers(1):
        assert tf.nn.compute_average_loss is own
    with global_losses.workers(2):
        assert tf.nn.compute_average_loss is not own
        assert tf.compat.v2.nn.compute_average_loss is tf.nn.compute_average_loss
    assert tf.nn.compute_average_loss is own and tf.compat.v2.nn.compute_average_loss is own
    assert float(tf.nn.compute_average_loss(PER_EXAMPLE, global_batch_size=8)) == 1.5


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


def test_a_global_batch_size_under_micro_batches_is_refused():
    with global_losses.workers(2, micro_batches=2):
        assert float(tf.nn.compute_average_loss(PER_EXAMPLE)) == 3.0
        with pytest.raises(ValueError, match=r"tf.nn.compute_average_loss with global_batch_size in a step "
                                             r"accumulating backward_passes_per_step=2 micro-batches is not supported"
                                             r".* Received: global_batch_size=8 in a job of 2 workers"):
            tf.nn.compute_average_loss(PER_EXAMPLE, global_batch_size=8)
