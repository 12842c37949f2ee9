"""Whether a scalar of a traced step sums or averages over the batch: the scalar recomputed on the batch's rows
repeated twice (a sum doubles, a mean stays), copying only the ops after the rows.

Walking back from the value, the last tensors whose first dimension is the batch's (a prediction, a per-example
loss, the batch itself) are repeated twice along it, and the ops between them and the value are copied
(``tf_compat.copy_op``); values the batch does not reach (weights, constants) and outputs of stateful ops (a
collective's sum) are taken as they are. The copies are the few ops after the batch's rows (reductions, a division
by a count), not the forward pass. Only ops that give a well-formed result on any number of rows are copied
(reductions, element-wise and shape ops), so a copy cannot fail where the step runs. A loss whose rows meet
(in-batch negatives: labels ``tf.range`` over the rows, one logit column per candidate) is so recomputed from its
per-example values; the whole function run on a doubled batch would index past its columns.

With a batch of static size (a dataset batched with ``drop_remainder=True``) TensorFlow folds the batch's shape into
constants while tracing: a count read from it is a constant, so a value divided after the batch's rows (by such a
count) cannot be told by its copies.

Relies on TensorFlow 2.15's graph internals (``Operation._is_stateful``, ``tf_compat.copy_op``). Used by
``step/scalar_metrics.py`` (metrics fed one value) and ``keras_losses`` (functions giving one scalar).
"""

import tensorflow as tf

from kparallax._compat import tf as tf_compat

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
# Ops whose output may have a first dimension of a static batch's size without holding its rows: a reduction over
# the rows ([B, B] -> [B]), a product or a transpose of the rows.
_MAYBE_NOT_ROWS = {"Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "EuclideanNorm", "MatMul", "BatchMatMulV2",
                   "Transpose"}


def sums(value, data):
    """Whether ``value`` (a scalar of the traced step) sums over the batch ``data``: a boolean tensor, true when its
    value with the batch's rows repeated twice is nearer twice its value than its value; a constant false when the
    batch does not reach it."""
    tail = Tail(data)
    twice = tail.twice(value)
    if twice is None or (tail.static and tail.divides):
        return tf.constant(False)
    return doubles(tf.cast(value, tf.float32), tf.cast(twice, tf.float32))


def twice_where_told(value, data):
    """``value`` (a scalar of the traced step) recomputed on the batch ``data``'s rows repeated twice, from its copied
    ops, or None where they cannot tell a sum from a mean: the step runs eagerly, an op that is not copied lies
    between the value and the rows, or, with a batch of static size, a count of it (folded into constants while
    tracing) is divided by or a tensor taken as rows may not be (made by a reduction, a product or a transpose, whose
    first dimension may be the batch's size by chance). ``value`` itself when the batch does not reach it (it
    stays)."""
    if not tf.is_symbolic_tensor(value):
        return None
    tail = Tail(data)
    try:
        twice = tail.twice(value)
    except (ValueError, TypeError, tf.errors.OpError):
        return None
    if twice is None:
        return value
    return None if tail.static and (tail.divides or tail.rows_made_by & _MAYBE_NOT_ROWS) else twice


def doubles(once, twice):
    """Whether a scalar of the batch sums over it: its value ``once``, and ``twice`` on the batch repeated twice (a
    boolean tensor, true when ``twice`` is nearer twice ``once`` than ``once``: a sum doubles, a mean stays)."""
    return tf.abs(twice - 2 * once) < tf.abs(twice - once)


class Tail:
    """The ops between a value and the batch's rows (the last tensors, walking back, whose first dimension is the
    batch's), and their copies on the rows repeated twice."""

    def __init__(self, data):
        parts = [t for t in tf.nest.flatten(data, expand_composites=True) if tf.is_tensor(t)]
        self._data = {t.ref() for t in parts if tf.is_symbolic_tensor(t)}
        # A batch of static size, from its dense tensors (a SparseTensor's parts are not rows: its dense_shape is [2])
        dense = [t for t in tf.nest.flatten(data) if isinstance(t, tf.Tensor)]
        self._rows = {t.shape[0] for t in dense if t.shape.rank} - {None}
        self._reached = dict.fromkeys(self._data, True)  # whether the batch reaches a tensor, by ref
        self._copies = {}
        self.divides = False  # whether a copied op divides (by a count, say)
        self.rows_made_by = set()  # the types of the ops giving the tensors taken as rows (the batch's own: none)

    @property
    def static(self):
        """Whether the batch has a size known while tracing: TensorFlow folds its shape into constants then."""
        return bool(self._rows)

    def reaches(self, tensor):
        """Whether the batch reaches ``tensor`` (memoized; the batch's own tensors are not walked past)."""
        return tf_compat.fold_back(tensor, self._reached,
                                   lambda current, inputs: any(self._reached[x.ref()] for x in inputs))

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
        if not self.reaches(value):
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
        if not tf.is_symbolic_tensor(tensor) or not self.reaches(tensor) or self._is_rows(tensor):
            return False
        if tensor.op.type == "Placeholder":
            return True  # a capture: stands for its enclosing graph's tensor
        return not tensor.op._is_stateful  # pylint: disable=protected-access

    def _copy(self, tensor):
        if not tf.is_symbolic_tensor(tensor) or not self.reaches(tensor):
            return tensor
        if self._is_rows(tensor):
            if tensor.ref() not in self._data:
                self.rows_made_by.add(tensor.op.type)
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
