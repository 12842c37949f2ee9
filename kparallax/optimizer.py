"""The optimizer wrapper that routes each gradient to its path.

``wrap(optimizer, router)`` returns an optimizer of the user's class (same hyper-parameters) whose
``apply_gradients`` sends gradients of PS variables to the sparse aggregator and averages the others with
Horovod, then applies the dense update locally, exactly once per step on every worker.
"""

import tensorflow as tf

from absl import logging

from kparallax import _compat
from kparallax import accumulation
from kparallax import allreduce

_KNOWN = ("sgd", "adam", "adagrad", "rmsprop", "adamax", "nadam", "adadelta", "ftrl", "adamw", "lion")


def resolve(optimizer):
    """Turns a string or instance into a tf.keras optimizer instance, with one clear error for anything else."""
    if isinstance(optimizer, str):
        if optimizer.lower() not in _KNOWN:
            raise ValueError(f"Unknown optimizer {optimizer!r}. Use one of {list(_KNOWN)} or a "
                             f"tf.keras.optimizers instance. Received: optimizer={optimizer!r}.")
        optimizer = tf.keras.optimizers.get(optimizer)
    _compat.optimizer_family(optimizer)  # raises for anything that is not a tf.keras optimizer
    if _compat.global_clipnorm(optimizer):
        raise ValueError(
            "global_clipnorm is not supported yet: the global norm would span the allreduce and PS paths. Use "
            f"clipnorm (per variable) instead. Received: global_clipnorm={_compat.global_clipnorm(optimizer)}.")
    return optimizer


class Router:
    """Everything the routing optimizer of one compiled model needs.

    Args:
      options: the strategy's ``Options``.
      num_workers: Horovod size.
      is_ps_variable: callable(variable) -> bool.
      aggregator: the ``SparseAggregator`` of PS variables.
    """

    def __init__(self, options, num_workers, is_ps_variable, aggregator):
        self.options = options
        self.num_workers = num_workers
        self.is_ps_variable = is_ps_variable
        self.aggregator = aggregator
        self.accumulator = (accumulation.GradientAccumulator(options.backward_passes_per_step)
                            if options.backward_passes_per_step > 1 else None)
        self._logged = False
        self.sent_bytes = None  # {"dense": int64 variable, "sparse": int64 variable}: bytes this worker sent

    @tf.autograph.experimental.do_not_convert
    def count_sent(self, dense_grads):
        """Ops adding this step's bytes to the counters: the dense allreduce payload and the PS pushes."""
        if self.sent_bytes is None:
            with tf.init_scope():
                self.sent_bytes = {k: tf.Variable(0, dtype=tf.int64, trainable=False, name=f"kp_{k}_bytes_sent")
                                   for k in ("dense", "sparse")}
        dense = [g.values if isinstance(g, tf.IndexedSlices) else g for g, _ in dense_grads]
        dense += [g.indices for g, _ in dense_grads if isinstance(g, tf.IndexedSlices)]
        dense_bytes = tf.add_n([tf.cast(tf.size(t), tf.int64) * t.dtype.size for t in dense] or [tf.constant(0, tf.int64)])
        sparse_bytes = tf.add_n(self.aggregator.pushed_bytes or [tf.constant(0, tf.int64)])
        self.aggregator.pushed_bytes = []
        return [self.sent_bytes["dense"].assign_add(dense_bytes), self.sent_bytes["sparse"].assign_add(sparse_bytes)]

    def split(self, grads_and_vars):
        dense, ps = [], []
        for grad, variable in grads_and_vars:
            if grad is not None:
                (ps if self.is_ps_variable(variable) else dense).append((grad, variable))
        if not self._logged:
            self._logged = True
            effective = self.options.architecture
            if effective == "hybrid" and not ps:
                effective = "allreduce (the model has no PS variable)"
            elif effective == "hybrid" and not dense:
                effective = "ps (the model has no replicated trainable variable)"
            logging.info("architecture: %s -> %s; %d variable(s) on PS, %d replicated; sync=%s, "
                         "backward_passes_per_step=%d, compression=%s", self.options.architecture, effective,
                         len(ps), len(dense), self.options.sync, self.options.backward_passes_per_step,
                         self.options.compression)
        return dense, ps


class _RoutingMixin:
    """Mixed in front of the user's optimizer class; the router is set by ``wrap``."""

    _kp_router = None

    @tf.autograph.experimental.do_not_convert
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        router = self._kp_router
        dense, ps = router.split(list(grads_and_vars))
        if router.accumulator is not None:
            return router.accumulator.accumulate_then(
                dense + ps, lambda averaged: self._kp_step(*router.split(averaged), args, kwargs))
        return self._kp_step(dense, ps, args, kwargs)

    def _kp_step(self, dense, ps, args, kwargs):
        router = self._kp_router
        ps_done = router.aggregator.push_and_apply(ps)
        ps_done = list(ps_done) + router.count_sent(dense)
        if dense:
            # The dense allreduce runs while the PS path (push, ids, the chief's update) is in flight; the step ends
            # at a barrier after the PS path, so no worker reads PS rows of the next step before the update.
            dense = allreduce.average_gradients(dense, router.num_workers, compression=router.options.compression,
                                                sparse_as_dense=router.options.sparse_as_dense)
            applied = super().apply_gradients(dense, *args, **kwargs)
            if ps and router.options.sync:
                token = allreduce.barrier(router.num_workers, control_inputs=ps_done, name="kp_step_done")
                router.aggregator.consume([token])   # a data edge: Grappler would prune a control-only collective
            return applied
        if router.options.sync:
            token = allreduce.barrier(router.num_workers, control_inputs=ps_done)
            return self.iterations.assign_add(tf.cast(token, tf.int64) * 0 + 1)  # data edge: the barrier must run
        with tf.control_dependencies(ps_done):
            return self.iterations.assign_add(1)


def wrap(optimizer, router):
    """Returns a routing optimizer of ``optimizer``'s class, hyper-parameters and name.

    Args:
      optimizer: a tf.keras optimizer instance (new or legacy).
      router: the model's ``Router``.
    """
    base = type(optimizer)
    cls = type(base.__name__, (_RoutingMixin, base), {"__module__": base.__module__})
    wrapped = cls.from_config(optimizer.get_config())
    wrapped._kp_router = router  # pylint: disable=protected-access
    return wrapped
