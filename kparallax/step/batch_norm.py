"""Batch normalization over the global batch: N workers x B normalize as one process x N*B.

In a synchronous step of several workers, every ``BatchNormalization`` layer in training takes its mean and
variance over all workers' batches: per layer call, one Horovod allreduce sums (per channel) the values, their
squares and their count. Gradients flow through it (Horovod's allreduce gradient is an allreduce), so backprop
through the statistics sums every worker's part, as one process's would. The moving statistics then move the same
way on every worker, and match one process's. Without it (``sync_batch_norm=False``: Horovod's and tf.distribute's
default), each worker normalizes its own batch, which one process on the global batch never does; layers built with
``synchronized=True`` still get global statistics then.

The values are shifted by the layer's moving mean before they are summed (the same on every worker), so that the
variance taken as E[x^2] - E[x]^2 does not lose float32 precision when the mean is large against the spread. On
Keras' fused path (images), the fused kernels do the per-worker work (``_compat/batch_norm.py``): one allreduce of
the per-channel moments forward, one of the per-channel gradient sums backward.
"""

import contextlib
import threading

import tensorflow as tf

from kparallax._compat import batch_norm as bn_compat
from kparallax.step import collectives
from kparallax.step import global_losses
from kparallax.step import rows_meet

_ACTIVE = threading.local()


def install():
    """Hooks Keras' BatchNormalization statistics once (they stay Keras' own outside ``global_statistics``)."""
    bn_compat.hook(_statistics, rows_meet.apart)  # each worker's own statistics on request are not refused


@contextlib.contextmanager
def global_statistics(num_workers, every_layer):
    """While tracing one training step: BatchNormalization layers in training use statistics over ``num_workers``
    workers; all of them if ``every_layer``, else only those built with ``synchronized=True``.

    When the workers' batches may differ in size, the step multiplies each worker's gradients by its share of the
    global batch (``global_losses.gradient_share``). Backprop through the statistics then sums each worker's part
    times its share and divides by this worker's, so that after that multiplication every worker's loss counts as
    its share of the global batch, through the statistics too."""
    previous = getattr(_ACTIVE, "state", None)
    _ACTIVE.state = (num_workers, every_layer)
    try:
        yield
    finally:
        _ACTIVE.state = previous


def check(model, num_workers, every_layer):
    """Refuses, at ``compile``, the BatchNormalization layers ``model`` already has that cannot be global."""
    for layer in model.submodules:
        if bn_compat.is_batch_norm(layer):
            _refuse_virtual_batches(layer, num_workers, every_layer)


def _refuse_virtual_batches(layer, num_workers, every_layer):
    if (every_layer or layer.synchronized) and layer.virtual_batch_size is not None:
        raise ValueError(
            f"BatchNormalization layer {layer.name!r} normalizes sub-batches of {layer.virtual_batch_size} rows of "
            "each worker's batch, which are not the sub-batches one process forms from the global batch. "
            f"Received: virtual_batch_size={layer.virtual_batch_size} with {num_workers} workers. Use "
            "HybridStrategy(sync_batch_norm=False) to normalize each worker's sub-batches (Horovod's behaviour, not "
            "equivalent to one process), or drop virtual_batch_size.")


def _statistics(layer):
    """The global statistics for ``layer`` while a step is traced under ``global_statistics``, else None."""
    state = getattr(_ACTIVE, "state", None)
    if state is None or not (state[1] or layer.synchronized):
        return None
    num_workers, share = state[0], global_losses.gradient_share()
    _refuse_virtual_batches(layer, num_workers, state[1])  # a layer created after compile (lazily built models)
    return bn_compat.Global(
        moments=lambda x, weights, axes: _global_moments(layer, x, weights, axes, num_workers, share),
        sum=lambda tensor: collectives.sum_over_workers(tensor, num_workers, name=None),
        gradient_sum=lambda tensor: _weighted_sum(tensor, num_workers, share))


def _weighted_sum(gradient, num_workers, share):
    """A gradient summed over the workers, each worker's times its ``share`` and the sum over this worker's (see
    ``global_statistics``); the plain sum when ``share`` is None."""
    if share is None:
        return collectives.sum_over_workers(gradient, num_workers, name=None)
    share = tf.cast(share, gradient.dtype)
    return collectives.sum_over_workers(gradient * share, num_workers, name=None) / share


def _sum_over_workers(tensor, num_workers, share):
    """``tensor`` summed over the workers; its gradient is ``_weighted_sum`` of the incoming one (Horovod's own
    allreduce gradient, the plain sum, when ``share`` is None)."""
    if share is None:
        return collectives.sum_over_workers(tensor, num_workers, name=None)

    @tf.custom_gradient
    def total(x):
        return collectives.sum_over_workers(x, num_workers, name=None), (
            lambda upstream: _weighted_sum(upstream, num_workers, share))

    return total(tensor)


def _global_moments(layer, x, weights, axes, num_workers, share):
    """Mean, biased variance and count over all workers, per channel, with the reduced axes kept (unfused path)."""
    dtype = x.dtype
    y = tf.cast(x, tf.float32)
    shape = [1 if i in axes else y.shape[i] for i in range(y.shape.rank)]
    shift = tf.stop_gradient(tf.reshape(tf.cast(layer.moving_mean, tf.float32), shape))
    y = y - shift
    if weights is None:
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(y), axes)), tf.float32) * tf.ones(shape, tf.float32)
    else:
        weights = tf.cast(weights, tf.float32)
        y = y * weights
        count = tf.reduce_sum(tf.broadcast_to(weights, tf.shape(y)), axis=axes, keepdims=True)
    sums = tf.stack([tf.reduce_sum(y, axis=axes, keepdims=True), tf.reduce_sum(tf.square(y), axis=axes, keepdims=True),
                     count])
    sums = _sum_over_workers(sums, num_workers, share)
    mean = sums[0] / sums[2]
    variance = tf.maximum(sums[1] / sums[2] - tf.square(mean), 0.0)
    return tf.cast(mean + shift, dtype), tf.cast(variance, dtype), sums[2]
