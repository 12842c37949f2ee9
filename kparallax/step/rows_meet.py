"""Rows of the batch scored against each other without a gather, refused in the training step of several workers.

A retrieval model trained with in-batch negatives scores every query against every candidate of its batch: logits
``q @ d^T`` over the batch's rows, labels ``tf.range(batch)``. On several workers each worker's batch is a part of
the global one, so each scores its queries against its own candidates only: a smaller softmax, other gradients,
and the model trains apart from one process on the global batch, silently (a two-tower model, 2 workers of 16 rows:
its weights 0.69 off one process after 2 epochs, the logged loss near log 16 against one process's log 32). The
fix is ``kp.all_gather`` (``rows.py``).

While the synchronous training step of several workers (or micro-batches) is traced (``refused``), each product of
two rank-2 tensors that the batch reaches and that scores the rows of one against the rows of the other (``a @
b^T``: ``tf.matmul(a, b, transpose_b=True)``, ``a @ tf.transpose(b)``, ``tf.einsum("id,jd->ij", a, b)``) gets a
check in the step: it fails at the first step when both sides have as many rows as the worker's batch. A side read
from ``kp.all_gather``'s output (``gathered``) is not checked; a side of sampled candidates (a sampled softmax's)
has its sample's rows, so it passes. Products in functions of their own (a ``tf.function`` the step calls, a loop's
body) are not seen (the meetings below are: ``row_axes`` follows calls and loops).

Rows that meet in other ways (``row_axes``: a statistic over the batch combined with its rows, a softmax over the
batch axis, pairwise differences, every pair of its rows built side by side or by tiles, a cumulative sum along the
rows, a top-k or sort over them, a roll or reverse of them, a value a loop over them carries from row to row, rows
taken by their place in the batch) get the same kind of check: it fails when the tensors meeting there have as many
rows as the worker's batch on the axes that hold them (a slice or pad whose bounds are not known while tracing:
and its output has fewer or more). Ops made under ``apart()`` (BatchNormalization's per-worker statistics,
``sync_batch_norm=False``; Keras' masked mean loss, whose valid count the step counts over the workers itself; a
scalar loss or metric recomputed on the batch's rows repeated twice, to tell a sum from a mean) and
``kp.all_gather``'s outputs are not followed. Rows taken by their place (copied once per row by a tile, reduced
together with entries of something else joined to them: ``row_joins``) are checked only where a differentiated
loss is computed from them (below): taken for a variable's write alone, the variable's aggregation combines them
(``x[0]`` kept in an ``ONLY_FIRST_REPLICA`` variable: worker 0's, the global batch's). Only the forward pass's
meetings are checked: the backward pass meets where it does.

A statistic of the batch taken through a function other than a sum or a scaling (``row_axes``' ``nonlinear``: a root
mean squared error as the loss, a loss divided by a statistic of the batch) is checked the same way, on the rows of
the reduced tensor, where a loss the step differentiates is computed from it (the targets of its ``tape.gradient``
and ``tf.gradients`` calls, recorded while the step is traced; not a call made while another one computes its
gradients, such as the tape ``tf.recompute_grad``'s gradient recomputes its function under: that is the backward
pass): a root of a mean logged beside the loss changes no weight. A loss function compiled with the model gets here
only what ``batch_statistics`` could not make global.

A reshape of the batch's rows into entries holding k whole rows or parts of consecutive rows (``row_axes.Cut``:
pairs laid out row after row, ``[B, 3] -> [-1, 2]``) gets a check that runs before it: the worker's part of the
batch fills whole entries. One process reshapes the global batch; the workers' parts of it differ by a row at most
(the data split), so a part of a global batch that one process reshapes may not fill them (22 rows in pairs, 11 on
each of 2 workers), and the reshape would fail with TensorFlow's error about value counts instead of saying why.

The step's Horovod collectives that its checks do not read run after them (``checked_first``), so each worker fails
on its own check, not in a collective another worker's failed check left.
"""

import contextlib
import threading

import tensorflow as tf

from kparallax._compat import keras_losses
from kparallax._compat import repeated_rows
from kparallax._compat import tf as tf_compat
from kparallax.step import row_axes

_ACTIVE = threading.local()
_MOST_CHECKS = 16


def gathered(tensor):
    """Marks ``tensor`` as ``kp.all_gather``'s output in the step being traced: products reading it are not
    refused (a worker whose part of a partial last batch is empty gathers as many rows as another's batch)."""
    marked = getattr(_ACTIVE, "gathered", None)
    if marked is not None:
        marked.add(tensor.ref())
    return tensor


