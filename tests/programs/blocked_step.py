"""Worker program whose 4th step blocks forever on worker 1 inside the step function (a py_function that
sleeps): the process keeps running and no collective ever completes. Run under kparallax-run."""

import os
import time

import numpy as np
import tensorflow as tf

import kparallax as kp

BLOCK = os.environ.get("KPARALLAX_TASK_INDEX") == "1"


def maybe_block(step):
    if BLOCK and int(step) == 3:
        print("worker 1 blocks inside step 4", flush=True)
        while True:
            time.sleep(1)
    return np.float32(0.0)


class Blocking(tf.keras.layers.Layer):
    def build(self, input_shape):
        self.calls = self.add_weight(name="calls", shape=(), dtype=tf.int64, initializer="zeros", trainable=False)

    def call(self, x):
        delay = tf.reshape(tf.py_function(maybe_block, [self.calls.read_value()], tf.float32), [])
        self.calls.assign_add(1)
        return x + delay


strategy = kp.HybridStrategy()
x = np.random.default_rng(0).integers(0, 50, size=(256, 4)).astype(np.int32)
y = np.zeros((256, 1), np.float32)
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.Input((4,), dtype=tf.int32), tf.keras.layers.Embedding(50, 4),
                                 tf.keras.layers.Flatten(), Blocking(), tf.keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
