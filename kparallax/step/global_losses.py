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

That is the contract of ``tf.distribute`` and Horovod, made exact for the losses Keras computes. What a step
computes itself follows each worker's batch: a loss function of the user's that returns one scalar is a mean of
the worker's batch; ``tf.nn.compute_average_loss`` is the worker's mean when called without
``global_batch_size`` (with one, it divides by that number, and the step still averages over the workers).
"""

import contextlib
import threading

import tensorflow as tf

from kparallax._compat import keras_losses
from kparallax.step import collectives

_ACTIVE = threading.local()


def install(model):
    """Scales ``model``'s compiled losses inside ``workers``; leaves them alone elsewhere (evaluate)."""
    keras_losses.scale_compiled_losses(model, lambda: getattr(_ACTIVE, "scales", None))


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


@contextlib.contextmanager
def workers(num_workers, rows_share=None, micro_batches=1):
    """While one training step is traced: summed compiled losses count ``num_workers`` workers, masked ones weight
    this worker's part by its valid count, and with ``rows_share`` (from ``batch_share``, when batches may differ in
    size) the worker's gradients are weighted by its share of the global batch (``gradient_share``).
    ``micro_batches``: the step's backward_passes_per_step (summed losses count them too; masked ones are refused
    under more than one)."""
    previous = getattr(_ACTIVE, "scales", None)
    _ACTIVE.scales = keras_losses.LossScales(
        num_workers, rows_share,
        lambda count: collectives.sum_over_workers(count, num_workers, name="kp_valid_count"), micro_batches)
    try:
        yield
    finally:
        _ACTIVE.scales = previous
