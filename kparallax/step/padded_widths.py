"""Ragged tensors padded in the training step to the global batch's longest rows, as one process pads them.

A ragged tensor made dense without a full ``shape`` (Keras' ``TextVectorization`` with ``output_mode="int"`` and
no ``output_sequence_length``, a user's ``x.to_tensor()``) is padded to the longest row of the batch it holds: one
process pads the global batch to its longest text, each worker its own part to that part's longest. A model that
masks the padding (``mask_zero=True``) does not see the difference; one that does not (an average over the time
steps, a convolution) trains apart from one process: a ``GlobalAveragePooling1D`` of an unmasked table ended 0.095
off one process after 2 epochs on 2 workers, silently. In the synchronous training step of several workers (one
micro-batch per update), every worker pads to the largest size over all workers instead (one allgather of the
padded sizes per ``to_tensor``). Sizes the caller fixes (``shape``, ``output_sequence_length``) are left alone.
With ``backward_passes_per_step`` above 1, one process pads the update's k micro-batches at once, which no
micro-batch can know: each worker pads its own part then, as before (a model that masks the padding is exact); so
it does in a ``tf.cond`` branch, a loop or a ``tf.function`` the step calls (a collective there may run on some
workers only).
"""

import contextlib
import itertools
import threading

import tensorflow as tf

from kparallax._compat import ragged as ragged_compat
from kparallax.step import collectives

_ACTIVE = threading.local()


def install():
    """Hooks ``tf.RaggedTensor.to_tensor`` once (unchanged outside ``global_widths``)."""
    ragged_compat.hook(_shape_of)


@contextlib.contextmanager
def global_widths(num_workers, micro_batches):
    """While tracing one synchronous training step of ``num_workers`` workers and ``micro_batches`` per update:
    ragged tensors made dense in it are padded to the largest sizes over the workers (one micro-batch only)."""
    previous = getattr(_ACTIVE, "state", None)
    graph = tf.compat.v1.get_default_graph()
    _ACTIVE.state = (num_workers, itertools.count(), graph) if num_workers > 1 and micro_batches == 1 else None
    if _ACTIVE.state is not None:
        collectives.prepare_allgather()
    try:
        yield
    finally:
        _ACTIVE.state = previous


def _shape_of(ragged, shape):
    """The ``shape`` ``ragged.to_tensor`` pads to: the caller's where it fixes every size after the rows, else the
    caller's sizes where given and the largest over the workers elsewhere (-1 for the rows: each worker's own)."""
    state = getattr(_ACTIVE, "state", None)
    rank = ragged.shape.rank
    if state is None or rank is None or tf.executing_eagerly() or isinstance(shape, tf.Tensor):
        return shape
    if tf.compat.v1.get_default_graph() is not state[2]:
        return shape  # in a branch, loop or function of the step, which may run on some workers only: no collective
    try:
        given = [None] * rank if shape is None else tf.TensorShape(shape).as_list()
    except (TypeError, ValueError):  # sizes given as tensors: the caller's
        return shape
    if len(given) != rank:
        return shape  # (TensorFlow's own error)
    open_sizes = [k for k in range(1, rank) if given[k] is None and ragged.shape[k] is None]
    if not open_sizes:
        return shape
    num_workers, calls, _ = state
    own = tf.gather(ragged.bounding_shape(out_type=tf.int64), open_sizes)
    every = collectives.allgather([own[None, :]], num_workers, f"kp_ragged_widths_{next(calls)}")[0]
    largest = tf.reduce_max(every, axis=0)
    sizes = [tf.constant(-1, tf.int64)] + [
        largest[open_sizes.index(k)] if k in open_sizes else tf.constant(
            -1 if given[k] is None else given[k], tf.int64) for k in range(1, rank)]
    return tf.cast(tf.stack(sizes), ragged.row_splits.dtype)
