"""Gradient accumulation: k micro-batches per update, accumulated locally, communicated once.

Each call adds the micro-batch gradients to local variables on the worker: dense gradients into a variable of
the gradient's shape, sparse ones (``tf.IndexedSlices``) appended to growing id/value buffers (memory grows with
the rows touched, never with the table). Every k-th call the averaged gradients go through the normal step
(allreduce / PS) inside a ``tf.cond`` and the buffers are cleared, so the optimizer, its ``iterations`` and every
collective run once per k micro-batches, on every worker at the same micro-step.
"""

import tensorflow as tf


class GradientAccumulator:
    """Accumulates ``k`` micro-batches of gradients per update.

    Args:
      k: micro-batches per update (``backward_passes_per_step``).
    """

    def __init__(self, k):
        self._k = k
        self._slots = {}
        self._count = None

    @tf.autograph.experimental.do_not_convert
    def _slot(self, grad, variable):
        key = variable.ref()
        if key not in self._slots:
            name = variable.name.split(":")[0].replace("/", "_")
            with tf.init_scope():
                if isinstance(grad, tf.IndexedSlices):
                    row_shape = variable.shape[1:]
                    self._slots[key] = (
                        tf.Variable(tf.zeros([0], tf.int64), shape=tf.TensorShape([None]), trainable=False,
                                    name=f"kp_accum_ids_{name}"),
                        tf.Variable(tf.zeros([0] + row_shape.as_list(), grad.values.dtype),
                                    shape=tf.TensorShape([None]).concatenate(row_shape), trainable=False,
                                    name=f"kp_accum_rows_{name}"))
                else:
                    self._slots[key] = (tf.Variable(tf.zeros(variable.shape, grad.dtype), trainable=False,
                                                    name=f"kp_accum_{name}"),)
                if self._count is None:
                    self._count = tf.Variable(0, dtype=tf.int64, trainable=False, name="kp_micro_steps")
        return self._slots[key]

    @tf.autograph.experimental.do_not_convert
    def accumulate_then(self, grads_and_vars, apply_fn):
        """Adds ``grads_and_vars``; on every k-th call runs ``apply_fn(averaged grads_and_vars)``.

        Returns a boolean tensor: True on the micro-steps that applied an update.
        """
        adds = []
        for grad, variable in grads_and_vars:
            slot = self._slot(grad, variable)
            if isinstance(grad, tf.IndexedSlices):
                adds.append(slot[0].assign(tf.concat([slot[0], tf.cast(grad.indices, tf.int64)], 0)))
                adds.append(slot[1].assign(tf.concat([slot[1], grad.values], 0)))
            else:
                adds.append(slot[0].assign_add(grad))
        with tf.control_dependencies(adds):
            count = self._count.assign_add(1)

        def apply():
            averaged = []
            for grad, variable in grads_and_vars:
                slot = self._slots[variable.ref()]
                if isinstance(grad, tf.IndexedSlices):
                    values = slot[1].read_value() / tf.cast(self._k, grad.values.dtype)
                    averaged.append((tf.IndexedSlices(values, slot[0].read_value(),
                                                      tf.constant(variable.shape.as_list(), tf.int64)), variable))
                else:
                    averaged.append((slot[0].read_value() / tf.cast(self._k, grad.dtype), variable))
            result = [t.read_value() if isinstance(t, tf.Variable) else t
                      for t in tf.nest.flatten(apply_fn(averaged)) if t is not None]
            with tf.control_dependencies(result):
                resets = []
                for grad, variable in grads_and_vars:
                    for buffer in self._slots[variable.ref()]:
                        resets.append(buffer.assign(tf.zeros_like(buffer)) if not isinstance(grad, tf.IndexedSlices)
                                      else buffer.assign(buffer[:0]))
            with tf.control_dependencies(resets):
                return tf.constant(True)

        return tf.cond(tf.equal(count % self._k, 0), apply, lambda: tf.constant(False))