@contextlib.contextmanager
def refused(num_workers, micro_batches, data):
    """While the synchronous training step on ``data`` (this worker's batch) is traced, with ``num_workers`` workers
    and ``micro_batches`` (``backward_passes_per_step``): products scoring the batch's rows against each other that
    the step made fail at its first run (see the module's docstring). Nothing on one worker and one micro-batch, or
    run eagerly."""
    if num_workers * micro_batches == 1 or tf.executing_eagerly():
        yield
        return
    graph = tf.compat.v1.get_default_graph()
    first = len(graph.get_operations())
    outer = getattr(_ACTIVE, "gathered", None), getattr(_ACTIVE, "apart", None)
    _ACTIVE.gathered, _ACTIVE.apart = set(), set()
    targets = []  # what the step's tapes differentiate: its losses

    def record(target, sources, gradients):
        del sources, gradients
        targets.extend(t for t in tf.nest.flatten(target) if tf.is_tensor(t) and getattr(t, "graph", None) is graph)

    try:
        with tf_compat.recording_gradients(record, outermost_only=True):
            yield
        marked, apart_ops = _ACTIVE.gathered, _ACTIVE.apart
    finally:
        _ACTIVE.gathered, _ACTIVE.apart = outer
    ops, where = graph.get_operations()[first:], _where(num_workers, micro_batches)
    tail, checks = repeated_rows.Tail(data), []
    for op in ops:
        sides = _scored_rows(op)
        if sides is not None and all(tail.reaches(side) and not _read_from(side, marked) for side in sides):
            held = [_batch_part(side, tail) for side in sides]
            checks.append(((held[0], 0), (held[1], 0), _message(op, *sides, where)))
    axes = row_axes.RowAxes(data, apart=marked, apart_ops=apart_ops)
    axes.follow(ops)
    meetings = _forward(axes.meetings, row_axes.feeding(targets, ops))
    checks = [(held, (), message) for *held, message in checks]
    checks.extend((meeting.checked, meeting.when + _taking_part(meeting), _meeting_message(meeting, where))
                  for meeting in [m for m in meetings if m.checked][:_MOST_CHECKS])
    rows = tf.cast(keras_losses.batch_rows(data), tf.int32) if checks or axes.cuts else None
    for held, when, message in checks:  # each held tensor with as many rows as the batch (times its entries per row)
        every = tf.reduce_all(tf.stack([_holds_every_row(t, axis, rows, axes.entries(t)) for t, axis in held]
                                       + [tf.equal(tf.cast(p, tf.bool), taken) for p, taken in when]))
        _kept(tf.debugging.Assert(tf.logical_not(every), [message]))
    for cut in axes.cuts[:_MOST_CHECKS]:
        _kept(_whole_entries(cut, rows, num_workers, micro_batches, where))


def _kept(check):
    """Keeps ``check`` (an ``Assert`` op) for ``checked_first``: the step's collectives wait for it."""
    if getattr(_ACTIVE, "asserts", None) is not None:
        _ACTIVE.asserts.append(check)
    return check


def _whole_entries(cut, rows, num_workers, micro_batches, where):
    """The check that runs before the reshape ``cut.op`` (``row_axes.Cut``): this worker's part of the batch
    (``rows`` rows) fills whole entries. One process reshapes the global batch, each worker its own contiguous part
    of it (the parts of a partial last batch a row apart at most, whatever the entries): without the check the
    worker's reshape fails with TensorFlow's error about value counts, on a batch one process trains on."""
    op, multiple = cut.op, cut.entries.denominator
    fits = tf.equal(tf.size(op.inputs[0], out_type=tf.int64) % cut.values, 0)
    parts = num_workers * micro_batches
    message = (f"The part of the batch on this worker does not fill whole entries of {op.name} (a reshape of "
               f"{op.inputs[0].shape} into {op.outputs[0].shape}: {cut.entries} entries per row of the batch, whole "
               f"on a multiple of {multiple} rows). One process reshapes the global batch, each worker its own "
               f"contiguous part of it ({parts} parts in all, a row apart at most, whatever the entries). Received: "
               f"a part of the rows below in the training step of {where}. Make every global batch a multiple of "
               f"{parts * multiple} rows (a per-worker batch_size a multiple of {micro_batches * multiple}, and a row "
               "count filling the last global batch so), or drop the partial last batch: Dataset.batch(..., "
               "drop_remainder=True), or fewer rows to fit.")
    check = tf.debugging.Assert(fits, [message, rows])
    tf_compat.run_independently(check)  # not after the step's earlier checks (past the reshape): no cycle
    tf_compat.add_control_inputs(op, [check])
    return check


