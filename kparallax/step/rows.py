"""The global batch's rows inside a training step: for a model whose rows interact (in-batch negatives).

kparallax's step is one process's only when each row's loss depends on that row alone: each worker computes its own
rows' losses, and their gradients are averaged. A retrieval model scoring every query against every candidate of the
batch (logits ``q @ d^T``, labels ``tf.range(batch)``) scores each worker's queries against that worker's candidates
only: a smaller softmax, other gradients (0.69 off one process after 2 epochs on the README's probe; such a
product without a gather is refused at the first step, ``rows_meet.py``).
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
that is TensorFlow's default context (one replica), whose gather returns the worker's own rows: in the training step
of several workers it is refused with the fix (``step/replica_context.py``).
"""

import tensorflow as tf
from horovod import tensorflow as hvd

from kparallax.step import collectives
from kparallax.step import global_losses
from kparallax.step import rows_meet
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
        return rows_meet.gathered(collectives.allgather([value], num_workers, _unique("kp_all_gather"))[0])
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

    return rows_meet.gathered(gather(value))


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
