"""A custom ``train_step``'s own transformation of its gradients, made on the global batch's gradients.

One process's custom ``train_step`` takes the global batch's gradient from its tape and may transform it before
``apply_gradients``: ``tf.clip_by_global_norm`` (the reference LM1B model clips its LSTM's gradients so),
``tf.clip_by_value``, a normalization. Under kparallax the tape gives each worker the gradient of its own batch, and
the exchange happens inside ``apply_gradients``, after the transformation. Averaging after it is one process's math
only when the transformation is affine in the gradients with coefficients that are the same on every worker (a
constant factor, mixed precision's loss scale, a sum of gradients); a norm or a clip acted on each worker's gradient
and trained differently from one process (0.033-0.063 off on the test programs), silently.

While the synchronous step is traced (``recording``), every ``tape.gradient`` and ``tf.gradients`` result is
recorded (a "tape output" below). ``plan`` looks at each gradient reaching the routing optimizer and walks its graph
back to the recorded tape outputs:

* a tape output itself, or an affine function of tape outputs with worker-independent coefficients (constants,
  variable reads): averaged as before, since averaging commutes with it;
* any other function of tape outputs and worker-independent values is *replayed*: the tape outputs it reads are
  averaged over the workers (each weighted by the worker's share of the global batch when batches differ in size;
  a sparse one allgathered, as Horovod does), the ops between them and the gradient are copied with the averages
  as inputs, and the result is one process's transformation of one process's gradient. A replicated variable's is
  applied as it is; a PS variable's is pushed whole by every worker, so the PS's sum over the workers divided by
  their count is that gradient again (a global norm over all gradients, tables included, costs every worker the
  allgather of the tables' rows and a push of all of them). Where every gradient read and replayed is a dense PS
  variable's (the ``ps`` architecture), the workers push their own as usual and the chief repeats the
  transformation on the PS tasks from the pushed sums (``Replay.on_ps``). Only the gradient is replayed: a value the
  ``train_step`` returns from the transformation (the norm ``tf.clip_by_global_norm`` gives back) stays this
  worker's;
* a transformation that reads values of this worker's own beside the gradients (its batch, its loss), or holds a
  stateful op, one under gradient accumulation, or one of a PS variable's gradient with the optimizer's own
  clipping or ``average_sparse=False``, cannot be made one process's: it is refused at the first step, naming the
  op. So is any under ``run_eagerly=True`` (there is no graph to read), and one that treats a partitioned table's
  stripes apart where one process has the whole table (``_refuse_some_stripes``).
"""

import contextlib
import dataclasses
import threading
from typing import Dict, List

import numpy as np
import tensorflow as tf

from kparallax import log as logging
from kparallax._compat import tf as tf_compat
from kparallax.step import collectives
from kparallax.step import global_losses

_ACTIVE = threading.local()

# Kinds of tensors: the same on every worker; this worker's own (its batch, its loss; no tape output in it); an
# affine function of tape outputs with worker-independent coefficients; a tape output's ids (reshaped or cast);
# anything else that depends on tape outputs.
SAME, LOCAL, AFFINE, IDS, OTHER = "same", "local", "affine", "ids", "other"

_SHAPE_ONLY = {"Shape", "ShapeN", "Size", "Rank", "OnesLike"}  # values from their input's shape only
_READS = {"ReadVariableOp", "VarHandleOp", "ResourceGather"}
_KEEP_IDS = {"Identity", "Snapshot", "Cast", "Reshape", "ExpandDims", "Squeeze", "EnsureShape", "ConcatV2"}
# Linear in each gradient input, given worker-independent other inputs; ids allowed only where an op takes ids.
_LINEAR = {"Identity", "IdentityN", "Snapshot", "Cast", "Reshape", "ExpandDims", "Squeeze", "EnsureShape",
           "Transpose", "Neg", "StridedSlice", "Slice", "Pack", "Unpack", "ConcatV2", "Split", "SplitV", "GatherV2",
           "BroadcastTo", "Tile", "ReverseV2", "AddN", "AddV2", "Add", "Sub", "Sum", "Mean", "UnsortedSegmentSum"}
