"""The optimizer wrapper that routes each gradient to its path.

``wrap(optimizer, router)`` returns an optimizer of the user's class (same hyper-parameters) whose
``apply_gradients`` sends gradients of PS variables to the sparse aggregator and averages the others with
Horovod, then applies the dense update locally, exactly once per step on every worker.
"""

import tensorflow as tf

from kparallax import _compat
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


class _RoutingMixin:
    """Mixed in front of the user's optimizer class; the router is set by ``wrap``."""

    _kp_router = None

    @tf.autograph.experimental.do_not_convert
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        router = self._kp_router
        dense, sparse = [], []
        for grad, variable in grads_and_vars:
            if grad is None:
                continue
            (sparse if router.is_ps_variable(variable) else dense).append((grad, variable))
        sparse_done = router.aggregator.push_and_apply(sparse)
        if dense:
            dense = allreduce.average_gradients(dense, router.num_workers, control_inputs=sparse_done)
            return super().apply_gradients(dense, *args, **kwargs)
        token = allreduce.barrier(router.num_workers, control_inputs=sparse_done)
        return self.iterations.assign_add(tf.cast(token, tf.int64) * 0 + 1)  # data edge: the barrier must run


def wrap(optimizer, router):
    """Returns a routing optimizer of ``optimizer``'s class, hyper-parameters and name.

    Args:
      optimizer: a tf.keras optimizer instance (new or legacy).
      router: object with ``is_ps_variable(v)``, ``aggregator`` and ``num_workers``.
    """
    base = type(optimizer)
    cls = type(base.__name__, (_RoutingMixin, base), {"__module__": base.__module__})
    wrapped = cls.from_config(optimizer.get_config())
    wrapped._kp_router = router  # pylint: disable=protected-access
    return wrapped
