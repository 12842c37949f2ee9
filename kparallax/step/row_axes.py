"""Which axis of each tensor of a traced training step holds the batch's rows, and where rows of the batch meet.

``RowAxes(data)`` follows the batch's dense tensors (rows on axis 0) forward through the ops a step made, in the
order they were made, and gives each output one of:
- ``None``: no rows of the batch (a weight, a constant, a shape);
- an ``int`` k: the batch's rows on axis k, each row computed from that row alone;
- ``STATISTIC``: a reduction over the rows (a per-column mean, the batch's maximum, a loss's mean; a product
  summing over them, ``a^T @ b``, a Gram matrix of the batch, in the forward pass), and what is computed from it and
  values without rows;
- ``ROW``: one row of the batch, an element of a list of its rows (what ``tf.map_fn``'s and ``tf.scan``'s
  function gets), and what is computed from it and values without rows;
- ``UNKNOWN``: anything else the batch reaches (an op not followed here, a collective, parts of several rows
  joined into one entry by a reshape leaving a size after the first to the input's, rows taken by their place:
  ``sliced`` below). Nothing is refused from it.
A list of tensors (a ``TensorArray``, a variant handle) made of a tensor's slices along an axis gets ``Listed``: its
elements' rows' axis (a Keras RNN's time steps: the slices along an axis after the rows'), or ``ROW`` (the slices
along the rows' axis: ``tf.map_fn``'s); stacked back, the rows are on the axis they came from.

A function the step calls (a ``tf.function`` of the user's, a ``tf.cond``'s branches) is followed inside: its
inputs' axes are given to its body's placeholders and its outputs get its body's outputs' (a cond's branches
agreeing, else ``UNKNOWN``). Rows meeting inside are meetings of the call (``Meeting.calls``), checked at run time
on the call's inputs that hold the batch's rows (``Meeting.checked``), the body's tensors being out of the step's
reach. A ``while`` loop's body (a Keras RNN's over its time steps) is followed from the loop's inputs until its
variables' axes (and entries per row and blocks: a list's are its elements') settle, and its meetings are the
loop's. A function or loop in a tape's backward pass is not followed.

A reshape may split each row's values into several entries of the rows' axis (``[B, T, V] -> [B * T, V]``, as a
sequence's cross-entropy does) and join them back (``[B * T] -> [B, T]``): ``entries`` counts them. It may also
join k whole consecutive rows into one entry (``[B, d] -> [-1, 3, d]``: triplets laid out row after row; entries
1/k), or cut the batch's values into entries of another size, an entry holding the end of one row and the start of
the next (``[B, 3] -> [-1, 2]``: entries 3/2), its first size left to the batch (``-1``; or computed, or a
constant on a batch of static size, the later sizes asked for: it can only be what ``-1`` gives): each worker's
part of the batch then starts on an entry's edge (the parts before it each filled whole entries: a part that does
not is refused before the reshape, ``cuts``), so its entries are one process's, and what follows is followed as
for rows.

Tensors of the batch's rows joined along them (``tf.concat([z1, z2], axis=0)``: two views of the batch, as a
contrastive loss joins them; ``tf.stack([z1, z2])`` flattened to ``[-1, d]``) hold the rows in ``blocks``, one after
the other, each every row of the batch (``entries`` counts all of them): what is computed per entry keeps them, and
scoring such a tensor against itself is checked as scoring the batch is. A split into as many parts (or a divisor)
gives the blocks back, as does a reshape into as many entries first (``[2, -1, d]``); a slice with bounds not known
while tracing (``z[b:]``) or on the blocks' edges leaves its output ``UNKNOWN``; anything else taking entries by their
place is ``sliced``.

While it follows them it records the ops where rows of the batch meet, which one process computes over the global
batch and each worker over its own part (``meetings``):
- ``statistic``: a statistic combined element-wise with the rows (centering or normalizing over the batch by hand,
  ``x - tf.reduce_mean(x, axis=0)``, ``x / tf.reduce_max(x)``; ``tf.nn.moments(x, axes=[0])``; a log-sum-exp over
  the rows);
- ``softmax``: a softmax (or log-softmax) over the rows (``tf.nn.softmax(x, axis=0)``);
- ``pairwise``: two tensors with rows on different axes broadcast against each other (pairwise differences,
  ``a[:, None] - b[None, :]``) or joined side by side (``tf.concat([a_i, b_j], -1)`` of rows on axes 0 and 1: every
  pair of rows);
- ``tiled``: the batch's rows copied as many times as the batch has rows, a count read from its size while the step
  runs (``tf.tile(z, [tf.shape(z)[0], 1])``, ``tf.repeat(z, tf.shape(z)[0], axis=0)``), as every pair of the
  batch's rows is built;
- ``cumulative``: a cumulative sum or product along the rows;
- ``shifted``: the rows rolled or reversed along their axis (``tf.roll(x, 1, axis=0)``: each row paired with another
  row's place, as negatives taken by rolling the batch are);
- ``ranked``: the rows ranked by value (``tf.math.top_k`` along them: the hardest examples of the batch kept,
  ``tf.sort`` or ``tf.argsort`` over it);
- ``carried``: a loop over a list of the batch's rows carrying a value computed from one row to the next
  (``tf.scan``'s accumulator);
- ``sliced``: rows taken by their place in the batch, which one process counts in the global batch and each worker
  in its own part: a slice, split or gather along the rows (``x[:1]``, ``tf.split(x, 2)``, ``tf.gather(x, [0,
  2])``, ``tf.unstack(x)``), a shuffle of them, a reshape into a fixed count of entries (``[B, d] -> [2, -1]``),
  rows padded on before or after them (``tf.pad(x, [[1, 0], [0, 0]])``: each worker's part gets them, the global
  batch once); a slice whose bounds (a pad whose paddings) are not known while tracing meets them only when it
  leaves some out (adds some: ``Meeting.part``);
- ``joined``: a reduction or a softmax along the axis where a ``tf.concat`` joins the batch's rows to entries of
  something else than the batch (``tf.reduce_mean(tf.concat([per_example, prior], 0))``: one process joins them
  to the global batch once, each worker to its own part); such a tensor is ``UNKNOWN`` with a ``row_joins.Join``,
  followed through per-entry ops and gathers at its entries, and split back at the parts' edges into the batch's
  rows and entries without rows (a sampled softmax's true and sampled ids, looked up in one gather); checked, as
  ``sliced`` is, only on the way to a differentiated loss;
- ``nonlinear``: a statistic taken through a function other than a sum, a difference or a scaling by values without
  rows (the root of a mean squared error, a log of the batch's mean activation, a quotient or a matrix product of
  two statistics, a value chosen by a comparison of one, ``tf.where(tf.reduce_mean(x) > 0, a, b)``): one
  process takes it of the global batch's statistic, each worker of its own. ``rows_meet`` refuses it only on the
  way to a loss a tape differentiates: a logged root of a mean changes no weight.
A loss's mean is a statistic too; it meets no rows. Keras' masked mean loss does (the mask times its size over its
valid count), and the step counts that over the workers itself (``global_losses``): its ops are made ``apart``.

Each meeting names the tensors and axes that hold the batch's rows where it happens; ``rows_meet`` checks them
against the worker's batch when the step runs. Ops are followed by type from their static attributes and constant
inputs (axes, permutations, shapes); an op whose axes are not known while tracing gives ``UNKNOWN``, so the analysis
can miss a meeting but does not make one up.
"""

import dataclasses
import fractions

import numpy as np
import tensorflow as tf

from kparallax._compat import tf as tf_compat
from kparallax.step import row_joins
from kparallax.step import traced_values

STATISTIC = "statistic"
UNKNOWN = "unknown"
ROW = "row"
BACKWARD = "/gradient_tape/"  # the name scope of a tape's gradient ops
_constant = traced_values.constant
_dimension_read = traced_values.dimension_read
_size = traced_values.size

_UNARY = {
    "Identity", "Snapshot", "StopGradient", "PreventGradient", "Cast", "Neg", "Abs", "Square", "Sqrt", "Rsqrt", "Exp",
    "Log", "Log1p", "Expm1", "Sigmoid", "Tanh", "Relu", "Relu6", "Elu", "Selu", "Softplus", "Softsign", "LeakyRelu",
    "Gelu", "Floor", "Ceil", "Round", "Rint", "Sign", "Reciprocal", "Inv", "Sin", "Cos", "Erf", "Erfc", "IsNan",
    "IsInf", "IsFinite", "LogicalNot", "CheckNumerics", "CheckNumericsV2", "EnsureShape",
    "Real", "Imag", "Conj", "Lgamma", "Digamma", "Atan", "Asin", "Acos", "Sinh", "Cosh"}
_ELEMENTWISE = {
    "Add", "AddV2", "Sub", "Mul", "MulNoNan", "RealDiv", "Div", "DivNoNan", "FloorDiv", "FloorMod", "TruncateDiv",
    "Mod", "Xdivy", "Xlogy", "Maximum", "Minimum", "Pow", "SquaredDifference", "Equal", "NotEqual", "Less",
    "LessEqual", "Greater", "GreaterEqual", "LogicalAnd", "LogicalOr", "SelectV2", "ClipByValue", "AddN", "Atan2",
    "BiasAdd", "SigmoidGrad", "TanhGrad", "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "SoftplusGrad",
    "LeakyReluGrad", "RsqrtGrad", "SqrtGrad", "ReciprocalGrad"}