_ID_INPUTS = {"GatherV2": 1, "UnsortedSegmentSum": 1}
_PRODUCTS = {"Mul", "MulNoNan", "MatMul", "BatchMatMulV2"}  # linear in one input when the other is the same
_QUOTIENTS = {"RealDiv", "Div", "DivNoNan"}  # linear in the numerator when the denominator is the same
_SELECTS = {"Select", "SelectV2"}  # linear in the branches when the condition is the same


@dataclasses.dataclass
class _Leaf:
    """A tape output: ``gradient`` (a tensor or tf.IndexedSlices) of ``variable``."""
    variable: tf.Variable
    gradient: object


def _parts(gradient):
    """The tensors a gradient is made of: itself, or an IndexedSlices' values and ids."""
    if isinstance(gradient, tf.IndexedSlices):
        return [gradient.values, gradient.indices]
    return [gradient]


@contextlib.contextmanager
def recording():
    """While one synchronous training step is traced: every ``tape.gradient`` and ``tf.gradients`` result is recorded
    for ``plan``."""
    outer = getattr(_ACTIVE, "leaves", None)
    leaves = _ACTIVE.leaves = {}

    def record(_, sources, gradients):
        for variable, gradient in zip(tf.nest.flatten(sources), tf.nest.flatten(gradients)):
            if gradient is None or not isinstance(variable, tf.Variable):
                continue
            if not isinstance(gradient, (tf.Tensor, tf.IndexedSlices)):
                continue
            for part in _parts(gradient):
                leaves[part.ref()] = _Leaf(variable, gradient)

    try:
        with tf_compat.recording_gradients(record):
            yield
    finally:
        _ACTIVE.leaves = outer


class _Kinds:
    """The kind of every tensor reached walking back from the gradients (memoized), and why a tensor is ``OTHER``
    (the op that made it so)."""

    def __init__(self, leaves):
        self.leaves = leaves
        self.kinds = {}
        self.why = {}

    def kind(self, tensor):
        return tf_compat.fold_back(tensor, self.kinds, self._of)

    def _of(self, tensor, inputs):
        leaf = self.leaves.get(tensor.ref())
        if leaf is not None:
            return IDS if tensor.dtype.is_integer else AFFINE
        if not tf.is_symbolic_tensor(tensor):
            return SAME  # a constant (or a variable's handle) made outside the function
        op = tensor.op
        if op.type == "Placeholder":
            if inputs:  # a capture: what it captures
                if self.why.get(inputs[0].ref()) is not None:
                    self.why[tensor.ref()] = self.why[inputs[0].ref()]
                return self.kinds[inputs[0].ref()]
            return SAME if tensor.dtype == tf.resource else LOCAL  # a variable's handle; the step's data
        kinds = [self.kinds[x.ref()] for x in inputs]
        if op.type == "ZerosLike":
            return SAME
        if op.type in _SHAPE_ONLY:
            # A gradient's shape is one process's only for a dense gradient (a sparse one's row count is the worker's
            # lookups, known while tracing or not): repeated on the global gradients, where it is one process's. A
            # shape of the worker's data (its batch size) is its own.
            if any(k in (AFFINE, IDS, OTHER) for k in kinds):
                self.why[tensor.ref()] = op
                return OTHER
            return LOCAL if LOCAL in kinds else SAME
        stateful = op._is_stateful and op.type not in _READS  # pylint: disable=protected-access
        if not any(k in (AFFINE, IDS, OTHER) for k in kinds):
            return LOCAL if stateful or LOCAL in kinds else SAME
        if OTHER in kinds:
            self.why[tensor.ref()] = next(self.why[x.ref()] for x, k in zip(inputs, kinds) if k == OTHER)
            return OTHER
        kind = self._affine(op, kinds) if not stateful and LOCAL not in kinds else None
        if kind is None:
            self.why[tensor.ref()] = op
            return OTHER
        return kind

    @staticmethod
    def _affine(op, kinds):
        """The kind of ``op``'s outputs given its inputs' (no input ``OTHER`` or ``LOCAL``), or None when the op is
        not affine in its gradient inputs."""
        gradients = [i for i, k in enumerate(kinds) if k in (AFFINE, IDS)]
        if all(kinds[i] == IDS for i in gradients) and op.type in _KEEP_IDS:
            return IDS
        ids = [i for i in gradients if kinds[i] == IDS]
        if op.type in _LINEAR:
            if op.type in _ID_INPUTS and kinds[0] != AFFINE:  # a worker-independent value picked by a worker's ids
                return None
            return AFFINE if all(_ID_INPUTS.get(op.type) == i for i in ids) else None
        if ids:
            return None
        if op.type in _PRODUCTS:
            return AFFINE if len(gradients) == 1 else None
        if op.type in _QUOTIENTS:
            return AFFINE if gradients == [0] else None
        if op.type in _SELECTS:
            return AFFINE if 0 not in gradients else None
        return None


