"""Local aggregation: the workers of one host sum their PS gradients and only the host's first worker pushes.

Sparse gradients are allgathered inside the host's Horovod process set (ids and rows, one grouped allgather per
table, so a table's rows leave while backprop still computes the layers below it) and re-deduplicated by the
leader; dense gradients are summed with an allreduce inside the set. The PS then receives one push per host
instead of one per worker (Parallax's local aggregation).
"""

import horovod.tensorflow as hvd
import tensorflow as tf

from kparallax.step import cached_reads
from kparallax.step import collectives


def dedup(ids, rows):
    """(unique ids, rows summed per id); the unique ids of an embedding lookup's gradient are those its forward pass
    pulled rows by (``cached_reads.distinct``)."""
    known = cached_reads.distinct(ids)
    ids, index = known if known is not None else tf.unique(tf.cast(ids, tf.int64))
    return ids, tf.math.unsorted_segment_sum(rows, index, tf.shape(ids)[0])


class LocalAggregation:
    """Aggregation inside one host's process set (None: every worker pushes its own gradients).

    Args:
      process_set: the Horovod process set of this host's workers, or None.
    """

    def __init__(self, process_set):
        self._set = process_set

    @property
    def is_leader(self):
        """Whether this worker pushes (for its host)."""
        return self._set is None or self._set.rank() == 0

    def sparse(self, deduped, tables):
        """What this worker pushes ([(ids, rows)] per variable, or None if it does not push) and the collective
        outputs it must keep alive.

        Args:
          deduped: [(ids, rows)] per variable, deduplicated on this worker.
          tables: lists of positions in ``deduped``, one per table: each table's ids and rows are gathered on their
            own, as soon as its gradient exists.
        """
        if self._set is None or not deduped:
            return deduped, []
        size = self._set.size()
        ids = collectives.allgather_groups([i for i, _ in deduped], tables, size, "kp_local_ids", self._set)
        rows = collectives.allgather_groups([r for _, r in deduped], tables, size, "kp_local_rows", self._set)
        if not self.is_leader:
            return None, ids + rows
        return [dedup(i, r) for i, r in zip(ids, rows)], []

    def dense(self, grads):
        """Given dense gradients: what this worker pushes (or None) and the outputs it must keep alive."""
        if self._set is None or not grads:
            return grads, []
        summed = hvd.grouped_allreduce(list(grads), op=hvd.Sum, process_set=self._set, name="kp_local_dense")
        if not self.is_leader:
            return None, list(summed)
        return list(summed), []