def _taking_part(meeting):
    """For a ``sliced`` meeting whose bounds were not known while tracing (``x[:tf.shape(y)[0]]``, a pad by
    paddings read while the step runs): the condition (predicate, True) that its output has another count of entries
    than its input, so a slice keeping every row, or a pad adding none, runs. Inside a function the step calls, the
    output is not the step's: checked on the call's inputs alone."""
    if not meeting.part or meeting.calls:
        return ()
    [(taken, taken_axis)], (x, axis) = meeting.part, meeting.rows[0]
    return ((tf.not_equal(tf.shape(taken)[taken_axis], tf.shape(x)[axis]), True),)


def _holds_every_row(tensor, axis, rows, entries):
    """Whether ``tensor``'s ``axis`` has the batch's ``rows`` times ``entries`` (a ``Fraction``) entries."""
    return tf.equal(tf.shape(tensor)[axis] * entries.denominator, rows * entries.numerator)


@contextlib.contextmanager
def checked_first():
    """While the training step is traced (around ``refused`` and every collective the step makes after it, its
    logs' and its barrier's too): each Horovod collective of the step that the checks ``refused`` made do not read
    waits for them. Without that, a worker whose check failed left Horovod while another, its own check not yet
    run, waited in a collective of the step: that one failed naming the other worker instead of the refusal
    (seen on a model whose rows meet past a Keras LSTM, in half the runs)."""
    if tf.executing_eagerly():
        yield
        return
    graph = tf.compat.v1.get_default_graph()
    first = len(graph.get_operations())
    outer = getattr(_ACTIVE, "asserts", None)
    _ACTIVE.asserts = []
    try:
        yield
        asserts = _ACTIVE.asserts
    finally:
        _ACTIVE.asserts = outer
    asserts = [check for check in asserts if check.graph is graph]  # not a branch's or a loop's own
    if not asserts:
        return
    ops = graph.get_operations()[first:]
    upstream = row_axes.feeding(asserts, ops, control=True)  # a control edge from one of them would make a cycle
    for op in ops:
        if op.name not in upstream and _collective(op):
            tf_compat.add_control_inputs(op, asserts)


def _collective(op):
    """Whether graph op ``op`` is a Horovod collective or calls a function (a loop's body, a branch) holding one."""
    if op.type.startswith("Horovod"):
        return True
    return any(_collective(inner) for graph in tf_compat.called_graphs(op) or () for inner in graph.get_operations())


def install():
    """Keras' masked mean losses count their valid entries, and a scalar loss is recomputed on the batch's rows
    repeated twice, under ``apart()`` (once, process-wide)."""
    keras_losses.hook_apart(apart)


@contextlib.contextmanager
def apart():
    """While the step is traced under ``refused``, the ops made inside compute each worker's own values on request
    (BatchNormalization's statistics under ``sync_batch_norm=False``): rows meeting there are not refused."""
    names = getattr(_ACTIVE, "apart", None)
    if names is None:
        yield
        return
    graph = tf.compat.v1.get_default_graph()
    first = len(graph.get_operations())
    try:
        yield
    finally:
        names.update(op.name for op in graph.get_operations()[first:])


def _forward(meetings, feeding):
    """The ``meetings`` of the forward pass (the backward pass meets where it does), of the ``nonlinear``,
    ``sliced`` and ``tiled`` kinds only those in ``feeding`` (names of the ops a differentiated loss is computed
    from), of the ``nonlinear`` kind the first of each statistic. Rows taken by their place for a variable's write
    alone are the variable's aggregation's to combine (``x[0]`` kept in an ``ONLY_FIRST_REPLICA`` variable: worker
    0's first row, the global batch's)."""
    kept, statistics = [], set()
    for meeting in meetings:
        if row_axes.BACKWARD in f"/{meeting.at.name}":
            continue
        if meeting.kind in ("sliced", "tiled", "joined") and meeting.at.name not in feeding:
            continue
        if meeting.kind == "nonlinear":
            if meeting.at.name not in feeding or meeting.source.name in statistics:
                continue
            statistics.add(meeting.source.name)
        kept.append(meeting)
    return kept


def _read_from(tensor, marked):
    """Whether graph tensor ``tensor`` is computed from one of the ``marked`` tensors (refs)."""
    stack, seen = [tensor], set()
    while stack:
        current = stack.pop()
        if current.ref() in marked:
            return True
        if current.ref() in seen:
            continue
        seen.add(current.ref())
        stack.extend(tf_compat.computed_from(current))
    return False


