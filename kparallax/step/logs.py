"""A step's (or an epoch's) logs as one process would show them: one checked allreduce over the workers.

A Keras ``Metric`` keeps its state in variables made by ``add_weight``, each with an aggregation, ``SUM`` unless
the metric asks otherwise: ``Mean`` a total and a count (so every ``MeanMetricWrapper``: the loss, accuracy, MSE, a
user's metric function), ``AUC`` and the confusion-matrix metrics (precision, recall, F1, IoU, ...) counts,
``R2Score`` sums, and a user's ``Metric`` subclass whatever it adds up (an F1 from its own true and false positive
counts). Summed over the workers, those states are the states one process would hold after the same global
batches (when the step adds to them), so a result computed from the sums is one process's result, whatever its
shape (``F1Score``'s array per class). An average of the workers' results is not, for any ratio nor for a count. That is also what TensorFlow's
distribution strategies do: a metric's result is computed from its states aggregated over the replicas, each by its
variable's aggregation (``SUM``; ``MEAN``: their mean; ``ONLY_FIRST_REPLICA``: worker 0's). A metric with a state
of aggregation ``NONE`` (a ``tf.Variable`` made directly) says nothing of how its states combine: such a metric,
and any other float scalar in the logs (a custom ``train_step``'s), keeps the average of the workers' values. A state
a step sets instead of adding to is summed all the same (as ``tf.distribute`` sums it): by contract.

``over_workers`` sends the states and the other values in ONE allreduce, ``collectives.sum_checked``, which also
checks that every worker's optimizer is at the same step. In a step it depends on the forward pass only, so Horovod
negotiates it with the gradients instead of after the step. Each result is computed with the aggregated states
assigned to the metric's variables, which are restored afterwards: every worker keeps accumulating its own part.
"""

import numpy as np
import tensorflow as tf

from kparallax.step import collectives

_AGGREGATIONS = (tf.VariableAggregation.SUM, tf.VariableAggregation.MEAN, tf.VariableAggregation.ONLY_FIRST_REPLICA)


def is_additive(metric):
    """Whether ``metric``'s result can be computed from its states aggregated over the workers: it has states, and
    each says how they aggregate (``SUM``, ``MEAN`` or ``ONLY_FIRST_REPLICA``; every ``add_weight`` state does)."""
    variables = metric.variables
    return bool(variables) and all(getattr(v, "aggregation", None) in _AGGREGATIONS for v in variables)


def _part(variable, value, num_workers, worker_index, dtype):
    """This worker's term of ``variable``'s aggregation over the workers (``value``: its value here), as a flat
    ``dtype`` tensor to be summed."""
    value = tf.reshape(tf.cast(value, dtype), [-1])
    if variable.aggregation == tf.VariableAggregation.MEAN:
        return value / float(num_workers)
    if variable.aggregation == tf.VariableAggregation.ONLY_FIRST_REPLICA:
        return value * float(worker_index == 0)
    return value


def result_keys(metrics):
    """The log keys of the additive ``metrics`` (a metric's name, or the keys of a dict result)."""
    keys = []
    for metric in metrics:
        if is_additive(metric):
            result = metric.result()
            keys += list(result) if isinstance(result, dict) else [metric.name]
    return keys


def _dtype(value):
    """The dtype of a log: a tensor's, a NumPy value's, float64 for a Python float (eager logs)."""
    return value.dtype if isinstance(value, (tf.Tensor, tf.Variable)) else tf.as_dtype(np.asarray(value).dtype)


def _is_float_scalar(value):
    if isinstance(value, (tf.Tensor, tf.Variable)):
        return value.dtype.is_floating and value.shape.rank == 0
    return isinstance(value, (float, np.floating)) or (isinstance(value, np.ndarray) and value.ndim == 0)


def over_workers(logs, metrics, iterations, num_workers, name, weight=None, worker_index=0):
    """``logs`` (a dict: tensors in a traced step, numbers eagerly) over all workers, in one checked allreduce.

    Keys that are results of additive ``metrics`` take the result of the aggregated states (of any shape); other
    float scalars are averaged, each worker's times ``weight`` when given (its share of the global batch, when
    batches may differ in size: a per-batch mean then averages to the global batch's); everything else is left as
    this worker has it.
    ``iterations``: this worker's optimizer step (read before this step's update); ``name``: the allreduce's, the
    same on every worker; ``worker_index``: this worker's (for states aggregated as ``ONLY_FIRST_REPLICA``).
    """
    if num_workers == 1 or not isinstance(logs, dict):
        return logs
    exact = [m for m in metrics if is_additive(m)]
    variables = [v for m in exact for v in m.variables]
    local = [tf.identity(v.read_value()) for v in variables]
    # Computed from the summed states below, so not sent again. Names only: calling result() here would add reads of
    # every state to the step. A dict result's keys are sent too, then replaced by the states' results.
    from_states = {m.name for m in exact}
    keys = [k for k, v in logs.items() if _is_float_scalar(v) and k not in from_states]
    # Summed in float32, or in float64 where a state or a log is (a float64 model's logs keep their precision).
    dtype = tf.float64 if tf.float64 in {v.dtype for v in variables} | {_dtype(logs[k]) for k in keys} else tf.float32
    payload = [_part(v, value, num_workers, worker_index, dtype) for v, value in zip(variables, local)]
    others = [tf.cast(logs[k], dtype) for k in keys]
    if weight is not None:
        others = [value * tf.cast(weight, dtype) for value in others]
    payload += [tf.reshape(value, [-1]) for value in others]
    summed = collectives.sum_checked(tf.concat(payload, axis=0) if payload else tf.zeros([0], dtype),
                                     iterations, num_workers, name)
    out = dict(logs)
    offset = 0
    for variable in variables:
        size = variable.shape.num_elements()
        variable.assign(tf.cast(tf.reshape(summed[offset:offset + size], variable.shape), variable.dtype))
        offset += size
    results = {}
    for metric in exact:
        result = metric.result()
        results.update(result if isinstance(result, dict) else {metric.name: result})
    averaged = {key: summed[offset + i] / float(num_workers) for i, key in enumerate(keys)}
    # A metric's result of any shape (F1Score's per-class vector) is its aggregated states' result.
    for key, value in {**averaged, **{k: v for k, v in results.items() if k in logs}}.items():
        out[key] = tf.identity(tf.cast(value, _dtype(logs[key])))
    for variable, value in zip(variables, local):
        variable.assign(value)
    return out
