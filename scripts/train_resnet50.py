"""Trains ResNet-50 v1.5 with kparallax (dense model: every architecture averages its gradients with allreduce,
except ``ps``, which keeps every variable on the PS tasks).

    # synthetic images, 2 workers on this machine (no PS needed):
    .venv/bin/kparallax-run --workers 2 --ps 0 -- .venv/bin/python scripts/train_resnet50.py \\
        --config=resnet50_small --data=synthetic --train_steps=50
    # ImageNet TFRecords (train-*-of-*, validation-*-of-*), on a cluster:
    kparallax-run --cluster cluster.yaml --host-index I -- python scripts/train_resnet50.py --config=resnet50 \\
        --data_dir=/data/imagenet --model_dir=/ckpt/resnet50 --epochs=90
    # one plain process:
    .venv/bin/python scripts/train_resnet50.py --config=resnet50_tiny --data=synthetic --train_steps=20

Every flag is optional. Worker 0 writes ``--model_dir/config.json``, prints loss and images/s every
``--log_every`` steps and writes TensorBoard scalars to ``--model_dir/tensorboard``.
"""

import json
import math
import os

from absl import app
from absl import flags


FLAGS = flags.FLAGS
flags.DEFINE_string("config", "resnet50_small", "Preset in configs/ (resnet50, resnet50_small, resnet50_tiny) or a JSON path.")
flags.DEFINE_enum("data", "imagenet", ["imagenet", "synthetic"], "ImageNet TFRecords under --data_dir, or synthetic.")
flags.DEFINE_string("data_dir", "data/imagenet", "Directory of train-*-of-* / validation-*-of-* TFRecords.")
flags.DEFINE_string("model_dir", "/tmp/kparallax_resnet50", "Where config.json and TensorBoard files go.")
flags.DEFINE_enum("architecture", None, ["hybrid", "allreduce", "ps"],
                  "kparallax architecture (default: $KPARALLAX_ARCHITECTURE, else hybrid = allreduce here).")
flags.DEFINE_integer("batch_size", None, "Per-worker batch; default: the preset's.", lower_bound=1)
flags.DEFINE_integer("train_steps", 0, "Optimizer steps (0: --epochs passes over the training records).",
                     lower_bound=0)
flags.DEFINE_integer("epochs", 1, "Passes over the training data when --train_steps=0.", lower_bound=1)
flags.DEFINE_float("learning_rate", None, "Base SGD learning rate for a global batch of 256 (scaled linearly).")
flags.DEFINE_integer("log_every", 10, "Steps between progress lines and TensorBoard writes.", lower_bound=1)
flags.DEFINE_integer("seed", 1, "Seed.")
flags.register_validator("learning_rate", lambda rate: rate is None or (math.isfinite(rate) and rate > 0),
                         "--learning_rate must be a finite number > 0")


def main(argv):
    del argv
    import tensorflow as tf
    import kparallax as kp
    from kparallax_models import imagenet_data
    from kparallax_models import resnet
    from kparallax_models import script_errors

    tf.keras.utils.set_random_seed(FLAGS.seed)
    strategy = kp.HybridStrategy(kp.Cluster.from_env(), architecture=FLAGS.architecture)
    overrides = {k: getattr(FLAGS, k) for k in ("batch_size", "learning_rate") if getattr(FLAGS, k) is not None}
    config = resnet.preset(FLAGS.config, **overrides)
    if strategy.is_chief:
        script_errors.check_writable_dir(FLAGS.model_dir, "--model_dir")
    n, index = strategy.num_workers, strategy.worker_index
    if FLAGS.data == "synthetic":
        data = imagenet_data.synthetic(config.batch_size, config.image_size, config.num_classes, seed=FLAGS.seed)
        steps_per_epoch = FLAGS.train_steps or 100
    else:
        paths = imagenet_data.files(FLAGS.data_dir, "train")
        if len(paths) < n:
            raise ValueError(f"{len(paths)} training file(s) for {n} workers: each worker reads its own files. "
                             f"Use fewer workers or more files. Received: --data_dir={FLAGS.data_dir}.")
        mine = paths[index::n]
        steps_per_epoch = kp.data.min_over_workers(imagenet_data.count_records(mine) // config.batch_size)
        if steps_per_epoch == 0:
            raise ValueError(f"A worker has fewer records than one batch of {config.batch_size}: lower --batch_size "
                             f"or give the workers more records. Received: --batch_size={config.batch_size}.")
        data = imagenet_data.dataset(mine, config.image_size, config.batch_size, training=True, seed=FLAGS.seed + index)
    if FLAGS.train_steps:
        steps_per_epoch = min(steps_per_epoch, FLAGS.train_steps)
        epochs = math.ceil(FLAGS.train_steps / steps_per_epoch)
    else:
        epochs = FLAGS.epochs
    data = kp.data.per_worker(data)
    if strategy.is_chief:
        with open(os.path.join(FLAGS.model_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump({"config": FLAGS.config, "model": {**vars(config)} if hasattr(config, "__dict__") else str(config),
                       "workers": n, "steps_per_epoch": steps_per_epoch, "epochs": epochs, "data": FLAGS.data},
                      f, indent=2, default=str)
    callbacks = [kp.callbacks.StepLogger(FLAGS.log_every, config.batch_size * n, "images", strategy.is_chief),
                 kp.callbacks.TensorBoardScalars(os.path.join(FLAGS.model_dir, "tensorboard"), FLAGS.log_every,
                                                 strategy.is_chief)]
    with strategy.scope():
        model = resnet.build(config)
        model.compile(optimizer=resnet.make_optimizer(config, n),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        history = model.fit(data, epochs=epochs, steps_per_epoch=steps_per_epoch, callbacks=callbacks, verbose=0)
    if strategy.is_chief:
        print(f"result: final_loss={history.history['loss'][-1]:.4f}", flush=True)


def run(argv):
    from kparallax_models import script_errors  # pylint: disable=import-outside-toplevel
    script_errors.run_with_clear_errors(main, argv, __file__)


if __name__ == "__main__":
    app.run(run)
