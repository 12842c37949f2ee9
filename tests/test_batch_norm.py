"""Fast tier: ``BatchNormalization(synchronized=True)`` under kparallax (``step/batch_norm.py``) against plain Keras.

With one worker the sum over workers is the identity, so the moments kparallax computes for a synchronized layer
must be Keras' own: outputs, gradients and moving statistics, masked and unmasked, in float32 and under
mixed_float16. The 2-worker equivalence (the global batch's mean) is in ``test_launcher.py``.
"""

import numpy as np
import pytest
import tensorflow as tf

from kparallax.step import batch_norm


def _moments(layer, x, mask=None):
    return layer._calculate_mean_and_var(x, [0, 1] if x.shape.rank == 3 else [0], False, mask=mask)  # pylint: disable=protected-access


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
@pytest.mark.parametrize("masked", [False, True])
def test_global_moments_on_one_worker_are_keras_own(policy, masked):
    batch_norm.install()
    tf.keras.mixed_precision.set_global_policy(policy)
    try:
        rng = np.random.default_rng(1)
        x = tf.constant((rng.normal(size=(8, 5, 3)) * 2 + 5).astype(np.float32))
        mask = tf.constant(rng.integers(0, 2, size=(8, 5)).astype(bool)) if masked else None
        layer = tf.keras.layers.BatchNormalization(synchronized=True)
        layer.build((None, 5, 3))
        layer.moving_mean.assign([4.0, 5.0, 6.0])
        x = tf.cast(x, layer.compute_dtype)
        want = _moments(layer, x, mask)  # Keras' own: outside a step of several workers
        got = batch_norm._global_moments(  # pylint: disable=protected-access
            layer, x, None if mask is None else tf.cast(mask, x.dtype)[..., None], [0, 1], num_workers=1, share=None)
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    tolerance = 1e-5 if policy == "float32" else 2e-2
    for w, g in zip(want, got):
        np.testing.assert_allclose(np.squeeze(g.numpy().astype(np.float32)), w.numpy().astype(np.float32),
                                   rtol=tolerance, atol=tolerance)


def test_layers_not_synchronized_keep_keras_statistics_outside_a_step():
    batch_norm.install()
    layer = tf.keras.layers.BatchNormalization()
    assert batch_norm._statistics(layer) is None  # pylint: disable=protected-access
    synchronized = tf.keras.layers.BatchNormalization(synchronized=True)
    assert batch_norm._statistics(synchronized) is None  # pylint: disable=protected-access  (no training step)
