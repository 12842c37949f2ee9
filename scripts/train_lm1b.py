"""Trains the LM1B LSTM language model with kparallax.

    # 2 workers + 1 PS on this machine, on the offline real-text corpus (scripts/make_lm1b_corpus.py):
    .venv/bin/kparallax-run --workers 2 --ps 1 -- .venv/bin/python scripts/train_lm1b.py \\
        --config=lm1b_small --data_dir=data/lm1b_offline --model_dir=/tmp/lm1b --train_steps=300
    # the published data set, the full model:
    kparallax-run --cluster cluster.yaml --host-index I -- python scripts/train_lm1b.py --config=lm1b \\
        --data_dir=/data/lm1b --model_dir=/ckpt/lm1b
    # synthetic Zipf ids (benchmarks), any architecture:
    kparallax-run --workers 2 --ps 1 --architecture ps -- python scripts/train_lm1b.py --data=synthetic
    # one plain process (no PS task: the model then trains with architecture=allreduce on one worker):
    .venv/bin/python scripts/train_lm1b.py --config=lm1b_tiny --data=synthetic --train_steps=50

Every flag is optional (defaults below). Worker 0 checkpoints everything (weights, PS tables, optimizer slots on
both paths, step) into ``--model_dir`` every ``--checkpoint_every`` steps and at the end; started again with the
same ``--model_dir``, the script resumes from the latest checkpoint and continues the data order where it stopped. The resolved configuration is written to ``--model_dir/config.json`` by
worker 0, which also prints progress (loss, sampled-softmax perplexity, words/s) every ``--log_every`` steps, writes
TensorBoard scalars to ``--model_dir/tensorboard`` and, at the end, the held-out perplexity with the full softmax.
"""

import json
import math
import os

from absl import app
from absl import flags


FLAGS = flags.FLAGS
flags.DEFINE_string("config", "lm1b_small", "Preset in configs/ (lm1b, lm1b_small, lm1b_tiny) or a JSON path.")
flags.DEFINE_enum("data", "lm1b", ["lm1b", "synthetic"], "LM1B files under --data_dir, or synthetic Zipf ids.")
flags.DEFINE_string("data_dir", "data/lm1b_offline", "Directory in the LM1B layout.")
flags.DEFINE_string("model_dir", "/tmp/kparallax_lm1b", "Where config.json and TensorBoard files go.")
flags.DEFINE_enum("architecture", None, ["hybrid", "allreduce", "ps"],
                  "kparallax architecture (default: $KPARALLAX_ARCHITECTURE, else hybrid; allreduce without PS).")
flags.DEFINE_string("partitions", "1", "Row shards per table: an integer or 'auto'.")
flags.DEFINE_integer("batch_size", None, "Per-worker batch (windows); default: the preset's.", lower_bound=1)
flags.DEFINE_integer("num_steps", None, "Unrolled LSTM steps per window; default: the preset's.", lower_bound=1)
flags.DEFINE_integer("train_steps", 0, "Optimizer steps to train (0: --epochs full passes).", lower_bound=0)
flags.DEFINE_integer("epochs", 1, "Passes over the training data when --train_steps=0.", lower_bound=1)
flags.DEFINE_float("learning_rate", None, "Adagrad learning rate; default: the preset's (0.2).")
flags.DEFINE_integer("warmup_steps", 0, "Linear learning-rate warm-up steps (0: none).", lower_bound=0)
flags.DEFINE_integer("log_every", 20, "Steps between progress lines and TensorBoard writes.", lower_bound=1)
flags.DEFINE_integer("synthetic_windows", 4096, "Windows per worker with --data=synthetic.", lower_bound=1)
flags.DEFINE_boolean("eval", True, "Evaluate held-out perplexity (full softmax) at the end.")
flags.DEFINE_integer("seed", 1, "Shuffling and initialization seed.")
flags.DEFINE_integer("checkpoint_every", 100, "Optimizer steps between checkpoints in --model_dir (and one at the "
                     "end); a run resumes from the latest checkpoint there automatically.", lower_bound=1)
