"""Horovod (0.28.1, Gloo) inside tf.function steps.

Workarounds:
- Keep-alive: TensorFlow's graph optimizations prune a Horovod collective whose output feeds only control edges
  (seen with TF 2.15.1 + Horovod 0.28.1). A worker that skips a collective the others run deadlocks them, so every
  collective output kparallax does not otherwise use is read by a stateful op (``KeepAlive.consume``).
- Explicit names: Horovod matches tensors across workers by name, and auto-generated names differ when the
  workers' graphs differ (the chief's PS update adds ops); every collective in a step gets a fixed name.
- Dynamic process sets: local aggregation adds a per-host process set after start-up, which needs
  ``hvd.init(process_sets="dynamic")``.
"""

import horovod.tensorflow as hvd
import tensorflow as tf


def init():
    hvd.init(process_sets="dynamic")


class KeepAlive:
    """A worker-local sink variable: ``consume(tensors)`` returns a stateful op reading one element of each."""

    def __init__(self):
        self._sink = None

    @tf.autograph.experimental.do_not_convert
    def consume(self, tensors):
        if self._sink is None:
            with tf.init_scope():
                self._sink = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="kp_collectives_seen")
        firsts = [tf.reduce_sum(tf.cast(tf.reshape(t, [-1])[:1], tf.float64)) for t in tensors]
        return self._sink.assign_add(tf.add_n(firsts) if firsts else tf.constant(0.0, tf.float64))
