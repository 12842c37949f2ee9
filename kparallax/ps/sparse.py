"""Synchronous sparse aggregation on the parameter servers.

Per step and per PS table:
  1. every worker sums its rows with equal ids and pushes them into an accumulator variable on the PS
     (``scatter_add``: non-blocking, nothing waits inside the PS);
  2. the workers allgather the (small, integer) ids they pushed, after their pushes completed;
  3. the chief gathers the accumulated rows of the union of ids on the PS, divides by the worker count, applies
     ONE optimizer update there (its optimizer clone and slots live on that PS), and zeroes those rows.
Only touched rows and their ids cross the network; the update math runs on the PS device.
"""

import horovod.tensorflow as hvd
import tensorflow as tf

from kparallax import _compat


def as_indexed_slices(grad, variable):
    """A PS variable's gradient as IndexedSlices (a dense gradient covers every row)."""
    if isinstance(grad, tf.IndexedSlices):
        return grad
    rows = tf.range(tf.shape(variable, out_type=tf.int64)[0])
    return tf.IndexedSlices(grad, rows, dense_shape=tf.shape(variable, out_type=tf.int64))


class SparseAggregator:
    """Owns the accumulators and per-table optimizer clones of the PS variables of one model.

    Args:
      store: the ``SharedVariableStore`` that creates accumulators next to their tables.
      ps_info: callable(variable) -> (path, ps_task) for a PS variable.
      optimizer: the user's optimizer; the chief clones it once per table.
      num_workers, is_chief: from Horovod.
      average: divide the summed gradient by the number of workers (single-process equivalent).
    """

    def __init__(self, store, ps_info, optimizer, num_workers, is_chief, average=True):
        self._store = store
        self._ps_info = ps_info
        self._optimizer = optimizer
        self._num_workers = num_workers
        self._is_chief = is_chief
        self._average = average
        self._accumulators = {}
        self._optimizers = {}
        self._sink = None

    @tf.autograph.experimental.do_not_convert
    def _accumulator(self, variable):
        key = variable.ref()
        if key not in self._accumulators:
            path, task = self._ps_info(variable)
            with tf.init_scope():
                self._accumulators[key] = self._store.create(
                    f"{path}/kp_accumulator", variable.shape, variable.dtype,
                    lambda: tf.zeros(variable.shape, variable.dtype), task, trainable=False)
        return self._accumulators[key]

    @tf.autograph.experimental.do_not_convert
    def table_optimizer(self, variable):
        """The chief's optimizer clone for ``variable``; its variables live on the table's PS task."""
        key = variable.ref()
        if key not in self._optimizers:
            with tf.init_scope(), tf.device(variable.device):
                clone = _compat.clone_optimizer(self._optimizer)
                _compat.build_optimizer(clone, [variable])
            self._optimizers[key] = clone
        return self._optimizers[key]

    def _consume(self, tensors):
        if self._sink is None:
            with tf.init_scope():
                self._sink = tf.Variable(0, dtype=tf.int64, trainable=False, name="kp_sparse_ids_seen")
        return self._sink.assign_add(tf.add_n([tf.size(t, out_type=tf.int64) for t in tensors]))

    @tf.autograph.experimental.do_not_convert
    def push_and_apply(self, grads_and_vars):
        """Builds the step's sparse path; returns the ops the end-of-step barrier must wait for."""
        if not grads_and_vars:
            return []
        pushes, local_ids = [], []
        for grad, variable in grads_and_vars:
            slices = as_indexed_slices(grad, variable)
            ids, index = tf.unique(tf.cast(slices.indices, tf.int64))
            rows = tf.math.unsorted_segment_sum(slices.values, index, tf.shape(ids)[0])  # [unique ids, ...]
            accumulator = self._accumulator(variable)
            pushes.append(accumulator.scatter_add(tf.IndexedSlices(rows, ids)))
            local_ids.append(ids)
        with tf.control_dependencies(pushes):
            if self._num_workers == 1:
                all_ids = [tf.identity(i) for i in local_ids]
            else:
                all_ids = hvd.grouped_allgather(local_ids, name="kp_sparse_ids")
        if not self._is_chief:
            # Grappler prunes a Horovod op whose output only feeds control edges, and a worker that skips the
            # allgather deadlocks the others: consume the ids in a stateful op.
            return pushes + [self._consume(all_ids)]
        done = []
        for (_, variable), ids in zip(grads_and_vars, all_ids):
            accumulator = self._accumulator(variable)
            with tf.device(variable.device):
                ids = tf.unique(ids).y
                rows = accumulator.sparse_read(ids)
                if self._average and self._num_workers > 1:
                    rows = rows / tf.cast(self._num_workers, rows.dtype)
                grad = tf.IndexedSlices(rows, ids, dense_shape=tf.constant(variable.shape.as_list(), tf.int64))
                applied = self.table_optimizer(variable).apply_gradients([(grad, variable)])
                with tf.control_dependencies([applied] if applied is not None else []):
                    done.append(accumulator.scatter_update(tf.IndexedSlices(tf.zeros_like(rows), ids)))
        return done
