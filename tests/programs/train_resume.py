"""Checkpoint/resume program (run under kparallax-run). Usage:

    train_resume.py OUT_DIR MODEL_DIR TOTAL_STEPS [KILL_AT_STEP [always]]

Trains the equivalence model (Adam) for TOTAL_STEPS global steps, checkpointing every 5 steps into MODEL_DIR and
resuming from the latest checkpoint there (skipping the batches already consumed: deterministic data order). With
KILL_AT_STEP, worker 1 SIGKILLs itself when that step ends (a preempted worker) on the first attempt of the run
(``$KPARALLAX_RESTART_COUNT`` unset or 0), or on every attempt with ``always``. Worker 0 saves the final weights.
"""

import os
import signal
import sys

import numpy as np
import tensorflow as tf

import equivalence_common as common
import kparallax as kp
from kparallax import checkpoint


class KillAt(tf.keras.callbacks.Callback):
    def __init__(self, step):
        super().__init__()
        self._step = step

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self._step:
            os.kill(os.getpid(), signal.SIGKILL)


def main(out_dir, model_dir, total, kill_at, always=False):
    if os.environ.get("KPARALLAX_RESTART_COUNT", "0") != "0" and not always:
        kill_at = 0
    strategy = kp.HybridStrategy(kp.Cluster.from_env(), partitions=2 if strategy_ps() > 1 else 1)
    rng = np.random.default_rng(5)
    n = common.PER_WORKER_BATCH * common.WORKERS * total
    x = np.minimum(rng.zipf(1.5, size=(n, common.LEN)) - 1, common.VOCAB - 1).astype(np.int32)
    y = rng.normal(size=(n, 1)).astype(np.float32)
    with strategy.scope():
        model = common.build_model("resume")
        model.set_weights(common.initial_weights(model))
        model.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="mse")
        start = 0
        path = checkpoint.latest(model_dir)
        if path:
            start = checkpoint.restore(strategy, model, path)["step"]
            print(f"resumed from step {start}", flush=True)
        callbacks = [kp.callbacks.Checkpoint(strategy, model_dir, every_steps=5)]
        if kill_at and strategy.worker_index == 1:
            callbacks.append(KillAt(kill_at))
        rows = start * common.PER_WORKER_BATCH * common.WORKERS
        model.fit(x[rows:], y[rows:], batch_size=common.PER_WORKER_BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=callbacks)
    if strategy.is_chief:
        np.savez(os.path.join(out_dir, "final.npz"), *model.get_weights(),
                 iterations=model.optimizer.iterations.numpy())


def strategy_ps():
    return len([h for h in os.environ.get("KPARALLAX_PS_HOSTS", "").split(",") if h])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 0,
         len(sys.argv) > 5 and sys.argv[5] == "always")
