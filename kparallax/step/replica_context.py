"""tf.distribute's replica context inside kparallax's training step: its collectives and replica count refused.

kparallax does not run the step under a tf.distribute strategy: Keras' train function runs it through TensorFlow's
default strategy, whose replica context (``tf.distribute.get_replica_context()``) is one replica, so its
``all_gather`` and ``all_reduce`` return this worker's own value, as do the default strategy's ``gather`` and
reductions (``reduce``, ``extended.reduce_to`` and ``extended.batch_reduce_to``), which a ``merge_call``'s function
gets. A program written for tf.distribute gathers its in-batch candidates or sums a normalizer (the batch's valid
tokens) over the replicas with them: under kparallax it would see this worker's rows alone and train silently apart
from one process. In the training step of a job of several workers they raise, at the first trace, with the fix. Keras' own calls (its
optimizers' gradient aggregation, synchronized BatchNormalization, its train function's logs) are left alone:
kparallax averages the gradients and the statistics over the workers itself. One worker, ``evaluate`` / ``predict``
and code outside the step are untouched.

kparallax averages the workers' gradients (Horovod's convention), where tf.distribute sums the replicas' (so its
programs scale each replica's loss down by the replica count): a tf.distribute program's
``tf.nn.compute_average_loss`` over a global batch size is scaled for that in the step (``global_losses``). The
replica count itself, ``num_replicas_in_sync`` of the default strategy or its replica context (1), has no value that
trains as one process: a loss divided by it is right with 1, a global batch size multiplied by it
(``rows * num_replicas_in_sync``) is right with the worker count. A user's read of it in the training step of several
workers or micro-batches (``backward_passes_per_step``, whose micro-batches the step averages too) raises.
"""

import contextlib

import tensorflow as tf

from kparallax._compat import tf as tf_compat


def _shapes(value):
    return ", ".join(str(getattr(part, "shape", "?")) for part in tf.nest.flatten(value))


_CONTEXT = ("the step does not run under a tf.distribute strategy, so its strategy and replica context are "
            "TensorFlow's default ones (one replica, replica_id_in_sync_group 0; a merge_call's function gets that "
            "strategy)")


def _method(where):
    """The method's own name in ``where`` (``tf.distribute.get_strategy().reduce`` -> ``reduce``)."""
    return where.rsplit(".", 1)[-1]


def _job(workers, micro_batches):
    job = f"in the training step of a job of {workers} worker{'s' if workers > 1 else ''}"
    return job + (f" with backward_passes_per_step={micro_batches}" if micro_batches > 1 else "")


@contextlib.contextmanager
def refused(strategy):
    """While a training step of a job of several workers is traced: ``all_gather``, a user's ``all_reduce`` and a
    user's read of ``num_replicas_in_sync`` on ``tf.distribute.get_replica_context()``, and a user's gather,
    reduction or read of ``num_replicas_in_sync`` on ``tf.distribute.get_strategy()`` raise a ValueError with the
    fix; the reads also under ``backward_passes_per_step > 1`` on one worker."""
    workers, micro_batches = strategy.num_workers, strategy.options.backward_passes_per_step
    job = _job(workers, micro_batches)

    def gather(where, value, axis):
        raise ValueError(
            f"{where} in kparallax's training step gathers nothing: {_CONTEXT} and the rows would be this worker's "
            f"alone, apart from one process. Received: {_method(where)} of a value of shape {_shapes(value)} "
            f"along axis {axis} {job}. Gather the rows with kp.all_gather(value) and offset "
            "this worker's labels by kp.row_offset(value).")

    def reduce(where, reduce_op, value):
        raise ValueError(
            f"{where} in kparallax's training step reduces nothing: {_CONTEXT} and the value would be this worker's "
            f"alone, apart from one process. Received: {_method(where)}"
            f"({str(getattr(reduce_op, 'value', reduce_op)).upper()}) of a value of shape {_shapes(value)} "
            f"{job}. Write the step as for one process on this "
            "worker's rows: kparallax averages the workers' gradients, weighted by their shares of the global batch. "
            "A loss averaged over its rows needs no reduction; for one normalized by a count over the global batch "
            "(valid tokens under a mask), compile the loss (a Keras mask or ignore_class is counted over the global "
            "batch), or divide by a constant with tf.nn.compute_average_loss(per_example, global_batch_size=N).")

    def count(where):
        raise ValueError(
            f"num_replicas_in_sync in kparallax's training step has no value that trains as one process: {_CONTEXT}, "
            "and kparallax averages the gradients of the workers and micro-batches where tf.distribute sums the "
            "replicas' (a loss divided by the replica count would be right with 1, a global batch size multiplied by "
            f"it with the worker count). Received: {where}.num_replicas_in_sync read {job}. Write the step as for one "
            "process on this worker's rows: average the loss over them (a compiled loss, tf.reduce_mean, or "
            "tf.nn.compute_average_loss(per_example) without global_batch_size), not divided by a replica count; "
            "divide a sum by the global batch size as a constant (tf.nn.compute_average_loss(per_example, "
            "global_batch_size=N)). Outside the step, strategy.num_workers is the worker count.")

    with contextlib.ExitStack() as stack:
        if workers > 1:
            stack.enter_context(tf_compat.default_gathers(gather))
            stack.enter_context(tf_compat.default_reductions(reduce))
        if workers * micro_batches > 1:
            stack.enter_context(tf_compat.default_replica_count(count))
        yield
