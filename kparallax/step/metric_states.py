"""Metric states a training step sets instead of adding to, or that do not say how the workers' values combine:
refused while the step is traced.

``logs.py`` logs a metric's result from its states summed over the workers (``add_weight``'s default aggregation,
``SUM``, which tf.distribute's strategies sum over replicas the same way). That is one process's state when the
step only adds to a state: ``assign_add``, ``assign_sub`` or ``assign(state + delta)``, as every Keras metric
does (totals, counts, confusion matrices). A state the step sets to a value of the batch (a last batch's mean, a
running maximum ``assign(tf.maximum(state, ...))``) is not: the sum of the workers' values is no value one process
holds (a last batch's mean logged at twice one process's on 2 workers), and the callbacks watching the metric
(``EarlyStopping``, ``ReduceLROnPlateau``, ``ModelCheckpoint(save_best_only=True)``) act on it, silently.

So while a synchronous step of several workers is traced (``checked``), an ``assign`` of a ``SUM`` state of a
metric whose result comes from its states (``logs.is_additive``) is refused unless its value is the state plus
(or minus) something that does not read the state, naming the metric, the state and the fixes; so is a ``scatter_*``
write that sets entries (``scatter_update``, ``scatter_max``, ``scatter_mul``, their ``_nd`` forms,
``batch_scatter_update``: the classes seen so far, marked 1, would be 2 where both workers saw one), while
``scatter_add`` / ``scatter_sub`` (and ``_nd``) add and run. States that say how the workers' values combine
(``MEAN``, ``ONLY_FIRST_REPLICA``) are the user's choice and are not checked, nor are raw ops.

A state of aggregation ``NONE`` (a ``tf.Variable`` made directly in a metric) says nothing of how the workers'
values combine, so ``logs.py`` could only average the workers' results: a count or a total logged at 1/N of one
process's (a row count 4 on 2 workers where one process counts 8; tf.distribute's ``MirroredStrategy`` logs the
same 4), a ratio of unequal parts at no value one process holds. Any write of one in the step is refused, naming
the fixes (``add_weight``, or an aggregation given to ``tf.Variable``).
"""

import contextlib

import tensorflow as tf

from kparallax._compat import assign_hook
from kparallax._compat import keras as keras_compat
from kparallax.step import logs

_PASSED = ("Identity", "Cast")
_ADDS = ("AddV2", "Add", "Sub")
_CHECKED = (tf.VariableAggregation.SUM, tf.VariableAggregation.NONE)
_SCATTERS_ADDING = ("scatter_add", "scatter_sub", "scatter_nd_add", "scatter_nd_sub")
_SEARCHED = 256  # ops looked at for a read of the state in the delta (beyond: taken to read it)


@contextlib.contextmanager
def checked(model, num_workers):
    """While ``model``'s synchronous training step is traced with ``num_workers`` workers: a write of a ``SUM``
    state of one of its metrics that sets the state instead of adding to it, and any write of a metric's state of
    aggregation ``NONE``, raise ``ValueError``."""
    if num_workers == 1:
        yield
        return
    states, others = {}, set()  # states: a metric's SUM state (of an additive metric) or NONE state -> the metric

    def refresh():
        for metric in model.metrics:
            additive = logs.is_additive(metric)
            for variable in metric.variables:
                if variable.aggregation == tf.VariableAggregation.NONE or (
                        variable.aggregation == tf.VariableAggregation.SUM and additive):
                    states[variable.ref()] = metric
        # The model's weights and its optimizer's slots (created so far) are none of these: not looked up again.
        # (A lookup layer's vocabulary handler among the weights is no variable.)
        optimizers = keras_compat.optimizer_list(model.optimizer) or [model.optimizer]
        slots = [v for optimizer in optimizers for v in keras_compat.optimizer_variables(optimizer)]
        others.update(v.ref() for v in [*model.weights, *slots] if isinstance(v, tf.Variable) and v.ref() not in states)

    def refuse(variable, method, made, sets):
        """Raises for a write of a metric's NONE state, or of its SUM state when ``sets()``; ``made()``: what the
        write writes, for the message. Each variable is looked up once."""
        key = variable.ref()
        if key not in states and key not in others:
            refresh()
            if key not in states:
                others.add(key)
        metric = states.get(key)
        if metric is None:
            return
        if variable.aggregation == tf.VariableAggregation.NONE:
            raise _unaggregated(metric, variable, method, made(), num_workers)
        if sets():
            raise _refusal(metric, variable, method, made(), num_workers)

    def check(variable, method, value):
        if tf.executing_eagerly() or variable.aggregation not in _CHECKED:
            return value
        # A SUM state's assign_add or assign_sub adds; its assign may not.
        if variable.aggregation == tf.VariableAggregation.NONE or method == "assign":
            refuse(variable, method,
                   lambda: _passed(value).op.type if tf.is_tensor(value) else type(value).__name__,
                   lambda: not _adds_to(variable, value))
        return value

    def check_scatter(variable, method):
        if tf.executing_eagerly() or variable.aggregation not in _CHECKED:
            return
        if variable.aggregation == tf.VariableAggregation.NONE or method not in _SCATTERS_ADDING:
            refuse(variable, method, lambda: "indices, updates" if "_nd_" in method else "IndexedSlices",
                   lambda: True)

    with assign_hook.combining(check), assign_hook.checking_scatters(check_scatter):
        yield


