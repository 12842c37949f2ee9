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
        unique = np.mean([len(np.unique(x[i:i + config.batch_size])) for i in range(0, 64 * config.batch_size,
                                                                                    config.batch_size)])
        unique_targets = np.mean([len(np.unique(y[i:i + config.batch_size])) for i in range(0, 64 * config.batch_size,
                                                                                           config.batch_size)])
        info = {"unit": "words", "items_per_step": items, "row_bytes": 4 * config.embedding_dim,
                "softmax_row_bytes": 4 * (config.projection_dim + 1), "unique_input_rows": float(unique),
                "unique_softmax_rows": float(min(unique_targets + config.num_sampled, config.vocab_size)),
                "num_sampled": config.num_sampled}
        return (lambda: lm1b.LM1B(config)), (lambda: lm1b.make_optimizer(config)), None, data, info
    config = resnet.preset(model_name, **({"batch_size": batch_size} if batch_size else {}))
    data = imagenet_data.synthetic(config.batch_size, config.image_size, config.num_classes, seed=rank)
    info = {"unit": "images", "items_per_step": config.batch_size}
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return (lambda: resnet.build(config)), (lambda: resnet.make_optimizer(config, workers)), loss, data, info


class Timer:
    def __init__(self, warmup):
        import tensorflow as tf

        class _Callback(tf.keras.callbacks.Callback):
            def __init__(cb):
                super().__init__()
                cb.times, cb.marks, cb.bytes = [], None, None

            def on_train_batch_end(cb, batch, logs=None):
                now = time.perf_counter()
                if batch + 1 == warmup:
                    cb.marks, cb.bytes = now, lo_tx_bytes()
                elif batch + 1 > warmup:
                    cb.times.append(now - cb.marks)
                    cb.marks = now

            def on_train_end(cb, logs=None):
                cb.bytes = lo_tx_bytes() - (cb.bytes or 0)
        self.callback = _Callback()


def main():
    args = parse()
    variant = args.variant
    timer = Timer(args.warmup)
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
                      callbacks=[timer.callback])
        params = model
    elif variant.startswith("horovod"):
        import horovod.tensorflow.keras as hvd
        hvd.init()
        workers, rank = hvd.size(), hvd.rank()
        make_model, make_optimizer, loss, data, info = build(args.model, args.batch_size, workers, rank)
        model = make_model()
        optimizer = hvd.DistributedOptimizer(make_optimizer(), sparse_as_dense=variant == "horovod-dense")
        model.compile(optimizer=optimizer, loss=loss)
        model.fit(data, epochs=1, steps_per_epoch=args.warmup + args.steps, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), timer.callback])
        params = model
    elif variant == "single":
        workers, rank = 1, 0
        make_model, make_optimizer, loss, data, info = build(args.model, args.batch_size, 1, 0)
        model = make_model()
        model.compile(optimizer=make_optimizer(), loss=loss)
        model.fit(data, epochs=1, steps_per_epoch=args.warmup + args.steps, verbose=0, callbacks=[timer.callback])
        params = model
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    if rank == 0:
        import numpy as np
        sparse = [w for w in params.trainable_weights if "embedding" in w.name or "softmax" in w.name]
        dense_bytes = 4 * sum(int(np.prod(w.shape)) for w in params.trainable_weights if not any(w is s for s in sparse))
        table_bytes = 4 * sum(int(np.prod(w.shape)) for w in sparse)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"variant": variant, "workers": workers, "step_seconds": timer.callback.times,
                       "lo_bytes": timer.callback.bytes, "timed_steps": len(timer.callback.times),
                       "dense_bytes": dense_bytes, "table_bytes": table_bytes, **info}, f)


if __name__ == "__main__":
    main()
