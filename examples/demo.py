"""Demo: a small Embedding + Dense classifier trained with kparallax.

    kparallax-run --workers 2 --ps 1 -- python examples/demo.py          # 2 workers + 1 PS on this machine
    python examples/demo.py --architecture allreduce                      # one plain process, no PS

Synthetic data: each example is 8 token ids (Zipf-like over a 20,000-word vocabulary); the label is a fixed
function of the ids, so the loss falls as the model learns it. Prints loss, accuracy and samples/s on worker 0.
"""

import argparse
import time

import numpy as np
import tensorflow as tf

import kparallax as kp

VOCAB, EMB, LEN, CLASSES = 20000, 32, 8, 4


def make_data(n, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.minimum(rng.zipf(1.3, size=(n, LEN)) - 1, VOCAB - 1).astype(np.int32)
    labels = (ids.sum(axis=1) * 2654435761 % 1000003 % CLASSES).astype(np.int32)
    labels = np.where(ids[:, 0] < 50, ids[:, 0] % CLASSES, labels)  # a learnable signal from the first token
    return ids, labels


def build_model():
    inputs = tf.keras.Input(shape=(LEN,), dtype=tf.int32)
    x = tf.keras.layers.Embedding(VOCAB, EMB)(inputs)           # [batch, LEN, EMB] -> lives on the PS
    x = tf.keras.layers.GlobalAveragePooling1D()(x)             # [batch, EMB]
    x = tf.keras.layers.Dense(64, activation="relu")(x)
    outputs = tf.keras.layers.Dense(CLASSES)(x)
    return tf.keras.Model(inputs, outputs)


def _at_least_one(text):
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1. Received: {text!r}")
    return int(text)


def _partitions(text):
    if text != "auto" and (not text.isdigit() or int(text) < 1):
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or 'auto'. Received: {text!r}")
    return text if text == "auto" else int(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=_at_least_one, default=3)
    parser.add_argument("--batch_size", type=_at_least_one, default=64, help="per worker")
    parser.add_argument("--examples", type=_at_least_one, default=32768)
    parser.add_argument("--partitions", type=_partitions, default=1, help="row shards per table: an integer or 'auto'")
    parser.add_argument("--architecture", choices=kp.options.ARCHITECTURES, default=None,
                        help="default: kparallax-run's --architecture, else hybrid (which needs PS tasks)")
    parser.add_argument("--no_local_aggregation", action="store_true",
                        help="every worker pushes its own sparse gradient (default: one push per host)")
    args = parser.parse_args()
    strategy = kp.HybridStrategy(kp.Cluster.from_env(), architecture=args.architecture, partitions=args.partitions,
                                 local_aggregation=not args.no_local_aggregation)
    x, y = make_data(args.examples)
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=tf.keras.optimizers.Adam(1e-3),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        global_batch = args.batch_size * strategy.num_workers
        start = time.perf_counter()
        history = model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, validation_split=0.05,
                            callbacks=[kp.callbacks.Throughput(global_batch, unit="samples")], verbose=2)
        elapsed = time.perf_counter() - start
    if strategy.is_chief:
        print(f"workers={strategy.num_workers} ps={strategy.cluster.num_ps} final loss="
              f"{history.history['loss'][-1]:.4f} val_accuracy={history.history['val_accuracy'][-1]:.4f} "
              f"throughput={history.history['samples_per_sec'][-1]:.0f} samples/s wall={elapsed:.1f}s")


if __name__ == "__main__":
    main()
