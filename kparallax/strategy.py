"""HybridStrategy: dense variables replicated and allreduced, embedding tables shared on PS tasks.

The public class validates its arguments and hands the work to the pieces: ``runtime`` (joining the cluster),
``placement`` (where each variable lives), ``ps.variables`` (shared PS variables), ``optimizer`` (gradient
routing) and ``training`` (Model.compile/fit under the strategy).
"""

import contextlib
from typing import Mapping, Optional

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from absl import logging

from kparallax import _compat
from kparallax import optimizer as optimizer_lib
from kparallax import placement as placement_lib
from kparallax import runtime
from kparallax import training
from kparallax.cluster import Cluster
from kparallax.ps import sparse
from kparallax.ps import variables as ps_variables

class HybridStrategy:
    """Trains an unchanged Keras model on many workers, Parallax style.

    Inside ``scope()``, every ``tf.keras.layers.Embedding`` table (and any variable a placement rule maps to
    ``"ps"``) is created once on a parameter-server task and shared by all workers; every other variable is
    replicated on each worker. ``model.compile`` inside the scope wraps the optimizer so that dense gradients are
    averaged with one fused Horovod allreduce and sparse gradients are aggregated on the PS and applied there as
    one update per step. Training is synchronous and equals single-process training on the concatenated batch.

    Args:
      cluster: the ``Cluster``; defaults to ``Cluster.from_env()``.
      placement: optional mapping from variable-path regex to ``"ps"`` or ``"replicated"`` (overrides the
        default: Embedding tables to PS, everything else replicated).
      average_sparse: average sparse gradients over workers (True, the single-process equivalent) or sum them.
      connect_timeout: seconds to wait for the PS tasks to accept connections.
      init_timeout: seconds a worker waits for the chief to initialize a shared variable.

    Example:
      ```python
      strategy = kp.HybridStrategy(kp.Cluster.from_env())
      with strategy.scope():
          model = build_model()
          model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
          model.fit(x, y, batch_size=64, epochs=2)   # batch_size is per worker
      ```
    """

    def __init__(self, cluster: Optional[Cluster] = None, *, placement: Optional[Mapping[str, str]] = None,
                 average_sparse: bool = True, connect_timeout: float = 30.0, init_timeout: float = 300.0):
        cluster = Cluster.from_env() if cluster is None else cluster
        if not isinstance(cluster, Cluster):
            raise TypeError(f"cluster must be a kparallax.Cluster. Received: {type(cluster).__name__}.")
        if not isinstance(average_sparse, bool):
            raise TypeError(f"average_sparse must be True or False. Received: average_sparse={average_sparse!r}.")
        for name, value in (("connect_timeout", connect_timeout), ("init_timeout", init_timeout)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds. Received: {name}={value!r}.")
        if logging.get_verbosity() < logging.INFO:  # absl's default outside app.run is WARNING
            logging.set_verbosity(logging.INFO)
        self._cluster = cluster
        self._placement = placement_lib.Placement(placement, cluster.num_ps)
        self._average_sparse = average_sparse
        runtime.connect(cluster, connect_timeout)
        self._store = ps_variables.SharedVariableStore(cluster, is_initializer=cluster.is_chief,
                                                       init_timeout=init_timeout)
        self._ps_variables = {}  # variable.ref() -> (path, ps_task)
        training.install()

    # Properties users need -----------------------------------------------------------------------------
    @property
    def cluster(self):
        return self._cluster

    @property
    def num_workers(self):
        return hvd.size()

    @property
    def worker_index(self):
        return hvd.rank()

    @property
    def is_chief(self):
        return hvd.rank() == 0

    def is_ps_variable(self, variable):
        """True if ``variable`` is a shared variable on a PS task."""
        return variable.ref() in self._ps_variables

    def ps_info(self, variable):
        return self._ps_variables[variable.ref()]

    # Scope ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self):
        """Context in which variables are placed and ``Model.compile`` wraps the optimizer."""
        with training.active(self), tf.variable_creator_scope(self._create_variable):
            yield self

    def _create_variable(self, next_creator, **kwargs):
        path = _compat.full_variable_name(kwargs.get("name"))
        initial_value = kwargs.get("initial_value")
        shape = kwargs.get("shape")
        if shape is None or not tf.TensorShape(shape).is_fully_defined():
            value = initial_value() if callable(initial_value) else initial_value
            shape, initial_value = tf.convert_to_tensor(value).shape, value
        shape = tf.TensorShape(shape)
        embedding = _compat.embedding_being_built() is not None
        decision = self._placement.decide(path, int(np.prod(shape.as_list())), embedding)
        if decision.where == placement_lib.REPLICATED:
            variable = next_creator(**kwargs)
            if variable.trainable:
                logging.info("placement: %s %s -> replicated (%s)", path, shape.as_list(), decision.why)
            return variable
        dtype = kwargs.get("dtype") or tf.convert_to_tensor(
            initial_value() if callable(initial_value) else initial_value).dtype
        variable = self._store.create(path, shape, dtype, initial_value, decision.ps_task,
                                      trainable=kwargs.get("trainable", True) is not False,
                                      constraint=kwargs.get("constraint"))
        self._ps_variables[variable.ref()] = (path, decision.ps_task)
        logging.info("placement: %s %s -> ps[%d] %s (%s)", path, shape.as_list(), decision.ps_task,
                     self._cluster.ps[decision.ps_task], decision.why)
        return variable

    # Used by training.py -------------------------------------------------------------------------------
    def make_optimizer(self, optimizer):
        """Returns the routing optimizer for ``optimizer`` (a string or tf.keras optimizer)."""
        optimizer = optimizer_lib.resolve(optimizer)
        router = _Router(self, optimizer)
        return optimizer_lib.wrap(optimizer, router)


class _Router:
    """What the routing optimizer needs to know about one compiled model's variables."""

    def __init__(self, strategy, optimizer):
        self.num_workers = strategy.num_workers
        self.is_ps_variable = strategy.is_ps_variable
        self.aggregator = sparse.SparseAggregator(
            strategy._store, strategy.ps_info, optimizer, strategy.num_workers,  # pylint: disable=protected-access
            strategy.is_chief, average=strategy._average_sparse)  # pylint: disable=protected-access
