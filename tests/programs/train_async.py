"""Asynchronous PS training where worker 1 is slower (sleeps every step). Usage: train_async.py OUT_DIR ARCH"""

import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

import equivalence_common as common
import kparallax as kp

EPOCHS = 4


class SlowWorker(tf.keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        time.sleep(0.05)


def main(out_dir, architecture):
    strategy = kp.HybridStrategy(kp.Cluster.from_env(), architecture=architecture, sync=False)
    x, y = common.data()
    y = (x[:, :1] % 7).astype(np.float32) / 7.0  # learnable from the ids
    with strategy.scope():
        model = common.build_model("async")
        model.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="mse")
        callbacks = [SlowWorker()] if strategy.worker_index == 1 else []
        history = model.fit(x, y, batch_size=common.PER_WORKER_BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                            callbacks=callbacks)
    if strategy.is_chief:
        with open(os.path.join(out_dir, "async.json"), "w", encoding="utf-8") as f:
            json.dump({"loss": history.history["loss"], "push_counts": strategy.push_counts(),
                       "steps_per_worker": EPOCHS * common.STEPS}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
