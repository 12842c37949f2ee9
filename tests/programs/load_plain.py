"""Loads export_partitioned.py's files in a plain process that never imports kparallax; checks weights and
predictions. Usage: load_plain.py OUT_DIR"""

import os
import sys

import numpy as np
import tensorflow as tf


def main(out):
    expected = np.load(os.path.join(out, "expected.npz"))
    weights = [expected[f"arr_{i}"] for i in range(len([k for k in expected.files if k.startswith("arr_")]))]
    for name in ("model.keras", "model.h5", "saved_model"):
        model = tf.keras.models.load_model(os.path.join(out, name))
        got = model.get_weights()
        assert [w.shape for w in got] == [w.shape for w in weights], (name, [w.shape for w in got])
        for a, b in zip(got, weights):
            np.testing.assert_array_equal(a, b, err_msg=name)
        np.testing.assert_allclose(model.predict(expected["x"], verbose=0), expected["predictions"], rtol=1e-6,
                                   err_msg=name)
    served = tf.saved_model.load(os.path.join(out, "saved_model"))
    outputs = served.signatures["serving_default"](ids=tf.constant(expected["x"]))
    np.testing.assert_allclose(list(outputs.values())[0].numpy(), expected["predictions"], rtol=1e-6)
    assert "kparallax" not in sys.modules
    print("loaded", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