@dataclasses.dataclass
class _Transform:
    """What one replayed gradient is computed by: its ``steps`` (ops to copy, or (placeholder, captured tensor)
    pairs, in order) from its ``leaves``."""
    steps: list
    leaves: List[_Leaf]


class Replay:
    """The gradients of a step that are replayed on the workers' averaged tape outputs (``plan``)."""

    def __init__(self, grads_and_vars, transforms: Dict[int, _Transform], is_ps_variable):
        self._grads_and_vars = grads_and_vars
        self._transforms = transforms
        self.local = [(None, v) if j in transforms else (g, v) for j, (g, v) in enumerate(grads_and_vars)]
        leaves = {}
        for transform in transforms.values():
            for leaf in transform.leaves:
                leaves.setdefault(id(leaf.gradient), leaf)
        self._leaves = list(leaves.values())
        targets = {grads_and_vars[j][1].ref(): grads_and_vars[j] for j in transforms}
        self._on_ps = (all(not isinstance(g, tf.IndexedSlices) and is_ps_variable(v) for g, v in targets.values())
                       and all(not isinstance(leaf.gradient, tf.IndexedSlices) and leaf.variable.ref() in targets
                               for leaf in self._leaves))

    @property
    def variables(self):
        """The variables whose gradients are replayed (set apart in ``local``), in the step's order."""
        return [self._grads_and_vars[j][1] for j in sorted(self._transforms)]

    def leaves(self, share=None):
        """(tape output, variable) of every tape output the replayed gradients read, each weighted by ``share``
        (this worker's share of the global batch, or None): what the workers exchange, or push when ``on_ps``."""
        return global_losses.weighted([(leaf.gradient, leaf.variable) for leaf in self._leaves], share)

    @property
    def on_ps(self):
        """Whether the transformation can run where its gradients are summed: every replayed gradient and every tape
        output it reads is a dense gradient of a PS variable, each of those variables is replayed too (so no
        update of its own takes its summed gradient first). Then the workers push their tape outputs (``leaves``)
        as usual, and the chief repeats the transformation on the sums, on the PS tasks (``from_sums``): no more
        bytes than the plain pushes (the ``ps`` architecture, e.g. LM1B's clipped LSTM on the PS)."""
        return self._on_ps

    def from_sums(self, sums):
        """``on_ps``: the replayed gradients from ``sums`` (variable ref -> its averaged summed gradient, read on its
        PS task), each copied op placed with its largest input (so the sums do not leave their tasks)."""
        return self._replayed({leaf.gradient.ref(): sums[leaf.variable.ref()] for leaf in self._leaves}, place=True)

    def run(self, num_workers, share=None, compression="none"):
        """The replayed gradients, (gradient, variable) in the step's order: the tape outputs averaged over the
        workers (weighted by ``share``, this worker's share of the global batch, when not None), the transformation
        repeated on the averages. The same on every worker."""
        averaged = collectives.average_gradients(self.leaves(share), num_workers, compression=compression,
                                                 name="kp_replayed")
        mapping = {}
        for leaf, (average, _) in zip(self._leaves, averaged):
            if isinstance(leaf.gradient, tf.IndexedSlices):
                mapping[leaf.gradient.values.ref()] = average.values
                mapping[leaf.gradient.indices.ref()] = tf.cast(average.indices, leaf.gradient.indices.dtype)
            else:
                mapping[leaf.gradient.ref()] = average
        return self._replayed(mapping)

    def _replayed(self, mapping, place=False):
        """The transformations' ops copied with ``mapping`` (tape output ref -> the tensor to use instead)."""
        out = []
        with tf.name_scope("kp_replayed"):
            for j, transform in sorted(self._transforms.items()):
                for step in transform.steps:
                    if isinstance(step, tuple):
                        placeholder, external = step
                        mapping.setdefault(placeholder.ref(), mapping.get(external.ref(), external))
                    elif step.outputs and step.outputs[0].ref() not in mapping:
                        inputs = [mapping.get(x.ref(), x) for x in step.inputs]
                        mapped = [x for x, y in zip(inputs, step.inputs) if y.ref() in mapping]
                        device = max(mapped, key=_size).device if place and mapped else None
                        with tf.device(device) if device else contextlib.nullcontext():
                            copied = tf_compat.copy_op(step, inputs)
                        mapping.update((o.ref(), c) for o, c in zip(step.outputs, copied))
                gradient, variable = self._grads_and_vars[j]
                if isinstance(gradient, tf.IndexedSlices):
                    gradient = tf.IndexedSlices(mapping.get(gradient.values.ref(), gradient.values),
                                                mapping.get(gradient.indices.ref(), gradient.indices),
                                                gradient.dense_shape)
                else:
                    gradient = mapping.get(gradient.ref(), gradient)
                out.append((gradient, variable))
        return out

    def merge(self, averaged, replayed):
        """``averaged`` and ``replayed`` (gradient, variable) pairs in the order of the step's gradients."""
        position = {v.ref(): j for j, (_, v) in enumerate(self._grads_and_vars)}
        return sorted(list(averaged) + list(replayed), key=lambda pair: position[pair[1].ref()])


