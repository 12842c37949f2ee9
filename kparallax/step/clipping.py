"""Gradient clipping on the synchronous PS path, as one process clips the global batch's gradient.

Keras clips each variable's gradient in ``apply_gradients`` (``clipnorm`` / ``clipvalue``, ``_compat.keras.clipping``
gives the order). In one process a table's gradient is an ``IndexedSlices`` with one slice per looked-up id of the
global batch, duplicates included, and Keras clips those slices before it sums the duplicates. On the PS path each
worker holds its share of the slices (scaled by the divisor the update applies later), its rows are summed per id
before they are pushed, and a partitioned table's gradient is split over its shards. So:
  - ``clipvalue`` clips each worker's slices before deduplication, with the bound scaled by the divisor;
  - ``clipnorm`` scales the step's update by ``clip / max(norm, clip)`` (``tf.clip_by_norm``'s factor), the norm
    taken over every worker's slices (their sums of squares, one allreduce per step) and over all shards of a table;
  - dense gradients of PS variables are clipped after aggregation, their norm also taken over a table's shards.
The PS-side optimizer clones are made without clipping (``clones.Clones(clip=False)``).
"""

import tensorflow as tf

from kparallax.step import collectives


class Clipping:
    """The clipping of one synchronous PS path.

    Args:
      plan: ``[("value", c), ("norm", c)]`` steps in Keras' order (``_compat.keras.clipping``); norm comes last.
      divisor: what the update divides summed gradients by (the worker count when averaging, else 1).
      num_workers: Horovod size.
      group_of: callable(variable) -> the key of the gradient one process clips as one (a table, or itself).
    """

    def __init__(self, plan, divisor, num_workers, group_of):
        self._plan = list(plan)
        if any(kind == "norm" for kind, _ in self._plan[:-1]):
            raise ValueError(f"Clipping by norm must come last. Received: {self._plan}.")
        self._divisor = divisor
        self._n = num_workers
        self._group_of = group_of
        self._norm = next((c for kind, c in self._plan if kind == "norm"), None)

    @property
    def by_norm(self):
        """Whether ``clipnorm`` is set: a dense gradient's factor needs every push of its table's shards first."""
        return self._norm is not None

    def slices(self, grad):
        """``clipvalue`` on this worker's slices of a sparse gradient (before they are summed per id)."""
        for kind, bound in self._plan:
            if kind == "value":
                bound *= self._divisor
                grad = tf.IndexedSlices(tf.clip_by_value(grad.values, -bound, bound), grad.indices, grad.dense_shape)
        return grad

    def dense(self, grad):
        """``clipvalue`` on an aggregated (already divided) dense gradient."""
        for kind, bound in self._plan:
            if kind == "value":
                grad = tf.clip_by_value(grad, -bound, bound)
        return grad

    def sparse_norm_factors(self, sparse):
        """``{group: factor}`` for the sparse gradients, from every worker's slices (one allreduce of each group's
        sum of squares, so that a group's update waits for its own gradients only), and those allreduces' outputs
        for the step to keep alive; ({}, []) without ``clipnorm``."""
        if self._norm is None or not sparse:
            return {}, []
        order = list(dict.fromkeys(self._group_of(v) for _, v in sparse))
        local = [[] for _ in order]
        for grad, variable in sparse:
            local[order.index(self._group_of(variable))].append(tf.reduce_sum(tf.square(grad.values)))
        totals = [collectives.sum_over_workers(tf.add_n(v), self._n, f"kp_sparse_sumsq_{i}") / float(self._divisor ** 2)
                  for i, v in enumerate(local)]
        return {key: self._factor(totals[i]) for i, key in enumerate(order)}, totals

    def dense_norm_factors(self, grads_and_vars):
        """``{group: factor}`` for aggregated dense gradients (each sum of squares computed on its variable's PS
        device); {} without ``clipnorm``."""
        if self._norm is None or not grads_and_vars:
            return {}
        groups = {}
        for grad, variable in grads_and_vars:
            with tf.device(variable.device):
                groups.setdefault(self._group_of(variable), []).append(tf.reduce_sum(tf.square(grad)))
        return {key: self._factor(tf.add_n(sums)) for key, sums in groups.items()}

    def _factor(self, sum_of_squares):
        return self._norm / tf.maximum(tf.sqrt(sum_of_squares), self._norm)
