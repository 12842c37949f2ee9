"""Losses weighted so that the workers' average gradient is one process's on the global batch.

The step averages gradients over the workers. That is one process's gradient for a loss averaged over the batch
(Keras' default) when every worker's batch has the same size and no mask applies, and for terms that are the same on
every worker (weight regularizers) always. Three cases need more, and get it while kparallax's synchronous step is
traced (``workers``):

* Losses that sum over the batch (``reduction="sum"`` or ``"none"``): one process differentiates (and, for
  ``"sum"``, logs) the sum over its whole batch, each worker sums over its own part, and the average would divide
  that term by the worker count. Such a compiled loss is multiplied by the worker count (value and gradient; for
  ``"none"``, whose logged value is a mean of per-example values, the gradient only), as tf.distribute's Keras does
  in its own way, and by ``backward_passes_per_step``, whose micro-batches' gradients the step averages too.
* Batches that may differ in size (a dataset's last, partial batch; ``train_on_batch`` with each worker's own
  batch): one process weights every example alike, the plain average would weight each worker's mean alike. Each
  worker's whole gradient is multiplied by its share of the global batch, ``num_workers * rows / rows over all
  workers`` (one scalar allreduce per step; the routing optimizer applies ``gradient_share()`` before the exchange).
  That is exact for every term averaged over the worker's batch, whoever computes it (compiled losses, a custom
  ``train_step``'s own loss, ``add_loss`` means, activity regularizers), and leaves terms that are the same on every
  worker unchanged (the shares average to 1). Backprop through BatchNormalization's global statistics weights each
  worker's part the same way (``batch_norm.py``). Compiled summed and masked losses take their factors over that
  share; the logged values of other scalars are weighted by it too (``logs.over_workers``).
* Losses averaged under a mask (a ``mask_zero`` sequence, a sparse cross-entropy's ``ignore_class``): Keras divides
  by the count of valid elements, which differs from worker to worker even when the batches do not. The gradient
  is multiplied by ``num_workers * valid / valid over all workers`` (one scalar allreduce per such loss and step),
  and the logged value so that Keras' rows-weighted mean is the global batch's. Under ``backward_passes_per_step >
  1`` refused: one process divides by the whole update's count, known only after its last micro-batch.

A loss or metric function of a user's own that returns one scalar for the batch is told to be a sum or a mean over
it (its value on the batch repeated twice doubles or stays, ``_compat.keras_losses._batch_scalar_sums``): a summed loss is
scaled as ``reduction="sum"`` is, and such a metric's mean is updated so that its states summed over the workers are
one process's (``_compat.keras_losses.weigh_compiled_metrics``). One that takes statistics of the batch through a
nonlinear function (a root mean squared error, a mean over a mask written by hand) runs with the global batch's sums
and means instead (``batch_statistics.py``), and is one process's value on every worker.

``tf.nn.compute_average_loss`` (a ``train_step`` written for tf.distribute) with a ``global_batch_size`` divides the
worker's sum by it where one process divides the whole batch's: it is scaled as a summed loss (``_average_loss``).
"""

import contextlib
import threading

import tensorflow as tf

from kparallax._compat import keras_losses
from kparallax._compat import tf as tf_compat
from kparallax.step import batch_statistics
from kparallax.step import collectives

_ACTIVE = threading.local()


def install(model):
    """Scales ``model``'s compiled losses, and weighs its compiled metric functions that give one scalar for the
    batch, inside ``workers``; leaves them alone elsewhere (evaluate)."""
    keras_losses.scale_compiled_losses(model, lambda: getattr(_ACTIVE, "scales", None))
    keras_losses.weigh_compiled_metrics(model, lambda: getattr(_ACTIVE, "scales", None))


def batch_share(data, num_workers):
    """``num_workers * rows / rows over all workers`` for this worker's batch ``data`` (a float64 scalar, cast to
    the dtype of what it weighs: a float64 model's gradients keep their precision; a collective)."""
    rows = tf.cast(keras_losses.batch_rows(data), tf.float64)
    return num_workers * rows / collectives.sum_over_workers(rows, num_workers, name="kp_batch_rows")


def gradient_share():
    """This worker's share of the global batch in the step being traced (a float64 scalar tensor), by which its
    gradients are multiplied before the exchange; None when the workers' batches have the same size."""
    scales = getattr(_ACTIVE, "scales", None)
    return None if scales is None else scales.rows_share


def weighted(grads_and_vars, share):
    """Each gradient of ``grads_and_vars`` times ``share`` (``gradient_share()``: this worker's share of the global
    batch, when batches may differ in size), or the list unchanged when ``share`` is None."""
    if share is None:
        return list(grads_and_vars)
    out = []
    for grad, var in grads_and_vars:
        if isinstance(grad, tf.IndexedSlices):
            grad = tf.IndexedSlices(grad.values * tf.cast(share, grad.values.dtype), grad.indices, grad.dense_shape)
        elif grad is not None:
            grad = grad * tf.cast(share, grad.dtype)
        out.append((grad, var))
    return out


def _average_loss(scales):
    """A wrapper of ``tf.nn.compute_average_loss`` for a training step of several workers or micro-batches. Without
    ``global_batch_size`` it is the worker's mean (the step's replica context is TensorFlow's default, one replica),
    which the step averages as one process's mean. With one, the micro-batch's sum divided by it, where one process
    divides the whole global batch's sum: multiplied as a summed loss is (``keras_losses.summed_factor``)."""
    def wrap(original):
        def compute_average_loss(per_example_loss, sample_weight=None, global_batch_size=None):
            value = original(per_example_loss, sample_weight=sample_weight, global_batch_size=global_batch_size)
            if global_batch_size is None:
                return value
            return value * keras_losses.summed_factor(scales, value.dtype)
        return compute_average_loss
    return wrap


@contextlib.contextmanager
def workers(num_workers, rows_share=None, micro_batches=1):
    """While one training step is traced: summed compiled losses count ``num_workers`` workers, masked ones weight
    this worker's part by its valid count, and with ``rows_share`` (from ``batch_share``, when batches may differ in
    size) the worker's gradients are weighted by its share of the global batch (``gradient_share``).
    ``micro_batches``: the step's backward_passes_per_step (summed losses count them too; masked ones are refused
    under more than one). With several workers or micro-batches ``tf.nn.compute_average_loss`` with a
    ``global_batch_size`` (a tf.distribute program's loss) is scaled as a summed loss (``_average_loss``)."""
    previous = getattr(_ACTIVE, "scales", None)
    scales = keras_losses.LossScales(
        num_workers, rows_share,
        lambda count: collectives.sum_over_workers(count, num_workers, name="kp_valid_count"), micro_batches,
        batch_statistics.globalized if num_workers > 1 and micro_batches == 1 else None)
    _ACTIVE.scales = scales
    averaged = (tf_compat.average_loss_replaced(_average_loss(scales)) if num_workers * micro_batches > 1
                else contextlib.nullcontext())
    try:
        with averaged:
            yield
    finally:
        _ACTIVE.scales = previous
