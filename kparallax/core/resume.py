"""Continuing a restored run exactly where it stopped: the epoch and step within it, and every worker's metrics.

``kparallax.checkpoint.restore(..., continue_fit=True)`` leaves a ``Pending`` record on the model; the next ``fit``
starts at the checkpoint's epoch and step within that epoch (as Keras' ``BackupAndRestore`` does, through the same
private counter hook, ``_compat.keras.set_initial_counters``) and, after Keras resets the metrics at that epoch's
start, puts back each worker's running averages as they were at the checkpoint. The metrics are saved per worker (one
small collective per checkpoint, ``gather_metric_states``), because ``fit`` logs their average over workers.
"""

import dataclasses
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf

from kparallax import log as logging
from kparallax._compat import keras as keras_compat


@dataclasses.dataclass
class Pending:
    """What the next ``fit`` of a restored model continues from."""
    step: int
    metrics: Optional[Dict[str, List[np.ndarray]]]  # this worker's metric variables by metric name, or None
    note: str = ""  # why the metrics restart, when they do


def metric_layout(model):
    """[(metric name, [its variables])] of the model's metrics that exist now, in ``model.metrics`` order."""
    return [(m.name, list(m.variables)) for m in model.metrics if m.variables]


def gather_metric_states(strategy, model):
    """Every worker's metric variables, flattened: (layout description, float64 [workers, k]). A collective."""
    layout = metric_layout(model)
    row = np.concatenate([np.ravel(v.numpy()).astype(np.float64) for _, variables in layout for v in variables]
                         or [np.zeros([0])])
    description = [{"name": name, "shapes": [list(v.shape) for v in variables]} for name, variables in layout]
    if strategy.num_workers == 1:
        return description, row[np.newaxis]
    import horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
    matrix = np.zeros([strategy.num_workers, row.size])
    matrix[strategy.worker_index] = row
    total = hvd.allreduce(tf.constant(matrix), op=hvd.Sum, name="kp_metric_states").numpy()
    return description, total


def pending_from_checkpoint(strategy, step, description, matrix):
    """The ``Pending`` record of this worker from a checkpoint's metric states (None or absent: metrics restart)."""
    if description is None:
        return Pending(step, None, "the checkpoint holds no metric states (written by kparallax.checkpoint.save "
                                   "without them)")
    if matrix.shape[0] != strategy.num_workers:
        return Pending(step, None, f"the checkpoint was written by {matrix.shape[0]} workers, this run has "
                                   f"{strategy.num_workers}")
    row, start, metrics = matrix[strategy.worker_index], 0, {}
    for entry in description:
        arrays = []
        for shape in entry["shapes"]:
            size = int(np.prod(shape))
            arrays.append(row[start:start + size].reshape(shape))
            start += size
        metrics[entry["name"]] = arrays
    return Pending(step, metrics)


class ResumePosition(tf.keras.callbacks.Callback):
    """Starts ``fit`` at a restored checkpoint's epoch and step, and puts back the metrics of that epoch."""

    def __init__(self, pending: Pending, clear):
        super().__init__()
        self._pending, self._clear = pending, clear
        self._metrics_done = False

    def on_train_begin(self, logs=None):
        steps = (self.params or {}).get("steps")
        if steps:
            keras_compat.set_initial_counters(self.model, *divmod(self._pending.step, steps))
        else:
            logging.info("resume: fit has no known number of steps per epoch, so it starts at the initial_epoch "
                         "given to fit rather than inside an epoch (step %d)", self._pending.step)

    def on_epoch_begin(self, epoch, logs=None):
        if self._metrics_done:
            return
        self._metrics_done = True
        steps = (self.params or {}).get("steps")
        if not steps or self._pending.step % steps == 0:
            return  # resumed at an epoch boundary: Keras' reset is what an unbroken run does here too
        if self._pending.metrics is None:
            logging.info("resume: the metric averages of epoch %d restart at step %d: %s", epoch + 1,
                         self._pending.step, self._pending.note)
            return
        missing = []
        for name, variables in metric_layout(self.model):
            saved = self._pending.metrics.get(name)
            if saved is None or [list(a.shape) for a in saved] != [list(v.shape) for v in variables]:
                missing.append(name)
                continue
            for variable, value in zip(variables, saved):
                variable.assign(value.astype(variable.dtype.as_numpy_dtype))
        if missing:
            logging.info("resume: metric(s) %s restart at step %d (not built yet or not in the checkpoint)",
                     ", ".join(missing), self._pending.step)

    def on_train_end(self, logs=None):
        keras_compat.set_initial_counters(self.model, None)
        self._clear()