def _size(tensor):
    """Static element count of ``tensor`` (0 when unknown)."""
    return tensor.shape.num_elements() or 0


def _averages_exactly(gradient, kinds):
    """Whether averaging ``gradient`` over the workers is averaging its tape outputs first (or it has none)."""
    if isinstance(gradient, tf.IndexedSlices):
        values, ids = kinds
        return values in (SAME, LOCAL, AFFINE) and ids in (SAME, LOCAL, IDS)
    return kinds[0] in (SAME, LOCAL, AFFINE)


def _walk(kinds, tensors):
    """The ops between ``tensors`` and the tape outputs they depend on, in an order that computes each op's
    inputs first (captures as (placeholder, captured) pairs), the tape outputs reached, and (op, input) pairs
    where an op reads a ``LOCAL`` value or is stateful."""
    steps, leaves, local, seen, ops = [], {}, [], set(), set()
    stack = [(t, False) for t in tensors]
    while stack:
        tensor, expanded = stack.pop()
        if tensor.ref() in seen or kinds.kind(tensor) in (SAME, LOCAL):
            continue
        leaf = kinds.leaves.get(tensor.ref())
        if leaf is not None:
            seen.add(tensor.ref())
            leaves.setdefault(id(leaf.gradient), leaf)
            continue
        inputs = tf_compat.computed_from(tensor)
        if not expanded:
            stack.append((tensor, True))
            stack.extend((x, False) for x in inputs if x.ref() not in seen)
            continue
        seen.add(tensor.ref())
        if tensor.op.type == "Placeholder":
            steps.append((tensor, inputs[0]))
            continue
        op = tensor.op
        if id(op) in ops:
            continue
        ops.add(id(op))
        steps.append(op)
        if op._is_stateful and op.type not in _READS:  # pylint: disable=protected-access
            local.append((op, None))
        local.extend((op, x) for x in inputs if kinds.kind(x) == LOCAL)
    return steps, list(leaves.values()), local


