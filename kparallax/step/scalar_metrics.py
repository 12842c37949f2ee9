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
values are, by its value on the batch repeated twice (a sum doubles, a mean stays): walking back from the value, the
last tensors whose first dimension is the batch's (a prediction, a per-example loss, the batch itself) are repeated
twice along it, and the ops between them and the value are copied (``tf_compat.copy_op``); values the batch does not
reach (weights, constants) and outputs of stateful ops (a collective's sum) are taken as they are. The copies are
the few ops after the batch's rows (reductions, a division by a count), not the forward pass.

Only ops that give a well-formed result on any number of rows are copied (reductions, element-wise and shape ops),
so a copy cannot fail where the step runs. A value that cannot be told (the step runs eagerly; another op, such as a
reshape to a fixed shape, a sparse op or a branch, or more than 64 ops lie between it and the batch's rows) keeps
Keras' own count, with a warning naming the metric and why. With a batch of static size (a dataset
batched with ``drop_remainder=True``) TensorFlow folds the batch's shape into constants while tracing: a count read
from it is a constant, and a value divided after the batch's rows (by such a count) is taken for a mean. Updates with a sample weight, values with more than one element (Keras weighs every element alike,
which the summed states already count exactly) and metrics of other classes are Keras' own.
"""

import contextlib
import threading

import tensorflow as tf

from kparallax import log as logging
from kparallax._compat import keras_losses
from kparallax._compat import tf as tf_compat

_ACTIVE = threading.local()
_MOST_COPIES = 64  # the ops after the batch's rows are a few reductions and divisions, not a forward pass
# The ops that are copied: each gives a well-formed result for inputs of any number of rows, so the copies cannot fail
# where the step itself runs (no reshape to a fixed shape, no sparse or ragged op whose parts must agree, no branch).
_COPIED = {
    "Identity", "Snapshot", "StopGradient", "PreventGradient", "Cast", "Neg", "Abs", "Square", "Sqrt", "Rsqrt", "Exp",
    "Log", "Log1p", "Expm1", "Sigmoid", "Tanh", "Relu", "Softplus", "Floor", "Ceil", "Round", "Sign", "Reciprocal",
    "Inv", "Add", "AddV2", "AddN", "Sub", "Mul", "MulNoNan", "RealDiv", "Div", "DivNoNan", "FloorDiv", "TruncateDiv",
    "Xdivy", "Maximum", "Minimum", "Pow", "SquaredDifference", "Equal", "NotEqual", "Less", "LessEqual", "Greater",
    "GreaterEqual", "LogicalAnd", "LogicalOr", "LogicalNot", "Select", "SelectV2", "Sum", "Mean", "Max", "Min",
    "Prod", "All", "Any", "EuclideanNorm", "Shape", "ShapeN", "Size", "Rank", "StridedSlice", "Pack", "ConcatV2",
    "ExpandDims", "Squeeze", "Transpose", "GatherV2", "MatMul", "BatchMatMulV2", "ZerosLike", "OnesLike", "Fill",
    "Range"}
_DIVISIONS = {"RealDiv", "Div", "DivNoNan", "Reciprocal", "Inv", "FloorDiv", "TruncateDiv", "Xdivy"}
_WARNED = set()


@contextlib.contextmanager
def weighing(model, data, num_workers, share=None):
    """While ``model``'s synchronous training step on ``data`` (this worker's batch) is traced with ``num_workers``
    workers: updates with one value and no sample weight of ``model``'s ``Mean`` and ``Sum`` metrics (also those
    ``add_metric`` makes in this trace) count as one process's. ``share``: this worker's share of the global batch
    (a float32 scalar tensor), or None when every worker's batch has the same rows."""
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
            sums = _sums(value, data)
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
    share = tf.ones([], tf.float32) if share is None else tf.cast(share, tf.float32)
    return keras_losses.batch_scalar_update(value, sums, num_workers, share)


def _sums(value, data):
    """Whether ``value`` (a scalar of the traced step) sums over the batch ``data``: a boolean tensor, true when its
    value with the batch's rows repeated twice is nearer twice its value than its value; a constant false when the
    batch does not reach it."""
    tail = _Tail(data)
    twice = tail.twice(value)
    if twice is None or (tail.static and tail.divides):
        return tf.constant(False)
    return keras_losses.doubles(tf.cast(value, tf.float32), tf.cast(twice, tf.float32))


