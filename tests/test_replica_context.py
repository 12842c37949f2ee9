"""tf.distribute's replica context in kparallax's training step (``step/replica_context.py``): TensorFlow's default
context (one replica), whose ``all_gather`` and ``all_reduce`` return this worker's own value and whose
``num_replicas_in_sync`` is 1, and the default strategy's gather and reductions. The swaps act only while active,
and all but ``all_gather``'s only on a user's calls (Keras' optimizers and synchronized BatchNormalization call
``all_reduce`` themselves, Keras and ``tf.nn.compute_average_loss`` read the count); a train_step written for
tf.distribute that counts the global batch's valid tokens with ``all_reduce``, with the strategy's ``reduce`` in a
``merge_call``, or as its own times ``num_replicas_in_sync``, is refused on both workers of a job, and runs in a
plain process."""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from kparallax import testing
from kparallax._compat import tf as tf_compat

PROGRAM = os.path.join(os.path.dirname(__file__), "programs", "tf_distribute_step.py")


def test_the_default_gathers_are_swapped_only_while_active_and_the_strategys_for_a_users_calls_only():
    value = tf.constant([[1.0], [2.0]])
    calls = []

    def gather(where, v, axis):
        calls.append((where, axis))
        return v * 10.0

    @tf.function
    def users_step(v):  # traced with autograph, as Keras traces a train_step
        return tf.distribute.get_replica_context().merge_call(lambda strategy, x: strategy.gather(x, axis=0),
                                                              args=(v,))

    other = tf.distribute.OneDeviceStrategy("/cpu:0")
    with tf_compat.default_gathers(gather):
        swapped = tf.distribute.get_replica_context().all_gather(value, axis=0)
        np.testing.assert_array_equal(users_step(value).numpy(), [[10.0], [20.0]])
        np.testing.assert_array_equal(other.gather(other.run(lambda: value), axis=0).numpy(), value.numpy())
    np.testing.assert_array_equal(swapped.numpy(), [[10.0], [20.0]])
    assert calls == [("tf.distribute.get_replica_context().all_gather", 0), ("tf.distribute.get_strategy().gather", 0)]
    np.testing.assert_array_equal(tf.distribute.get_replica_context().all_gather(value, axis=0).numpy(),
                                  value.numpy())
    np.testing.assert_array_equal(tf.distribute.get_strategy().gather(value, axis=0).numpy(), value.numpy())
    assert len(calls) == 2, calls


def test_the_default_strategys_reductions_are_swapped_for_a_users_calls_only():
    calls = []

    def reduce(where, reduce_op, value):
        calls.append((where, str(getattr(reduce_op, "value", reduce_op)).upper()))
        return tf.nest.map_structure(lambda v: v * 10.0, value)

    @tf.function
    def users_step(value):  # traced with autograph, as Keras traces a train_step
        context = tf.distribute.get_replica_context()
        merged = context.merge_call(lambda strategy, v: strategy.reduce("sum", v, axis=None), args=(value,))
        return context.all_reduce("sum", value) + merged

    value = tf.constant([1.0, 2.0])
    with tf_compat.default_reductions(reduce):
        np.testing.assert_array_equal(tf.distribute.get_replica_context().all_reduce("sum", value).numpy(),
                                      [10.0, 20.0])
        np.testing.assert_array_equal(users_step(value).numpy(), [20.0, 40.0])
        strategy = tf.distribute.get_strategy()
        np.testing.assert_array_equal(strategy.extended.reduce_to("mean", value, "/cpu:0").numpy(), [10.0, 20.0])
        pairs = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, [(value, "/cpu:0")])
        np.testing.assert_array_equal(pairs[0].numpy(), [10.0, 20.0])
        context, strategy = "tf.distribute.get_replica_context()", "tf.distribute.get_strategy()"
        assert calls == [(f"{context}.all_reduce", "SUM"), (f"{strategy}.reduce", "SUM"),
                         (f"{context}.all_reduce", "SUM"), (f"{strategy}.extended.reduce_to", "MEAN"),
                         (f"{strategy}.extended.batch_reduce_to", "SUM")], calls
        # Keras' own calls: a legacy optimizer aggregates its gradients, synchronized BatchNormalization sums its
        # statistics, both with the default context's all_reduce (identities: one replica); another strategy's.
        variable = tf.Variable([1.0, 1.0])
        tf.keras.optimizers.legacy.SGD(1.0).apply_gradients([(tf.constant([0.5, 0.25]), variable)])
        normalization = tf.keras.layers.BatchNormalization(synchronized=True)
        normalized = tf.function(lambda x: normalization(x, training=True))(tf.constant([[1.0], [3.0]]))
        other = tf.distribute.OneDeviceStrategy("/cpu:0")
        np.testing.assert_array_equal(other.reduce("sum", value, axis=None).numpy(), value.numpy())
        assert len(calls) == 5, calls
    np.testing.assert_array_equal(variable.numpy(), [0.5, 0.75])
    np.testing.assert_allclose(normalized.numpy(), [[-1.0], [1.0]], atol=1e-2)
    np.testing.assert_array_equal(tf.distribute.get_replica_context().all_reduce("sum", value).numpy(),
                                  value.numpy())
    np.testing.assert_array_equal(tf.distribute.get_strategy().reduce("sum", value, axis=None).numpy(),
                                  value.numpy())
    assert len(calls) == 5, calls


