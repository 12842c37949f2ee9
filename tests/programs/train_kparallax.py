"""Trains every equivalence model with kparallax (run under kparallax-run). Usage: train_kparallax.py OUT_DIR [NAMES]"""

import os
import sys

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(__file__))
import equivalence_common as common  # noqa: E402
import kparallax as kp  # noqa: E402


def main(out_dir, names):
    strategy = kp.HybridStrategy(kp.Cluster.from_env())
    assert strategy.num_workers == common.WORKERS, strategy.num_workers
    x, y = common.data()
    for name in names:
        with strategy.scope():
            model = common.build_model(name)
            model.set_weights(common.initial_weights(model))
            model.compile(optimizer=common.OPTIMIZERS[name](), loss="mse")
            history = model.fit(x, y, batch_size=common.PER_WORKER_BATCH, epochs=1, shuffle=False, verbose=0)
        if strategy.is_chief:
            np.savez(os.path.join(out_dir, f"{name}.npz"), *model.get_weights(),
                     loss=np.array(history.history["loss"]))
            print(f"{name}: trained {model.optimizer.iterations.numpy()} steps", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else list(common.OPTIMIZERS))
