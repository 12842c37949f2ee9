"""Single plain-Keras process on the concatenated batch (no kparallax). Usage: train_reference.py OUT_DIR [NAMES [K]]

K: micro-batches per update of the distributed run; the reference batch is WORKERS * K * PER_WORKER_BATCH.
"""

import os
import sys

import numpy as np

import equivalence_common as common


def main(out_dir, names, k):
    x, y = common.data()
    for name in names:
        model = common.build_model(name)
        model.set_weights(common.initial_weights(model))
        model.compile(optimizer=common.OPTIMIZERS[name](), loss="mse")
        history = model.fit(x, y, batch_size=common.PER_WORKER_BATCH * common.WORKERS * k, epochs=1, shuffle=False,
                            verbose=0)
        np.savez(os.path.join(out_dir, f"{name}.npz"), *model.get_weights(), loss=np.array(history.history["loss"]))
    assert "kparallax" not in sys.modules, "the reference must not import kparallax"


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else list(common.OPTIMIZERS),
         int(sys.argv[3]) if len(sys.argv) > 3 else 1)
