"""Asynchronous PS updates (``sync=False``): each worker applies its own gradient on the PS as soon as it has it.

Each worker deduplicates its rows and applies them with its optimizer clone, whose slot variables are shared by
all workers (``clones.py``); nothing waits for other workers. The push counter counts the updates each variable
received.
"""

import tensorflow as tf

from kparallax.step import local_aggregation
from kparallax.step import ps_sync


class AsyncPs:
    """Builds the asynchronous PS path of a step.

    Args:
      registry: the strategy's ``Registry``.
      clones: the model's ``Clones`` (created with shared slots).
    """

    def __init__(self, registry, clones):
        self._registry = registry
        self._clones = clones

    @tf.autograph.experimental.do_not_convert
    def build(self, grads_and_vars):
        tokens, sent = [], []
        for grad, variable in grads_and_vars:
            if isinstance(grad, tf.IndexedSlices):
                ids, rows = local_aggregation.dedup(grad.indices, grad.values)
                grad = tf.IndexedSlices(rows, ids, dense_shape=tf.constant(variable.shape.as_list(), tf.int64))
                sent.append(ps_sync.nbytes([rows, ids]))
                first = ids[:1]
            else:
                sent.append(ps_sync.nbytes([grad]))
                first = None
            with tf.device(variable.device):
                self._clones.get(variable).apply_gradients([(grad, variable)])
                check = (variable.sparse_read(first) if first is not None
                         else tf.reshape(variable.read_value(), [-1])[:1])
                with tf.control_dependencies([tf.reduce_sum(check)]):
                    counter = self._registry.helper(variable, ps_sync.PUSHES, [], tf.int64)
                    tokens.append(ps_sync.count(counter))
        return ps_sync.PsStep([], tokens, tf.add_n(sent) if sent else tf.constant(0, tf.int64))
