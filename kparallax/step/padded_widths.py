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
micro-batch can know: each worker pads its own part then (a model that masks the padding is exact); so it does in a
``tf.cond`` branch, a loop or a ``tf.function`` the step calls (a collective there may run on some workers only).
Worker 0 warns when it traces such a padding.
"""

import contextlib
import dataclasses
import itertools
import threading

import tensorflow as tf

from kparallax import log as logging
from kparallax._compat import ragged as ragged_compat
from kparallax.step import collectives

_ACTIVE = threading.local()
_WARNED = []


@dataclasses.dataclass
class _Step:
    """The synchronous training step being traced: its workers, whether its ``to_tensor`` calls can pad over them
    (one micro-batch per update), the graph where they can, whether this is worker 0, the collectives' count."""
    num_workers: int
    over_workers: bool
    graph: tf.Graph
    chief: bool
    calls: itertools.count = dataclasses.field(default_factory=itertools.count)


def install():
    """Hooks ``tf.RaggedTensor.to_tensor`` once (unchanged outside ``global_widths``)."""
    ragged_compat.hook(_shape_of)


@contextlib.contextmanager
def global_widths(num_workers, micro_batches, chief):
    """While tracing one synchronous training step of ``num_workers`` workers and ``micro_batches`` per update:
    ragged tensors made dense in it are padded to the largest sizes over the workers (one micro-batch only; else
    worker 0, ``chief``, warns)."""
    previous = getattr(_ACTIVE, "step", None)
    _ACTIVE.step = None
    if num_workers > 1:
        _ACTIVE.step = _Step(num_workers, micro_batches == 1, tf.compat.v1.get_default_graph(), chief)
        if _ACTIVE.step.over_workers:
            collectives.prepare_allgather()
    try:
        yield
    finally:
        _ACTIVE.step = previous


def _shape_of(ragged, shape):
    """The ``shape`` ``ragged.to_tensor`` pads to: the caller's where it fixes every size after the rows, else the
    caller's sizes where given and the largest over the workers elsewhere (-1 for the rows: each worker's own)."""
    step = getattr(_ACTIVE, "step", None)
    rank = ragged.shape.rank
    if step is None or rank is None or tf.executing_eagerly() or isinstance(shape, tf.Tensor):
        return shape
    try:
        given = [None] * rank if shape is None else tf.TensorShape(shape).as_list()
    except (TypeError, ValueError):  # sizes given as tensors: the caller's
        return shape
    if len(given) != rank:
        return shape  # (TensorFlow's own error)
    open_sizes = [k for k in range(1, rank) if given[k] is None and ragged.shape[k] is None]
    if not open_sizes:
        return shape
    if not step.over_workers or tf.compat.v1.get_default_graph() is not step.graph:
        if step.chief and not _WARNED:
            _WARNED.append(True)  # once per process (the step is traced more than once)
            logging.warning(
                "A ragged tensor is made dense in the training step (to_tensor(); a TextVectorization without "
                "output_sequence_length) %s: each worker pads its own part of the batch to its longest row, where one "
                "process pads the global batch. A model that masks the padding (mask_zero=True) trains as one "
                "process; one that does not trains apart from it. Fix the length (output_sequence_length=..., "
                "to_tensor(shape=...)) to train exactly.",
                "with backward_passes_per_step above 1" if not step.over_workers
                else "inside a branch, loop or function of the step")
        return shape
    own = tf.gather(ragged.bounding_shape(out_type=tf.int64), open_sizes)
    every = collectives.allgather([own[None, :]], step.num_workers, f"kp_ragged_widths_{next(step.calls)}")[0]
    largest = tf.reduce_max(every, axis=0)
    sizes = [tf.constant(-1, tf.int64)] + [
        largest[open_sizes.index(k)] if k in open_sizes else tf.constant(
            -1 if given[k] is None else given[k], tf.int64) for k in range(1, rank)]
    return tf.cast(tf.stack(sizes), ragged.row_splits.dtype)
