"""The Horovod side: the one place where gradients of replicated variables are averaged across workers."""

import horovod.tensorflow as hvd
import tensorflow as tf
from absl import logging

_warned = set()


def _dense(grad, variable):
    if isinstance(grad, tf.IndexedSlices):
        if variable.name not in _warned:
            _warned.add(variable.name)
            logging.warning(
                "Replicated variable %s received a sparse gradient; it is densified and allreduced. To send only "
                "touched rows, place it on a parameter server: placement={%r: 'ps'}.", variable.name,
                variable.name.split(":")[0])
        return tf.convert_to_tensor(grad)
    return grad


def average_gradients(grads_and_vars, num_workers, control_inputs=()):
    """Averages dense gradients across workers with one fused (grouped) allreduce.

    Args:
      grads_and_vars: list of (gradient, replicated variable); gradients may be IndexedSlices (densified).
      num_workers: Horovod size.
      control_inputs: ops that must finish before the allreduce starts (it then also acts as a barrier
        ordering them before every worker's next step).

    Returns:
      List of (averaged gradient, variable), in the same order.
    """
    grads = [_dense(g, v) for g, v in grads_and_vars]
    variables = [v for _, v in grads_and_vars]
    with tf.control_dependencies(list(control_inputs)):
        if num_workers == 1 or not grads:
            grads = [tf.identity(g) for g in grads]
        else:
            grads = hvd.grouped_allreduce(grads, op=hvd.Average)
    return list(zip(grads, variables))


def barrier(num_workers, control_inputs=()):
    """Returns a tensor that is ready only when every worker has passed this point and ``control_inputs`` ran."""
    with tf.control_dependencies(list(control_inputs)):
        token = tf.constant(1.0)
        if num_workers == 1:
            return tf.identity(token)
        return hvd.allreduce(token, op=hvd.Sum, name="kp_barrier")