def test_the_default_replica_count_is_swapped_for_a_users_reads_only():
    reads = []

    def count(where):
        reads.append(where)
        return 7

    @tf.function
    def users_step(value):  # traced with autograph, as Keras traces a train_step
        return value * tf.distribute.get_replica_context().num_replicas_in_sync

    value = tf.constant([1.0, 3.0])
    other = tf.distribute.OneDeviceStrategy("/cpu:0")
    with tf_compat.default_replica_count(count):
        assert tf.distribute.get_replica_context().num_replicas_in_sync == 7
        assert tf.distribute.get_strategy().num_replicas_in_sync == 7
        np.testing.assert_array_equal(users_step(value).numpy(), [7.0, 21.0])
        assert reads == ["tf.distribute.get_replica_context()", "tf.distribute.get_strategy()",
                         "tf.distribute.get_replica_context()"], reads
        # TensorFlow's and Keras' own reads: the mean over the rows (one replica), Keras' loss scaling; another
        # strategy's count.
        np.testing.assert_allclose(tf.nn.compute_average_loss(value).numpy(), 2.0)
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)])
        model.compile(loss="mse", optimizer=tf.keras.optimizers.SGD(0.0))
        logs = model.train_on_batch(np.ones((2, 1), np.float32), np.zeros((2, 1), np.float32), return_dict=True)
        assert other.num_replicas_in_sync == 1
        assert len(reads) == 3, reads
    np.testing.assert_allclose(logs["loss"], 1.0)
    assert tf.distribute.get_replica_context().num_replicas_in_sync == 1
    assert tf.distribute.get_strategy().num_replicas_in_sync == 1
    assert len(reads) == 3, reads


class _CountedLoss(tf.keras.Model):
    """A regression whose train_step divides its mean loss by the default strategy's replica count, as a program
    written for tf.distribute's summed gradients does."""

    def __init__(self):
        super().__init__()
        self.out = tf.keras.layers.Dense(1, kernel_initializer="ones")

    def call(self, x):
        return self.out(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x) - y)) / tf.distribute.get_strategy().num_replicas_in_sync
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables))
        return {"loss": loss}


def _counted_loss_model(micro_batches):
    import kparallax as kp  # pylint: disable=import-outside-toplevel
    with kp.HybridStrategy(kp.Cluster.local(), backward_passes_per_step=micro_batches).scope():
        model = _CountedLoss()
        model.compile(optimizer=tf.keras.optimizers.SGD(0.0))
    return model


def test_the_replica_count_is_refused_on_one_worker_with_micro_batches_only():
    # One worker (Horovod of size 1, no PS): one micro-batch reads 1 (the step is one process's); two micro-batches,
    # whose gradients the step averages, refuse it.
    x, y = np.ones((8, 2), np.float32), np.zeros((8, 1), np.float32)
    np.testing.assert_allclose(_counted_loss_model(1).fit(x, y, batch_size=4, verbose=0).history["loss"], [4.0])
    with pytest.raises(ValueError, match=r"num_replicas_in_sync in kparallax's training step has no value that "
                                         r"trains as one process.* Received: tf.distribute.get_strategy\(\)."
                                         r"num_replicas_in_sync read in the training step of a job of 1 worker "
                                         r"with backward_passes_per_step=2\. "):
        _counted_loss_model(2).fit(x, y, batch_size=4, verbose=0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("normalizer, message", [
    ("all_reduce", ["tf.distribute.get_replica_context().all_reduce in kparallax's training step reduces nothing",
                    "Received: all_reduce(SUM) of a value of shape () in the training step of a job of 2 workers"]),
    ("merge_call", ["tf.distribute.get_strategy().reduce in kparallax's training step reduces nothing",
                    "Received: reduce(SUM) of a value of shape () in the training step of a job of 2 workers"]),
    ("replica_count", ["num_replicas_in_sync in kparallax's training step has no value that trains as one process",
                       "Received: tf.distribute.get_replica_context().num_replicas_in_sync read in the training step "
                       "of a job of 2 workers"]),
])
def test_a_tf_distribute_normalizer_in_the_training_step_is_refused(tmp_path, normalizer, message):
    ref, got, run = testing.reference_and_job(PROGRAM, tmp_path, args=(normalizer,))
    assert os.path.exists(os.path.join(ref, "model.npz"))  # a plain process trains it
    run.assert_refused(message)
    assert not os.path.exists(os.path.join(got, "model.npz"))
