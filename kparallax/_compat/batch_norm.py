"""Keras 2 ``BatchNormalization`` internals (Keras 2.15; the same private methods exist in tf-keras 2.16-2.18) and
TensorFlow's fused batch-norm kernels (``gen_nn_ops``, TF 2.15).

In training, a ``BatchNormalization`` layer gets its batch statistics in one of two private methods of
``BatchNormalizationBase``:

- ``_calculate_mean_and_var(inputs, reduction_axes, keep_dims, mask)`` on the unfused path (inputs of rank other
  than 4 or 5, ``fused=False``, ``synchronized=True``, renorm, virtual batches, an adjustment). The caller uses the
  returned (biased) variance both to normalize and to update ``moving_variance``;
- ``_fused_batch_norm(inputs, mask, training)`` on the fused path (``FusedBatchNormV3``, the default for images). It
  normalizes with the biased variance, but moves ``moving_variance`` towards the *unbiased* one (Bessel-corrected
  by the kernel; Keras keeps it: ``_bessels_correction_test_only``), as ``(1 - f) * moving + f * batch`` with
  ``f = 1 - momentum`` inside the kernel.

``hook(statistics, apart)`` wraps both once, process-wide. ``statistics(layer)`` returns ``None`` (Keras runs
unchanged; its unfused statistics under the context ``apart()``, which marks them as each worker's own) or
a ``Global``: ``moments(x, weights, reduction_axes) -> (mean, variance, count)`` over all workers (``weights``:
Keras' mask as 0 / 1 per position, or None; reduced axes kept) for the unfused path, and ``sum(tensor)`` (the sum
over all workers) and ``gradient_sum(tensor)`` (the same for gradient sums, which the step may weight per worker)
for the fused one, which is replaced by ``_fused_global``: the fused kernels per worker and two per-channel sums over
the workers, with the kernel's moving averages.
"""

import dataclasses
import functools
from typing import Callable

import tensorflow as tf
from tensorflow.python.ops import gen_nn_ops  # pylint: disable=no-name-in-module

_HOOKED = []
_CHANNELS_LAST = ("NHWC", "NDHWC")


@dataclasses.dataclass(frozen=True)
class Global:
    """How one layer's statistics span the workers (see the module docstring)."""
    moments: Callable
    sum: Callable
    gradient_sum: Callable


def _base_class():
    for cls in tf.keras.layers.BatchNormalization.__mro__:
        if cls.__name__ == "BatchNormalizationBase":
            return cls
    raise ImportError("kparallax: Keras' BatchNormalizationBase not found (Keras 2.11-2.15 / tf-keras 2.16-2.18 "
                      f"expected). Received: tf.keras {getattr(tf.keras, '__version__', '?')}.")


def is_batch_norm(layer):
    """Whether ``layer`` is a Keras BatchNormalization (any of its classes: v1, v2, SyncBatchNormalization)."""
    return isinstance(layer, _base_class())


def hook(statistics, apart):
    """Wraps ``BatchNormalizationBase``'s statistics once (idempotent); see the module docstring. Keras' own
    statistics (each worker's batch, where ``statistics(layer)`` is None) are computed under ``apart()``."""
    if _HOOKED:
        return
    base = _base_class()
    calculate, fused = base._calculate_mean_and_var, base._fused_batch_norm  # pylint: disable=protected-access
    _HOOKED.append(base)

    @functools.wraps(calculate)
    def _calculate_mean_and_var(self, inputs, reduction_axes, keep_dims, mask=None):
        spanning = statistics(self)
        if spanning is None:
            with apart():
                return calculate(self, inputs, reduction_axes, keep_dims, mask=mask)
        weights = None if mask is None else tf.expand_dims(tf.cast(mask, inputs.dtype), axis=-1)
        mean, variance, _ = spanning.moments(inputs, weights, reduction_axes)
        if not keep_dims:
            mean, variance = tf.squeeze(mean, reduction_axes), tf.squeeze(variance, reduction_axes)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)

    @functools.wraps(fused)
    def _fused_batch_norm(self, inputs, mask, training):
        spanning = statistics(self)
        if spanning is None or _constant(training) is False:
            return fused(self, inputs, mask, training)
        if _constant(training) is None:
            raise ValueError(
                f"BatchNormalization layer {self.name!r} was called with a `training` tensor whose value is known "
                "only when the step runs; its statistics over all workers need a collective that every worker must "
                "run. Received: training=<a symbolic tensor>. Pass a Python bool (Keras' fit and train_step do).")
        if self._data_format in _CHANNELS_LAST:  # pylint: disable=protected-access
            return _fused_global(self, inputs, spanning.sum, spanning.gradient_sum)
        return _unfused_like_the_fused_kernel(self, inputs, spanning)

    base._calculate_mean_and_var = _calculate_mean_and_var  # pylint: disable=protected-access
    base._fused_batch_norm = _fused_batch_norm  # pylint: disable=protected-access


def _constant(training):
    """True / False when ``training`` is known while tracing, else None."""
    if isinstance(training, (bool, int)):
        return bool(training)
    value = tf.get_static_value(training) if training is not None else None
    return None if value is None else bool(value)


