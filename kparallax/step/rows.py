"""The global batch's rows inside a training step: for a model whose rows interact (in-batch negatives).

kparallax's step is one process's only when each row's loss depends on that row alone: each worker computes its own
rows' losses, and their gradients are averaged. A retrieval model scoring every query against every candidate of the
batch (logits ``q @ d^T``, labels ``tf.range(batch)``) scores each worker's queries against that worker's candidates
only: a smaller softmax, other gradients. That is the contract of Horovod and tf.distribute too, and it is the
default here: the first step of several workers logs one warning where it sees the batch's rows multiplied with
themselves (a ``[rows, rows]`` matrix product, ``warn_rows_meeting``), and trains on.
Horovod's users gather the candidates themselves (``hvd.allgather``), tf.distribute's ``ReplicaContext.all_gather``;
``all_gather`` is that for kparallax, with ``row_offset`` for the labels:

    candidates = kp.all_gather(d)                              # every worker's rows, worker 0's first
    logits = tf.matmul(q, candidates, transpose_b=True)
    labels = kp.row_offset(q) + tf.range(tf.shape(q)[0])       # where this worker's rows are in ``candidates``

In kparallax's synchronous training step on several workers, ``all_gather`` concatenates ``value`` over the workers
(a Horovod allgather; batches may differ in size). Its gradient sends each candidate row's gradient, summed over the
workers' losses, back to the worker that computed the row: one process's, which differentiates one loss over all
rows. When batches differ in size the step weights each worker's gradient by its share of the global batch
(``global_losses``), so each worker's part is weighted by its own share before the sum and divided by the receiving
worker's after it. Everywhere else (one process, one worker, ``evaluate`` / ``predict`` and validation, which see
the whole input on every worker) it returns ``value`` and ``row_offset`` returns 0, so the same code runs in a plain
process. The gathered rows are one process's batch in its order (each worker's batch is its contiguous part of the
global batch: ``core/data.py``), and ``row_offset`` is each worker's first row's place in it. Called on a Keras
tensor (a functional model being built), each returns a ``Lambda`` layer's output, so that the model calls it in
every step (called directly, it would run once, at construction, and leave the model without it).

A program written for tf.distribute gathers with ``tf.distribute.get_replica_context().all_gather``; under kparallax
that is TensorFlow's default context (one replica), whose gather returns the worker's own rows: use ``all_gather``.
"""

import tensorflow as tf
from horovod import tensorflow as hvd

from kparallax.step import collectives
from kparallax.step import global_losses
from kparallax import log as logging
from kparallax.step import train_step


def _job():
    """The strategy of the synchronous training step traced on several workers, or None where gathering is the
    identity; raises where rows cannot be gathered."""
    strategy = train_step.model_step_strategy()
    if strategy is None or strategy.num_workers == 1:
        return None
    where = None
    if not strategy.options.sync:
        where = "an asynchronous training step (sync=False), where the workers do not step together"
    elif strategy.options.backward_passes_per_step > 1:
        where = (f"a step accumulating backward_passes_per_step={strategy.options.backward_passes_per_step} "
                 "micro-batches")
    elif tf.executing_eagerly():
        where = "a training step run eagerly (run_eagerly=True)"
    if where is not None:
        raise ValueError(
            f"kp.all_gather / kp.row_offset in {where} is not supported: the gathered rows would not be one "
            f"process's batch. Received: a call in the training step of a job of {strategy.num_workers} workers. "
            "Train with sync=True, backward_passes_per_step=1 and run_eagerly=False.")
    return strategy


def _unique(name):
    """A collective's name, the same on every worker (they trace the same step), unique in the traced function."""
    return tf.compat.v1.get_default_graph().unique_name(name, mark_as_used=True)


def _sizes(value, strategy):
    """Every worker's row count of ``value`` (an int32 vector, worker 0's first), and the position of this worker's
    first row among the gathered ones (the row count of the workers before it, an int32 scalar)."""
    rows = tf.shape(value, out_type=tf.int32)[:1]
    sizes = collectives.allgather([rows], strategy.num_workers, _unique("kp_rows_sizes"))[0]
    return sizes, tf.reduce_sum(sizes[:strategy.worker_index])


