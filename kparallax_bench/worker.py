"""One benchmark run of one variant (started by kparallax_bench.benchmark; not a user entry point).

    python -m kparallax_bench.worker --variant V --model M --steps S --warmup W --batch_size B --out FILE [--partitions P]
        [--batch_norm per_worker|global] [--steps_per_execution N] [--local_aggregation auto|on|off]
        [--placement JSON]

Variants: kparallax-hybrid / -hybrid-async / -allreduce / -allreduce-dense / -ps (kparallax under kparallax-run), horovod /
horovod-dense (plain Horovod Keras: hvd.DistributedOptimizer + BroadcastGlobalVariablesCallback; kparallax is never
imported), tf-pss (TensorFlow ParameterServerStrategy + Model.fit; this process is the chief, a worker server or a PS
server, as TF_CONFIG says), single (one plain process). Synthetic data. Worker 0 (the chief for tf-pss) writes
``start`` and ``stop`` around the timed steps to the FIFO named by $KPBENCH_MARKS (the driver reads the byte
counters then), and writes FILE (JSON): per-step times after the warm-up, plus the analytic floor inputs.
"""

import argparse
import json
import os
import time

from kparallax_bench import traffic
from kparallax_models import presets


def mark(label):
    """Tells the driver that the timed window starts or stops (it reads the byte counters at once)."""
    path = os.environ.get("KPBENCH_MARKS")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(label + "\n")


def parse():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--partitions", type=int, default=1, help="kparallax variants: shards per table")
    parser.add_argument("--batch_norm", choices=("per_worker", "global"), default="per_worker",
                        help="BatchNormalization statistics: kparallax variants Keras' layer / the layer with "
                             "synchronized=True; horovod variants Keras' layer / hvd.SyncBatchNormalization")
    parser.add_argument("--local_aggregation", choices=("auto", "on", "off"), default="auto",
                        help="kparallax variants: HybridStrategy(local_aggregation=...)")
    parser.add_argument("--placement", default=None, help="kparallax variants: HybridStrategy(placement=...), JSON")
    parser.add_argument("--steps_per_execution", type=int, default=1,
                        help="compile(steps_per_execution=N) in every variant")
    return parser.parse_args()


def build(model_name, batch_size, workers, rank):
    import tensorflow as tf
    from kparallax_models import imagenet_data, lm1b, resnet
    if presets.model_of(model_name) == "lm1b":
        config = lm1b.preset(model_name, **({"batch_size": batch_size} if batch_size else {}))
        x, y = traffic.lm1b_windows(config, seed=rank)
        data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(config.batch_size, drop_remainder=True)
        info = traffic.lm1b_shape(config, x, y)
        return (lambda: lm1b.LM1B(config, stream=rank)), (lambda: lm1b.make_optimizer(config)), None, data, info
    config = resnet.preset(model_name, **({"batch_size": batch_size} if batch_size else {}))
    data = imagenet_data.synthetic(config.batch_size, config.image_size, config.num_classes, seed=rank)
    info = {"unit": "images", "items_per_step": config.batch_size}
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return (lambda: resnet.build(config)), (lambda: resnet.make_optimizer(config, workers)), loss, data, info


def profiling(label):
    """Starts TensorFlow's profiler into ``$KPBENCH_PROFILE/<label>`` when that variable is set (benchmark.py
    --profile; ``label`` is ``<variant>@<workers>/worker-<rank>``); returns the function that stops it (a no-op
    otherwise)."""
    directory = os.environ.get("KPBENCH_PROFILE")
    if not directory:
        return lambda: None
    import tensorflow as tf
    tf.profiler.experimental.start(os.path.join(directory, label))
    return tf.profiler.experimental.stop


def step_timer(warmup, rank, label="run"):
    """A callback recording each step's seconds after ``warmup`` steps; rank 0 marks the timed window. With
    $KPBENCH_PROFILE every rank traces its timed steps with TensorFlow's profiler (``op_profile`` summarizes
    worker 0's ops and every worker's phases)."""
    import tensorflow as tf

    class StepTimer(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self.last, self.done, self.stop_profile = [], None, 0, None

        def on_train_batch_end(self, batch, logs=None):
            # With steps_per_execution=N Keras calls this every N steps, with ``batch`` the last step's index:
            # each of those N steps is timed as the call's time / N.
            now, done = time.perf_counter(), batch + 1
            if self.done >= warmup:
                self.times.extend([(now - self.last) / (done - self.done)] * (done - self.done))
            elif done >= warmup:
                if rank == 0:
                    mark("start")
                self.stop_profile = profiling(f"{label}/worker-{rank}")
            self.last, self.done = now, done

        @property
        def timed_steps(self):
            return len(self.times)

        def on_train_end(self, logs=None):
            if rank == 0:
                mark("stop")
            if self.stop_profile is not None:
                self.stop_profile()
    return StepTimer()


def epoch_timer(rounds):
    """tf-pss: Model.fit joins all scheduled steps at each epoch's end; epoch 0 is the warm-up, and each later
    epoch of ``rounds`` steps per worker gives one sample of seconds per round."""
    import tensorflow as tf

    class EpochTimer(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self.last = [], None

        def on_epoch_end(self, epoch, logs=None):
            now = time.perf_counter()
            if epoch == 0:
                mark("start")
            else:
                self.times.append((now - self.last) / rounds)
            self.last = now

        @property
        def timed_steps(self):  # per worker
            return len(self.times) * rounds

        def on_train_end(self, logs=None):
            mark("stop")
    return EpochTimer()


def tf_pss(args):
    """The tf-pss variant: serve as a worker or PS (never returns), or, as the chief, run Model.fit.

    Returns (model, timer, workers, info)."""
    import math
    import tensorflow as tf
    config = json.loads(os.environ["TF_CONFIG"])
    task, cluster = config["task"], config["cluster"]
    if task["type"] in ("worker", "ps"):
        server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=task["type"], task_index=task["index"],
                                      protocol="grpc", start=True)
        server.join()
    workers, num_ps = len(cluster["worker"]), len(cluster["ps"])
    partitioner = (tf.distribute.experimental.partitioners.MinSizePartitioner(max_shards=num_ps) if num_ps > 1
                   else None)
    strategy = tf.distribute.ParameterServerStrategy(
        tf.distribute.cluster_resolver.TFConfigClusterResolver(), variable_partitioner=partitioner)
    make_model, make_optimizer, loss, _, info = build(args.model, args.batch_size, workers, 0)
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=make_optimizer(), loss=loss, steps_per_execution=args.steps_per_execution)
    rounds = max(args.warmup, math.ceil(args.steps / 5))   # steps per worker per epoch

    def dataset_fn(context):
        return build(args.model, args.batch_size, workers, context.input_pipeline_id)[3]
    timer = epoch_timer(rounds)
    model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1 + math.ceil(args.steps / rounds),
              steps_per_epoch=rounds * workers, verbose=0, callbacks=[timer])
    return model, timer, workers, info


