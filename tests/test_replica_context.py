"""tf.distribute's replica context in kparallax's training step (``step/replica_context.py``): TensorFlow's default
context (one replica), whose ``all_gather`` and ``all_reduce`` return this worker's own value. The swaps act only
while active, and the ``all_reduce`` one only on a user's calls (Keras' optimizers and synchronized BatchNormalization
call it themselves); a train_step written for tf.distribute that counts the global batch's valid tokens with
``all_reduce`` is refused on both workers of a job, and runs in a plain process."""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from kparallax import testing
from kparallax._compat import tf as tf_compat

PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "tf_distribute_step.py")


def test_the_default_replica_contexts_all_gather_is_swapped_only_while_active():
    value = tf.constant([[1.0], [2.0]])
    calls = []
    with tf_compat.default_replica_gather(lambda v, axis: calls.append(axis) or v * 10.0):
        swapped = tf.distribute.get_replica_context().all_gather(value, axis=0)
    np.testing.assert_array_equal(swapped.numpy(), [[10.0], [20.0]])
    assert calls == [0]
    np.testing.assert_array_equal(tf.distribute.get_replica_context().all_gather(value, axis=0).numpy(),
                                  value.numpy())


def test_the_default_replica_contexts_all_reduce_is_swapped_for_a_users_calls_only():
    calls = []

    def reduce(reduce_op, value):
        calls.append(str(reduce_op))
        return value * 10.0

    @tf.function
    def users_step(value):  # traced with autograph, as Keras traces a train_step
        return tf.distribute.get_replica_context().all_reduce("sum", value)

    value = tf.constant([1.0, 2.0])
    with tf_compat.default_replica_reduce(reduce):
        np.testing.assert_array_equal(tf.distribute.get_replica_context().all_reduce("sum", value).numpy(),
                                      [10.0, 20.0])
        np.testing.assert_array_equal(users_step(value).numpy(), [10.0, 20.0])
        assert len(calls) == 2, calls
        # Keras' own calls: a legacy optimizer aggregates its gradients, synchronized BatchNormalization sums its
        # statistics, both with the default context's all_reduce (identities: one replica).
        variable = tf.Variable([1.0, 1.0])
        tf.keras.optimizers.legacy.SGD(1.0).apply_gradients([(tf.constant([0.5, 0.25]), variable)])
        normalization = tf.keras.layers.BatchNormalization(synchronized=True)
        normalized = tf.function(lambda x: normalization(x, training=True))(tf.constant([[1.0], [3.0]]))
        assert len(calls) == 2, calls
    np.testing.assert_array_equal(variable.numpy(), [0.5, 0.75])
    np.testing.assert_allclose(normalized.numpy(), [[-1.0], [1.0]], atol=1e-2)
    np.testing.assert_array_equal(tf.distribute.get_replica_context().all_reduce("sum", value).numpy(),
                                  value.numpy())
    assert len(calls) == 2, calls


@pytest.mark.multiprocess
def test_a_tf_distribute_replica_reduce_in_the_training_step_is_refused(tmp_path):
    ref, got, run = testing.reference_and_job(PROGRAM, tmp_path)
    assert os.path.exists(os.path.join(ref, "model.npz"))  # a plain process trains it
    assert run.returncode != 0, run.report()
    for name in ("worker-0.log", "worker-1.log"):
        log = run.logs()[name]
        assert "tf.distribute.get_replica_context().all_reduce in kparallax's training step reduces nothing" in log, (
            run.report())
        assert "Received: all_reduce(SUM) of a value of shape () in the training step of a job of 2 workers" in log, (
            run.report())
    assert not os.path.exists(os.path.join(got, "model.npz"))