def plan(grads_and_vars, is_ps_variable, num_workers, accumulating=False, clipping=False, ps_averages=True,
         stripe_of=None):
    """The ``Replay`` of the gradients in ``grads_and_vars`` (the list a routing optimizer received) that a
    ``train_step`` transformed in a way averaging does not commute with, or None (nothing recorded, one worker, or
    nothing to replay). ``clipping``: the optimizer clips (clipnorm / clipvalue / global_clipnorm); ``ps_averages``:
    the PS divides the workers' summed gradients by their count (``average_sparse``); ``stripe_of``: (table, index)
    of a partitioned table's stripe, else None. Raises ValueError for a transformation that cannot be one process's
    (module docstring), such as one that reads some of a table's stripes with other gradients or combines a
    stripe's rows (``_refuse_some_stripes``)."""
    leaves = getattr(_ACTIVE, "leaves", None)
    if not leaves or num_workers == 1:
        return None
    kinds = _Kinds(leaves)
    transforms, found = {}, {}
    for j, (gradient, variable) in enumerate(grads_and_vars):
        if gradient is None:
            continue
        parts = _parts(gradient)
        if all(p.ref() in leaves for p in parts):
            continue
        if tf.executing_eagerly():
            raise ValueError(
                "With run_eagerly=True, kparallax cannot see how a train_step computed the gradients it passes to "
                "apply_gradients (there is no graph to read), so it cannot make a transformation of them act on the "
                "global batch's gradients as one process's would. Received: a gradient of "
                f"{variable.name!r} that is not what tape.gradient returned. Leave run_eagerly unset or False "
                "(then any transformation of the gradients is read from the traced step), or pass the tape's "
                "gradients as they are.")
        if _averages_exactly(gradient, [kinds.kind(p) for p in parts]):
            continue
        op = next((kinds.why[p.ref()] for p in parts if kinds.why.get(p.ref()) is not None), parts[0].op)
        steps, reached, local = _walk(kinds, parts)
        if is_ps_variable(variable) and clipping:
            _refuse(variable, op, "the optimizer's clipnorm / clipvalue / global_clipnorm too", "The replayed gradient of a PS "
                    "variable reaches the PS from every worker whole, where that clipping expects each worker's own.")
        if is_ps_variable(variable) and not ps_averages:
            _refuse(variable, op, "average_sparse=False", "The PS sums the workers' gradients of PS variables "
                    "instead of averaging them, which one process's transformation of its gradient does not do.")
        if local:
            bad_op, tensor = local[0]
            what = (f"a stateful op ({bad_op.type} {bad_op.name!r})" if tensor is None else
                    f"a value of this worker's own ({tensor.name!r}: its batch, its loss, ...), read by "
                    f"{bad_op.type} {bad_op.name!r}")
            _refuse(variable, bad_op, what, "One process would compute it on the global batch.")
        if accumulating:
            _refuse(variable, op, "backward_passes_per_step > 1", "The transformation would act on each pass's "
                    "gradient, one process's on the sum of them.")
        _refuse_some_stripes(variable, op, reached, steps, stripe_of)
        transforms[j] = _Transform(steps, reached)
        found.setdefault(f"{op.type} {op.name!r}", []).append(variable.name)
    if not transforms:
        return None
    replay = Replay(grads_and_vars, transforms, is_ps_variable)
    where = ("on the PS tasks, from the sums of the workers' pushes" if replay.on_ps else
             "on the gradients averaged over the workers")
    for how, names in found.items():
        logging.info("the train_step transforms the gradients of %s by %s: repeated %s", ", ".join(names), how, where)
    return replay


