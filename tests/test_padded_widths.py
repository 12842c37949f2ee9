"""step/padded_widths.py, in one process (Horovod of size 1): a ragged tensor made dense in a synchronous training
step of several workers is padded to sizes gathered over the workers (here, the worker's own: one of one); where it
cannot be (several micro-batches per update, inside a branch of the step), each worker pads its own and worker 0
warns once. Sizes the caller fixes are left alone. The padding over real workers against one process is
``padded_in_the_model`` in ``test_keras_programs.py``."""

import logging

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from kparallax.step import padded_widths

ROWS = tf.ragged.constant([[1, 2, 3], [4]], dtype=tf.int64)


def _traced(build, num_workers=2, micro_batches=1, chief=True):
    """``build(ragged)`` traced in a tf.function under ``global_widths``: its value on ROWS, the op types of its
    graph and the kparallax warnings logged."""
    hvd.init()
    padded_widths.install()
    padded_widths._WARNED.clear()  # pylint: disable=protected-access
    records, handler = [], logging.Handler()
    handler.emit = records.append
    logging.getLogger("kparallax").addHandler(handler)

    @tf.function
    def step(ragged):
        with padded_widths.global_widths(num_workers, micro_batches, chief):
            return build(ragged)

    try:
        concrete = step.get_concrete_function(tf.RaggedTensorSpec([None, None], tf.int64))
        value = step(ROWS).numpy()
    finally:
        logging.getLogger("kparallax").removeHandler(handler)
    ops = {op.type for op in concrete.graph.get_operations()}
    return value, ops, [r.getMessage() for r in records if r.levelno == logging.WARNING]


def test_a_ragged_tensor_made_dense_in_the_step_is_padded_to_sizes_gathered_over_the_workers():
    value, ops, warned = _traced(lambda r: r.to_tensor())
    np.testing.assert_array_equal(value, [[1, 2, 3], [4, 0, 0]])
    assert "HorovodGroupedAllgather" in ops and not warned, (ops, warned)
    value, ops, _ = _traced(lambda r: r.to_tensor(default_value=-1, shape=[None, 5]))  # fixed: the caller's
    np.testing.assert_array_equal(value, [[1, 2, 3, -1, -1], [4, -1, -1, -1, -1]])
    assert "HorovodGroupedAllgather" not in ops
    _, ops, _ = _traced(lambda r: r.to_tensor(), num_workers=1)  # one worker: nothing to gather
    assert "HorovodGroupedAllgather" not in ops


def test_where_the_step_cannot_pad_over_the_workers_each_pads_its_own_and_worker_0_warns_once():
    value, ops, warned = _traced(lambda r: r.to_tensor() + r.to_tensor(), micro_batches=2)
    np.testing.assert_array_equal(value, [[2, 4, 6], [8, 0, 0]])
    assert "HorovodGroupedAllgather" not in ops
    assert len(warned) == 1 and "with backward_passes_per_step above 1" in warned[0], warned
    _, ops, warned = _traced(lambda r: tf.cond(tf.size(r.values) > 0, r.to_tensor, lambda: tf.zeros([2, 3], tf.int64)))
    assert len(warned) == 1 and "inside a branch, loop or function of the step" in warned[0], warned
    assert _traced(lambda r: r.to_tensor(), micro_batches=2, chief=False)[2] == []  # worker 0 says it
