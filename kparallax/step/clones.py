"""The PS-side optimizer state: one clone of the user's optimizer per PS variable, living on that variable's task.

Every worker that updates PS variables has clones, and their slot variables (and step counters) are shared PS
variables next to the variable: one set of optimizer state, whoever applies an update. Synchronous training: the
worker whose push completes a step applies that step's one update (``ps_sync.py``). Asynchronous training: every
worker applies its own gradients. Clones read the learning rate of the optimizer Keras trains with, so schedules
and callbacks changing it apply to both paths.
"""

import tensorflow as tf

from kparallax._compat import optimizers as optimizer_compat
from kparallax._compat import tf as tf_compat
from kparallax.core import tables


class Clones:
    """Optimizer clones of the PS variables of one compiled model.

    Args:
      registry: the strategy's ``Registry`` (PS task and path of each variable, shared slots).
      optimizer: the user's optimizer (cloned by config).
      namespace: prefix of the shared slots' names, the same on every worker and different for each optimizer
        compiled in a strategy (a new optimizer starts from fresh slots, as in one process).
      clip: the clones clip gradients as ``optimizer`` does (asynchronous training: each worker's deduplicated
        gradient); False when the caller clips (synchronous training: ``ps_sync`` clips as one process would).
    """

    def __init__(self, registry, optimizer, namespace, clip=True):
        self._registry = registry
        self._optimizer = optimizer
        self._namespace = namespace
        self._clip = clip
        self._clones = {}
        self.learning_rate_source = None  # the optimizer Keras trains with

    @tf.autograph.experimental.do_not_convert
    def get(self, variable):
        """The clone for ``variable`` (created on first use, with slots on ``variable``'s PS task)."""
        key = variable.ref()
        if key not in self._clones:
            self._check_row_wise(variable)
            if self.learning_rate_source is not None:
                with tf.init_scope():  # on the worker, as Keras would create it
                    optimizer_compat.create_learning_rate(self.learning_rate_source)
            with tf.init_scope(), tf.device(variable.device), self._shared_slot_scope(variable):
                clone = optimizer_compat.clone_optimizer(self._optimizer, clip=self._clip)
                if self.learning_rate_source is not None:
                    optimizer_compat.share_learning_rate(clone, self.learning_rate_source)
                optimizer_compat.build_optimizer(clone, [variable])
            self._clones[key] = clone
        return self._clones[key]

    def _check_row_wise(self, variable):
        """Refuses an optimizer whose update reads across rows for a shard of a partitioned table."""
        reason = optimizer_compat.row_coupled_reason(self._optimizer)
        table = self._registry.table_of(variable)
        if reason and table is not None:
            path = table[0].path
            raise ValueError(
                f"Table {path!r} is split into row shards (partitions=P, a 'ps:P' rule or partitions='auto'), and "
                f"{reason} Received: "
                f"{type(self._optimizer).__name__} updating {len(table[0].shards)} shard(s) of {path!r}. Keep the "
                f"table in one piece with placement={{{path!r}: 'ps:1'}} (or partitions=1), or train it with an "
                "optimizer whose update is row-wise (SGD, Adam, Adagrad, RMSprop, Ftrl, ...).")

    def existing(self, variable):
        """The clone for ``variable`` if one was made (it applied an update or was restored), else None."""
        return self._clones.get(variable.ref())

    def _shared_slot_scope(self, variable):
        def creator(_, **kwargs):
            initial_value = kwargs["initial_value"]
            value = initial_value() if callable(initial_value) else initial_value
            value = tf.convert_to_tensor(value, dtype=kwargs.get("dtype"))
            name = (kwargs.get("name") or "slot").split(":")[0]
            return self._registry.shared_slot(variable, f"{self._namespace}/{name}", value)
        return tf.variable_creator_scope(creator)

    def finalize(self, variables):
        """Keras' end-of-``fit`` finalization (``use_ema``: the moving average replaces the value) for each of
        ``variables`` this process has a clone of."""
        for variable in variables:
            clone = self.existing(variable)
            if clone is not None:
                clone.finalize_variable_values([variable])

    def state(self, shards):
        """Optimizer state of ``shards`` (one table) joined over shards, or None if a shard has no clone yet."""
        clones = [self.existing(s) for s in shards]
        if any(c is None for c in clones):
            return None
        return tables.join_row_state(shards, [optimizer_compat.optimizer_variables(c) for c in clones])

    def set_state(self, shards, joined):
        """Inverse of ``state``: splits ``joined`` over the clones of ``shards`` (created if needed)."""
        tables.split_row_state(shards, [optimizer_compat.optimizer_variables(self.get(s)) for s in shards], joined)

    def move_state(self, old_variables, new_variables):
        """After a re-partitioning: carries the optimizer state of the old shards to the new ones (chief only)."""
        old = [self._clones.pop(v.ref(), None) for v in old_variables]
        if any(o is None for o in old):
            return
        joined = tables.join_row_state(old_variables, [optimizer_compat.optimizer_variables(o) for o in old])
        self.set_state(new_variables, joined)
        tf_compat.async_wait()
