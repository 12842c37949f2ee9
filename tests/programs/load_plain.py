"""Loads export_partitioned.py's files in a plain process that never imports kparallax; checks weights and
predictions, and that the .keras file holds the optimizer state of one process trained on the global batches.
Usage: load_plain.py OUT_DIR"""

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
        # One regularization loss, over the whole table, as one process's model has.
        assert len(model.losses) == 1, (name, model.losses)
        np.testing.assert_allclose(float(model.losses[0]), float(expected["regularization"]) * float(
            np.sum(np.square(weights[0]))), rtol=1e-5, err_msg=name)
        # Weights are equal bit for bit; a prediction sums 12 products, in an order that may differ between
        # processes (one CI run: 1.5e-8 off at 0.0044), hence the absolute tolerance.
        np.testing.assert_allclose(model.predict(expected["x"], verbose=0), expected["predictions"], rtol=1e-6,
                                   atol=1e-6, err_msg=name)
    served = tf.saved_model.load(os.path.join(out, "saved_model"))
    outputs = served.signatures["serving_default"](ids=tf.constant(expected["x"]))
    np.testing.assert_allclose(list(outputs.values())[0].numpy(), expected["predictions"], rtol=1e-6, atol=1e-6)
    check_optimizer_state(out, expected)
    assert "kparallax" not in sys.modules
    print("loaded", flush=True)


def check_optimizer_state(out, expected):
    """One process trains a copy of the architecture from the same initial weights on the global batches (2
    workers x 8 rows, unshuffled: rows [16k, 16k+16) at step k); the .keras file holds its weights and its optimizer
    state (iterations, the table's accumulator joined from its shards, the dense ones); and the model that
strategy.load_model made of that file trained one more epoch as that process does."""
    model = tf.keras.models.load_model(os.path.join(out, "model.keras"))
    reference = tf.keras.models.clone_model(model)
    reference.set_weights([expected[f"initial_{i}"] for i in range(len(reference.weights))])
    reference.compile(optimizer=tf.keras.optimizers.Adagrad(0.5), loss="mse")
    reference.fit(expected["x_train"], expected["y_train"], batch_size=16, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    model.optimizer.build(model.trainable_variables)  # no-op once loaded; a loaded state is never rebuilt
    got, want = model.optimizer.variables, reference.optimizer.variables
    assert len(got) == len(want) == 1 + len(model.trainable_variables), ([v.name for v in got], len(want))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6, err_msg=a.name)
    # strategy.load_model of that file on 2 workers, one more epoch: as the one process going on.
    reference.fit(expected["x_train"], expected["y_train"], batch_size=16, shuffle=False, verbose=0)
    continued = np.load(os.path.join(out, "continued.npz"))
    for i, b in enumerate(reference.get_weights()):
        np.testing.assert_allclose(continued[f"arr_{i}"], b, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    main(sys.argv[1])
