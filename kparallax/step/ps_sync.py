"""Synchronous aggregation of the gradients of PS variables: one update per step, applied on the PS.

Per step and per PS variable:
  1. push: every worker (with local aggregation, one worker per host, after an allgather inside the host, one per
     table) adds its deduplicated rows into an accumulator next to the variable on its PS task (``scatter_add``; a
     dense gradient is added whole), then increments the variable's push counter; the counter's new value is the
     push's *token*;
  2. the workers allgather the ids they pushed, one allgather per table, each tied to the tokens of that table's
     pushes only (no id leaves before its rows landed, and a table whose gradient comes early in backprop is
     exchanged and updated while backprop goes on); for dense gradients they pass a barrier that carries the
     tokens instead;
  3. the chief reads the accumulated rows of the union of ids on the PS (the ids travel there as data), applies
     ONE optimizer update with its clone (``clones.py``), zeroes those rows and increments the update counter,
     whose value is the token the end-of-step barrier (``train_step.py``) waits for.
Gradient clipping (the user's ``clipnorm`` / ``clipvalue``) is applied along the way as one process would
(``clipping.py``); the clones do not clip again.
Only touched rows and their ids cross the network; the update math runs on the PS device. Ordering across devices
uses data edges only (see ``collectives.py``); control edges are used only between ops on the same PS device.
"""

import dataclasses
from typing import List

import tensorflow as tf

from kparallax.step import clipping as clipping_lib
from kparallax.step import collectives
from kparallax.step import local_aggregation

ACCUMULATOR = "kp_accumulator"
PUSHES = "kp_pushes"
UPDATES = "kp_updates"


@dataclasses.dataclass
class PsStep:
    """What the PS path of one step hands to the step builder.

    Attributes:
      tokens: int64 scalars the end-of-step barrier must wait for (this worker's pushes; the chief's updates).
      keep: collective outputs nothing else reads (kept alive by the step).
      sent_bytes: int64 scalar, the bytes this worker sent to PS tasks in this step.
    """
    tokens: List[tf.Tensor]
    keep: List[tf.Tensor]
    sent_bytes: tf.Tensor


def nbytes(tensors):
    """Total size in bytes of ``tensors`` (an int64 scalar)."""
    sizes = [tf.cast(tf.size(t), tf.int64) * t.dtype.size for t in tensors]
    return tf.add_n(sizes) if sizes else tf.constant(0, tf.int64)


def _op(value):
    """The op of a variable update (``assign_add`` etc. return a variable-like object in graphs)."""
    return getattr(value, "op", value)


def count(counter):
    """Increments ``counter`` (a PS int64 helper) and returns its new value, read on the counter's device."""
    return tf.convert_to_tensor(counter.assign_add(1))