class _Tail:
    """The ops between a value and the batch's rows (the last tensors, walking back, whose first dimension is the
    batch's), and their copies on the rows repeated twice."""

    def __init__(self, data):
        parts = [t for t in tf.nest.flatten(data, expand_composites=True) if tf.is_tensor(t)]
        self._data = {t.ref() for t in parts if tf.is_symbolic_tensor(t)}
        # A batch of static size, from its dense tensors (a SparseTensor's parts are not rows: its dense_shape is [2])
        dense = [t for t in tf.nest.flatten(data) if isinstance(t, tf.Tensor)]
        self._rows = {t.shape[0] for t in dense if t.shape.rank} - {None}
        self._reached = {}
        self._copies = {}
        self.divides = False  # whether a copied op divides (by a count, say)

    @property
    def static(self):
        """Whether the batch has a size known while tracing: TensorFlow folds its shape into constants then."""
        return bool(self._rows)

    def _from_batch(self, tensor):
        """Whether the batch reaches ``tensor`` (memoized, iteratively: a forward pass is deep)."""
        stack = [(tensor, False)]
        while stack:
            current, expanded = stack.pop()
            if current.ref() in self._reached:
                continue
            inputs = tf_compat.computed_from(current)
            if current.ref() in self._data:
                self._reached[current.ref()] = True
                continue
            if not expanded and any(x.ref() not in self._reached for x in inputs):
                stack.append((current, True))
                stack.extend((x, False) for x in inputs if x.ref() not in self._reached)
                continue
            self._reached[current.ref()] = any(self._reached[x.ref()] for x in inputs)
        return self._reached[tensor.ref()]

    def _is_rows(self, tensor):
        """Whether ``tensor`` (reached by the batch) holds rows of it along its first dimension: a batch tensor, or
        a first dimension unknown while tracing, or, for a batch of static size B, a multiple of B (B x steps
        flattened)."""
        shape = tensor.shape
        if tensor.ref() in self._data:
            return True
        if shape.rank is None or shape.rank == 0:
            return False
        return shape[0] is None or any(shape[0] > 0 and shape[0] % rows == 0 for rows in self._rows)

    def twice(self, value):
        """``value`` computed with the batch's rows repeated twice, or None when the batch does not reach it."""
        if not self._from_batch(value):
            return None
        order, seen, stack = [], set(), [(value, False)]
        while stack:  # post-order: every tensor after what it is computed from
            current, expanded = stack.pop()
            if current.ref() in seen:
                continue
            if expanded:
                seen.add(current.ref())
                order.append(current)
                continue
            stack.append((current, True))
            if self._copied(current):
                stack.extend((x, False) for x in tf_compat.computed_from(current) if x.ref() not in seen)
        copied = {t.op.name: t.op for t in order if self._copied(t) and t.op.type != "Placeholder"}
        for op in copied.values():
            if op.type not in _COPIED:
                raise ValueError(f"op {op.name!r} ({op.type}) lies between the value and the batch's rows, and only "
                                 "reductions, element-wise and shape ops are copied")
        if len(copied) > _MOST_COPIES:
            raise ValueError(f"{len(copied)} ops lie between the value and the batch's rows (at most {_MOST_COPIES} "
                             "are copied)")
        for tensor in order:
            if tensor.ref() not in self._copies:  # an op's other output may have been copied with it
                self._copies[tensor.ref()] = self._copy(tensor)
        return self._copies[value.ref()]

    def _copied(self, tensor):
        """Whether ``tensor`` is recomputed from its inputs (else it is repeated, or taken as it is)."""
        if not tf.is_symbolic_tensor(tensor) or not self._from_batch(tensor) or self._is_rows(tensor):
            return False
        if tensor.op.type == "Placeholder":
            return True  # a capture: stands for its enclosing graph's tensor
        return not tensor.op._is_stateful  # pylint: disable=protected-access

    def _copy(self, tensor):
        if not tf.is_symbolic_tensor(tensor) or not self._from_batch(tensor):
            return tensor
        if self._is_rows(tensor):
            return tf.concat([tensor, tensor], axis=0)
        if not self._copied(tensor):
            return tensor  # a stateful op's output (a collective's sum): as it is
        if tensor.op.type == "Placeholder":
            return self._copies[tf_compat.computed_from(tensor)[0].ref()]
        self.divides = self.divides or tensor.op.type in _DIVISIONS
        outputs = tf_compat.copy_op(tensor.op, [self._copies[x.ref()] for x in tensor.op.inputs])
        for output, copy in zip(tensor.op.outputs, outputs):
            self._copies[output.ref()] = copy
        return outputs[tensor.value_index]
