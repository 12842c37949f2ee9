"""One benchmark run of one variant (started by scripts/benchmark.py; not a user entry point).

    bench_worker.py --variant V --model M --steps S --warmup W --batch_size B --out FILE

Variants: kparallax-hybrid / -allreduce / -allreduce-dense / -ps (kparallax under kparallax-run), horovod /
horovod-dense (plain Horovod Keras under horovodrun: hvd.DistributedOptimizer + BroadcastGlobalVariablesCallback;
kparallax is never imported), single (one plain process). Synthetic data. Worker 0 writes FILE (JSON): per-step
times after the warm-up, and the loopback interface's transmitted bytes over the timed steps (every task of the
run talks over loopback on one machine, so that is the run's traffic), plus the analytic floor inputs.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def lo_tx_bytes():
    with open("/proc/net/dev", encoding="utf-8") as f:
        for line in f:
            name, _, data = line.partition(":")
            if name.strip() == "lo":
                return int(data.split()[8])
    return 0


def parse():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=None)
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def build(model_name, batch_size, workers, rank):
    import numpy as np
    import tensorflow as tf
    from models import imagenet_data, lm1b, lm1b_data, resnet
    if model_name.startswith("lm1b"):
        config = lm1b.preset(model_name, **({"batch_size": batch_size} if batch_size else {}))
        x, y = lm1b_data.synthetic(config.batch_size * 64, config.num_steps, config.vocab_size, seed=rank)
        data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(config.batch_size, drop_remainder=True)
        items = config.batch_size * config.num_steps

        def mean_unique(ids):  # distinct ids per batch, averaged over the 64 batches of data
            return float(np.mean([len(np.unique(batch)) for batch in np.split(ids, 64)]))

        unique, unique_targets = mean_unique(x), mean_unique(y)
        info = {"unit": "words", "items_per_step": items, "row_bytes": 4 * config.embedding_dim,
                "softmax_row_bytes": 4 * (config.projection_dim + 1), "unique_input_rows": unique,
                "unique_softmax_rows": float(min(unique_targets + config.num_sampled, config.vocab_size)),
                "num_sampled": config.num_sampled}
        return (lambda: lm1b.LM1B(config)), (lambda: lm1b.make_optimizer(config)), None, data, info
    config = resnet.preset(model_name, **({"batch_size": batch_size} if batch_size else {}))
    data = imagenet_data.synthetic(config.batch_size, config.image_size, config.num_classes, seed=rank)
    info = {"unit": "images", "items_per_step": config.batch_size}
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return (lambda: resnet.build(config)), (lambda: resnet.make_optimizer(config, workers)), loss, data, info


def step_timer(warmup):
    """A callback recording each step's seconds after ``warmup`` steps, and the loopback bytes sent meanwhile."""
    import tensorflow as tf

    class StepTimer(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self.mark, self.bytes = [], None, None

        def on_train_batch_end(self, batch, logs=None):
            now = time.perf_counter()
            if batch + 1 == warmup:
                self.mark, self.bytes = now, lo_tx_bytes()
            elif batch + 1 > warmup:
                self.times.append(now - self.mark)
                self.mark = now

        def on_train_end(self, logs=None):
            self.bytes = lo_tx_bytes() - (self.bytes or 0)
    return StepTimer()


def main():
    args = parse()
    variant = args.variant
    timer = step_timer(args.warmup)
    if variant.startswith("kparallax-"):
        import kparallax as kp
        architecture = {"kparallax-hybrid": "hybrid", "kparallax-allreduce": "allreduce",
                        "kparallax-allreduce-dense": "allreduce", "kparallax-ps": "ps"}[variant]
        strategy = kp.HybridStrategy(kp.Cluster.from_env(), architecture=architecture,
                                     sparse_as_dense=variant == "kparallax-allreduce-dense")
        workers, rank = strategy.num_workers, strategy.worker_index
        make_model, make_optimizer, loss, data, info = build(args.model, args.batch_size, workers, rank)
        with strategy.scope():
            model = make_model()
            model.compile(optimizer=make_optimizer(), loss=loss)
            model.fit(kp.data.per_worker(data), epochs=1, steps_per_epoch=args.warmup + args.steps, verbose=0,
                      callbacks=[timer])
    elif variant.startswith("horovod"):
        import horovod.tensorflow.keras as hvd
        hvd.init()
        workers, rank = hvd.size(), hvd.rank()
        make_model, make_optimizer, loss, data, info = build(args.model, args.batch_size, workers, rank)
        model = make_model()
        optimizer = hvd.DistributedOptimizer(make_optimizer(), sparse_as_dense=variant == "horovod-dense")
        model.compile(optimizer=optimizer, loss=loss)
        model.fit(data, epochs=1, steps_per_epoch=args.warmup + args.steps, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), timer])
    elif variant == "single":
        workers, rank = 1, 0
        make_model, make_optimizer, loss, data, info = build(args.model, args.batch_size, 1, 0)
        model = make_model()
        model.compile(optimizer=make_optimizer(), loss=loss)
        model.fit(data, epochs=1, steps_per_epoch=args.warmup + args.steps, verbose=0, callbacks=[timer])
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    if rank == 0:
        import numpy as np
        sparse = [w for w in model.trainable_weights if "embedding" in w.name or "softmax" in w.name]
        dense_bytes = 4 * sum(int(np.prod(w.shape)) for w in model.trainable_weights if not any(w is s for s in sparse))
        table_bytes = 4 * sum(int(np.prod(w.shape)) for w in sparse)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"variant": variant, "workers": workers, "step_seconds": timer.times,
                       "lo_bytes": timer.bytes, "timed_steps": len(timer.times),
                       "dense_bytes": dense_bytes, "table_bytes": table_bytes, **info}, f)


if __name__ == "__main__":
    main()
