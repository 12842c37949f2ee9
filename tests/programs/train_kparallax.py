"""Trains equivalence models with kparallax (run under kparallax-run).

Usage: train_kparallax.py OUT_DIR [NAMES [OPTIONS_JSON]]; OPTIONS_JSON holds HybridStrategy keyword arguments.
"""

import json
import os
import sys

import numpy as np

import equivalence_common as common
import kparallax as kp


def main(out_dir, names, options):
    strategy = kp.HybridStrategy(kp.Cluster.from_env(), **options)
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
            with open(os.path.join(out_dir, f"{name}.json"), "w", encoding="utf-8") as f:
                json.dump({"iterations": int(model.optimizer.iterations.numpy()),
                           "push_counts": strategy.push_counts(),
                           "num_weights": len(model.weights),
                           "forwarded": os.environ.get("KP_TEST_FORWARDED")}, f)
            print(f"{name}: trained {model.optimizer.iterations.numpy()} steps", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else list(common.OPTIMIZERS),
         json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})