def _scored_rows(op):
    """(a, b) when graph op ``op`` computes ``a @ b^T`` of rank-2 tensors (every row of ``a`` against every row of
    ``b``); None otherwise."""
    if op.type == "Einsum":
        return _einsum_rows(op)
    if op.type not in row_axes.PRODUCTS or len(op.inputs) != 2 or any(x.shape.rank != 2 for x in op.inputs):
        return None
    flip_a, flip_b = row_axes.flips(op)
    a, transpose_a = _untransposed(op.inputs[0], flip_a)
    b, transpose_b = _untransposed(op.inputs[1], flip_b)
    return (a, b) if not transpose_a and transpose_b else None


def _einsum_rows(op):
    """``_scored_rows`` of an ``Einsum`` op: two rank-2 operands whose first labels make the output's
    (``"id,jd->ij"``)."""
    sides, output = row_axes.einsum_sides(op)
    if len(op.inputs) != 2 or len(sides) != 2 or any(len(s) != 2 for s in sides) or len(output) != 2:
        return None
    (a_row, a_col), (b_row, b_col) = sides
    if output != a_row + b_row or a_row == b_row or a_col != b_col or a_col in output:
        return None
    return op.inputs[0], op.inputs[1]


def _batch_part(side, tail):
    """The tensor of a scored product's ``side`` that holds the batch's rows: ``side``, or where it joins the rows
    of one tensor the batch reaches to rows of others it does not (``tf.concat([k, bank], axis=0)``: the batch's keys
    and a memory bank's), that tensor, so the product is checked on the batch's part."""
    if side.op.type != "ConcatV2" or side.shape.rank != 2:
        return side
    axis = tf.get_static_value(side.op.inputs[-1])
    parts = [x for x in side.op.inputs[:-1] if tail.reaches(x)]
    return parts[0] if axis is not None and int(axis) % 2 == 0 and len(parts) == 1 else side


def _untransposed(tensor, transposed):
    """``tensor`` and whether it is used transposed, looking through a ``Transpose`` swapping its two axes."""
    if tensor.op.type == "Transpose":
        perm = tf.get_static_value(tensor.op.inputs[1])
        if perm is not None and list(perm) == [1, 0]:
            return tensor.op.inputs[0], not transposed
    return tensor, transposed


def _where(num_workers, micro_batches):
    return (f"a job of {num_workers} workers" if micro_batches == 1 else
            f"a job of {num_workers} worker(s) accumulating backward_passes_per_step={micro_batches} micro-batches")


def _message(op, a, b, where):
    """The product check's error (no apostrophes: TensorFlow escapes them in an assertion's message)."""
    return (f"The rows of the batch are scored against each other in {op.name} ({op.type} of {a.shape} and "
            f"{b.shape} transposed, both holding every row of the batch of this worker, as in-batch negatives do): "
            "each worker would score its own rows only, and the model would train apart from one process on the "
            f"global batch. Received: that product in the training step of {where}. Gather the candidate rows over "
            "the workers with kp.all_gather(value) and offset the labels by kp.row_offset(value) (with sync=True "
            "and backward_passes_per_step=1), or score each row against its own candidate only.")


_A_ROW = "one row of the batch ({}: an element of a list of its rows, as the function of tf.map_fn gets)"
_COMPILED = (" a loss function compiled with the model (of its targets and predictions) gets its sums and means "
             "over every worker from kparallax itself (with backward_passes_per_step=1);")


