"""Aggregation of the gradients of PS variables, synchronous (default) or asynchronous.

Synchronous, per step and per PS variable:
  1. every worker sums its rows with equal ids (``tf.unique`` + segment sum) and pushes them into an accumulator
     variable next to the table on the PS (``scatter_add``: non-blocking, nothing waits inside the PS). With local
     aggregation the workers of one host first allgather their rows inside the host's Horovod process set and only
     the host's first worker pushes their sum: one push per host. A dense gradient (a dense variable under
     ``architecture="ps"``) is added whole (``assign_add``).
  2. the workers allgather the (small, integer) ids that were pushed, after their pushes completed;
  3. the chief gathers the accumulated rows of the union of ids on the PS, divides by the worker count, applies
     ONE optimizer update there (its optimizer clone and slots live on that PS), and zeroes those rows.
Only touched rows and their ids cross the network; the update math runs on the PS device.

Asynchronous (``sync=False``): each worker applies its own (deduplicated) gradient on the PS as soon as it is
computed, through an optimizer whose slot variables are shared by all workers; nothing waits for other workers.
"""

import contextlib

import horovod.tensorflow as hvd
import tensorflow as tf

from kparallax import _compat
from kparallax import allreduce
from kparallax import partition


def dedup(grad):
    """(unique ids, summed rows) of an IndexedSlices gradient."""
    ids, index = tf.unique(tf.cast(grad.indices, tf.int64))
    return ids, tf.math.unsorted_segment_sum(grad.values, index, tf.shape(ids)[0])


def _nbytes(tensor):
    return tf.cast(tf.size(tensor), tf.int64) * tensor.dtype.size