# Called from a user's traced code: kept out of AutoGraph's conversion (plain Python decisions at trace time).
@tf.autograph.experimental.do_not_convert
def all_gather(value):
    """``value``'s rows of every worker concatenated (worker 0's first) in kparallax's synchronous training step on
    several workers, with the gradient one process would compute; ``value`` itself everywhere else.

    Args:
      value: a tensor whose first dimension is the batch's (a per-row embedding, say).

    Returns:
      A tensor of the global batch's rows of ``value`` (its first dimension the sum of the workers' row counts).

    Raises:
      ValueError: in an asynchronous step, a step accumulating micro-batches, or a step run eagerly, on several
        workers.
    """
    if tf.keras.backend.is_keras_tensor(value):
        return tf.keras.layers.Lambda(all_gather)(value)
    strategy = _job()
    if strategy is None:
        return value
    num_workers = strategy.num_workers
    value = tf.convert_to_tensor(value)
    if not value.dtype.is_floating:
        return _gathered(collectives.allgather([value], num_workers, _unique("kp_all_gather"))[0])
    share = global_losses.gradient_share()
    sizes, start = _sizes(value, strategy)

    @tf.custom_gradient
    def gather(local):
        gathered = collectives.allgather([local], num_workers, _unique("kp_all_gather"))[0]

        def backward(upstream):
            upstream = tf.convert_to_tensor(upstream)
            if share is not None:
                upstream *= tf.cast(share, upstream.dtype)
            total = hvd.allreduce(upstream, op=hvd.Sum, name=_unique("kp_all_gather_grad"))
            mine = total[start:start + sizes[strategy.worker_index]]
            return mine if share is None else mine / tf.cast(share, mine.dtype)

        return gathered, backward

    return _gathered(gather(value))


@tf.autograph.experimental.do_not_convert
def row_offset(value):
    """The position of this worker's first row of ``value`` in ``all_gather(value)`` (an int32 scalar tensor): the
    row count of the workers before it in kparallax's synchronous training step on several workers, 0 elsewhere."""
    if tf.keras.backend.is_keras_tensor(value):
        return tf.keras.layers.Lambda(row_offset)(value)
    strategy = _job()
    if strategy is None:
        return tf.constant(0, tf.int32)
    return _sizes(value, strategy)[1]


_GATHERED = "kp_gathered"  # the collection of a traced step's graph that holds ``all_gather``'s outputs
_PRODUCTS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")


def _gathered(tensor):
    tf.compat.v1.add_to_collection(_GATHERED, tensor)
    return tensor


def rows_meeting(graph, batch_rows):
    """The names of the matrix products in ``graph`` (a traced training step) that multiply the batch's rows with
    themselves: in the forward pass, two operands of ``batch_rows`` rows (the batch's static row count, or None for
    an unknown one) contracted over a known, common width into ``[rows, rows]``, neither operand from
    ``all_gather``. A cheap look at static shapes: it sees the usual in-batch softmax (``q @ d^T``), not every way
    rows can meet."""
    if batch_rows is not None and batch_rows < 2:
        return []
    gathered = {t.name for t in graph.get_collection(_GATHERED)}
    found = []
    for op in graph.get_operations():
        if op.type not in _PRODUCTS or "gradient_tape/" in op.name or op.name.startswith("gradients"):
            continue
        a, b = (t.shape for t in op.inputs[:2])
        if a.rank != 2 or b.rank != 2:
            continue
        flip_a = bool(op.get_attr("transpose_a" if op.type == "MatMul" else "adj_x"))
        flip_b = bool(op.get_attr("transpose_b" if op.type == "MatMul" else "adj_y"))
        rows_a, width_a = (a[1], a[0]) if flip_a else (a[0], a[1])
        width_b, rows_b = (b[1], b[0]) if flip_b else (b[0], b[1])
        if rows_a != batch_rows or rows_b != batch_rows or width_a is None or width_a != width_b:
            continue
        if not any(_comes_from(t, gathered) for t in op.inputs):
            found.append(op.name)
    return found


def _comes_from(tensor, names, limit=200):
    """Whether ``tensor`` is computed from one of the tensors ``names`` (a bounded walk back through its ops)."""
    seen, todo = set(), [tensor]
    while todo and len(seen) < limit:
        t = todo.pop()
        if t.name in names:
            return True
        if t.name in seen:
            continue
        seen.add(t.name)
        todo.extend(t.op.inputs)
    return False


def warn_rows_meeting(graph, batch_rows, num_workers):
    """Logs one warning (worker 0) where ``rows_meeting`` finds products of the batch's rows with themselves."""
    found = rows_meeting(graph, batch_rows)
    if found:
        logging.warning(
            "The training step multiplies the batch's rows with each other (%s): on %d workers each worker scores its "
            "own rows only (in-batch negatives from its own batch), as under Horovod and tf.distribute. To score "
            "against the global batch, gather the candidates with kp.all_gather (labels: kp.row_offset(q) + "
            "tf.range(rows)).", ", ".join(found[:3]), num_workers)
    return found