def _adds_to(variable, value):
    """Whether ``value`` (a tensor of the step being traced) is ``variable``'s value read in this graph plus or minus
    a tensor that does not read it."""
    if not tf.is_tensor(value) or not hasattr(getattr(value, "graph", None), "capture"):
        return False
    handle = value.graph.capture(variable.handle).name
    op = _passed(value).op
    if op.type not in _ADDS:
        return False
    sides = [_passed(x) for x in op.inputs]
    read = [i for i, x in enumerate(sides) if x.op.type == "ReadVariableOp" and x.op.inputs[0].name == handle]
    if not read or (op.type == "Sub" and read[0] != 0):
        return False
    delta = sides[1 - read[0]]
    return not _reads(delta, handle)


def _passed(tensor):
    while tensor.op.type in _PASSED:
        tensor = tensor.op.inputs[0]
    return tensor


def _reads(tensor, handle):
    """Whether ``tensor`` depends on the tensor named ``handle`` (the state's captured handle), looked for among
    ``_SEARCHED`` ops."""
    seen, stack = set(), [tensor.op]
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if len(seen) > _SEARCHED:
            return True
        if any(x.name == handle for x in op.inputs):
            return True
        stack.extend(x.op for x in op.inputs)
        stack.extend(op.control_inputs)
    return False


def _state_name(variable):
    return variable.name.split("/")[-1].split(":")[0]


def _refusal(metric, variable, method, made, num_workers):
    state = _state_name(variable)
    return ValueError(
        f"Metric {metric.name!r} ({type(metric).__name__}) sets its state {state!r} in the training step "
        f"({method}), while kparallax logs a metric's result from its states summed over the workers (add_weight's "
        "default aggregation, SUM, as tf.distribute's strategies sum them): the sum of the workers' values so set "
        "is no value one process holds after the global batch, and callbacks watching the metric would act on it, "
        f"silently. Received: {state}.{method}(<{made}>) in a step of {num_workers} workers. Add to the state "
        f"(self.{state}.assign_add(...), assign({state} + delta), or scatter_add); or say how the workers' values "
        "combine: add_weight(..., aggregation=tf.VariableAggregation.MEAN) averages them (a value each worker computes "
        "alike from its batch), ONLY_FIRST_REPLICA takes worker 0's (a value of the global batch, such as a "
        "maximum over all rows, computed from kp.all_gather(values) on every worker).")


def _unaggregated(metric, variable, method, made, num_workers):
    state = _state_name(variable)
    return ValueError(
        f"Metric {metric.name!r} ({type(metric).__name__}) writes its state {state!r} in the training step "
        f"({method}), a variable of aggregation NONE (made with tf.Variable, or add_weight(aggregation=NONE)), "
        "which does not say how the workers' values combine: its logged result would be the average of the "
        f"workers' results, 1/{num_workers} of one process's for a count or a total (a row count logged as 4 on 2 "
        "workers where one process counts 8) and no value one process holds for a ratio of unequal parts, "
        f"silently. Received: {state}.{method}(<{made}>) of an aggregation=NONE state in a step of {num_workers} "
        f"workers. Make the state with self.add_weight({state!r}, ...) (aggregation SUM: the workers' values "
        "summed, one process's for a count or a total), or give it an aggregation: tf.Variable(..., "
        "aggregation=tf.VariableAggregation.SUM), MEAN (averaged: a value each worker computes alike from its "
        "batch) or ONLY_FIRST_REPLICA (worker 0's: a count of steps).")
