"""Fast tier: kparallax's global BatchNormalization statistics (``step/batch_norm.py``) against plain Keras.

With one worker the sum over workers is the identity, so the path that replaces Keras' statistics must give what
Keras computes itself: on the fused kernel's path (images; the kernel moves ``moving_variance`` towards the
Bessel-corrected variance; kparallax's forward and backward there are its own, around the fused kernels) and on the
unfused one (a masked sequence, a Dense output, renorm), in float32 and under
mixed_float16. The 2-worker equivalence is in ``test_keras_programs.py`` (``batch_normalization``) and
``test_launcher.py`` (global vs per-worker means).
"""

import contextlib

import numpy as np
import pytest
import tensorflow as tf

import kparallax  # noqa: F401  (the hook is installed by the first strategy; installed here directly)
from kparallax.step import batch_norm


def _data():
    rng = np.random.default_rng(0)
    images = (rng.normal(size=(64, 6, 6, 3)) * 2 + 5).astype(np.float32)
    ids = rng.integers(0, 9, size=(64, 4)).astype(np.int32)
    return {"images": images, "ids": ids}, rng.normal(size=(64, 1)).astype(np.float32)


def _model():
    images = tf.keras.Input((6, 6, 3), name="images")
    ids = tf.keras.Input((4,), dtype=tf.int32, name="ids")
    h = tf.keras.layers.Conv2D(4, 3, use_bias=False)(images)
    h = tf.keras.layers.BatchNormalization(momentum=0.7)(h)  # fused
    h = tf.keras.layers.GlobalAveragePooling2D()(tf.keras.layers.ReLU()(h))
    e = tf.keras.layers.Embedding(10, 3, mask_zero=True)(ids)
    e = tf.keras.layers.GlobalAveragePooling1D()(tf.keras.layers.BatchNormalization(momentum=0.5)(e))  # masked
    h = tf.keras.layers.Dense(5, use_bias=False)(tf.keras.layers.Concatenate()([h, e]))
    h = tf.keras.layers.BatchNormalization(momentum=0.6, center=False)(h)
    h = tf.keras.layers.BatchNormalization(synchronized=True, scale=False)(tf.keras.layers.ReLU()(h))
    return tf.keras.Model({"images": images, "ids": ids}, tf.keras.layers.Dense(1, dtype="float32")(h))


def _train(statistics):
    model = _model()
    rng = np.random.default_rng(3)
    trainable = {id(v) for v in model.trainable_weights}
    model.set_weights([rng.normal(scale=0.3, size=w.shape).astype(np.float32) if id(v) in trainable else w
                       for v, w in zip(model.weights, model.get_weights())])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    keras_step = model.train_step

    def train_step(data):
        with statistics():
            return keras_step(data)

    model.train_step = train_step
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    graph = model.train_function.get_concrete_function(iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(16))).graph
    fused = {op.get_attr("is_training") for op in graph.get_operations() if op.type == "FusedBatchNormV3"}
    return model, fused


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_global_statistics_on_one_worker_are_keras_own(policy):
    batch_norm.install()
    tf.keras.mixed_precision.set_global_policy(policy)
    try:
        plain, plain_fused = _train(contextlib.nullcontext)
        ours, our_fused = _train(lambda: batch_norm.global_statistics(1, every_layer=True))
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    # Keras normalizes images with the fused kernel in training mode; the global path normalizes with it in
    # inference mode, given the global statistics (it still takes each worker's moments from a training-mode call).
    assert plain_fused == {True} and our_fused == {True, False}
    # float16 activations: held to float16 precision (moving means of O(10) differ by a few float16 steps).
    tolerance = 1e-5 if policy == "float32" else 2e-3
    for variable, want, got in zip(plain.weights, plain.get_weights(), ours.get_weights()):
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance, err_msg=variable.name)


def test_one_renorm_step_is_keras_own():
    """Batch renormalization: outputs, gradients and every moving statistic after one step. (Over many steps its
    stop-gradient corrections amplify float32 rounding, so a multi-step comparison would test the noise.)"""
    batch_norm.install()
    rng = np.random.default_rng(1)
    x = tf.constant((rng.normal(size=(16, 5)) * 0.1 + 0.2).astype(np.float32))
    upstream = tf.constant(rng.normal(size=(16, 5)).astype(np.float32))

    def step(statistics):
        layer = tf.keras.layers.BatchNormalization(momentum=0.6, center=False, renorm=True)
        layer.build((None, 5))
        layer.set_weights([np.full(w.shape, 0.3 + 0.1 * i, np.float32) for i, w in enumerate(layer.get_weights())])

        @tf.function
        def run():
            with tf.GradientTape() as tape:
                tape.watch(x)
                with statistics():
                    out = layer(x, training=True)
                loss = tf.reduce_sum(out * upstream)
            return [out] + tape.gradient(loss, [x] + layer.trainable_weights)

        return [t.numpy() for t in run()] + layer.get_weights()

    for want, got in zip(step(contextlib.nullcontext), step(lambda: batch_norm.global_statistics(1, True))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_training_flag_unknown_while_tracing_is_refused():
    batch_norm.install()
    layer = tf.keras.layers.BatchNormalization()
    layer.build((None, 2, 2, 1))

    @tf.function
    def call(x, training):
        with batch_norm.global_statistics(1, every_layer=True):
            return layer(x, training=training)

    with pytest.raises(ValueError, match="Pass a Python bool"):
        call(tf.ones((2, 2, 2, 1)), tf.constant(True))
