"""``BatchNormalization(synchronized=True)``: statistics over the global batch, as tf.distribute computes them.

A layer built with Keras' own ``synchronized=True`` takes, in kparallax's synchronous training step on several
workers, its mean and variance over every worker's batch: per layer call, one Horovod allreduce sums (per channel)
the values, their squares and their count. Gradients flow through it (an allreduce's gradient is an allreduce), so
backprop through the statistics sums every worker's part, as one process's would, and the moving statistics move
the same way on every worker. Every other BatchNormalization layer normalizes each worker's own batch, as under
Horovod and tf.distribute (the user's choice; documented in the training contract).

The values are shifted by the layer's moving mean before they are summed (the same on every worker), so that the
variance taken as E[x^2] - E[x]^2 keeps float32 precision when the mean is large against the spread.
"""

import tensorflow as tf

from kparallax._compat import batch_norm as bn_compat
from kparallax.step import collectives
from kparallax.step import global_losses
from kparallax.step import train_step


def install():
    """Hooks Keras' synchronized BatchNormalization statistics once (Keras' own outside a step of several
    workers)."""
    bn_compat.hook(_statistics)


def check(model, num_workers):
    """Refuses, at ``compile``, synchronized BatchNormalization layers that cannot span the workers."""
    for layer in model.submodules:
        if bn_compat.is_batch_norm(layer):
            _refuse_virtual_batches(layer, num_workers)


def _refuse_virtual_batches(layer, num_workers):
    if layer.synchronized and layer.virtual_batch_size is not None:
        raise ValueError(
            f"BatchNormalization layer {layer.name!r} is synchronized and normalizes sub-batches of "
            f"{layer.virtual_batch_size} rows, which are not sub-batches of the global batch. Received: "
            f"synchronized=True, virtual_batch_size={layer.virtual_batch_size} with {num_workers} workers. Drop "
            "virtual_batch_size, or synchronized=True (each worker then normalizes its own sub-batches).")


def _statistics(layer):
    """The global moments of ``layer`` in a synchronous step of several workers, else None (Keras' own)."""
    strategy = train_step.model_step_strategy()
    if not layer.synchronized or strategy is None or strategy.num_workers == 1 or not strategy.options.sync:
        return None
    _refuse_virtual_batches(layer, strategy.num_workers)  # a layer created after compile (lazily built models)
    share = global_losses.gradient_share()
    return lambda x, weights, axes: _global_moments(layer, x, weights, axes, strategy.num_workers, share)


def _sum_over_workers(tensor, num_workers, share):
    """``tensor`` summed over the workers. When the workers' batches differ in size the step multiplies each
    worker's gradient by its share of the global batch (``global_losses``): backprop through the sum then weights
    each worker's part by its share and divides by this worker's, so every row counts once."""
    if share is None:
        return collectives.sum_over_workers(tensor, num_workers, name=None)
    share = tf.cast(share, tensor.dtype)

    @tf.custom_gradient
    def total(x):
        def backward(upstream):
            return collectives.sum_over_workers(upstream * share, num_workers, name=None) / share
        return collectives.sum_over_workers(x, num_workers, name=None), backward

    return total(tensor)


def _global_moments(layer, x, weights, axes, num_workers, share):
    """Mean and biased variance over all workers, per channel, with the reduced axes kept."""
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
                     count])  # [3, 1.., channels]
    sums = _sum_over_workers(sums, num_workers, share)
    mean = sums[0] / sums[2]
    variance = tf.maximum(sums[1] / sums[2] - tf.square(mean), 0.0)
    return tf.cast(mean + shift, dtype), tf.cast(variance, dtype)
