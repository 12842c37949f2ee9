"""Metrics updated with one value per batch, counted as one process counts them.

``model.add_metric(tensor)`` and a ``Mean`` (or ``Sum``) that a custom ``train_step`` feeds one value per batch
(Keras' guides track the loss so: ``self.loss_tracker.update_state(loss)``) add that value to their state once per
step, with no sample weight. One process adds its global batch's value. Each worker adds its own, and the states are
summed over the workers (``logs.py``), so the logged result was the mean of the workers' values: half one process's
for a sum over the batch on 2 workers (a row count, a sum of predictions), and off it for a mean when the batches
differ in size (each worker's mean counted alike: the guide's loss tracker 0.0056 off one process's on a partial
last batch), silently.

While the synchronous step is traced (``weighing``), such an update is weighted as the compiled metric functions
that give one scalar are (``_compat.keras_losses``): each worker adds ``value * N`` with weight ``1 / N`` for a sum
over the batch (summed over the workers: the global batch's sum, counted once), and ``value`` with weight
``share / N`` for a mean or a value the batch does not change (the global batch's mean; ``share`` is the worker's
share of the global batch, 1 when batches have one size). A value is told to be a sum or a mean as those functions'
values are, by its value on the batch repeated twice (a sum doubles, a mean stays), recomputed from the ops after
the batch's rows (``_compat.repeated_rows``). A value that cannot be told (the step runs eagerly; another op, such as
a reshape to a fixed shape, a sparse op or a branch, or more than 64 ops lie between it and the batch's rows) keeps
Keras' own count, with a warning naming the metric and why. With a batch of static size (``drop_remainder=True``) a
value divided after the batch's rows (by a count TensorFlow folded into a constant) is taken for a mean.
Updates with a sample weight, values with more than one element (Keras weighs every element alike,
which the summed states already count exactly) and metrics of other classes are Keras' own.
"""

import contextlib
import threading

import tensorflow as tf

from kparallax import log as logging
from kparallax._compat import keras_losses
from kparallax._compat import repeated_rows
from kparallax.step import rows_meet

_ACTIVE = threading.local()
_WARNED = set()


@contextlib.contextmanager
def weighing(model, data, num_workers, share=None):
    """While ``model``'s synchronous training step on ``data`` (this worker's batch) is traced with ``num_workers``
    workers: updates with one value and no sample weight of ``model``'s ``Mean`` and ``Sum`` metrics (also those
    ``add_metric`` makes in this trace) count as one process's. ``share``: this worker's share of the global batch
    (a float64 scalar tensor), or None when every worker's batch has the same rows."""
    if num_workers == 1:
        yield
        return

    def weigh(metric, value):
        return _weighed(metric, value, data, num_workers, share)

    def install(metric):
        if any(metric is m for m in model.metrics):
            keras_losses.weigh_scalar_updates(metric, _current)

    for metric in model.metrics:
        install(metric)
    outer, _ACTIVE.weigh = getattr(_ACTIVE, "weigh", None), weigh
    try:
        with keras_losses.on_metric_call(install):
            yield
    finally:
        _ACTIVE.weigh = outer


def _current(metric, value):
    """(value, sample weight) for one update of ``metric`` with one ``value``, or None outside ``weighing``."""
    weigh = getattr(_ACTIVE, "weigh", None)
    return None if weigh is None else weigh(metric, value)


def _weighed(metric, value, data, num_workers, share):
    """``value`` and its sample weight for ``metric``'s update, or None (Keras' own count) when the value cannot be
    told a sum or a mean (with a warning, once per metric name)."""
    sums = None
    if tf.is_symbolic_tensor(value):
        try:
            with rows_meet.apart():  # the doubled rows are two blocks of the batch: not the model's rows meeting
                sums = repeated_rows.sums(value, data)
        except (ValueError, TypeError, tf.errors.OpError) as error:
            reason = f"its value could not be evaluated on the batch repeated twice ({type(error).__name__}: {error})"
        else:
            reason = None
    else:
        reason = "the step runs eagerly (run_eagerly=True), so there is no graph to evaluate its value again"
    if reason is not None:
        if metric.name not in _WARNED:
            _WARNED.add(metric.name)
            logging.warning(
                "Metric %r is updated with one value per batch and no sample weight, and kparallax cannot tell whether "
                "that value sums or averages over the batch: %s. Its logged result is the mean of the workers' "
                "values, which is one process's only for a mean over batches of one size.", metric.name, reason)
        return None
    dtype = tf.as_dtype(metric.dtype)  # the weight's, as Keras casts it (a float16 value's metric keeps float32)
    share = tf.ones([], dtype) if share is None else tf.cast(share, dtype)
    return keras_losses.batch_scalar_update(value, sums, num_workers, share)
