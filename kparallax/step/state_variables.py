"""Replicated variables a training step assigns besides the optimizer: a layer's own running statistic, a counter.

One process assigns such a variable from the global batch; under kparallax each worker's step assigns its own copy
from its own rows, so the copies drift apart and away from one process's. TensorFlow's distribution strategies
refuse that assignment in a replica's step unless the variable says how replicas combine (``aggregation``), and
then combine every assignment's value over the replicas before it is made. kparallax does the same while a
synchronous training step is traced (``_compat/assign_hook.py``), for the model's replicated non-trainable
variables. An ``ON_READ`` variable with one of the aggregations below is combined too (TensorFlow's strategies keep
one per replica and combine them when it is read; combining each assignment gives every worker that value, the one
process's for an assignment linear in the batch); one with ``NONE`` stays each worker's own. Keras'
BatchNormalization statistics (global through ``batch_norm.py``) and metrics' states (combined when logged) are not
concerned. Each ``assign`` / ``assign_add`` / ``assign_sub`` of such a variable then uses, as its value or delta:

  * ``MEAN``: the workers' values averaged, each weighted by its share of the global batch (one process's value for
    an assignment linear in the batch: a moving average of the batch's mean, a mean over its rows);
  * ``SUM``: their sum (``assign_add`` of each worker's row count: the global batch's);
  * ``ONLY_FIRST_REPLICA``: worker 0's.
Later reads in the same step see the combined value, as in one process. ``NONE`` (Keras' default), not ``ON_READ``,
is left as each worker's: ``fit`` compares all of them over the workers after its first step
(``fit_callbacks.SameState``; ``train_on_batch`` after its first call) and refuses any that differ, naming them and
these aggregations. A model built by its first call creates its variables while its step is traced: they are looked
for at the first assignment of each variable.
"""

import contextlib
import zlib

import numpy as np
import tensorflow as tf

from kparallax._compat import assign_hook
from kparallax._compat import batch_norm as bn_compat
from kparallax._compat import keras as keras_compat
from kparallax.step import collectives

_AGGREGATED = (tf.VariableAggregation.MEAN, tf.VariableAggregation.SUM, tf.VariableAggregation.ONLY_FIRST_REPLICA)


def candidates(model, is_ps_variable):
    """The replicated non-trainable variables of ``model`` that a step could assign differently on each worker
    (none before a model not built yet has its variables): all but ``ON_READ`` ones, and ``ON_READ`` ones with an
    aggregation other than ``NONE``, except the states of metrics and of BatchNormalization layers."""
    if not keras_compat.weights_created(model):
        return []
    variables = [v for v in model.non_trainable_weights if isinstance(v, tf.Variable) and not is_ps_variable(v)]
    on_read = [v for v in variables if v.synchronization == tf.VariableSynchronization.ON_READ]
    kept = set()
    if any(v.aggregation in _AGGREGATED for v in on_read):
        kept = {v.ref() for layer in model.submodules
                if isinstance(layer, tf.keras.metrics.Metric) or bn_compat.is_batch_norm(layer)
                for v in layer.variables}
    return [v for v in variables if v.synchronization != tf.VariableSynchronization.ON_READ
            or (v.aggregation in _AGGREGATED and v.ref() not in kept)]


