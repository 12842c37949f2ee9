"""Gradient clipping on the synchronous PS path, as one process clips the global batch's gradient.

Keras clips each variable's gradient in ``apply_gradients`` (``clipnorm`` / ``clipvalue``, ``_compat.keras.clipping``
gives the order). In one process a table's gradient is an ``IndexedSlices`` with one slice per looked-up id of the
global batch, duplicates included, and Keras clips those slices before it sums the duplicates. On the PS path each
worker holds its share of the slices (scaled by the divisor the update applies later), its rows are summed per id
before they are pushed, and a partitioned table's gradient is split over its shards. So:
  - ``clipvalue`` clips each worker's slices before deduplication, with the bound scaled by the divisor;
  - ``clipnorm`` scales the step's update by ``clip / max(norm, clip)`` (``tf.clip_by_norm``'s factor), the norm
    taken over every worker's slices (their sums of squares, one allreduce per step) and over all shards of a table;
  - dense gradients of PS variables are clipped after aggregation, their norm also taken over a table's shards;
  - ``global_clipnorm`` scales every update of the step, replicated and PS, by ``tf.clip_by_global_norm``'s factor
    of the norm over all of them: the averaged replicated gradients' sum of squares (the same on every worker), every
    worker's sparse slices' (one allreduce) and the summed dense gradients of PS variables' (read by the chief once
    every push landed, then summed over the workers so that each has it).
The PS-side optimizer clones are made without clipping (``clones.Clones(clip=False)``).
"""

import tensorflow as tf

from kparallax.step import collectives


def sum_of_squares(grads):
    """The sum of the squares of ``grads`` (tensors or ``tf.IndexedSlices``: their slices), in float32."""
    sums = [tf.reduce_sum(tf.square(tf.cast(g.values if isinstance(g, tf.IndexedSlices) else g, tf.float32)))
            for g in grads]
    return tf.add_n(sums) if sums else tf.constant(0.0)


def by_value(grad, bounds):
    """``grad`` (a tensor or ``tf.IndexedSlices``) clipped to each of ``bounds`` in turn (``tf.clip_by_value``)."""
    for bound in bounds:
        if isinstance(grad, tf.IndexedSlices):
            grad = tf.IndexedSlices(tf.clip_by_value(grad.values, -bound, bound), grad.indices, grad.dense_shape)
        else:
            grad = tf.clip_by_value(grad, -bound, bound)
    return grad


def scaled(grad, factor):
    """``grad`` (a tensor or ``tf.IndexedSlices``) times the scalar ``factor``, in ``grad``'s dtype."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


class Clipping:
    """The clipping of one synchronous PS path.

    Args:
      plan: ``[("value", c), ("norm", c) or ("global", c)]`` steps in Keras' order (``_compat.keras.clipping``);
        a norm comes last.
      divisor: what the update divides summed gradients by (the worker count when averaging, else 1).
      num_workers: Horovod size.
      group_of: callable(variable) -> the key of the gradient one process clips as one (a table, or itself).
    """

    def __init__(self, plan, divisor, num_workers, group_of):
        self._plan = list(plan)
        if any(kind in ("norm", "global") for kind, _ in self._plan[:-1]):
            raise ValueError(f"Clipping by norm must come last. Received: {self._plan}.")
        self._divisor = divisor
        self._n = num_workers
        self._group_of = group_of
        self._norm = next((c for kind, c in self._plan if kind == "norm"), None)
        self._global = next((c for kind, c in self._plan if kind == "global"), None)

    @property
    def by_norm(self):
        """Whether ``clipnorm`` is set: a dense gradient's factor needs every push of its table's shards first."""
        return self._norm is not None

    @property
    def by_global_norm(self):
        """Whether ``global_clipnorm`` is set: every update of the step waits for one factor."""
        return self._global is not None

    def slices(self, grad):
        """``clipvalue`` on this worker's slices of a sparse gradient (before they are summed per id)."""
        return by_value(grad, [bound * self._divisor for kind, bound in self._plan if kind == "value"])

    def dense(self, grad):
        """``clipvalue`` on an aggregated (already divided) dense gradient."""
        return by_value(grad, [bound for kind, bound in self._plan if kind == "value"])

    def sparse_norm_factors(self, sparse):
        """``{group: factor}`` for the sparse gradients, from every worker's slices (one allreduce of each group's
        sum of squares, so that a group's update waits for its own gradients only), and those allreduces' outputs
        for the step to keep alive; ({}, []) without ``clipnorm``."""
        if self._norm is None or not sparse:
            return {}, []
        order = list(dict.fromkeys(self._group_of(v) for _, v in sparse))
        local = [[] for _ in order]
        for grad, variable in sparse:
            local[order.index(self._group_of(variable))].append(sum_of_squares([grad]))
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
                groups.setdefault(self._group_of(variable), []).append(sum_of_squares([grad]))
        return {key: self._factor(tf.add_n(sums)) for key, sums in groups.items()}

    def _factor(self, sum_of_squares):
        return self._norm / tf.maximum(tf.sqrt(sum_of_squares), self._norm)

    def sparse_sum_of_squares(self, sparse):
        """The sum of squares of every worker's slices of ``sparse`` (one process's slices of the global batch; one
        scalar allreduce; none without sparse gradients, which every worker's step has alike), for
        ``global_factor``."""
        if not sparse:
            return tf.constant(0.0)
        total = collectives.sum_over_workers(sum_of_squares([g for g, _ in sparse]), self._n,
                                             "kp_global_norm_sparse_sumsq")
        return total / float(self._divisor ** 2)

    def dense_sum_of_squares(self, grads_and_vars):
        """The sum of squares of aggregated dense gradients (each computed on its variable's PS device)."""
        sums = []
        for grad, variable in grads_and_vars:
            with tf.device(variable.device):
                sums.append(sum_of_squares([grad]))
        return tf.add_n(sums) if sums else tf.constant(0.0)

    def global_factor(self, total):
        """``tf.clip_by_global_norm``'s factor for a step whose gradients' squares sum to ``total``: its
        own formula, so that an infinite or NaN norm gives NaN as there."""
        norm = tf.sqrt(total)
        return self._global * tf.minimum(1.0 / norm, 1.0 / self._global) + (norm - norm)