def _scale_and_offset(layer):
    """gamma and beta as tensors; ones / zeros where the layer has none (``scale`` / ``center`` False), as Keras."""
    channels, dtype = layer.moving_mean.shape[0], layer._param_dtype  # pylint: disable=protected-access
    gamma = tf.convert_to_tensor(layer.gamma) if layer.scale else tf.ones([channels], dtype)
    beta = tf.convert_to_tensor(layer.beta) if layer.center else tf.zeros([channels], dtype)
    return gamma, beta


def _move(layer, mean, variance, count):
    """The fused kernel's moving averages: ``moving_variance`` follows the Bessel-corrected variance."""
    unbiased = variance * count / tf.maximum(count - 1.0, 1.0)
    factor = 1.0 - layer.momentum

    def moving(variable, value):
        return lambda: variable.assign((1.0 - factor) * variable + factor * tf.reshape(value, variable.shape))

    layer.add_update(moving(layer.moving_mean, mean))
    layer.add_update(moving(layer.moving_variance, unbiased))


def _fused_global(layer, inputs, total, gradient_total):
    """Keras' fused path with statistics over all workers (channels-last images).

    Forward: each worker's per-channel mean and variance from the fused kernel in training mode, combined over the
    workers by one ``total`` of (count, count x (mean - shift), count x (variance + (mean - shift)^2)); the output
    from the fused kernel in inference mode with the global mean and variance. Backward: the fused kernel's
    inference-mode gradient (``dy * gamma / std``, and per-channel sums of ``dy`` and ``dy * x_hat``, which are
    gamma's and beta's gradients), one ``gradient_total`` of those sums, and the correction one process's training-mode
    gradient has: ``- gamma / std / n * (sum(dy) + x_hat * sum(dy * x_hat))`` over the global batch.
    """
    epsilon, data_format = layer.epsilon, layer._data_format  # pylint: disable=protected-access
    channels = layer.moving_mean.shape[0]
    shift = tf.stop_gradient(tf.cast(layer.moving_mean, tf.float32))
    gamma, beta = _scale_and_offset(layer)
    empty = tf.constant([], tf.float32)

    @tf.custom_gradient
    def normalize(x, gamma, beta):
        _, local_mean, local_unbiased, _, _, _ = gen_nn_ops.fused_batch_norm_v3(
            x, tf.ones([channels], tf.float32), tf.zeros([channels], tf.float32), empty, empty, epsilon=epsilon,
            data_format=data_format, is_training=True)
        local_count = tf.cast(tf.size(x) // channels, tf.float32)
        local_variance = local_unbiased * (local_count - 1.0) / tf.maximum(local_count, 1.0)
        offset = local_mean - shift
        sums = total(tf.concat([local_count * offset, local_count * (local_variance + tf.square(offset)),
                                tf.reshape(local_count, [1])], axis=0))
        count = sums[-1]
        mean_offset = sums[:channels] / count
        mean = shift + mean_offset
        variance = tf.maximum(sums[channels:2 * channels] / count - tf.square(mean_offset), 0.0)
        y, _, _, _, _, reserve = gen_nn_ops.fused_batch_norm_v3(
            x, gamma, beta, mean, variance, epsilon=epsilon, data_format=data_format, is_training=False)

        def grad(dy, *unused):
            del unused  # the moving averages take no gradient
            dx, dgamma, dbeta, _, _ = gen_nn_ops.fused_batch_norm_grad_v3(
                dy, x, gamma, mean, variance, reserve, epsilon=epsilon, data_format=data_format, is_training=False)
            global_sums = gradient_total(tf.concat([dbeta, dgamma], axis=0))
            inv = tf.math.rsqrt(variance + epsilon)
            per_x = gamma * inv * inv * global_sums[channels:] / count
            per_one = gamma * inv * global_sums[:channels] / count - mean * per_x
            correction = tf.cast(x, tf.float32) * per_x + per_one
            if dx.dtype == tf.float32:
                return dx - correction, dgamma, dbeta
            # float16 activations: the difference is taken in float32, as the training-mode kernel does inside.
            direct = tf.cast(dy, tf.float32) * (gamma * inv)
            return tf.cast(direct - correction, dx.dtype), dgamma, dbeta

        return (y, mean, variance, count), grad

    y, mean, variance, count = normalize(inputs, gamma, beta)
    _move(layer, mean, variance, count)
    return y


def _unfused_like_the_fused_kernel(layer, inputs, spanning):
    """The fused path's output and moving averages from ``spanning.moments`` (channels-first images)."""
    rank = inputs.shape.rank
    axes = [i for i in range(rank) if i not in layer.axis]
    x = tf.cast(inputs, layer._param_dtype)  # pylint: disable=protected-access
    mean, variance, count = spanning.moments(x, None, axes)
    shape = [1] * rank
    for i in layer.axis:
        shape[i] = inputs.shape[i]
    gamma, beta = _scale_and_offset(layer)
    outputs = tf.nn.batch_normalization(x, mean, variance, tf.reshape(beta, shape), tf.reshape(gamma, shape),
                                        layer.epsilon)
    _move(layer, tf.reshape(mean, [-1]), tf.reshape(variance, [-1]), tf.reshape(count, [-1]))
    return tf.cast(outputs, inputs.dtype)