def _meeting_message(meeting, where):
    """A meeting's error (``row_axes``), naming the op (and the calls of the functions it is in), how the rows meet
    there, and the fix."""
    op, (x, axis) = meeting.op, meeting.rows[0]
    inside = "".join(f", in the body of the loop {c.name}" if c.type in ("While", "StatelessWhile")
                     else f", in the function called by {c.name}" for c in reversed(meeting.calls))
    inside += "," if inside else ""
    if meeting.kind == "statistic":
        what = _A_ROW.format(x.shape) if axis == row_axes.ROW else f"rows of {x.shape}"
        how = (f"{op.type} combines {what} with {meeting.source.type} over the rows of the batch in "
               f"{meeting.source.name}, a statistic of the batch, as centering or normalizing over the batch by hand "
               "does")
    elif meeting.kind == "pairwise" and meeting.rows[1][1] == axis:
        other = meeting.rows[1][0]
        how = (f"{op.type} combines the entries of {x.shape} with those of {other.shape} in order, along axis {axis}, "
               "each holding the rows of the batch in another order (each row copied in place by tf.repeat, the "
               "whole batch copied after itself by tf.tile or tf.concat), pairing rows of the batch with other rows")
    elif meeting.kind == "pairwise":
        other, other_axis = meeting.rows[1]
        against = (_A_ROW.format(other.shape) if other_axis == row_axes.ROW else
                   f"those of {other.shape} (axis {other_axis})")
        how = (f"{op.type} combines the rows of {x.shape} (axis {axis}) with {against}, pairing every row of the "
               "batch with every other, as pairwise differences or pairs of rows joined side by side do")
    elif meeting.kind == "tiled":
        how = (f"{op.type} copies the rows of the batch, axis {axis} of its input {x.shape}, once per row of the batch "
               "(a count read from its size while the step runs), as building every pair of the batch's rows with "
               "tf.tile or tf.repeat does")
    elif meeting.kind == "shifted":
        how = (f"{op.type} reorders the rows of the batch along axis {axis} of its input {x.shape}, putting each row "
               "in another row's place, as negatives taken by rolling or reversing the batch are")
    elif meeting.kind == "ranked":
        how = (f"{op.type} ranks the rows of the batch by value, axis {axis} of its input {x.shape}, as tf.math.top_k "
               "keeping the hardest examples of the batch, tf.sort or tf.argsort over the batch do")
    elif meeting.kind == "sliced" and op.type == "Reshape":
        how = (f"Reshape joins the rows of the batch, axis 0 of its input {x.shape}, into a fixed count of entries "
               f"whatever the size of the batch (to {op.outputs[0].shape}), each entry holding a share of the batch")
    elif meeting.kind == "sliced" and op.type in row_axes.PADS:
        how = (f"{op.type} adds rows before or after the rows of the batch, axis {axis} of its input {x.shape}: one "
               "process pads the global batch once, each worker its own part; pad along another axis, or pad the "
               "rows gathered over every worker")
    elif meeting.kind == "sliced":
        how = (f"{op.type} takes rows of the batch by their place in it, axis {axis} of its input {x.shape}, as "
               "the first row of the batch taken as an anchor, a batch laid out in halves and split, or rows taken at "
               "fixed or shuffled places are; to pair rows, lay each pair out in one row (two inputs, or [B, 2, ...]) "
               "or in consecutive rows joined by a reshape to [-1, 2, ...]")
    elif meeting.kind == "joined":
        joined = meeting.source
        how = (f"{op.type} runs along the axis where {joined.name} ({joined.type}) joins the rows of the batch, axis "
               f"{axis} of {x.shape}, to entries of something else than the batch (a weight, a prior, a sample): one "
               "process joins them to the global batch once, each worker to its own part, as a mean over "
               "tf.concat([per_example_loss, prior], 0) does; reduce the rows of the batch and the other entries "
               "apart (a mean over the rows plus a term of the others), or join the others to the rows gathered over "
               "every worker")
    elif meeting.kind == "carried":
        how = ("a loop over the rows of the batch carries a value computed from one row on to the next, as the "
               "accumulator of tf.scan does")
    elif meeting.kind == "nonlinear":
        # what batch_statistics makes global (not inside a function of the loss function's own)
        compiled = _COMPILED if row_axes.summed_or_averaged(meeting.source) and not meeting.calls else ""
        return (f"A statistic of the batch reaches the loss through {op.name}{inside} ({op.type} of "
                f"{meeting.source.type} "
                f"over the rows of the batch in {meeting.source.name}: a function of that statistic other than a sum "
                "or a scaling, as a root mean squared error loss, a log of a mean over the batch, a loss divided "
                "by a statistic of the batch or a penalty on a Gram matrix of the batch is): each worker would take "
                "it of the statistic of its own rows only, and the model would train apart from one process on the "
                f"global batch. Received: that op in the training step of {where}. Take the statistic over every "
                "worker: of the rows of kp.all_gather(value) (with sync=True and backward_passes_per_step=1);"
                f"{compiled} or make the loss a mean or sum of per-row values.")
    else:
        how = f"{op.type} along the rows of the batch, axis {axis} of its input {x.shape}"
    return (f"Rows of the batch meet in {op.name}{inside} ({how}): each worker would compute it from its own rows "
            f"only, and the model would train apart from one process on the global batch. Received: that op in the "
            f"training step of {where}. Compute it per row, or over every worker: gather the rows with "
            "kp.all_gather(value) first (with sync=True and backward_passes_per_step=1); for a mean and variance "
            "over the batch, BatchNormalization takes them over every worker (sync_batch_norm=True).")
