"""``tf.RaggedTensor.to_tensor`` (TensorFlow 2.15; the same public method in 2.16-2.18), hooked process-wide.

Padding a ragged tensor into a dense one without a full ``shape`` pads each ragged dimension to the longest of the
tensor's own rows: Keras' ``TextVectorization`` (``output_mode="int"`` without ``output_sequence_length``) does it in
the model, as does a user's ``x.to_tensor()``. ``hook(shape_of)`` wraps the method once: ``shape_of(ragged, shape)``
returns the ``shape`` to pad to (the caller's, or a tensor of sizes, -1 where the tensor's own size is kept).
"""

import functools

import tensorflow as tf

_HOOKED = []


def hook(shape_of):
    """Wraps ``tf.RaggedTensor.to_tensor`` once (idempotent)."""
    if _HOOKED:
        return
    original = tf.RaggedTensor.to_tensor
    _HOOKED.append(original)

    @functools.wraps(original)
    def to_tensor(self, default_value=None, name=None, shape=None):
        return original(self, default_value=default_value, name=name, shape=shape_of(self, shape))

    tf.RaggedTensor.to_tensor = to_tensor