_REDUCTIONS = {"Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "EuclideanNorm"}
_ARG_REDUCTIONS = {"ArgMax", "ArgMin"}
_METADATA = {"Shape", "ShapeN", "Size", "Rank", "Const", "Range", "RandomUniform", "RandomStandardNormal",
             "TruncatedNormal", "RandomUniformInt", "StatelessRandomUniformV2", "StatelessRandomNormalV2",
             "StatelessRandomUniformIntV2", "StatelessTruncatedNormalV2", "VarHandleOp", "ReadVariableOp"}
_CONSTANT_LIKE = {"ZerosLike", "OnesLike"}  # the input's shape, not its values
_BATCH_FIRST = {"Conv2D", "Conv3D", "DepthwiseConv2dNative", "MaxPool", "MaxPoolV2", "AvgPool", "MaxPool3D",
                "AvgPool3D", "FusedBatchNormV3", "FusedBatchNorm", "LRN"}
PRODUCTS = {"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"}
PADS = ("Pad", "PadV2", "MirrorPad")  # tf.pad: constant, REFLECT / SYMMETRIC
_BRANCHES = {"If", "StatelessIf"}  # a tf.cond: (predicate, inputs...), its branches called with the inputs
_LOOPS = {"While", "StatelessWhile"}  # a tf.while_loop: its variables in and out, its body called with them
_CALLS = {"PartitionedCall", "StatefulPartitionedCall"} | _BRANCHES
_LISTS = row_joins.LISTS  # lists of tensors
_ROUNDS = 4  # a loop's body followed until its variables' axes settle, at most this many times
_DEEPEST = 8  # functions called inside functions: followed this many levels deep
_SOFTMAX = {"Softmax", "LogSoftmax"}
_CUMULATIVE = {"Cumsum", "Cumprod", "CumulativeLogsumexp"}
# Ops running along axes of their first input: the meeting where one of them holds the rows, and the input naming
# them (None: the last axis).
_ALONG = {**{kind: ("softmax", None) for kind in _SOFTMAX}, **{kind: ("cumulative", 1) for kind in _CUMULATIVE},
          "TopKV2": ("ranked", None), "Roll": ("shifted", 2), "ReverseV2": ("shifted", 1)}
# Functions of a statistic other than sums, differences and scalings (``nonlinear``): ops that pass it on as it is,
# and those of a piecewise constant output (no gradient), are not.
_NONLINEAR = (_UNARY - {"Identity", "Snapshot", "StopGradient", "PreventGradient", "Cast", "Neg", "CheckNumerics",
                        "CheckNumericsV2", "EnsureShape", "Real", "Imag", "Conj", "Floor", "Ceil", "Round", "Rint",
                        "Sign", "IsNan", "IsInf", "IsFinite", "LogicalNot"}
              | {"Maximum", "Minimum", "Pow", "SquaredDifference", "Xdivy", "Xlogy", "Atan2", "ClipByValue", "Max",
                 "Min", "Prod", "EuclideanNorm"} | _SOFTMAX)
_PRODUCT_LIKE = {"Mul", "MulNoNan", "Einsum"} | PRODUCTS  # nonlinear when two statistics multiply
_QUOTIENTS = {"RealDiv", "Div", "DivNoNan"}  # nonlinear when a statistic divides
_SELECTS = {"Select", "SelectV2"}  # nonlinear when a statistic chooses
# Ops combining their inputs' values entry by entry or by products: one row of the batch meets what they combine it
# with (the batch's rows, a statistic of them).
_COMBINING = _ELEMENTWISE | _SELECTS | PRODUCTS | {"Einsum", "ConcatV2", "Pack"}
_SIDE_BY_SIDE = _ELEMENTWISE | _SELECTS | {"ConcatV2", "Pack"}  # their inputs' entries combined in order


@dataclasses.dataclass(frozen=True)
class Meeting:
    """Rows of the batch meeting at graph op ``op``: ``kind`` (see the module docstring) and ``rows``, pairs
    (tensor, axis) that hold the batch's rows there (the meeting is real when each has as many as the batch)."""

    op: object
    kind: str
    rows: tuple
    source: object = None  # for a statistic: the reduction's op
    calls: tuple = ()  # inside functions the step calls: the call ops, the step's own first
    held: tuple = ()  # then: pairs (tensor, axis) of the step's own call's inputs holding the batch's rows
    when: tuple = ()  # in a branch of the step's own tf.cond: (its predicate, True for the first branch)
    part: tuple = ()  # ``sliced`` with bounds not known while tracing: ((output, axis),), real if its rows differ

    @property
    def at(self):
        """The op of the step's own graph where the rows meet: ``op``, or the call of the function it is in."""
        return self.calls[0] if self.calls else self.op

    @property
    def checked(self):
        """The pairs (tensor, axis) to check against the worker's batch when the step runs: ``rows``, or for a
        meeting inside a function, ``held`` (its own tensors are not the step's); those with the rows on an axis."""
        return tuple(pair for pair in (self.held if self.calls else self.rows) if isinstance(pair[1], int))


@dataclasses.dataclass(frozen=True)
class Cut:
    """A reshape ``op`` of the batch's rows into entries of ``values`` values each, ``entries`` (a ``Fraction`` not
    whole) per row of the batch: 1/k for k whole rows per entry, 3/2 for ``[B, 3] -> [-1, 2]``. It runs only on a
    part of the batch whose rows fill whole entries (a multiple of ``entries.denominator`` rows)."""

    op: object
    entries: fractions.Fraction
    values: int


@dataclasses.dataclass(frozen=True)
class Listed:
    """The rows' axis of a list of tensors (a ``TensorArray``'s, a ``tf.while_loop``'s list; a variant handle):
    ``element``, each element's rows' axis (a Keras RNN's inputs, one time step each, and its outputs), or ``ROW``:
    each element one row of the batch (``tf.map_fn``'s), or a value of one row (``one_row``: its slices, a list a
    function of one row writes)."""

    element: object
    one_row: bool = False


class RowAxes:
    """Where the batch ``data``'s rows lie in the tensors of a step traced after it; see the module docstring.
    ``apart``: tensors (refs) to take as ``UNKNOWN`` (each worker's own statistics on request, a gather's output)."""

    def __init__(self, data, apart=frozenset(), apart_ops=frozenset(), depth=0):
        self._apart, self._apart_ops, self._depth = set(apart), set(apart_ops), depth
        self._axes = {t.ref(): UNKNOWN if t.ref() in self._apart else 0
                      for t in tf.nest.flatten(data) if isinstance(t, tf.Tensor) and t.shape.rank}
        self._sources = {}  # a statistic's ref -> (its reduction's op, the reduced tensor, the rows' axis)
        self.meetings = []
        self.reductions = []  # the ops reducing the batch's rows (statistics' sources)
        self._merged = {}  # a tensor's ref -> the entries per row of the batch on its rows' axis, when not 1
        self._blocks = {}  # a tensor's ref -> k >= 2: its rows' axis holds k blocks, each every row of the batch
        self._own = set()  # the names of ops whose outputs' entries and blocks their own rule set (not ``_merge``)
        self._listed_from = {}  # a list's ref -> (the tensor it was made of, that tensor's rows' axis)
        self._row_indices = set()  # the refs of the indices a list of rows (or of a join's entries) was read at
        self._joins = {}  # a tensor's ref -> its row_joins.Join: the batch's rows joined to other entries
        self.cuts = []  # Cut: each reshape of the step's own graph into entries holding parts of rows or whole rows

    def follow(self, ops):
        """Follows graph ``ops`` (each after the ops it reads), recording ``meetings``. The outputs of
        ``apart_ops`` (names) and the ``apart`` tensors are ``UNKNOWN``, and nothing meets in those ops."""
        for op in ops:
            axes = [self.axis(x) for x in op.inputs]
            if all(a is None for a in axes):
                continue  # nothing of the batch: every output has no rows
            if op.type in traced_values.CLAMPS and traced_values.clamped(op.outputs[0]) is not None:
                continue  # a statistic clamped to one value (a bincount's size): no rows, no meeting
            joins = [self._joins.get(x.ref()) for x in op.inputs]
            try:
                outputs = ([UNKNOWN] * len(op.outputs) if op.name in self._apart_ops else
                           self._past_join(op, axes, joins) if any(joins) else
                           self._of_a_row(op, axes) if ROW in axes else self._outputs(op, axes))
            except (ValueError, TypeError, IndexError, KeyError, ArithmeticError):  # not as expected: not followed
                outputs = [UNKNOWN] * len(op.outputs)
            if op.name not in self._apart_ops and ROW not in axes and not any(joins):
                outputs = self._taken_by_place(op, axes, outputs)
            outputs = self._merge(op, axes, outputs)
            statistic = next((self._sources[x.ref()] for x, a in zip(op.inputs, axes) if a == STATISTIC), None)
            if statistic is not None and outputs[:1] == [STATISTIC] and _nonlinear(op, axes):
                if op.type in _QUOTIENTS:  # the statistic dividing
                    statistic = self._sources.get(op.inputs[1].ref()) or statistic
                source, reduced, axis = statistic
                self.meetings.append(Meeting(op, "nonlinear", ((reduced, axis),), source))
            for tensor, axis in zip(op.outputs, outputs):
                if axis == STATISTIC and tensor.ref() not in self._sources:  # computed from a statistic
                    self._sources[tensor.ref()] = statistic
                    axis = UNKNOWN if statistic is None else axis
                self._axes[tensor.ref()] = UNKNOWN if tensor.ref() in self._apart else axis

    def _taken_by_place(self, op, axes, outputs):
        """``outputs``, after recording a ``sliced`` meeting where ``op`` takes rows of the batch by their place in
        it (``_placed``). Of a tensor of k blocks (``blocks``), a split into n parts (n dividing k) keeps k / n
        blocks in each, and a slice whose bounds fall on the blocks' edges (known while tracing) or are not known
        leaves its output ``UNKNOWN``: neither is a meeting."""
        try:
            found = _placed(op, axes)
        except (ValueError, TypeError, IndexError, KeyError, ArithmeticError):  # not as expected: not followed
            return outputs
        if found is None:
            return outputs
        index, axis, part = found
        x = op.inputs[index]
        blocks = self.blocks(x)
        if blocks > 1 and op.type == "Split" and blocks % len(op.outputs) == 0:
            self._own.add(op.name)
            for tensor in op.outputs:
                self._set_rows(tensor, self.entries(x) / len(op.outputs), blocks // len(op.outputs))
            return [axis] * len(op.outputs)
        if blocks > 1 and (part or op.type in ("Slice", "StridedSlice", "SplitV") and _on_edges(op, axis, blocks)
                           or op.type == "Reshape" and _first_size(op) == blocks):
            return outputs
        self.meetings.append(Meeting(op, "sliced", ((x, axis),), part=part))
        return outputs

    def blocks(self, tensor):
        """How many blocks ``tensor``'s rows' axis holds, each every row of the batch, one after the other (2 for
        ``tf.concat([a, b], axis=0)`` of two tensors of the batch's rows, as a contrastive loss joins two views of
        the batch; 1 for the batch's own rows). ``entries`` counts them all: each block has entries / blocks per
        row."""
        return self._blocks.get(tensor.ref(), 1)

    def _rows_of(self, tensor):
        """(entries, blocks) of ``tensor``: its rows' entries per row and blocks (a list's: its elements')."""
        return self.entries(tensor), self.blocks(tensor)

    def _set_rows(self, tensor, entries, blocks):
        """Records ``tensor``'s entries per row and blocks (when not 1)."""
        self._merged.pop(tensor.ref(), None)
        self._blocks.pop(tensor.ref(), None)
        if entries != 1:
            self._merged[tensor.ref()] = fractions.Fraction(entries)
        if blocks != 1:
            self._blocks[tensor.ref()] = blocks

    def axis(self, tensor):
        """The rows' axis of ``tensor`` (``None``, an ``int``, ``STATISTIC`` or ``UNKNOWN``)."""
        return self._axes.get(tensor.ref())

    def entries(self, tensor):
        """How many entries of ``tensor``'s rows' axis each row of the batch has (a ``Fraction``): 1, more where a
        reshape merged the rows with the axes after them (``[B, T, V] -> [B * T, V]``, as a sequence's
        cross-entropy does), 1/k where it joined k rows into one entry (``[B, d] -> [-1, k, d]``)."""
        return self._merged.get(tensor.ref(), fractions.Fraction(1))

    def _merge(self, op, axes, outputs):
        """``outputs`` (the rows' axes of ``op``'s outputs), recording the entries per row of those with rows: a
        reshape's own (``_reshape``), or those of the inputs with rows (``UNKNOWN`` where they differ). Inputs of
        different blocks combined entry by entry (``tf.repeat(a, k, axis=0)`` beside ``tf.tile(b, [k, 1])``: each
        entry a row of one and another row of the other) are a ``pairwise`` meeting."""
        if op.type == "Reshape" or op.type in _CALLS or op.type in _LOOPS or op.name in self._own:  # their own
            return outputs
        held = [(x, a) for x, a in zip(op.inputs, axes) if _has_rows(a)]  # a list's rows: its elements'
        rows = [self._rows_of(x) for x, _ in held]
        if len(set(rows)) > 1:
            if op.type in _SIDE_BY_SIDE and any(isinstance(a, int) for a in outputs):
                other = next(pair for pair, kept in zip(held, rows) if kept != rows[0])
                self.meetings.append(Meeting(op, "pairwise", (held[0], other)))
            return [UNKNOWN if _has_rows(a) else a for a in outputs]
        if rows and rows[0] != (1, 1):
            for tensor, axis in zip(op.outputs, outputs):
                if _has_rows(axis):
                    self._set_rows(tensor, *rows[0])
        return outputs

    def _reshape(self, op, axes):
        """Rows stay on axis 0 when each entry of the output's first axis holds values of one row of the batch: the
        other axes keep their size (``Flatten``, ``[-1, d]`` of ``[B, d]``), or a row's values are split into
        several entries (``[B, T, V] -> [-1, V]``: ``entries``) or joined back (``[B * T] -> [-1, T]``); or when
        the shape asks for as many entries as the batch's values fill (``-1`` first), each k whole rows (``[B, d] ->
        [-1, k, d]``) or parts of consecutive rows (``[B, 3] -> [-1, 2]``)."""
        axis, before, after = axes[0], op.inputs[0].shape, _reshaped(op)
        if axis == STATISTIC and axes[1] is None:
            return [STATISTIC]
        if isinstance(axis, int) and axis > 0 and axes[1] is None:
            return self._blocks_stacked(op, axis, before, after)
        if axis != 0 or axes[1] is not None or not before[1:].is_fully_defined() or not after.rank:
            return [UNKNOWN]
        blocks = self.blocks(op.inputs[0])
        if blocks > 1 and _first_size(op) == blocks:
            return self._blocks_apart(op, blocks, before, after)
        if not after[1:].is_fully_defined() or not after[1:].num_elements():
            return [UNKNOWN]
        per_row = self.entries(op.inputs[0]) * before[1:].num_elements()  # the values of one row of the batch
        entries = per_row / after[1:].num_elements()
        if entries.denominator != 1 and not (_first_size_left(op) or _rest_asked(op)):
            return [UNKNOWN]  # entries holding parts of rows, in a count not set by the batch
        if blocks > 1 and (entries / blocks).denominator != 1:
            return [UNKNOWN]  # an entry would hold rows of a block, or parts of two blocks
        if entries.denominator != 1 and not self._depth and BACKWARD not in f"/{op.name}":
            self.cuts.append(Cut(op, entries, after[1:].num_elements()))
        self._set_rows(op.outputs[0], entries, blocks)
        return [0]

    def _blocks_stacked(self, op, axis, before, after):
        """A reshape of rows on ``axis`` > 0 after axes of sizes known while tracing (``tf.stack([z1, z2])``, [2, B,
        d]) into rows first (``[-1, d]``): each entry of those axes a block of the output's (``blocks``)."""
        if (not before[:axis].is_fully_defined() or not before[axis + 1:].is_fully_defined() or not after.rank
                or not after[1:].is_fully_defined() or not _first_size_left(op) or self.blocks(op.inputs[0]) != 1
                or after[1:].num_elements() != before[axis + 1:].num_elements()):
            return [UNKNOWN]
        count = before[:axis].num_elements()
        self._set_rows(op.outputs[0], self.entries(op.inputs[0]) * count, count)
        return [0]

    def _blocks_apart(self, op, blocks, before, after):
        """A reshape of a tensor of ``blocks`` blocks into as many entries first (``[2 * B, d] -> [2, -1, d]``):
        the rows on axis 1, each block's."""
        if after.rank < 2 or not after[2:].is_fully_defined() or not after[2:].num_elements():
            return [UNKNOWN]
        entries = self.entries(op.inputs[0]) / blocks * before[1:].num_elements() / after[2:].num_elements()
        if entries.denominator != 1:
            return [UNKNOWN]
        self._set_rows(op.outputs[0], entries, 1)
        return [1]

    def _outputs(self, op, axes):
        kind = op.type
        if kind in _METADATA:
            return [None] * len(op.outputs)
        if kind in _UNARY:
            return [_alone(axes)] * len(op.outputs)
        if kind in _CONSTANT_LIKE:
            return [axes[0] if isinstance(axes[0], int) else None]
        if kind == "Fill":  # (dims, value): the value everywhere
            return [axes[1] if axes[1] == STATISTIC and axes[0] is None else UNKNOWN]
        if kind == "IdentityN":
            return list(axes)
        if kind in _ELEMENTWISE or (kind == "Select" and len({x.shape.rank for x in op.inputs}) == 1):
            return [self._broadcast(op, axes)]
        if kind in _REDUCTIONS or kind in _ARG_REDUCTIONS:
            return [self._reduced(op, axes)]
        if kind == "TopKV2":  # (input, k) -> (values, indices); a statistic's top values are not followed
            return [UNKNOWN if axes[0] == STATISTIC else self._along(op, axes)] * 2
        if kind in _ALONG:
            return [self._along(op, axes)]
        if kind in ("ConcatV2", "Pack"):
            return [self._joined(op, axes)]
        if kind == "Tile":
            return [self._tiled(op, axes)]
        if kind == "Reshape":
            return self._reshape(op, axes)
        if kind in _SHAPES:
            return _SHAPES[kind](op, axes)
        if kind in PRODUCTS:
            return [self._product(op, axes)]
        if kind == "Einsum":
            return [self._einsum(op, axes)]
        if kind in _BATCH_FIRST:
            rows = axes[0] == 0 and all(a is None for a in axes[1:])
            return [0 if rows else UNKNOWN] + [UNKNOWN] * (len(op.outputs) - 1)
        if kind == "DenseBincount":  # (input, size, weights): of a matrix, each row's counts in a row
            per_row = op.inputs[0].shape.rank == 2 and axes[0] == 0 and axes[1] is None and axes[2] in (None, 0)
            return [0 if per_row else UNKNOWN]
        if kind == "Unique":  # (y, idx): the distinct values, a set with no rows; where each value of x is in y
            return [None, axes[0] if isinstance(axes[0], int) else UNKNOWN]
        if kind in ("SoftmaxCrossEntropyWithLogits", "SparseSoftmaxCrossEntropyWithLogits"):
            return [0 if axes[0] == 0 and axes[1] in (0, None) else UNKNOWN] * 2
        if kind in _CALLS:
            return self._called(op, axes)
        if kind in _LOOPS:
            return self._looped(op, axes)
        if kind in _LISTS:
            return self._listed(op, axes)
        return [UNKNOWN] * len(op.outputs)

    def _of_a_row(self, op, axes):
        """The outputs of ``op`` reading one row of the batch (``ROW``): computed from it alone (and values without
        rows) they are of that row; a list's, a call's or a loop's are followed as any; combined with the batch's
        rows (``pairwise``) or with a statistic of the batch (``statistic``) by an op of ``_COMBINING``, the rows
        meet there; ``UNKNOWN`` otherwise."""
        kind, count = op.type, len(op.outputs)
        if kind in _METADATA:
            return [None] * count
        if kind in _LISTS or kind in _CALLS or kind in _LOOPS:
            return self._outputs(op, axes)
        row = next((x, a) for x, a in zip(op.inputs, axes) if a == ROW)
        others = [(x, a) for x, a in zip(op.inputs, axes) if a not in (None, ROW)]
        rows = [(x, a) for x, a in others if isinstance(a, int)]
        statistics = [x for x, a in others if a == STATISTIC]
        if not others:
            return [ROW] * count
        if kind not in _COMBINING or len(rows) + len(statistics) != len(others):
            return [UNKNOWN] * count
        if rows:
            self.meetings.append(Meeting(op, "pairwise", (rows[0], row)))
            return [UNKNOWN] * count
        self._statistic_meets(op, row, statistics)
        return [ROW] * count

    def _held(self, inputs):
        """The pairs (tensor, axis) of ``inputs`` (pairs (tensor, its axis)) holding the batch's rows, a list's as
        the tensor it was made of, a join's as its part of the batch's rows."""
        held = [(x, a) for x, a in inputs if isinstance(a, int)]
        held += [self._listed_from[x.ref()] for x, a in inputs
                 if isinstance(a, Listed) and x.ref() in self._listed_from]
        held += [self._joins[x.ref()].held for x, _ in inputs if x.ref() in self._joins]  # a join's: its rows' part
        return tuple(held)

    def _inner(self, body, inputs, rows=None, joins=None):
        """A ``RowAxes`` of function graph ``body`` whose placeholders get the rows of ``inputs`` (pairs (tensor,
        axis) of this graph; their entries per row and blocks, or ``rows``' (pairs); their joins, or ``joins``'),
        followed."""
        inner = RowAxes((), depth=self._depth + 1)
        rows = rows or [self._rows_of(x) for x, _ in inputs]
        joins = joins or [self._joins.get(x.ref()) for x, _ in inputs]
        for placeholder, (x, axis), (entries, blocks), join in zip(body.inputs, inputs, rows, joins):
            if axis is not None:
                inner._axes[placeholder.ref()] = axis
            inner._set_rows(placeholder, entries, blocks)
            if x.ref() in self._sources:
                inner._sources[placeholder.ref()] = self._sources[x.ref()]
            if join is not None:  # the join's parts are this graph's: their rows' axis and entries too
                inner._joins[placeholder.ref()] = join
                part = join.held[0]
                inner._axes[part.ref()] = self.axis(part)
                inner._set_rows(part, *self._rows_of(part))
        inner.follow(body.get_operations())
        return inner

    def _record(self, op, inner, held, when=(), passed=None):
        """Records ``inner``'s meetings (in a function ``op`` calls) as meetings of ``op``, checked on ``held``, in
        the steps ``when`` holds. A meeting in a branch of a ``tf.cond`` inside the function keeps its predicate
        where it is one of the function's inputs (``passed``: the body's placeholders' refs -> ``op``'s inputs): a
        flag the step passes in; other predicates are the function's own, and the meeting is checked in every step
        the function runs."""
        for meeting in inner.meetings:
            checked = held or meeting.checked  # no rows passed in: a statistic's, this graph's reduced tensor
            if all(t.graph is op.graph for t, _ in checked):
                inside = tuple((passed[_unwrapped(p).ref()], taken) for p, taken in meeting.when
                               if passed and _unwrapped(p).ref() in passed)
                self.meetings.append(dataclasses.replace(meeting, calls=(op, *meeting.calls), held=checked,
                                                         when=when + inside))

    def _looped(self, op, axes):
        """A ``while`` loop's outputs (its variables after it): the body followed from the loop's inputs until its
        variables' axes settle (a state without rows at first, ``tf.zeros`` of the batch's size, holds them after
        one step); the meetings of the last pass recorded as the loop's. ``UNKNOWN`` where they do not settle."""
        unknown = [UNKNOWN] * len(op.outputs)
        bodies = tf_compat.called_graphs(op)
        if (not bodies or self._depth >= _DEEPEST or BACKWARD in f"/{op.name}"
                or len(bodies[0].inputs) != len(op.inputs) or len(bodies[0].outputs) != len(op.inputs)):
            return unknown
        state, rows = list(axes), [self._rows_of(x) for x in op.inputs]
        joins = [self._joins.get(x.ref()) for x in op.inputs]
        entering = [join for join in joins if join is not None]
        carried = None  # a join's entry carried to the next (tf.scan's accumulator over them)
        for _ in range(_ROUNDS):
            inner = self._inner(bodies[0], list(zip(op.inputs, state)), rows, joins)
            carried = carried or _entry_carried(bodies[0], inner)
            after = [_union(a, inner.axis(t)) for a, t in zip(state, bodies[0].outputs)]
            rows_after = [inner._rows_of(t) if _has_rows(a) else (1, 1) for a, t in zip(after, bodies[0].outputs)]
            joins_after = [self._carried_join(a, join, inner._joins.get(t.ref()), entering)
                           for a, join, t in zip(state, joins, bodies[0].outputs)]
            if after == state and rows_after == rows and all(j is k for j, k in zip(joins, joins_after)):
                held = self._held(list(zip(op.inputs, axes)))
                self._carried(op, bodies[0], state, held)
                if carried is not None:
                    self.meetings.append(Meeting(op, "joined", (carried.held,), carried.source))
                self._record(op, inner, held)
                for x, y, kept, join in zip(op.inputs, op.outputs, rows, joins):
                    self._same_list(x, y)
                    self._set_rows(y, *kept)
                    if join is not None:
                        self._joins[y.ref()] = join
                return state
            state, rows, joins = after, rows_after, joins_after
        return unknown

    def _carried_join(self, before, join, out, entering):
        """The join a loop's variable holds (or None) from its rows' axis ``before`` and its join ``join`` at a step
        of the loop, and its join ``out`` after it: a variable without rows at first (a ``tf.zeros`` state) becoming
        a join of one of the joins ``entering`` the loop, or a join of the same layout from step to step (kept: a value
        chosen by a mask's join, or multiplied by it, where it was the inputs' before); None (not followed)
        otherwise. A join made in the loop's body (of its own tensors) is not carried out of it."""
        if out is None or not any(out.source is other.source for other in entering) or (
                out.axis == row_joins.ENTRY):  # (a value carried from entry to entry: not followed)
            return None
        if join is None:
            return out if before is None else None
        return join if row_joins.equivalent(join, out, self._counts_part) else None

    def _carried(self, op, body, state, held):
        """Records a ``carried`` meeting at loop ``op`` (of ``body``, its variables' settled axes ``state``) when it
        reads a list of the batch's rows and a variable of it other than a list comes out of the body as one row's
        value computed in the body from its own value before (not only its shape, as Keras' CTC loss's labels
        scan reads it): a value carried from one row to the next."""
        if not any(isinstance(a, Listed) and a.element == ROW and not a.one_row for a in state):
            return
        for k, axis in enumerate(state):
            if axis == ROW and _from_itself(body, k):
                self.meetings.append(Meeting(op, "carried", held or ((op.inputs[k], ROW),)))
                return

    def _same_list(self, before, after):
        """List handle ``after`` (a write's, a loop's output) is ``before`` changed: made of the same tensor, for the
        checks of what reads it."""
        if before.ref() in self._listed_from:
            self._listed_from[after.ref()] = self._listed_from[before.ref()]

    def _listed(self, op, axes):
        """A list op's outputs: a tensor's slices along an axis made into a list (``Listed``: each element's rows'
        axis, or ``ROW`` for the slices along the rows' axis), an element read, written or pushed, the list stacked
        back (the rows one axis on, or on axis 0). One row's value makes a list of rows only written at the index a
        row was read at (``tf.map_fn``'s loop writes its function's value for row i at i)."""
        kind, first = op.type, axes[0]
        self._own.add(op.name)  # a list's entries per row and blocks are its elements'
        listed = self._rows_of(op.inputs[0])
        if kind == "TensorListFromTensor":
            if first == ROW and axes[1] is None:
                return [Listed(ROW, one_row=True)]
            if not isinstance(first, int) or axes[1] is not None or (first == 0 and listed != (1, 1)):
                return [UNKNOWN]
            self._listed_from[op.outputs[0].ref()] = (op.inputs[0], first)
            self._set_rows(op.outputs[0], *listed)
            return [Listed(first - 1 if first else ROW)]
        if kind in ("TensorListLength", "TensorListElementShape"):
            return [None]
        if not isinstance(first, Listed) and first is not None:
            return [UNKNOWN] * len(op.outputs)
        if kind in ("TensorListSetItem", "TensorListPushBack"):
            item = axes[-1]
            if any(a is not None for a in axes[1:-1]) or not (isinstance(item, int) or item in (None, ROW)):
                return [UNKNOWN]
            if isinstance(item, int):  # the list's elements get the item's rows, which must be the list's
                written = self._rows_of(op.inputs[-1])
                if first is not None and isinstance(first.element, int) and written != listed:
                    return [UNKNOWN]
                listed = written
            rows = self._at_read_index(op)  # at a row's index
            self._same_list(op.inputs[0], op.outputs[0])
            merged = _union(first, Listed(item, one_row=item == ROW and not rows) if item is not None else None)
            self._set_rows(op.outputs[0], *listed)
            return [merged if isinstance(merged, Listed) else UNKNOWN]
        if first is None or any(a is not None for a in axes[1:]):
            return [UNKNOWN] * len(op.outputs)
        for tensor in op.outputs:
            self._set_rows(tensor, *listed)
        if kind == "TensorListGetItem":
            if first.element == ROW and not first.one_row:
                self._row_indices.add(op.inputs[1].ref())
            return [first.element]
        if kind == "TensorListPopBack":
            return [first, first.element]
        if kind == "TensorListStack" and (isinstance(first.element, int) or first.element == ROW):
            return [first.element + 1 if first.element != ROW else ROW if first.one_row else 0]
        return [UNKNOWN] * len(op.outputs)

    def _at_read_index(self, op):
        """Whether ``op`` writes a list's element at an index a list of rows (or of a join's entries) was read at."""
        return op.type == "TensorListSetItem" and op.inputs[1].ref() in self._row_indices

    def _called(self, op, axes):
        """A call of functions (a ``tf.function``'s body, a ``tf.cond``'s branches): its outputs' rows' axes, from
        following each body with its inputs' axes; the meetings inside recorded as the call's."""
        unknown = [UNKNOWN] * len(op.outputs)
        bodies = tf_compat.called_graphs(op)
        inputs = list(zip(op.inputs, axes))[1:] if op.type in _BRANCHES else list(zip(op.inputs, axes))
        if (not bodies or self._depth >= _DEEPEST or BACKWARD in f"/{op.name}"
                or any(len(b.inputs) != len(inputs) or len(b.outputs) != len(op.outputs) for b in bodies)):
            return unknown
        held = self._held(inputs)
        results = []
        for body in bodies:
            inner = self._inner(body, inputs)
            # A branch's meetings are checked in the steps that take it (a cond inside a function: see _record).
            self._record(op, inner, held, ((op.inputs[0], body is bodies[0]),) if op.type in _BRANCHES else (),
                         {p.ref(): x for p, (x, _) in zip(body.inputs, inputs)})
            results.append([(inner.axis(t), (inner.entries(t), inner.blocks(t)), inner._sources.get(t.ref()),
                             inner._joins.get(t.ref())) for t in body.outputs])
        outputs = []
        for tensor, (axis, rows, source, join), *others in zip(op.outputs, *results):
            if any(other[0] != axis or (isinstance(axis, int) and other[1] != rows) for other in others):
                outputs.append(UNKNOWN)
                continue
            if join is not None and all(other[3] is join for other in others):  # a join of this graph's parts
                self._joins[tensor.ref()] = join
            if isinstance(axis, int):
                self._set_rows(tensor, *rows)
            if axis == STATISTIC and source is not None:
                reduced = held[0] if held else source[1:]  # checked on the step's own tensors
                if all(t.graph is op.graph for t in reduced[:1]):
                    self._sources[tensor.ref()] = (source[0], *reduced)
            outputs.append(axis)
        return outputs

    def _broadcast(self, op, axes):
        """An element-wise op of broadcast inputs: the rows' axis of its output, recording where rows meet."""
        ranks = [x.shape.rank for x in op.inputs]
        if UNKNOWN in axes or None in ranks:
            return UNKNOWN
        if op.type == "BiasAdd" and op.get_attr("data_format") != b"NHWC":
            return UNKNOWN
        out_rank = max(ranks)
        rows = {}  # output axis -> (input, its axis)
        for x, axis, rank in zip(op.inputs, axes, ranks):
            if isinstance(axis, int):
                rows.setdefault(axis + out_rank - rank, (x, axis))
        statistics = [x for x, axis in zip(op.inputs, axes) if axis == STATISTIC]
        if len(rows) > 1:
            self.meetings.append(Meeting(op, "pairwise", tuple(rows.values())))
            return UNKNOWN
        if not rows:
            return STATISTIC if statistics else None
        (out_axis, held), = rows.items()
        self._statistic_meets(op, held, statistics)
        return out_axis

    def _statistic_meets(self, op, held, statistics):
        """Records a meeting at ``op`` of the rows ``held`` (tensor, axis) with the first of ``statistics``."""
        if statistics:
            source, reduced, axis = self._sources[statistics[0].ref()]
            self.meetings.append(Meeting(op, "statistic", (held, (reduced, axis)), source))

    def _joined(self, op, axes):
        """``ConcatV2`` (values..., axis) and ``Pack`` (values, attr axis): rows on one axis of every input with
        rows, not the joined one; a statistic joined to rows (features and their mean over the batch) meets them."""
        values, value_axes = (op.inputs[:-1], axes[:-1]) if op.type == "ConcatV2" else (op.inputs, axes)
        rank = values[0].shape.rank
        if UNKNOWN in value_axes or rank is None or (op.type == "ConcatV2" and axes[-1] is not None):
            return UNKNOWN
        joined = (_static(op.inputs[-1])[0] % rank) if op.type == "ConcatV2" else op.get_attr("axis") % (rank + 1)
        if op.type == "ConcatV2" and all(a == joined for a in value_axes):
            return self._blocks_joined(op, values, joined)
        rows = {a: x for x, a in zip(values, value_axes) if isinstance(a, int)}
        statistics = [x for x, a in zip(values, value_axes) if a == STATISTIC]
        if not rows:
            return STATISTIC
        if op.type == "ConcatV2" and joined in rows:  # the rows joined to other entries along them (row_joins)
            join = row_joins.made(op, value_axes, joined)
            if join is not None and not any(self._sized_by_the_batch(part) for k, part in enumerate(join.parts)
                                            if k != join.rows):
                self._joins[op.outputs[0].ref()] = join
            return UNKNOWN
        if len(rows) > 1:  # entry [i, j] of rows i of one and j of another, side by side: every pair of rows
            self.meetings.append(Meeting(op, "pairwise", tuple((x, a) for a, x in list(rows.items())[:2])))
            return UNKNOWN
        (axis, held), = rows.items()
        self._statistic_meets(op, (held, axis), statistics)
        return axis if op.type == "ConcatV2" or axis < joined else axis + 1

    def _past_join(self, op, axes, joins):
        """The outputs of ``op`` reading a tensor that joins the batch's rows to other entries (``row_joins``):
        ``UNKNOWN`` where it holds a join (recorded), or the batch's rows split back from it; a ``joined`` meeting
        where it reduces along the join."""
        if op.type in _CALLS:  # followed inside, the join given to its body
            return self._called(op, axes)
        if op.type in _LOOPS:  # its body followed until its variables settle, a join among them or not
            return self._looped(op, axes)
        if op.type in _METADATA:  # its shape: no rows
            return [None] * len(op.outputs)
        self._own.add(op.name)
        outputs, met = row_joins.follow(op, axes, joins, self._counts_part, self._at_read_index(op))
        join = next(j for j in joins if j is not None)
        if op.type == "TensorListGetItem" and join.axis == row_joins.EACH:  # an entry read: its index
            self._row_indices.add(op.inputs[1].ref())
        if met:
            self.meetings.append(Meeting(op, "joined", (join.held,), join.source))
        for k, (tensor, out) in enumerate(zip(op.outputs, outputs)):
            if isinstance(out, row_joins.Join):
                self._joins[tensor.ref()] = out
                outputs[k] = UNKNOWN
            elif isinstance(out, int):  # the batch's rows again, each entry of them split in join.scale
                entries, blocks = self._rows_of(join.held[0])
                self._set_rows(tensor, entries * join.scale, blocks)
        return outputs

    def _sized_by_the_batch(self, tensor, most=64):
        """Whether ``tensor`` (without the batch's rows) is shaped by a size of a tensor holding them, read while the
        step runs (``tf.zeros([tf.shape(x)[0], d])``): joined to the rows, it grows with the batch as they do, one
        process's mean over both the workers' average of theirs (looked through ``most`` ops at most)."""
        stack, seen = [tensor], set()
        while stack and len(seen) < most:
            current = stack.pop()
            if current.ref() in seen:
                continue
            seen.add(current.ref())
            if current.op.type in ("Shape", "ShapeN", "Size") and any(
                    isinstance(self.axis(x), int) or x.ref() in self._joins for x in current.op.inputs):
                return True
            stack.extend(current.op.inputs)
        return False

    def _counts_part(self, bound, join, k):
        """Whether ``bound`` (an int, or ``(tensor, axis)``: ``tf.shape(tensor)[axis]`` read while the step runs, or
        ``(tensor, axis, factor)``: that times an int) is the count of entries of part ``k`` of ``join`` along it
        (``join.scale`` per entry of the part): its static size, a read of its own size, or for the batch's rows,
        of a tensor holding as many (the same rows on that axis and blocks, as many entries per row)."""
        part = join.parts[k]
        if isinstance(bound, int):
            size = part.shape[join.along]
            return size is not None and size * join.scale == bound
        x, axis, factor = (*bound, 1)[:3]
        if _unwrapped(x).ref() == _unwrapped(part).ref() and axis == join.along and factor == join.scale:
            return True
        entries, blocks = self._rows_of(part)
        return k == join.rows and self.axis(x) == axis and self._rows_of(x) == (entries * join.scale / factor, blocks)

    def _blocks_joined(self, op, values, axis):
        """``tf.concat`` of tensors of the batch's rows along their rows' axis (``[z1; z2]``: two views of the batch,
        as a contrastive loss joins them): the rows stay on that axis, in the blocks of every input one after the
        other (``blocks``); ``UNKNOWN`` where the inputs' blocks have different entries per row."""
        per_block = {self.entries(x) / self.blocks(x) for x in values}
        if len(per_block) != 1:
            return UNKNOWN
        count = sum(self.blocks(x) for x in values)
        self._own.add(op.name)
        self._set_rows(op.outputs[0], per_block.pop() * count, count)
        return axis

    def _tiled(self, op, axes):
        """``tf.tile`` (input, multiples): repeated along other axes, the rows stay on theirs; k copies along the
        rows' axis (k known while tracing: ``tf.tile(z, [2, 1])``) are k blocks of them one after the other, as
        ``tf.concat([z, z], 0)`` (``_blocks_joined``); a count along them not known while tracing is not followed.
        Copies of the batch's rows counted by the batch's own size, read while the step runs (``tf.tile(z, [B,
        1])``, ``tf.repeat(z, B, axis=0)``'s tile along a new axis), are a ``tiled`` meeting: every row copied once
        per row of the batch, as every pair of the batch's rows is built."""
        x, axis = op.inputs[0], axes[0]
        if not isinstance(axis, int):
            return axis if axes[1] is None else UNKNOWN
        counts = _counts(op)
        if any(tf.is_tensor(count) and self._batch_size(count) for count in counts):
            self.meetings.append(Meeting(op, "tiled", ((x, axis),)))
        copies = counts[axis]
        if tf.is_tensor(copies) or copies < 1:
            return UNKNOWN
        if copies == 1:
            return axis
        self._own.add(op.name)
        self._set_rows(op.outputs[0], self.entries(x) * copies, self.blocks(x) * copies)
        return axis

    def _batch_size(self, size):
        """Whether scalar ``size`` is the count of the batch's rows read while the step runs (``tf.shape(x)[k]`` of
        a tensor ``x`` holding them on axis k), cast or reshaped."""
        read = _dimension_read(traced_values.unwrapped(size))
        return read is not None and self.axis(read[0]) == read[1]

    def _reduced(self, op, axes):
        """A reduction's output: the rows' axis shifted, or ``STATISTIC`` when it reduces the rows."""
        x, axis = op.inputs[0], axes[0]
        rank = x.shape.rank
        reduced = _constant(op.inputs[1])
        if axis == UNKNOWN or rank is None or reduced is None or any(a is not None for a in axes[1:]):
            return UNKNOWN
        reduced = {int(a) % rank for a in np.atleast_1d(reduced)} if rank else set()
        keep = op.type in _REDUCTIONS and op.get_attr("keep_dims")
        if axis == STATISTIC:
            return STATISTIC
        if axis in reduced:
            self._sources[op.outputs[0].ref()] = (op, x, axis)
            self.reductions.append(op)
            return STATISTIC
        return axis if keep else axis - sum(a < axis for a in reduced)

    def _along(self, op, axes):
        """An op of ``_ALONG`` (a softmax, a cumulative op, a top-k, a roll or reverse): a meeting when it runs along
        the rows; else the rows stay on their axis."""
        x, axis = op.inputs[0], axes[0]
        if not isinstance(axis, int) or any(a is not None for a in axes[1:]) or x.shape.rank is None:
            return UNKNOWN if axis != STATISTIC else STATISTIC
        kind, named_by = _ALONG[op.type]
        along = x.shape.rank - 1 if named_by is None else _constant(op.inputs[named_by])
        if along is None:
            return UNKNOWN
        if axis in {int(a) % x.shape.rank for a in np.atleast_1d(along)}:
            self.meetings.append(Meeting(op, kind, ((x, axis),)))
            return UNKNOWN
        return axis

    def _summed(self, op, held, statistics):
        """Product ``op`` summing over the rows ``held`` (tensor, axis): ``STATISTIC``, recorded as a reduction of
        them, in the forward pass; ``UNKNOWN`` in a tape's backward pass (a weight's gradient) or when ``statistics``
        (other inputs') are summed against the rows."""
        if statistics or BACKWARD in f"/{op.name}":
            return UNKNOWN
        self._sources[op.outputs[0].ref()] = (op, *held)
        self.reductions.append(op)
        return STATISTIC

    def _product(self, op, axes):
        """A matrix product's output: the rows of one side that are not summed over (a statistic on the other side
        meets them); ``STATISTIC`` when the rows are summed over on each side that has them (``a^T @ b``, a Gram
        matrix over the batch) in the forward pass (in the backward pass that is a weight's gradient: ``UNKNOWN``);
        ``UNKNOWN`` when both sides keep their rows (``rows_meet`` checks ``a @ b^T``)."""
        a, b = op.inputs
        if a.shape.rank is None or b.shape.rank is None or UNKNOWN in axes:
            return UNKNOWN
        flip_a, flip_b = flips(op)
        rank = max(a.shape.rank, b.shape.rank)
        summed = (a.shape.rank - (2 if flip_a else 1), b.shape.rank - (1 if flip_b else 2))  # each side's axis
        rows = [(side, axis) for side, axis in enumerate(axes) if isinstance(axis, int)]
        statistics = [x for x, axis in zip(op.inputs, axes) if axis == STATISTIC]
        if not rows:
            return STATISTIC
        if all(axis == summed[side] for side, axis in rows):
            side, axis = rows[0]
            return self._summed(op, (op.inputs[side], axis), statistics)
        if len(rows) == 2:
            both_first = axes[0] == 0 and axes[1] == 0 and a.shape.rank == b.shape.rank > 2
            return 0 if both_first else UNKNOWN
        (side, axis), = rows
        side_rank = op.inputs[side].shape.rank
        if axis < side_rank - 2:  # a batch axis, broadcast
            kept = axis + rank - side_rank
        elif axis != summed[side]:
            kept = rank - 2 + side
        else:
            return UNKNOWN  # the rows summed against a statistic
        self._statistic_meets(op, (op.inputs[side], axis), statistics)
        return kept

    def _einsum(self, op, axes):
        """An einsum's output: the rows' label's place in it, when one label holds the rows of every side that has
        them (a statistic on another side meets them); ``STATISTIC`` when that label is summed over, in the forward
        pass; ``UNKNOWN`` when the sides' rows have different labels."""
        sides, output = einsum_sides(op)
        if "." in "".join(sides) + output or len(sides) != len(op.inputs) or UNKNOWN in axes:
            return UNKNOWN
        rows = [(x, side, axis) for x, side, axis in zip(op.inputs, sides, axes) if isinstance(axis, int)]
        statistics = [x for x, axis in zip(op.inputs, axes) if axis == STATISTIC]
        labels = {side[axis] for _, side, axis in rows}
        if not labels:
            return STATISTIC
        if len(labels) != 1:
            return UNKNOWN
        (label,), (x, _, axis) = labels, rows[0]
        if label in output:
            self._statistic_meets(op, (x, axis), statistics)
            return output.index(label)
        return self._summed(op, (x, axis), statistics)


def summed_or_averaged(op):
    """Whether reduction ``op`` of the batch's rows is a sum, or a mean of floating values: the statistics
    ``batch_statistics`` can take over every worker's rows (a compiled loss's)."""
    return op.type == "Sum" or (op.type == "Mean" and op.outputs[0].dtype.is_floating)


def feeding(targets, ops, control=False):
    """The names of the graph ``ops`` that the ``targets`` (tensors or ops) are computed from (data edges, and
    control edges too if ``control``), the targets' own too. A value clamped to one number
    (``traced_values.clamped``) is computed from nothing."""
    names, seen = {op.name for op in ops}, set()
    stack = [t if isinstance(t, tf.Operation) else t.op for t in targets]
    while stack:
        op = stack.pop()
        if op.name in seen or op.name not in names:
            continue
        seen.add(op.name)
        stack.extend(x.op for x in op.inputs if traced_values.clamped(x) is None)
        if control:
            stack.extend(op.control_inputs)
    return seen


def _nonlinear(op, axes):
    """Whether graph op ``op``, of inputs whose rows' axes are ``axes`` and of a statistic as output, takes a
    statistic through a function other than a sum, a difference or a scaling by values without rows (a choice by a
    comparison of one, ``tf.where(tf.reduce_mean(x) > 0, ...)``, is: piecewise)."""
    if op.type in _SELECTS:
        return axes[0] == STATISTIC
    if op.type in _PRODUCT_LIKE:
        return axes.count(STATISTIC) > 1
    if op.type in _QUOTIENTS:
        return axes[1] == STATISTIC
    return op.type in _NONLINEAR and STATISTIC in axes


def _unwrapped(tensor):
    """``tensor`` read through ``Identity`` ops."""
    while tensor.op.type == "Identity" and tensor.op.inputs:
        tensor = tensor.op.inputs[0]
    return tensor


def _entry_carried(body, inner):
    """The join (``row_joins.ENTRY``) of a variable of loop ``body`` (followed: ``inner``) computed in a step from its
    own value before and one entry of a join, a value carried from entry to entry along it; None if none is."""
    for k, after in enumerate(body.outputs):
        join = inner._joins.get(after.ref())  # pylint: disable=protected-access
        if join is not None and join.axis == row_joins.ENTRY and _from_itself(body, k):
            return join
    return None


def _from_itself(body, k):
    """Whether variable ``k`` of loop ``body`` comes out of a step computed from its own value before it (not only
    its shape), not passed on unchanged."""
    out = _unwrapped(body.outputs[k])
    return out.ref() != body.inputs[k].ref() and _reads(out, body.inputs[k])


def _reads(tensor, source):
    """Whether graph ``tensor`` is computed from the values of ``source`` (data edges; a shape read is not)."""
    stack, seen = [tensor], set()
    while stack:
        current = stack.pop()
        if current.ref() == source.ref():
            return True
        if current.ref() in seen or current.op.type in _METADATA or current.op.type in _CONSTANT_LIKE:
            continue
        seen.add(current.ref())
        stack.extend(current.op.inputs)
    return False


def _has_rows(axis):
    """Whether a value of rows' axis ``axis`` holds the batch's rows on an axis (a list: its elements)."""
    return isinstance(axis, int) or isinstance(axis, Listed) and isinstance(axis.element, int)


def _union(a, b):
    """The rows' axis of a value that is either of two with axes ``a`` and ``b`` (a loop's variable before and after
    a step of it): the one with rows if the other has none, ``UNKNOWN`` if they differ otherwise."""
    if a == b or b is None:
        return a
    return b if a is None else UNKNOWN


def _alone(axes):
    """A unary op's output: its first input's rows, if the other inputs have none."""
    return axes[0] if all(a is None for a in axes[1:]) else UNKNOWN


def _first_size_left(op):
    """Whether a ``Reshape``'s shape input leaves its first size to be inferred (``-1``, a constant)."""
    shape = op.inputs[1]
    first = _constant(shape.op.inputs[0]) if shape.op.type == "Pack" else None
    if first is None:
        value = _constant(shape)
        first = None if value is None or not np.ndim(value) or not np.size(value) else np.ravel(value)[0]
    return first is not None and int(np.ravel(first)[0]) == -1


def _rest_asked(op):
    """Whether a ``Reshape``'s shape input asks for each size after the first, known while tracing (a constant, a
    static dimension read by ``tf.shape``; not ``-1``): then its first size, however computed
    (``tf.reshape(x, [tf.shape(x)[0] * 3 // 2, 2])``, a constant on a batch of static size), can only be the input's
    values over theirs, as ``-1`` gives, or the reshape fails."""
    shape = op.inputs[1]
    if shape.op.type == "Pack":
        sizes = [_size(x) for x in shape.op.inputs[1:]]
    else:
        value = _constant(shape)
        if value is None or np.ndim(value) != 1:
            return False
        sizes = [int(size) for size in np.ravel(value)[1:]]
    return all(size is not None and size >= 0 for size in sizes)


def _reshaped(op):
    """The static shape of a ``Reshape``'s output, with the sizes its shape input takes from static dimensions of
    other tensors (``tf.reshape(x, [-1, tf.shape(x)[-1]])``, which TensorFlow's shape inference leaves unknown)."""
    shape, known = op.inputs[1], op.outputs[0].shape
    if shape.op.type != "Pack" or known.rank is None:
        return known
    sizes = [_size(x) for x in shape.op.inputs]
    return known.merge_with([None if size is None or size < 0 else size for size in sizes])


def _static(tensor):
    value = _constant(tensor)
    if value is None:
        raise ValueError("not known while tracing")
    return np.atleast_1d(value).astype(np.int64).tolist()


def _expand_dims(op, axes):
    axis = axes[0]
    if not isinstance(axis, int):
        return [axis if axis in (STATISTIC, UNKNOWN) and axes[1] is None else UNKNOWN]
    where = _static(op.inputs[1])[0] % (op.inputs[0].shape.rank + 1)
    return [axis + 1 if where <= axis else axis]


def _squeeze(op, axes):
    axis, rank = axes[0], op.inputs[0].shape.rank
    if not isinstance(axis, int):
        return [axis]
    dims = [d % rank for d in op.get_attr("squeeze_dims")]
    if not dims or axis in dims:
        return [UNKNOWN]
    return [axis - sum(d < axis for d in dims)]


def _transpose(op, axes):
    axis = axes[0]
    if not isinstance(axis, int):
        return [axis if axes[1] is None else UNKNOWN]
    return [_static(op.inputs[1]).index(axis)]


def _broadcast_to(op, axes):
    axis = axes[0]
    if not isinstance(axis, int):
        return [axis if axes[1] is None else UNKNOWN]
    return [axis + op.outputs[0].shape.rank - op.inputs[0].shape.rank]


def _slice(op, axes):
    axis = axes[0]
    if not isinstance(axis, int):
        return [axis]
    begin, size = _static(op.inputs[1]), _static(op.inputs[2])
    return [axis if begin[axis] == 0 and size[axis] == -1 else UNKNOWN]


def _strided_slice(op, axes):
    """Rows kept whole (``x[:, 0]``, ``x[:, None]``, ``x[..., :3]``) move to their output axis; sliced rows are
    ``UNKNOWN``."""
    axis, rank = axes[0], op.inputs[0].shape.rank
    if axis == STATISTIC and all(a is None for a in axes[1:]):
        return [STATISTIC]
    if not isinstance(axis, int) or any(a is not None for a in axes[1:]) or rank is None:
        return [UNKNOWN]
    begin, _, strides = (_static(x) for x in op.inputs[1:4])
    entry, out = traced_values.strided_axis(op, axis, rank, len(begin))
    if entry is None or out is None:  # whole (in an ellipsis, after the entries), or shrunk
        return [UNKNOWN if out is None else out]
    whole = ((op.get_attr("begin_mask") >> entry) & 1 and (op.get_attr("end_mask") >> entry) & 1
             and strides[entry] == 1)
    return [out if whole else UNKNOWN]


def _gather(op, axes):
    """``GatherV2`` (params, indices, axis) and ``ResourceGather`` (table, indices): rows of the indices move to
    their place in the output; params' rows gathered along another axis stay."""
    if op.get_attr("batch_dims") != 0:
        return [UNKNOWN]
    params, indices = axes[0], axes[1]
    if op.type == "ResourceGather":
        return [indices if isinstance(indices, int) and params is None else UNKNOWN]
    along = _static(op.inputs[2])[0] % op.inputs[0].shape.rank
    if isinstance(indices, int) and params is None and axes[2] is None:
        return [along + indices]
    if isinstance(params, int) and indices is None and axes[2] is None and params != along:
        return [params if params < along else params - 1 + op.inputs[1].shape.rank]
    return [UNKNOWN]


def _placed(op, axes):
    """(input index, rows' axis, part) when graph op ``op`` takes rows of the batch by their place in it, which one
    process counts in the global batch and each worker in its own part: a slice or a split along the rows' axis
    (``x[:1]``, ``x[0]``, ``x[1:]``, ``x[::-1]``, ``tf.split(x, 2)``), a gather along it at indices that are not
    the batch's (``tf.gather(x, [0, 2])``, at a shuffled range), a shuffle of the rows, a reshape of the rows
    into a fixed count of entries (``[B, d] -> [2, -1]``), or a pad along them (paddings known while tracing); None
    otherwise. ``part`` is () when the op takes part of the rows whatever the batch's size, or (output, axis) when
    its bounds are not known while tracing (``x[:tf.shape(y)[0]]``; a pad by paddings read while the step runs):
    it takes part of them (adds rows to them) only when that output has fewer (more) entries than its input."""
    kind = op.type
    if kind == "Reshape":
        return (0, 0, ()) if axes[0] == 0 and axes[1] is None and _grouped(op) else None
    if kind in ("Split", "SplitV"):
        index = 1 if kind == "Split" else 0
        along = _static(op.inputs[0 if kind == "Split" else 2])[0]
        value, rank = axes[index], op.inputs[index].shape.rank
        if (not isinstance(value, int) or rank is None or len(op.outputs) < 2 or along % rank != value
                or any(a is not None for i, a in enumerate(axes) if i != index)):
            return None
        return index, value, ()
    if kind == "GatherV2":
        params, indices = axes[0], axes[1]
        if not isinstance(params, int) or indices is not None or axes[2] is not None or op.get_attr("batch_dims"):
            return None
        return (0, params, ()) if _static(op.inputs[2])[0] % op.inputs[0].shape.rank == params else None
    if kind == "Unpack":  # tf.unstack along the rows: each output one row, by its place
        rank = op.inputs[0].shape.rank
        return (0, axes[0], ()) if isinstance(axes[0], int) and op.get_attr("axis") % rank == axes[0] else None
    if kind == "RandomShuffle":
        return (0, 0, ()) if axes[0] == 0 else None
    if kind in PADS:  # rows added before or after the batch's: as many on each worker
        if not isinstance(axes[0], int) or any(a is not None for a in axes[1:]):
            return None
        paddings = _constant(op.inputs[1])
        if paddings is None:  # read while the step runs (up to a fixed size): real if it adds rows
            return 0, axes[0], ((op.outputs[0], axes[0]),)
        return (0, axes[0], ()) if np.any(paddings[axes[0]]) else None
    if kind not in ("Slice", "StridedSlice"):
        return None
    axis = axes[0]
    if not isinstance(axis, int) or any(a not in (None, STATISTIC) for a in axes[1:]):
        return None
    if kind == "Slice":
        begin, size = _constant(op.inputs[1]), _constant(op.inputs[2])
        if begin is None or size is None or any(a is not None for a in axes[1:]):
            return 0, axis, ((op.outputs[0], axis),)
        return None if begin[axis] == 0 and size[axis] == -1 else (0, axis, ())
    return _strided_rows(op, axis)


def _on_edges(op, axis, blocks):
    """Whether a ``Slice`` or ``SplitV`` along ``axis`` of a tensor of ``blocks`` blocks cuts it only where blocks
    meet (its size on that axis and the bounds known while tracing), or at bounds not known while tracing (``tf.split(z,
    [b, b])``); a ``StridedSlice`` with bounds known, never."""
    size = op.inputs[0].shape[axis]
    block = None if size is None or size % blocks else size // blocks
    if op.type == "SplitV":
        sizes = _constant(op.inputs[1])
        if sizes is None:
            return True
        sizes = [int(n) for n in np.ravel(sizes)]
        return block is not None and all(n % block == 0 for n in sizes if n != -1)
    if op.type == "Slice":
        begin, count = _constant(op.inputs[1]), _constant(op.inputs[2])
        if begin is None or count is None:
            return True
        first, count = int(np.ravel(begin)[axis]), int(np.ravel(count)[axis])
        return block is not None and first % block == 0 and (count == -1 or count % block == 0)
    return False


def _strided_rows(op, axis):
    """``_placed`` of a ``StridedSlice`` of rows on ``axis``: whether the entry of the slice reading that axis
    takes every row in order (``x[:, 0]``, ``x[..., 1:]``), some (``x[1:]``, ``x[0]``, ``x[::2]``, ``x[::-1]``), or
    bounds not known while tracing."""
    rank, entries = op.inputs[0].shape.rank, op.inputs[1].shape[0]
    if rank is None or entries is None:
        return None
    masks = {name: op.get_attr(name) for name in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
                                                   "shrink_axis_mask")}
    bit = lambda name, i: (masks[name] >> i) & 1  # pylint: disable=unnecessary-lambda-assignment
    spanned = rank - sum(1 for i in range(entries) if not bit("new_axis_mask", i) and not bit("ellipsis_mask", i))
    position, out = 0, 0  # the input axis and output axis the next entry reads and makes
    for i in range(entries):
        if bit("ellipsis_mask", i):
            if position <= axis < position + spanned:
                return None
            position, out = position + spanned, out + spanned
        elif bit("new_axis_mask", i):
            out += 1
        elif position == axis:
            if bit("shrink_axis_mask", i):
                return 0, axis, ()
            begin, end, stride = (_constant(x) for x in op.inputs[1:4])
            stride = None if stride is None else int(np.ravel(stride)[i])
            first = bit("begin_mask", i) or (begin is not None and int(np.ravel(begin)[i]) == 0)
            if stride == 1 and first and bit("end_mask", i):
                return None
            known = stride is not None and (bit("begin_mask", i) or begin is not None) and (
                bit("end_mask", i) or end is not None)
            return (0, axis, ()) if known else (0, axis, ((op.outputs[0], out),))
        else:
            position, out = position + 1, out + (0 if bit("shrink_axis_mask", i) else 1)
    return None  # the rows' axis after the entries passes through


def _sizes(op):
    """A ``Reshape``'s shape input while tracing: each size an int, or None where not known."""
    shape = op.inputs[1]
    if shape.op.type == "Pack":
        sizes = [_constant(x) for x in shape.op.inputs]
    else:
        value = _constant(shape)
        if value is None or np.ndim(value) != 1:
            return []
        sizes = list(value)
    return [None if size is None else int(np.ravel(size)[0]) for size in sizes]


def _counts(op):
    """A ``Tile``'s multiples while tracing: per axis, an int, or the scalar tensor it is read from while the step
    runs (an input of the ``Pack`` making them, as ``tf.tile(x, [tf.shape(x)[0], 1])`` does)."""
    multiples = op.inputs[1]
    value = _constant(multiples)
    if value is not None:
        return [int(count) for count in np.ravel(value)]
    if multiples.op.type != "Pack":
        raise ValueError("multiples not known while tracing")
    counts = []
    for count in multiples.op.inputs:
        value = _size(count) if count.shape.rank == 0 else None
        counts.append(count if value is None else int(value))
    return counts


def _first_size(op):
    """A ``Reshape``'s first size asked for, when known while tracing and followed by a size left to the input's
    (``-1``, or one not known while tracing): ``[2, -1]`` and ``[4, -1, d]`` give 2 and 4; None otherwise."""
    sizes = _sizes(op)
    if len(sizes) < 2 or sizes[0] is None or not any(size is None or size == -1 for size in sizes[1:]):
        return None
    return sizes[0]


def _grouped(op):
    """Whether a ``Reshape``'s shape asks for a fixed count (2 or more) of entries first and leaves a later size to
    the input's (``[2, -1]``, ``[4, -1, d]``): the rows of the batch joined into that many entries."""
    first = _first_size(op)
    return first is not None and first >= 2


def _split(op, axes):
    """``Split`` (axis, value), ``SplitV`` (value, sizes, axis), ``Unpack`` (value, attr axis)."""
    if op.type == "Split":
        value, along = axes[1], _static(op.inputs[0])[0]
    elif op.type == "SplitV":
        value, along = axes[0], _static(op.inputs[2])[0]
    else:
        value, along = axes[0], op.get_attr("axis")
    rank = op.inputs[1 if op.type == "Split" else 0].shape.rank
    if not isinstance(value, int) or rank is None or along % rank == value:
        return [UNKNOWN] * len(op.outputs)
    along %= rank
    shifted = value - 1 if op.type == "Unpack" and along < value else value
    return [shifted] * len(op.outputs)


def _one_hot(op, axes):
    indices, rank = axes[0], op.inputs[0].shape.rank
    if not isinstance(indices, int) or any(a is not None for a in axes[1:]) or rank is None:
        return [UNKNOWN]
    where = op.get_attr("axis")
    return [indices if where == -1 or where > indices else indices + 1]


def _pad(op, axes):
    axis = axes[0]
    if not isinstance(axis, int) or any(a is not None for a in axes[1:]):
        return [UNKNOWN]
    paddings = _constant(op.inputs[1])
    return [axis if paddings is not None and not np.any(paddings[axis]) else UNKNOWN]


_SHAPES = {
    "ExpandDims": _expand_dims, "Squeeze": _squeeze, "Transpose": _transpose,
    "BroadcastTo": _broadcast_to, "Slice": _slice, "StridedSlice": _strided_slice, "GatherV2": _gather,
    "ResourceGather": _gather, "Split": _split, "SplitV": _split, "Unpack": _split, "OneHot": _one_hot,
    **{kind: _pad for kind in PADS}}


def flips(op):
    """Whether matrix product ``op`` (a type in ``PRODUCTS``) takes each side transposed: (a's, b's)."""
    names = ("transpose_a", "transpose_b") if op.type == "MatMul" else ("adj_x", "adj_y")
    return tuple(bool(op.get_attr(name)) for name in names)


def einsum_sides(op):
    """An ``Einsum`` op's labels, spaces dropped: each operand's, and the output's (``(["id", "jd"], "ij")``)."""
    inputs, _, output = op.get_attr("equation").decode().replace(" ", "").partition("->")
    return inputs.split(","), output
