"""Compiled losses scaled so that the workers' average gradient is one process's on the global batch.

The step averages gradients over the workers. That is one process's gradient for a loss averaged over the batch
(Keras' default) when every worker's batch has the same size, and for regularization losses always. Two cases need
more, and get it while kparallax's synchronous step is traced (``workers``):

* Losses that sum over the batch (``reduction="sum"`` or ``"none"``): one process differentiates (and, for
  ``"sum"``, logs) the sum over its whole batch, each worker sums over its own part, and the average would divide
  that term by the worker count. Such a term is multiplied by the worker count (value and gradient; for ``"none"``,
  whose logged value is a mean of per-example values, the gradient only), as tf.distribute's Keras does in its own
  way.
* Losses averaged over the batch, when the workers' batches may differ in size (a dataset's last, partial batch;
  ``train_on_batch`` with each worker's own batch): one process weights every example alike, the plain average
  would weight each worker's mean alike. Such a term's gradient is multiplied by the worker's share of the global
  batch, ``num_workers * rows / rows over all workers`` (one scalar allreduce per step); its logged value is left
  alone, since Keras' loss metric already weights each batch by its rows.
"""

import contextlib
import threading

import tensorflow as tf

from kparallax._compat import keras as keras_compat
from kparallax.step import collectives

_ACTIVE = threading.local()


def install(model):
    """Scales ``model``'s compiled losses inside ``workers``; leaves them alone elsewhere (evaluate)."""
    keras_compat.scale_compiled_losses(model, lambda: getattr(_ACTIVE, "scales", None))


def batch_share(data, num_workers):
    """``num_workers * rows / rows over all workers`` for this worker's batch ``data`` (a float32 scalar; a
    collective)."""
    rows = tf.cast(keras_compat.batch_rows(data), tf.float32)
    return num_workers * rows / collectives.sum_over_workers(rows, num_workers, name="kp_batch_rows")


@contextlib.contextmanager
def workers(num_workers, share=None):
    """While one training step is traced: summed losses count ``num_workers`` workers, and losses averaged over the
    batch have their gradient weighted by ``share`` (``batch_share``) when it is given."""
    previous = getattr(_ACTIVE, "scales", None)
    _ACTIVE.scales = keras_compat.LossScales(summed=num_workers, averaged=share)
    try:
        yield
    finally:
        _ACTIVE.scales = previous
