"""Keras 2 ``BatchNormalization(synchronized=True)`` (Keras 2.15; tf-keras 2.16-2.21 keep the same private method).

Keras computes a synchronized layer's statistics in the private ``BatchNormalizationBase._calculate_mean_and_var
(inputs, reduction_axes, keep_dims, mask)`` (a synchronized layer always takes this unfused path), summing over
``tf.distribute.get_replica_context()``. kparallax's step runs under TensorFlow's default strategy (one replica),
where that sum is the worker's own, so ``hook(statistics)`` wraps the method once, process-wide: where
``statistics(layer)`` returns a function ``moments(x, weights, reduction_axes) -> (mean, variance)`` over every
worker (``weights``: Keras' mask as 0 / 1 per position, or None; reduced axes kept), the layer uses it; elsewhere
(``None``) Keras runs unchanged.
"""

import functools

import tensorflow as tf

_HOOKED = []


def _base_class():
    for cls in tf.keras.layers.BatchNormalization.__mro__:
        if cls.__name__ == "BatchNormalizationBase":
            return cls
    raise ImportError("kparallax: Keras' BatchNormalizationBase not found (Keras 2.11-2.15 / tf-keras 2.16+ "
                      f"expected). Received: tf.keras {getattr(tf.keras, '__version__', '?')}.")


def is_batch_norm(layer):
    """Whether ``layer`` is a Keras BatchNormalization (any of its classes: v1, v2, SyncBatchNormalization)."""
    return isinstance(layer, _base_class())


def hook(statistics):
    """Wraps ``BatchNormalizationBase._calculate_mean_and_var`` once (idempotent); see the module docstring."""
    if _HOOKED:
        return
    base = _base_class()
    calculate = base._calculate_mean_and_var  # pylint: disable=protected-access
    _HOOKED.append(base)

    @functools.wraps(calculate)
    def _calculate_mean_and_var(self, inputs, reduction_axes, keep_dims, mask=None):
        moments = statistics(self)
        if moments is None:
            return calculate(self, inputs, reduction_axes, keep_dims, mask=mask)
        weights = None if mask is None else tf.expand_dims(tf.cast(mask, inputs.dtype), axis=-1)
        mean, variance = moments(inputs, weights, reduction_axes)
        if not keep_dims:
            mean, variance = tf.squeeze(mean, reduction_axes), tf.squeeze(variance, reduction_axes)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)

    base._calculate_mean_and_var = _calculate_mean_and_var  # pylint: disable=protected-access