@contextlib.contextmanager
def combined(model, is_ps_variable, num_workers, share):
    """While a step of ``model`` is traced: assignments of its aggregated variables are combined over the
    ``num_workers`` workers (collectives in the step; every worker traces the same ones, in the same order).
    ``share``: ``num_workers`` x this worker's share of the global batch, or None when the batches are equal."""
    def aggregated():
        return {v.ref() for v in candidates(model, is_ps_variable) if v.aggregation in _AGGREGATED}

    members = aggregated()
    # A model not built yet builds in this trace: its variables are looked for at each assignment.
    if num_workers == 1 or (not members and keras_compat.weights_created(model)):
        yield
        return
    weight = tf.constant(1.0 / num_workers, tf.float64) if share is None else share / num_workers
    count = [0]
    others = set()  # variables found not to be members (an optimizer's slots, say): not looked for again

    def combine(variable, method, value):
        if variable.ref() not in members and variable.ref() not in others:
            members.update(aggregated())
            if variable.ref() not in members:
                others.add(variable.ref())
        if variable.ref() not in members:
            return value
        name, count[0] = f"kp_state_{count[0]}", count[0] + 1
        value = tf.convert_to_tensor(value, dtype=variable.dtype)
        if variable.aggregation == tf.VariableAggregation.MEAN:
            if not variable.dtype.is_floating:
                raise ValueError(
                    f"Variable {variable.name!r} has aggregation=MEAN, which averages the workers' values, but holds "
                    f"{variable.dtype.name}. Received: {method} of a {variable.dtype.name} variable with "
                    "aggregation=MEAN. Use a float variable, or SUM for a count.")
            return collectives.sum_over_workers(value * tf.cast(weight, value.dtype), num_workers, name)
        if variable.aggregation == tf.VariableAggregation.SUM:
            return collectives.sum_over_workers(value, num_workers, name)
        return collectives.from_first_worker(value, num_workers, name)

    with assign_hook.combining(combine):
        yield


def trainable_replicas(model, is_ps_variable):
    """The replicated trainable variables of ``model`` (none before it is built): the optimizer updates each from
    the gradient averaged over the workers, so every worker holds the same values after a step."""
    if not keras_compat.weights_created(model):
        return []
    return [v for v in model.trainable_weights if isinstance(v, tf.Variable) and not is_ps_variable(v)]


def differing(variables, num_workers, name):
    """``variables`` whose values differ between the workers (eager; every worker must call it): one allgather of a
    CRC-32 of each one's bytes."""
    local = [zlib.crc32(np.ascontiguousarray(v.numpy()).tobytes()) for v in variables]
    rows = collectives.allgather_ints(local, name) if num_workers > 1 else [local]
    return [v for j, v in enumerate(variables) if len({row[j] for row in rows}) > 1]


def refuse_differing(variables):
    """The error for replicated ``variables`` that the first training step left different on the workers."""
    trained = [v.name for v in variables if v.trainable]
    if trained:
        return ValueError(
            f"Trainable variable(s) {trained} differ between the workers after the first training step: the step "
            "changed them by other means than the optimizer, which updates every worker's copy from the gradient "
            "averaged over the workers (an update written by hand in a custom train_step, variable.assign_sub(lr * "
            "gradient), uses each worker's own gradient), so the copies drift apart and away from one process on "
            f"the global batch, silently. Received: {len(trained)} replicated trainable variable(s) left different. "
            "Apply the gradients with an optimizer (self.optimizer.apply_gradients, or a second optimizer given to "
            "compile: see the README), which averages them over the workers first.")
    names = [v.name for v in variables]
    plain = [v.name for v in variables if v.aggregation not in _AGGREGATED]
    if not plain:
        return ValueError(
            f"Variable(s) {names} differ between the workers after the first training step although their "
            "aggregation combines every assign / assign_add / assign_sub in the step: something else wrote them "
            "(a scatter update, a raw op, an assignment outside the model's training step). Received: "
            f"{len(names)} aggregated variable(s) left different. Assign them with assign, assign_add or assign_sub "
            "in the step.")
    return ValueError(
        f"Variable(s) {plain} changed differently on the workers in the first training step: the step assigns them "
        "from each worker's own rows (a layer's running statistic, say), while one process assigns them once from "
        f"the global batch, so the copies drift apart, silently. Received: {len(plain)} replicated non-trainable "
        "variable(s) with aggregation=NONE assigned in the step. Say how the workers' values combine, as "
        "TensorFlow's distribution strategies require for a variable assigned in a training step: "
        "add_weight(..., aggregation=tf.VariableAggregation.MEAN) averages every assignment's value over the "
        "workers (weighted by their rows: one process's value for an assignment linear in the batch), SUM adds "
        "them, ONLY_FIRST_REPLICA takes worker 0's; or create it with synchronization=ON_READ (and aggregation NONE) "
        "to keep one per worker.")
