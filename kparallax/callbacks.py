"""Keras callbacks users add to ``fit``: throughput, step logs, learning-rate warm-up, TensorBoard scalars,
checkpoints, stopping at a step. (The callbacks ``fit`` adds by itself are in ``core/fit_callbacks.py``.)"""

import time

import numpy as np
import tensorflow as tf

from kparallax._compat import optimizers as optimizer_compat


def _step(model):
    """The optimizer steps ``model`` has trained (of a compiled list of optimizers, the last one's)."""
    return int(optimizer_compat.step_optimizer(model).iterations.numpy())


class Throughput(tf.keras.callbacks.Callback):
    """Adds ``<unit>_per_sec`` (global, across all workers) to the epoch logs and prints it on the chief.

    Args:
      global_batch_size: items per step summed over workers (per-worker batch x workers x items per example).
      unit: what is counted, e.g. ``"samples"`` or ``"words"``.
      skip_steps: steps excluded at the start of each epoch (tracing, warm-up).
    """

    def __init__(self, global_batch_size, unit="samples", skip_steps=2):
        super().__init__()
        if not global_batch_size > 0 or skip_steps < 0:
            raise ValueError(f"Throughput needs global_batch_size > 0 and skip_steps >= 0. Received: "
                             f"global_batch_size={global_batch_size}, skip_steps={skip_steps}.")
        self._global_batch = global_batch_size
        self._unit = unit
        self._skip = skip_steps
        self._start = None
        self._steps = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._start, self._steps = None, 0

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == self._skip:
            self._start = time.perf_counter()
        elif batch + 1 > self._skip:
            self._steps += 1

    def on_epoch_end(self, epoch, logs=None):
        if self._start is None or self._steps == 0 or logs is None:
            return
        rate = self._steps * self._global_batch / (time.perf_counter() - self._start)
        logs[f"{self._unit}_per_sec"] = rate


def _learning_rate(optimizer):
    rate = optimizer.learning_rate
    if callable(rate) and not isinstance(rate, tf.Variable):
        rate = rate(optimizer.iterations)
    return float(tf.keras.backend.get_value(rate))


def sent_bytes(model):
    """(dense, sparse) bytes this worker has sent so far: allreduce payload and PS pushes (0, 0 before training,
    or for a model not compiled under a strategy)."""
    from kparallax.core import model_state  # pylint: disable=import-outside-toplevel
    compiled = model_state.compiled(model)
    return (0, 0) if compiled is None else compiled.step.sent_bytes()


class StepLogger(tf.keras.callbacks.Callback):
    """Each time the optimizer's step passes a multiple of ``every``, adds ``<unit>_per_sec`` (global, since the
    last report) to the batch logs and prints ``step N: loss ... perplexity ... <unit>/s ...`` on the chief. Steps
    are the optimizer's, so a run resumed from a checkpoint numbers them as the unbroken run did.

    Args:
      every: steps between reports.
      global_batch_size: items per step summed over workers (e.g. words: batch x num_steps x workers).
      unit: what is counted (``"words"``, ``"images"``).
      is_chief: print only where True (pass ``strategy.is_chief``).
    """

    def __init__(self, every, global_batch_size, unit="samples", is_chief=True):
        super().__init__()
        if every < 1:
            raise ValueError(f"every must be >= 1. Received: every={every}.")
        self._every, self._global_batch, self._unit, self._chief = every, global_batch_size, unit, is_chief
        self._mark = None  # (time, optimizer step) of the last report

    def on_train_begin(self, logs=None):
        self._mark = (time.perf_counter(), _step(self.model))

    def on_train_batch_end(self, batch, logs=None):
        step = _step(self.model)  # so that a resumed run numbers its steps as before
        if step // self._every == self._mark[1] // self._every or logs is None:
            return
        now = time.perf_counter()
        logs[f"{self._unit}_per_sec"] = (step - self._mark[1]) * self._global_batch / (now - self._mark[0])
        self._mark = (now, step)
        if self._chief:
            shown = " ".join(f"{k} {v:.4g}" for k, v in logs.items() if isinstance(v, (int, float)))
            print(f"step {step}: {shown}", flush=True)


class LearningRateWarmup(tf.keras.callbacks.Callback):
    """Linear warm-up of the learning rate to ``target`` over ``warmup_steps`` optimizer steps, then constant.

    Under kparallax the PS-side optimizer clones read the same learning-rate variable, so both paths warm up.
    """

    def __init__(self, target, warmup_steps):
        super().__init__()
        if warmup_steps < 1 or target <= 0:
            raise ValueError(f"LearningRateWarmup needs target > 0 and warmup_steps >= 1. Received: target={target}, "
                             f"warmup_steps={warmup_steps}.")
        self._target, self._steps = float(target), int(warmup_steps)

    def on_train_begin(self, logs=None):
        if optimizer_compat.optimizer_list(self.model.optimizer) is not None:
            raise ValueError(
                "LearningRateWarmup warms up one optimizer, but the model was compiled with a list of them. Received: "
                f"optimizer={[type(o).__name__ for o in self.model.optimizer]}. Give each optimizer a "
                "tf.keras.optimizers.schedules.LearningRateSchedule of its own, or compile with one optimizer.")

    def on_train_batch_begin(self, batch, logs=None):
        step = _step(self.model)
        if step <= self._steps:
            self.model.optimizer.learning_rate.assign(self._target * min(1.0, (step + 1) / self._steps))


