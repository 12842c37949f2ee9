"""Horovod (0.28.1, Gloo) inside tf.function steps.

Workarounds:
- Keep-alive: TensorFlow's graph optimizations prune a Horovod collective whose output feeds only control edges
  (seen with TF 2.15.1 + Horovod 0.28.1). A worker that skips a collective the others run deadlocks them, so every
  collective output kparallax does not otherwise use is read by a stateful op (``KeepAlive.consume``).
- Explicit names: Horovod matches tensors across workers by name, and auto-generated names differ when the
  workers' graphs differ (with ``clipnorm``, the chief's update of dense PS gradients adds ops); every collective
  in a step gets a fixed name.
- Static process sets only: local aggregation's per-host process sets are registered at ``hvd.init``. With
  ``hvd.init(process_sets="dynamic")`` (what adding a set after start-up needs) Horovod 0.28.1's background loop
  runs one more global Gloo allgather on *every* cycle (``ProcessSetTable::InitializeRegisteredAndRemoveMarkedIfReady``
  in ``RunLoopOnce``), whether or not a set is ever added. Measured (``kparallax_bench.horovod_idle``): an idle
  worker burns 0.32-0.45 CPU-s per second with dynamic sets against 0.06-0.07 with static ones; on two saturated
  cores, kparallax-allreduce went from 0.88x to 1.03x Horovod on lm1b_small (README, Benchmarks).
"""

import horovod.tensorflow as hvd
import tensorflow as tf


def init(host_groups=()):
    """Initializes Horovod with one static process set per host that has 2 or more ranks but not all of them.

    Args:
      host_groups: the ranks of each host (lists partitioning all ranks); the same on every process.

    Returns:
      ``{rank: ProcessSet}`` for the ranks in those process sets.
    """
    size = sum(len(g) for g in host_groups)
    groups = [sorted(g) for g in host_groups if 1 < len(g) < size]
    sets = [hvd.ProcessSet(g) for g in groups]
    hvd.init(process_sets=sets or None)
    return {rank: s for s, g in zip(sets, groups) for rank in g}


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