class SparseAggregator:
    """Owns the accumulators and per-variable optimizer clones of the PS variables of one model.

    Args:
      store: the ``SharedVariableStore`` that creates accumulators next to their tables.
      ps_info: callable(variable) -> (path, ps_task) for a PS variable.
      optimizer: the user's optimizer; cloned once per PS variable.
      num_workers, is_chief: from Horovod.
      average: divide the summed gradient by the number of workers (single-process equivalent).
      local_set: Horovod process set of this host's workers for local aggregation, or None.
      sync: synchronous aggregation (True) or asynchronous updates (False).
    """

    def __init__(self, store, ps_info, optimizer, num_workers, is_chief, average=True, local_set=None, sync=True):
        self._store = store
        self._ps_info = ps_info
        self._optimizer = optimizer
        self._num_workers = num_workers
        self._is_chief = is_chief
        self._average = average
        self._local_set = local_set
        self._sync = sync
        self._accumulators = {}
        self._counters = {}
        self._optimizers = {}
        self._sink = None
        self.pushed_bytes = []  # while tracing a step: scalar tensors, bytes this worker pushes to the PS
        self.learning_rate_source = None  # the optimizer Keras trains with; clones read its learning rate

    # Variables next to each PS variable ---------------------------------------------------------------
    @tf.autograph.experimental.do_not_convert
    def _next_to(self, variable, cache, suffix, shape, dtype):
        """The zero-initialized shared helper variable ``<path>/<suffix>`` on ``variable``'s PS task."""
        key = variable.ref()
        if key not in cache:
            path, task = self._ps_info(variable)
            with tf.init_scope():
                cache[key] = self._store.create(f"{path}/{suffix}", shape, dtype, lambda: tf.zeros(shape, dtype),
                                                task, trainable=False)
        return cache[key]

    def _accumulator(self, variable):
        return self._next_to(variable, self._accumulators, "kp_accumulator", variable.shape, variable.dtype)

    def _counter(self, variable):
        return self._next_to(variable, self._counters, "kp_pushes", [], tf.int64)

    def push_counts(self):
        """{PS variable path: pushes it received so far} (every worker's, or one per host with local aggregation)."""
        return {self._ps_info(ref.deref())[0]: int(c.numpy()) for ref, c in self._counters.items()}

    @tf.autograph.experimental.do_not_convert
    def table_optimizer(self, variable):
        """The optimizer clone for ``variable``; its variables live on the variable's PS task.

        Synchronous: the chief's own clone. Asynchronous: every worker's clone uses the same shared slot
        variables (created through the store), so all workers update one set of optimizer state.
        """
        key = variable.ref()
        if key not in self._optimizers:
            with tf.init_scope(), tf.device(variable.device), \
                    (self._shared_slots(variable) if not self._sync else contextlib.nullcontext()):
                clone = _compat.clone_optimizer(self._optimizer)
                if self.learning_rate_source is not None:
                    _compat.share_learning_rate(clone, self.learning_rate_source)
                _compat.build_optimizer(clone, [variable])
            self._optimizers[key] = clone
        return self._optimizers[key]

    def existing_table_optimizer(self, variable):
        """The clone for ``variable`` if one was made (it has applied an update or was restored), else None."""
        return self._optimizers.get(variable.ref())

    def _shared_slots(self, variable):
        path, task = self._ps_info(variable)

        def creator(_, **kwargs):
            initial_value = kwargs["initial_value"]
            value = initial_value() if callable(initial_value) else initial_value
            value = tf.convert_to_tensor(value, dtype=kwargs.get("dtype"))
            name = (kwargs.get("name") or "slot").split(":")[0]
            return self._store.create(f"{path}/kp_optimizer/{name}", value.shape, value.dtype, value, task,
                                      trainable=False)
        return tf.variable_creator_scope(creator)

    def move_state(self, old_variables, new_variables):
        """After a re-partitioning: carries every per-variable optimizer state from the old shards to the new.

        Row-shaped optimizer variables (slots) are joined and re-split by rows; the others (iterations, ...) are
        copied. Returns the old shards' PS-side helper variables (accumulators, counters), which the caller
        frees once every worker has switched. Only the chief holds optimizer clones (synchronous mode).
        """
        stale = [self._accumulators.pop(v.ref(), None) for v in old_variables]
        stale += [self._counters.pop(v.ref(), None) for v in old_variables]
        old = [self._optimizers.pop(v.ref(), None) for v in old_variables]
        if not self._is_chief or any(o is None for o in old):
            return [v for v in stale if v is not None]
        new = [self.table_optimizer(v) for v in new_variables]
        joined = partition.join_row_state(old_variables, [_compat.optimizer_variables(o) for o in old])
        partition.split_row_state(new_variables, [_compat.optimizer_variables(o) for o in new], joined)
        _compat.async_wait()
        return [v for v in stale if v is not None]

    def consume(self, tensors):
        """A stateful op that reads one element of each tensor (a data edge Grappler cannot fold away)."""
        if self._sink is None:
            with tf.init_scope():
                self._sink = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="kp_collectives_seen")
        firsts = [tf.reduce_sum(tf.cast(tf.reshape(t, [-1])[:1], tf.float64)) for t in tensors]
        return self._sink.assign_add(tf.add_n(firsts))

    # Steps ---------------------------------------------------------------------------------------------
    @tf.autograph.experimental.do_not_convert
    def push_and_apply(self, grads_and_vars):
        """Builds the step's PS path; returns the ops the end-of-step synchronization must wait for."""
        if not grads_and_vars:
            return []
        if not self._sync:
            return self._apply_async(grads_and_vars)
        sparse = [(g, v) for g, v in grads_and_vars if isinstance(g, tf.IndexedSlices)]
        dense = [(g, v) for g, v in grads_and_vars if not isinstance(g, tf.IndexedSlices)]
        pushes, pushed_ids, unused = self._push_sparse(sparse)
        dense_pushes, dense_unused = self._push_dense(dense)
        pushes += dense_pushes
        unused += dense_unused
        with tf.control_dependencies(pushes):
            if pushed_ids and self._num_workers > 1:
                all_ids = hvd.grouped_allgather(pushed_ids, name="kp_sparse_ids")
            else:
                all_ids = [tf.identity(i) for i in pushed_ids]
            if not pushed_ids:
                all_ids = [tf.cast(allreduce.barrier(self._num_workers, name="kp_ps_pushed"), tf.int64)]
        if not self._is_chief:
            # Grappler prunes a Horovod op whose output only feeds control edges, and a worker that skips the
            # collective deadlocks the others: consume its output in a stateful op.
            return pushes + [self.consume(all_ids + unused)]
        done = []
        for (_, variable), ids in zip(sparse, all_ids):
            done.append(self._apply_rows(variable, tf.unique(ids).y))
        with tf.control_dependencies(all_ids):
            for _, variable in dense:
                done.append(self._apply_whole(variable))
        return done

    def _is_leader(self):
        return self._local_set is None or self._local_set.rank() == 0

    def _push_sparse(self, sparse):
        if not sparse:
            return [], [], []
        deduped = [dedup(g) for g, _ in sparse]
        if self._local_set is not None:
            local_ids = hvd.grouped_allgather([i for i, _ in deduped], process_set=self._local_set,
                                              name="kp_local_ids")
            local_rows = hvd.grouped_allgather([r for _, r in deduped], process_set=self._local_set,
                                               name="kp_local_rows")
            if not self._is_leader():  # its rows travel in the leader's push; the collectives' outputs must be used
                return [], [i[:0] for i in local_ids], list(local_rows)
            deduped = [dedup(tf.IndexedSlices(r, i)) for i, r in zip(local_ids, local_rows)]
        pushes, pushed_ids = [], []
        for (_, variable), (ids, rows) in zip(sparse, deduped):
            with tf.device(variable.device):
                pushes.append(self._accumulator(variable).scatter_add(tf.IndexedSlices(rows, ids)))
                pushes.append(self._counter(variable).assign_add(1))
            pushed_ids.append(ids)
            self.pushed_bytes.append(_nbytes(rows) + _nbytes(ids))
        return pushes, pushed_ids, []

    def _push_dense(self, dense):
        if not dense:
            return [], []
        grads = [g for g, _ in dense]
        if self._local_set is not None:
            grads = hvd.grouped_allreduce(grads, op=hvd.Sum, process_set=self._local_set, name="kp_local_dense")
        if not self._is_leader():
            return [], list(grads)  # its gradient is in the leader's push; the allreduce's output must be used
        pushes = []
        for grad, (_, variable) in zip(grads, dense):
            with tf.device(variable.device):
                pushes.append(self._accumulator(variable).assign_add(grad))
                pushes.append(self._counter(variable).assign_add(1))
            self.pushed_bytes.append(_nbytes(grad))
        return pushes, []

    def _scale(self, value):
        if self._average and self._num_workers > 1:
            return value / tf.cast(self._num_workers, value.dtype)
        return value

    def _apply_rows(self, variable, ids):
        accumulator = self._accumulator(variable)
        with tf.device(variable.device):
            rows = self._scale(accumulator.sparse_read(ids))
            grad = tf.IndexedSlices(rows, ids, dense_shape=tf.constant(variable.shape.as_list(), tf.int64))
            applied = self.table_optimizer(variable).apply_gradients([(grad, variable)])
            with tf.control_dependencies([applied] if applied is not None else []):
                return accumulator.scatter_update(tf.IndexedSlices(tf.zeros_like(rows), ids))

    def _apply_whole(self, variable):
        accumulator = self._accumulator(variable)
        with tf.device(variable.device):
            grad = self._scale(accumulator.read_value())
            applied = self.table_optimizer(variable).apply_gradients([(grad, variable)])
            with tf.control_dependencies([applied] if applied is not None else []):
                return accumulator.assign(tf.zeros_like(grad))

    def _apply_async(self, grads_and_vars):
        done = []
        for grad, variable in grads_and_vars:
            if isinstance(grad, tf.IndexedSlices):
                ids, rows = dedup(grad)
                grad = tf.IndexedSlices(rows, ids, dense_shape=tf.constant(variable.shape.as_list(), tf.int64))
                self.pushed_bytes.append(_nbytes(rows) + _nbytes(ids))
            else:
                self.pushed_bytes.append(_nbytes(grad))
            with tf.device(variable.device):
                applied = self.table_optimizer(variable).apply_gradients([(grad, variable)])
                with tf.control_dependencies([applied] if applied is not None else []):
                    done.append(self._counter(variable).assign_add(1))
        return done
