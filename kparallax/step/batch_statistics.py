"""A compiled loss function of statistics of the batch, computed with the global batch's statistics.

A root mean squared error compiled as the loss (``tf.sqrt(tf.reduce_mean(tf.square(y_pred - y_true)))``), or a mean
over a mask written by hand (``tf.reduce_sum(loss * mask) / tf.reduce_sum(mask)``, as TensorFlow's transformer
tutorial writes its loss), takes a statistic of the whole batch through a function other than a sum or a scaling;
per-example errors scaled by the batch's own deviation combine a statistic with the rows. One process takes them of
the global batch's statistics, each worker of its own rows' (a root mean squared error loss on 2 workers ended
2.1e-3 off one process after 3 epochs, a masked mean 1.5e-3, silently).

``globalized(call, y_true, y_pred)`` reads such a function from a trace of its own (``row_axes``: a ``nonlinear`` or
``statistic`` meeting its output is computed from) and gives a replacement for it: the function itself, run with
each sum and mean over the batch's rows taken over every worker's rows (a ``kp.all_gather`` of the worker's sum, and
of its count of elements for a mean). Each worker then computes one process's statistics, and the gather's gradient
sends every worker's part of their gradient back to the rows they came from: the workers' averaged gradient is one
process's (``rows.all_gather`` weights by the batch shares when batches differ in size). It costs two small
gathers per such statistic (a scalar, or one value per column) per step. A function that only sums, averages or
scales its statistics is left as it is (the step's averaging is one process's there). One that reduces the rows
otherwise (a maximum, a log-sum-exp, a product over them: a Gram matrix) or whose rows meet otherwise (a softmax
over the batch, pairwise differences) is not replaced: ``rows_meet`` refuses it at the first step.
"""

import contextlib

import tensorflow as tf

from kparallax._compat import tf as tf_compat
from kparallax.step import row_axes
from kparallax.step import rows

_MADE_GLOBAL = {"nonlinear", "statistic"}  # the meetings that the global batch's statistics make one process's
_OTHER_MEETINGS = {"softmax", "pairwise", "cumulative", "carried", "ranked", "shifted"}


def globalized(call, y_true, y_pred):
    """A replacement for the loss function ``call(y_true, y_pred)`` taking its sums and means over the batch's rows
    over every worker (see the module docstring), or None: its statistics reach its output only through sums and
    scalings, its rows meet otherwise or are reduced otherwise than by sums and means, its inputs are not plain
    tensors, or the step runs eagerly."""
    if tf.executing_eagerly() or not all(isinstance(t, tf.Tensor) for t in (y_true, y_pred)):
        return None
    specs = [tf.TensorSpec.from_tensor(t) for t in (y_true, y_pred)]
    graph = tf.function(call).get_concrete_function(*specs).graph
    axes, ops = row_axes.RowAxes(graph.inputs[:2]), graph.get_operations()
    axes.follow(ops)
    feeding = row_axes.feeding([t for t in graph.outputs if t.dtype.is_floating], ops)
    kinds = {m.kind for m in axes.meetings if m.op.name in feeding and not m.calls}  # inside a call: not made global
    if (not kinds & _MADE_GLOBAL or kinds & _OTHER_MEETINGS
            or not all(row_axes.summed_or_averaged(op) for op in axes.reductions)):
        return None

    def over_the_global_batch(y_true, y_pred, **kwargs):
        with _global_reductions((y_true, y_pred)):
            return call(y_true, y_pred, **kwargs)

    return over_the_global_batch


@contextlib.contextmanager
def _global_reductions(data):
    """While active, each ``tf.reduce_sum`` (and ``tf.reduce_mean`` of floating values) over the rows of the batch
    ``data`` (followed by ``row_axes`` through the ops made since it began) gives the sum (mean) over every worker's
    rows."""
    graph = tf.compat.v1.get_default_graph()
    axes, followed = row_axes.RowAxes(data), [len(graph.get_operations())]

    def reduces_rows(local):
        """Whether ``local``, a reduction's output, reduces the batch's rows."""
        ops = graph.get_operations()
        axes.follow(ops[followed[0]:])
        followed[0] = len(ops)
        return local.op in axes.reductions

    def global_sum(own, *args, **kwargs):
        local = own(*args, **kwargs)
        if not reduces_rows(local):
            return local
        return own(rows.all_gather(local[None]), 0, False)

    def global_mean(own, *args, **kwargs):
        local = own(*args, **kwargs)
        if not reduces_rows(local) or not local.dtype.is_floating:
            return local
        tensor = local.op.inputs[0]
        count = tf.cast(tf.size(tensor), local.dtype) / tf.cast(tf.size(local), local.dtype)  # elements per value
        total = tf.math.reduce_sum(rows.all_gather(tf.math.multiply_no_nan(local, count)[None]), axis=0)
        return total / tf.math.reduce_sum(rows.all_gather(count[None]), axis=0)  # an empty part adds 0 rows

    with tf_compat.reductions_replaced(global_sum, global_mean):
        yield