def _refuse_some_stripes(variable, op, leaves, steps, stripe_of):
    """Refuses a transformation that reads some, not all, of a partitioned table's stripes together with the
    gradients of other variables, or that combines the rows of such a stripe's gradient (``_rows_mixed_by``).
    Keras lists a table's stripes one by one in ``trainable_variables``: code that picks a table's gradient by its
    position (``grads[:1]``, then a global norm of ``grads[1:]``) picks one stripe, and the others' gradients join the
    rest's transformation; code that clips each gradient by its own norm (``tf.clip_by_norm``) clips each stripe by
    the stripe's norm. Both are silently unlike one process, which transforms the whole table's gradient. A
    transformation acting row by row or element by element is one process's on every stripe, and allowed."""
    if stripe_of is None:
        return
    read = {}
    for leaf in leaves:
        owner = stripe_of(leaf.variable)
        if owner is not None:
            read.setdefault(id(owner[0]), (owner[0], set()))[1].add(owner[1])
    for table, stripes in read.values():
        if len(stripes) == len(table.shards):
            continue
        fixes = f"or keep the table in one piece with placement={{{table.path!r}: 'ps:1'}}."
        if len(leaves) > len(stripes):
            raise ValueError(
                f"The train_step transforms the gradient of {variable.name!r} together with the gradients of "
                f"stripe(s) {sorted(stripes)} of the {len(table.shards)} stripes of table {table.path!r}, not all of "
                f"them ({op.type} op {op.name!r}). Keras lists a partitioned table's stripes one by one in "
                "trainable_variables, so code that picks a table's gradient by its position (grads[:1]) picks one "
                "stripe, and the transformation of the others (a global norm, say) would mix stripes of the table in, "
                "silently unlike one process. Received: that transformation before apply_gradients, with table "
                f"{table.path!r} in {len(table.shards)} stripes. Pick gradients by their variables, not by position, "
                + fixes)
        mixing = _rows_mixed_by(steps)
        if mixing is not None:
            raise ValueError(
                f"The train_step transforms the gradient of {variable.name!r}, stripe(s) {sorted(stripes)} of the "
                f"{len(table.shards)} stripes of table {table.path!r}, by an op that combines the gradient's rows "
                f"({mixing.type} op {mixing.name!r}: a norm or a sum over the whole gradient, as tf.clip_by_norm "
                "takes). Keras lists a partitioned table's stripes one by one in trainable_variables, so it would act "
                "on each stripe's rows apart, where one process acts on the whole table's gradient: silently unlike "
                f"one process. Received: that transformation before apply_gradients, with table {table.path!r} in "
                f"{len(table.shards)} stripes. Transform the table's gradient row by row (tf.clip_by_norm(g, c, "
                "axes=[-1])) or element by element (tf.clip_by_value), use the optimizer's clipnorm (applied to the "
                "whole table, as one process does), " + fixes)


_REDUCTIONS = {"Sum", "Mean", "Max", "Min", "Prod", "EuclideanNorm", "All", "Any", "ArgMax", "ArgMin", "Cumsum",
               "Cumprod"}  # their axes are their second input
_MIXING = {"L2Loss", "MatMul", "BatchMatMulV2", "Einsum", "Transpose"}  # combine or move the rows whatever the rest


def _rows_mixed_by(steps):
    """The first of a transformation's ops (``steps``, as ``_walk`` gives them) that combines values of different
    rows of the gradients it reads: a reduction over the first axis (or axes not known while tracing; after a
    ``Reshape``, over any axis), ``L2Loss`` (``tf.clip_by_global_norm``'s), a product of matrices, a transpose.
    None when it acts row by row or element by element."""
    reshaped = False
    for step in steps:
        if isinstance(step, tuple):
            continue
        if step.type in _MIXING:
            return step
        reshaped = reshaped or step.type == "Reshape"
        if step.type in _REDUCTIONS:
            axes = tf.get_static_value(step.inputs[1])
            rank = step.inputs[0].shape.rank
            if axes is None or not rank or reshaped or 0 in {int(a) % rank for a in np.ravel(axes)}:
                return step
    return None


def _refuse(variable, op, what, why):
    raise ValueError(
        f"The train_step transforms the gradient of {variable.name!r} by a function of its gradients ({op.type} op "
        f"{op.name!r}, e.g. tf.clip_by_global_norm or tf.clip_by_value) that kparallax cannot compute on the global "
        f"batch's gradients, because it involves {what}. {why} Applied to each worker's own gradient instead, it "
        "would train differently from one process. Received: that transformation before apply_gradients. Compute it "
        "from the gradients, constants and variables only (kparallax then applies it to the global batch's "
        "gradients), or use the optimizer's clipnorm / clipvalue / global_clipnorm alone (applied as one process does).")