class SyncPs:
    """Builds the synchronous PS path of a step.

    Args:
      registry: the strategy's ``Registry`` (helper variables next to each PS variable).
      clones: the model's ``Clones`` (optimizer state on the PS).
      num_workers, is_chief: from Horovod.
      average: divide summed gradients by the worker count (the single-process equivalent).
      local: the ``LocalAggregation`` of this worker.
      clipping: the user's optimizer's clipping (``_compat.keras.clipping``), done here; the clones do not clip.
    """

    def __init__(self, registry, clones, num_workers, is_chief, average, local, clipping=()):
        self._registry = registry
        self._clones = clones
        self._n = num_workers
        self._is_chief = is_chief
        self._average = average
        self._local = local
        self._clip = clipping_lib.Clipping(clipping, self._divisor(), num_workers, self._group)

    def _helper(self, variable, name):
        if name == ACCUMULATOR:
            return self._registry.helper(variable, name, variable.shape, variable.dtype)
        return self._registry.helper(variable, name, [], tf.int64)

    @tf.autograph.experimental.do_not_convert
    def build(self, grads_and_vars):
        """Builds push, id exchange and (on the chief) the update for ``grads_and_vars`` of PS variables."""
        sparse = [(g, v) for g, v in grads_and_vars if isinstance(g, tf.IndexedSlices)]
        dense = [(g, v) for g, v in grads_and_vars if not isinstance(g, tf.IndexedSlices)]
        tokens, keep, sent = [], [], []
        sparse = [(self._clip.slices(g), v) for g, v in sparse]
        factors, sums = self._clip.sparse_norm_factors(sparse)
        keep += sums
        deduped = [local_aggregation.dedup(g.indices, g.values) for g, _ in sparse]
        tables = self._tables(sparse)
        pushed, unused = self._local.sparse(deduped, tables)
        keep += unused
        pushed_ids = [ids[:0] for ids, _ in deduped]
        if pushed is not None:
            pushed_ids = []
            for (_, variable), (ids, rows) in zip(sparse, pushed):
                with tf.device(variable.device):
                    added = self._helper(variable, ACCUMULATOR).scatter_add(tf.IndexedSlices(rows, ids))
                    with tf.control_dependencies([_op(added)]):
                        tokens.append(count(self._helper(variable, PUSHES)))
                pushed_ids.append(collectives.tie(ids, tokens[-1:]))
                sent.append(nbytes([rows, ids]))
        dense_grads, unused = self._local.dense([g for g, _ in dense])
        keep += unused
        for grad, (_, variable) in zip(dense_grads or [], dense):
            with tf.device(variable.device):
                added = self._helper(variable, ACCUMULATOR).assign_add(grad)
                with tf.control_dependencies([_op(added)]):
                    tokens.append(count(self._helper(variable, PUSHES)))
            sent.append(nbytes([grad]))
        # Each table's ids leave once its own pushes landed (the ids are tied to their push tokens above).
        all_ids = collectives.allgather_groups(pushed_ids, tables, self._n, "kp_sparse_ids")
        pushed_all = collectives.barrier(self._n, tokens, "kp_ps_pushed") if dense else None
        sent_bytes = tf.add_n(sent) if sent else tf.constant(0, tf.int64)
        if not self._is_chief:
            return PsStep(tokens, keep + list(all_ids) + ([pushed_all] if dense else []), sent_bytes)
        updates = [self._apply_rows(variable, ids, factors.get(self._group(variable)))
                   for (_, variable), ids in zip(sparse, all_ids)]
        grads = [(self._clip.dense(self._read_whole(variable, pushed_all)), variable) for _, variable in dense]
        factors = self._clip.dense_norm_factors(grads)
        updates += [self._apply_whole(variable, grad, factors.get(self._group(variable))) for grad, variable in grads]
        return PsStep(updates, keep, sent_bytes)

    def _tables(self, sparse):
        """The positions in ``sparse`` of each table's variables (a variable, or all shards of a partitioned table),
        in order of first appearance: the unit of the per-table collectives."""
        groups = {}
        for i, (_, variable) in enumerate(sparse):
            groups.setdefault(self._group(variable), []).append(i)
        return list(groups.values())

    def _divisor(self):
        """What the chief divides summed gradients by: the worker count when averaging, else 1."""
        return self._n if self._average and self._n > 1 else 1

    def _scaled(self, value):
        if self._divisor() > 1:
            return value / tf.cast(self._divisor(), value.dtype)
        return value

    def _group(self, variable):
        """The variable one process would clip as one gradient: a partitioned table (all its shards), else itself."""
        owner = self._registry.table_of(variable)
        return id(owner[0]) if owner else variable.ref()

    def _finish(self, variable, check, zeroed):
        """The update token: incremented on the PS after the update is readable and the accumulator is zero."""
        with tf.control_dependencies([check, _op(zeroed)]):
            return count(self._helper(variable, UPDATES))

    def _apply_rows(self, variable, ids, factor=None):
        accumulator = self._helper(variable, ACCUMULATOR)
        with tf.device(variable.device):
            ids = tf.unique(ids).y
            rows = self._scaled(accumulator.sparse_read(ids))
            if factor is not None:
                rows = rows * factor
            grad = tf.IndexedSlices(rows, ids, dense_shape=tf.constant(variable.shape.as_list(), tf.int64))
            self._clones.get(variable).apply_gradients([(grad, variable)])
            # Automatic control dependencies order these reads and writes after the update of the same variables.
            check = tf.reduce_sum(variable.sparse_read(ids[:1]))
            zeroed = accumulator.scatter_update(tf.IndexedSlices(tf.zeros_like(rows), ids))
            return self._finish(variable, check, zeroed)

    def _read_whole(self, variable, pushed_all):
        """The summed dense gradient of ``variable`` once every push landed, divided as the step averages."""
        accumulator = self._helper(variable, ACCUMULATOR)
        with tf.device(variable.device):
            if variable.shape.rank:
                # Gathering every row with ids tied to the barrier makes the read wait for all pushes (a data edge).
                every_row = collectives.tie(tf.range(variable.shape[0], dtype=tf.int64),
                                            [tf.cast(pushed_all, tf.int64)])
                grad = accumulator.sparse_read(every_row)
            else:
                with tf.control_dependencies([tf.identity(pushed_all)]):
                    grad = accumulator.read_value()
            return self._scaled(grad)

    def _apply_whole(self, variable, grad, factor=None):
        accumulator = self._helper(variable, ACCUMULATOR)
        with tf.device(variable.device):
            if factor is not None:
                grad = grad * factor
            self._clones.get(variable).apply_gradients([(grad, variable)])
            check = tf.reduce_sum(tf.reshape(variable.read_value(), [-1])[:1])
            zeroed = accumulator.assign(tf.zeros_like(grad))
            return self._finish(variable, check, zeroed)
