"""Keras callbacks kparallax adds to every ``fit`` (and ones users may add themselves)."""

import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from kparallax import _compat


class SyncReplicatedVariables(tf.keras.callbacks.Callback):
    """Makes every worker start from worker 0's replicated weights.

    At the start of training it waits for this worker's pending PS writes, then broadcasts worker 0's values of
    every replicated model variable (a collective, so it is also a barrier). Variables that first appear during
    the first step (a model built inside ``fit``) are broadcast after that step.
    """

    def __init__(self, strategy):
        super().__init__()
        self._strategy = strategy
        self._synced = set()

    def _sync(self):
        variables = [v for v in self.model.variables
                     if not self._strategy.is_ps_variable(v) and v.ref() not in self._synced]
        _compat.async_wait()
        if self._strategy.num_workers > 1 and variables:
            hvd.broadcast_variables(variables, root_rank=0)
        elif self._strategy.num_workers > 1:
            hvd.allreduce(tf.constant(0.0), op=hvd.Sum, name="kp_start_barrier")
        self._synced.update(v.ref() for v in variables)
        return variables

    def on_train_begin(self, logs=None):
        self._sync()

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0 and len(self._synced) < len(self.model.variables):
            late = self._sync()
            if late:
                tf.get_logger().warning(
                    "%d replicated variable(s) were created during the first step and were synchronized after it. "
                    "Build the model before fit (give it an input shape) for exact single-process equivalence.",
                    len(late))


class AverageMetrics(tf.keras.callbacks.Callback):
    """Replaces each logged loss/metric with its average over workers (every batch and every epoch).

    With ``sync=False`` (asynchronous PS) only epoch logs are averaged: a per-batch collective would put the
    workers back in lock-step; the per-batch progress then shows worker 0's own values.
    """

    def __init__(self, strategy):
        super().__init__()
        self._strategy = strategy
        self._per_batch = strategy.options.sync

    def _average(self, logs, tag):
        if self._strategy.num_workers == 1 or not logs:
            return
        keys = sorted(k for k, v in logs.items() if isinstance(v, (int, float, np.number, np.ndarray)))
        if not keys:
            return
        values = hvd.allreduce(tf.constant([float(logs[k]) for k in keys], tf.float64), op=hvd.Average,
                               name=f"kp_metrics_{tag}")
        for key, value in zip(keys, values.numpy()):
            logs[key] = float(value)

    def on_train_batch_end(self, batch, logs=None):
        if self._per_batch:
            self._average(logs, "batch")

    def on_epoch_end(self, epoch, logs=None):
        self._average(logs, "epoch")


class Throughput(tf.keras.callbacks.Callback):
    """Adds ``<unit>_per_sec`` (global, across all workers) to the epoch logs and prints it on the chief.

    Args:
      global_batch_size: items per step summed over workers (per-worker batch x workers x items per example).
      unit: what is counted, e.g. ``"samples"`` or ``"words"``.
      skip_steps: steps excluded at the start of each epoch (tracing, warm-up).
    """

    def __init__(self, global_batch_size, unit="samples", skip_steps=2):
        super().__init__()
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