def _synchronized_batch_norm():
    """Makes every ``tf.keras.layers.BatchNormalization`` the models build ``synchronized=True``."""
    import tensorflow as tf
    base = tf.keras.layers.BatchNormalization

    class SynchronizedBatchNormalization(base):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("synchronized", True)
            super().__init__(*args, **kwargs)

    tf.keras.layers.BatchNormalization = SynchronizedBatchNormalization


def main():
    args = parse()
    variant = args.variant
    if variant == "tf-pss":
        model, timer, workers, info = tf_pss(args)
        rank = 0
    elif variant.startswith("kparallax-"):
        import kparallax as kp
        architecture = {"kparallax-hybrid": "hybrid", "kparallax-hybrid-async": "hybrid", "kparallax-allreduce": "allreduce",
                        "kparallax-allreduce-dense": "allreduce", "kparallax-ps": "ps"}[variant]
        strategy = kp.HybridStrategy(kp.Cluster.from_env(), architecture=architecture,
                                     sparse_as_dense=variant == "kparallax-allreduce-dense",
                                     partitions=args.partitions, sync=variant != "kparallax-hybrid-async",
                                     local_aggregation={"auto": "auto", "on": True,
                                                        "off": False}[args.local_aggregation],
                                     placement=json.loads(args.placement) if args.placement else None)
        workers, rank = strategy.num_workers, strategy.worker_index
        if args.batch_norm == "global":  # Keras' own opt-in, which kparallax honours
            _synchronized_batch_norm()
        timer = step_timer(args.warmup, rank, f"{variant}@{workers}")
        make_model, make_optimizer, loss, data, info = build(args.model, args.batch_size, workers, rank)
        with strategy.scope():
            model = make_model()
            model.compile(optimizer=make_optimizer(), loss=loss, steps_per_execution=args.steps_per_execution)
            model.fit(kp.data.per_worker(data), epochs=1, steps_per_epoch=args.warmup + args.steps, verbose=0,
                      callbacks=[timer])
    elif variant.startswith("horovod"):
        import horovod.tensorflow.keras as hvd
        hvd.init()
        if args.batch_norm == "global":  # Horovod's own synchronized batch norm, built where the model asks for one
            import horovod.tensorflow as hvd_tf
            import tensorflow as tf
            tf.keras.layers.BatchNormalization = hvd_tf.SyncBatchNormalization
        workers, rank = hvd.size(), hvd.rank()
        timer = step_timer(args.warmup, rank, f"{variant}@{workers}")
        make_model, make_optimizer, loss, data, info = build(args.model, args.batch_size, workers, rank)
        model = make_model()
        optimizer = hvd.DistributedOptimizer(make_optimizer(), sparse_as_dense=variant == "horovod-dense")
        model.compile(optimizer=optimizer, loss=loss, steps_per_execution=args.steps_per_execution)
        model.fit(data, epochs=1, steps_per_epoch=args.warmup + args.steps, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), timer])
    elif variant == "single":
        workers, rank = 1, 0
        timer = step_timer(args.warmup, rank, f"{variant}@{workers}")
        make_model, make_optimizer, loss, data, info = build(args.model, args.batch_size, 1, 0)
        model = make_model()
        model.compile(optimizer=make_optimizer(), loss=loss, steps_per_execution=args.steps_per_execution)
        model.fit(data, epochs=1, steps_per_epoch=args.warmup + args.steps, verbose=0, callbacks=[timer])
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    if rank == 0:
        import numpy as np
        sparse = [w for w in model.trainable_weights if "embedding" in w.name or "softmax" in w.name]
        dense_bytes = 4 * sum(int(np.prod(w.shape)) for w in model.trainable_weights if not any(w is s for s in sparse))
        table_bytes = 4 * sum(int(np.prod(w.shape)) for w in sparse)
        shape = {**info, "dense_bytes": dense_bytes, **({"table_bytes": table_bytes} if table_bytes else {})}
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"variant": variant, "workers": workers, "step_seconds": timer.times,
                       "timed_steps": timer.timed_steps,
                       "shape": shape}, f)


if __name__ == "__main__":
    main()