flags.register_validator("partitions", lambda text: text == "auto" or (text.isdigit() and int(text) >= 1),
                         "--partitions must be an integer >= 1 or 'auto'")
flags.register_validator("learning_rate", lambda rate: rate is None or (math.isfinite(rate) and rate > 0),
                         "--learning_rate must be a finite number > 0")


def _partitions(text):
    return text if text == "auto" else int(text)  # checked when the flags are parsed


def _write_json(path, data):
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def main(argv):
    del argv
    import numpy as np
    import tensorflow as tf
    import kparallax as kp
    from kparallax_models import lm1b
    from kparallax_models import lm1b_data
    from kparallax_models import script_errors

    tf.keras.utils.set_random_seed(FLAGS.seed)
    cluster = kp.Cluster.from_env()
    architecture = kp.options.architecture_from_env(FLAGS.architecture,
                                                    default="hybrid" if cluster.num_ps else "allreduce")
    strategy = kp.HybridStrategy(cluster, architecture=architecture, partitions=_partitions(FLAGS.partitions))
    if strategy.is_chief:
        script_errors.check_writable_dir(FLAGS.model_dir, "--model_dir")
    overrides = {k: getattr(FLAGS, k) for k in ("batch_size", "num_steps", "learning_rate")
                 if getattr(FLAGS, k) is not None}
    config = lm1b.preset(FLAGS.config, **overrides)
    n, index = strategy.num_workers, strategy.worker_index

    heldout = None
    if FLAGS.data == "synthetic":
        x, y = lm1b_data.synthetic(FLAGS.synthetic_windows, config.num_steps, config.vocab_size,
                                   seed=FLAGS.seed + index)
        vocab_size, source = config.vocab_size, "synthetic Zipf ids"
    else:
        vocab = lm1b_data.Vocabulary.load(os.path.join(FLAGS.data_dir, lm1b_data.VOCAB_FILE),
                                          max_size=config.vocab_size)
        vocab_size = min(config.vocab_size, len(vocab))
        files = lm1b_data.files(FLAGS.data_dir, "train")
        if len(files) < n:
            raise ValueError(f"{len(files)} training file(s) for {n} workers: each worker reads its own files. "
                             f"Use fewer workers or more shards. Received: --data_dir={FLAGS.data_dir}.")
        x, y = lm1b_data.windows(files[index::n], vocab, config.num_steps)
        source = f"{len(files[index::n])} of {len(files)} files in {FLAGS.data_dir}"
        if FLAGS.eval:
            heldout = lm1b_data.windows(lm1b_data.files(FLAGS.data_dir, "heldout"), vocab, config.num_steps)
    if config.num_sampled >= vocab_size:
        config = lm1b.preset(FLAGS.config, **overrides, num_sampled=max(1, vocab_size // 4))
    config = lm1b.LMConfig(**{**lm1b.config_dict(config), "vocab_size": vocab_size})
    steps_per_epoch = kp.data.min_over_workers(len(x) // config.batch_size)
    if steps_per_epoch == 0:
        what = "--synthetic_windows" if FLAGS.data == "synthetic" else "its files"
        raise ValueError(f"A worker has fewer windows than one batch of {config.batch_size} (worker {index} has "
                         f"{len(x)}): lower --batch_size or give the workers more windows ({what}). "
                         f"Received: --batch_size={config.batch_size}.")
    if FLAGS.train_steps:
        steps_per_epoch = min(steps_per_epoch, FLAGS.train_steps)
        total_steps = FLAGS.train_steps
    else:
        total_steps = FLAGS.epochs * steps_per_epoch
    epochs = math.ceil(total_steps / steps_per_epoch)
    dataset = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=FLAGS.seed + index)
               .repeat().batch(config.batch_size, drop_remainder=True))

    resolved = {"flags": {f: getattr(FLAGS, f) for f in ("config", "data", "data_dir", "model_dir", "partitions",
                                                            "train_steps", "epochs", "log_every", "seed",
                                                            "warmup_steps")},
                "model": lm1b.config_dict(config), "architecture": architecture, "workers": n,
                "ps_tasks": cluster.num_ps, "data_source": source, "steps_per_epoch": steps_per_epoch,
                "epochs": epochs}
    if strategy.is_chief:
        _write_json(os.path.join(FLAGS.model_dir, "config.json"), resolved)
        print(f"training {FLAGS.config} ({architecture}, {n} worker(s), {cluster.num_ps} PS task(s), {total_steps} "
              f"steps) on {source}; configuration: {os.path.join(FLAGS.model_dir, 'config.json')}", flush=True)

    words_per_step = config.batch_size * config.num_steps * n
    callbacks = [kp.callbacks.StepLogger(FLAGS.log_every, words_per_step, "words", strategy.is_chief),
                 kp.callbacks.TensorBoardScalars(os.path.join(FLAGS.model_dir, "tensorboard"), FLAGS.log_every,
                                                 strategy.is_chief)]
    if FLAGS.warmup_steps:
        callbacks.insert(0, kp.callbacks.LearningRateWarmup(config.learning_rate, FLAGS.warmup_steps))
    saver = kp.callbacks.Checkpoint(strategy, FLAGS.model_dir, FLAGS.checkpoint_every)
    callbacks += [saver, kp.callbacks.StopAtStep(total_steps)]
    with strategy.scope():
        model = lm1b.LM1B(config, seed=FLAGS.seed, stream=index)
        model.compile(optimizer=lm1b.make_optimizer(config))
        start = 0
        latest = kp.checkpoint.latest(FLAGS.model_dir)
        if latest:
            start = kp.checkpoint.restore(strategy, model, latest, continue_fit=True)["step"]
            if strategy.is_chief:
                print(f"resumed from {latest} (step {start} of {total_steps})", flush=True)
        if start >= total_steps:
            summary = _finished_run_summary(start, total_steps, strategy.is_chief)
        else:
            dataset = kp.data.per_worker(dataset.skip(start).prefetch(2))  # the data order continues where it stopped
            history = model.fit(dataset, epochs=epochs, initial_epoch=start // steps_per_epoch,
                                steps_per_epoch=steps_per_epoch, callbacks=callbacks, verbose=0)
            if saver.bad_loss_step is not None:
                raise ValueError(f"the loss became NaN/Inf at step {saver.bad_loss_step}; the last good checkpoint "
                                 f"in {FLAGS.model_dir} is kept. Lower --learning_rate or check the data.")
            summary = {"final_loss": float(history.history["loss"][-1]),
                       "train_perplexity_sampled": float(history.history["perplexity"][-1]), "steps": total_steps}
    if heldout is not None:
        result = model.evaluate(heldout[0], heldout[1], batch_size=config.batch_size, verbose=0, return_dict=True)
        summary["heldout_loss"], summary["heldout_perplexity"] = float(result["loss"]), float(result["perplexity"])
    if strategy.is_chief:
        _write_json(os.path.join(FLAGS.model_dir, "result.json"), summary)
        print("result: " + " ".join(f"{k}={v}" if isinstance(v, int) else f"{k}={v:.4f}" for k, v in summary.items()),
              flush=True)
    del np


def _finished_run_summary(start, total_steps, is_chief):
    """The training figures of a run whose checkpoint is already at its last step: nothing is trained again.

    They are the finished run's own, from its ``result.json``; without that file (the run stopped after its last
    checkpoint and before writing it) there are none, and only the held-out figures are computed again.
    """
    path = os.path.join(FLAGS.model_dir, "result.json")
    previous = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            previous = json.load(f)
    if is_chief:
        print(f"nothing to train: the checkpoint in {FLAGS.model_dir} is at step {start} of {total_steps}; "
              f"pass a larger --train_steps or --epochs to train on, or a new --model_dir to start again", flush=True)
    summary = {k: previous[k] for k in ("final_loss", "train_perplexity_sampled") if k in previous}
    summary["steps"] = total_steps
    return summary


def run(argv):
    from kparallax_models import script_errors  # pylint: disable=import-outside-toplevel
    script_errors.run_with_clear_errors(main, argv, __file__)


if __name__ == "__main__":
    app.run(run)