class TensorBoardScalars(tf.keras.callbacks.Callback):
    """Writes scalars to TensorBoard event files on the chief only, each time the optimizer's step passes a multiple
    of ``every`` (a resumed run continues the same curves): the numeric batch logs
    (loss, perplexity, throughput, ...), ``learning_rate``, and ``bytes_per_step/dense`` and
    ``bytes_per_step/sparse`` (what this worker sent per step since the last write: allreduce payload, PS pushes).

    Args:
      log_dir: directory for the event files.
      every: steps between writes.
      is_chief: write only where True (pass ``strategy.is_chief``).
    """

    def __init__(self, log_dir, every=10, is_chief=True):
        super().__init__()
        if every < 1:
            raise ValueError(f"every must be >= 1. Received: every={every}.")
        self._log_dir, self._every, self._chief = log_dir, every, is_chief
        self._writer, self._last = None, (0, 0, 0)  # (optimizer step, dense bytes, sparse bytes) at the last write

    def on_train_begin(self, logs=None):
        if self._chief and self._writer is None:
            self._writer = tf.summary.create_file_writer(self._log_dir)
        dense, sparse = sent_bytes(self.model)
        self._last = (_step(self.model), dense, sparse)

    def on_train_batch_end(self, batch, logs=None):
        step = _step(self.model)  # a resumed run continues the same curves
        if not self._chief or step // self._every == self._last[0] // self._every:
            return
        dense, sparse = sent_bytes(self.model)
        steps = step - self._last[0]
        with self._writer.as_default(step=step):
            for key, value in (logs or {}).items():
                if isinstance(value, (int, float, np.number)):
                    tf.summary.scalar(key, float(value))
            listed = optimizer_compat.optimizer_list(self.model.optimizer)  # compile(optimizer=[...]): each one's
            rates = ([("learning_rate", self.model.optimizer)] if listed is None else
                     [(f"learning_rate/{index}", optimizer) for index, optimizer in enumerate(listed)])
            for name, optimizer in rates:
                tf.summary.scalar(name, _learning_rate(optimizer))
            tf.summary.scalar("bytes_per_step/dense", (dense - self._last[1]) / steps)
            tf.summary.scalar("bytes_per_step/sparse", (sparse - self._last[2]) / steps)
        self._last = (step, dense, sparse)
        self._writer.flush()

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.flush()


class Checkpoint(tf.keras.callbacks.Callback):
    """Worker 0 writes an atomic checkpoint of everything (``kparallax.checkpoint``) every ``every_steps``
    optimizer steps and at the end of training, keeping the ``keep`` newest.

    Give it to ``fit`` on every worker: each checkpoint also holds every worker's metric variables (gathered by a
    small collective), so that after ``kparallax.checkpoint.restore(..., continue_fit=True)`` the next ``fit``
    continues at the saved epoch and step with the metric averages as they were. What else decides the next step must follow from the step too:
    the data (e.g. ``dataset.repeat().skip(step)`` with a seeded shuffle) and the randomness of training (stateless
    ops seeded by the step, as ``kparallax_models.lm1b`` does); then the resumed run is bit-identical.

    Args:
      strategy: the ``HybridStrategy``.
      directory: where ``ckpt-<step>/`` and ``checkpoint.json`` go (visible to every worker for resuming).
      every_steps: optimizer steps between checkpoints.
      keep: the newest checkpoints kept (0: all).
      extra: optional callable returning a JSON-able dict saved with each checkpoint (e.g. the data position).
    """

    def __init__(self, strategy, directory, every_steps, keep=3, extra=None):
        super().__init__()
        if every_steps < 1 or keep < 0:
            raise ValueError(f"Checkpoint needs every_steps >= 1 and keep >= 0 (0: all). Received: "
                             f"every_steps={every_steps}, keep={keep}.")
        self._strategy, self._directory, self._every, self._keep, self._extra = (
            strategy, directory, every_steps, keep, extra)
        self._last = None
        self.bad_loss_step = None  # set when training stopped on a NaN/Inf loss

    def _save(self):
        """Called on every worker at the same steps: the metric states are gathered from all of them."""
        from kparallax import checkpoint  # pylint: disable=import-outside-toplevel
        from kparallax.core import resume  # pylint: disable=import-outside-toplevel
        step = _step(self.model)
        if step != self._last:
            metric_states = resume.gather_metric_states(self._strategy, self.model)
            if self._strategy.is_chief:
                checkpoint.save(self._strategy, self.model, self._directory,
                                extra=self._extra() if self._extra else None, keep=self._keep,
                                metric_states=metric_states)
            self._last = step

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not np.isfinite(loss):
            # The loss is averaged over workers, so every worker stops at this same step.
            self.bad_loss_step = _step(self.model)
            self.model.stop_training = True
            if self._strategy.is_chief:
                from kparallax import checkpoint  # pylint: disable=import-outside-toplevel
                print(f"loss is {loss} at step {self.bad_loss_step}: training stopped; the last good checkpoint "
                      f"is kept: {checkpoint.latest(self._directory)}", flush=True)
            return
        if _step(self.model) % self._every == 0:
            self._save()

    def on_train_end(self, logs=None):
        if self.bad_loss_step is None:
            self._save()


class StopAtStep(tf.keras.callbacks.Callback):
    """Stops ``fit`` once the optimizer has made ``total_steps`` steps (so a resumed run ends where it should)."""

    def __init__(self, total_steps):
        super().__init__()
        if total_steps < 0:
            raise ValueError(f"total_steps must be >= 0. Received: total_steps={total_steps}.")
        self._total = total_steps

    def on_train_batch_end(self, batch, logs=None):
        if _step(self.model) >= self._total:
            self.model.stop_training = True

    def on_train_begin(self, logs=None):
        if _step(self.model) >= self._total:
            self.model.stop_training = True
