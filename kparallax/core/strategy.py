"""HybridStrategy: dense variables replicated and allreduced, embedding tables shared on PS tasks.

A facade: it validates its arguments and hands the work to the pieces. ``cluster.runtime`` joins the cluster;
``placement`` decides where each variable lives; ``registry`` owns the PS variables it creates (``tables`` for
partitioned ones); ``keras_hooks`` binds Keras' ``compile``/``fit`` of the models compiled in its scope; and
``make_optimizer`` assembles the model's step (``kparallax.step``).
"""

import contextlib
from typing import Mapping, Optional, Union

import horovod.tensorflow as hvd
import tensorflow as tf
from kparallax import log as logging

from kparallax._compat import keras as keras_compat
from kparallax._compat import tf as tf_compat
from kparallax.cluster import Cluster
from kparallax.cluster import runtime
from kparallax.core import keras_hooks
from kparallax.core import layer_weights
from kparallax.core import model_state
from kparallax.core import loading
from kparallax.core import optimizer_steps
from kparallax.core import options as options_lib
from kparallax.core import partition_search
from kparallax.core import placement as placement_lib
from kparallax.core import ps_writes
from kparallax.core import registry as registry_lib
from kparallax.core import saving
from kparallax.core import shared_variables
from kparallax.core import tables
from kparallax.step import cached_reads
from kparallax.step import collectives
from kparallax.step import ps_sync


# tf.distribute.Strategy's names that a program ported from tf.distribute looks for, with kparallax's way.
_CUSTOM_LOOP = ("A custom training loop is not supported on several workers: compile the model in strategy.scope() "
                "and train with model.fit (or train_on_batch), which shard the data per worker.")
_TF_DISTRIBUTE_NAMES = {
    "num_replicas_in_sync": (
        "kparallax's workers are Horovod's processes, not replicas: fit's batch_size is per worker (the global batch "
        "is batch_size * strategy.num_workers), and the step averages the workers' gradients. Use "
        "strategy.num_workers."),
    **{name: _CUSTOM_LOOP for name in ("run", "experimental_run", "experimental_distribute_dataset",
                                       "distribute_datasets_from_function",
                                       "experimental_distribute_values_from_function", "experimental_local_results",
                                       "reduce", "gather")},
    **{name: "Use strategy.cluster (a kp.Cluster), strategy.num_workers, worker_index and is_chief."
       for name in ("extended", "cluster_resolver")},
}


class HybridStrategy:
    """Trains an unchanged Keras model on many workers, Parallax style.

    Inside ``scope()``, every ``tf.keras.layers.Embedding`` table (and any variable a placement rule maps to
    ``"ps"``) is created once on a parameter-server task and shared by all workers; under ``hybrid``, any other
    trainable variable the first traced step finds with a sparse gradient moves there before the step runs
    (``move_to_ps``); every other variable is replicated on each worker. ``model.compile`` inside the scope wraps
    the optimizer so that dense gradients are averaged with one Horovod allreduce per gradient and sparse gradients
    are aggregated on the PS and applied there as one update per step. Training is synchronous and equals
    single-process training on the concatenated batch.

    Args:
      cluster: the ``Cluster``; defaults to ``Cluster.from_env()``.
      architecture: ``"hybrid"`` (default), ``"allreduce"`` (every variable replicated; no PS needed) or ``"ps"``
        (every trainable floating-point variable on PS). None reads ``$KPARALLAX_ARCHITECTURE`` (``kparallax-run
        --architecture``), else ``"hybrid"``.
      placement: optional mapping from variable-path regex to ``"ps"``, ``"ps:P"`` (P row shards) or
        ``"replicated"`` (overrides the architecture's default).
      partitions: row shards per Embedding table (int >= 1), spread over the PS tasks; or ``"auto"``: time a few
        real steps at P = num_ps, 2*num_ps, ... up to ``max_partitions``, fit t(P) = a/P + b(P-1) + c, keep the
        best P, and go on training (state is carried over exactly).
      max_partitions: upper bound of the ``"auto"`` search.
      auto_steps: timed steps per candidate of the ``"auto"`` search (each after one warm-up step).
      average_sparse: average sparse gradients over workers (True, the single-process equivalent) or sum them.
      sparse_as_dense: under ``"allreduce"``, densify sparse gradients instead of allgathering them.
      local_aggregation: workers on one host sum their sparse gradients and one of them pushes per host;
        ``"auto"`` (default) does so unless every worker and PS task is on one host.
      backward_passes_per_step: micro-batches accumulated locally (dense and sparse) before one communication
        and one update; ``fit``'s ``batch_size`` is then the micro-batch.
      sync: False makes PS updates asynchronous (each worker's update applied on arrival; dense stays synchronous).
      compression: ``"none"`` or ``"fp16"`` (Horovod's fp16 compression of the dense allreduce).
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

    def __init__(self, cluster: Optional[Cluster] = None, *, architecture: Optional[str] = None,
                 placement: Optional[Mapping[str, str]] = None, partitions: Union[int, str] = 1,
                 max_partitions: int = 16, auto_steps: int = 5, average_sparse: bool = True, sparse_as_dense: bool = False,
                 local_aggregation: Union[bool, str] = "auto", backward_passes_per_step: int = 1, sync: bool = True,
                 compression: str = "none", connect_timeout: float = 30.0,
                 init_timeout: float = 300.0):
        cluster = Cluster.from_env() if cluster is None else cluster
        if not isinstance(cluster, Cluster):
            raise TypeError(f"cluster must be a kparallax.Cluster. Received: {type(cluster).__name__}.")
        self._options = options_lib.Options(
            architecture=options_lib.architecture_from_env(architecture), partitions=partitions,
            max_partitions=max_partitions, auto_steps=auto_steps, average_sparse=average_sparse, sparse_as_dense=sparse_as_dense,
            local_aggregation=local_aggregation, backward_passes_per_step=backward_passes_per_step, sync=sync,
            compression=compression)
        for name, value in (("connect_timeout", connect_timeout), ("init_timeout", init_timeout)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds. Received: {name}={value!r}.")
        self._cluster = cluster
        self._placement = placement_lib.Placement(placement, cluster.num_ps, self._options.architecture,
                                                  self._options.partitions)
        runtime.connect(cluster, connect_timeout)
        store = shared_variables.SharedVariableStore(cluster, is_initializer=cluster.is_chief,
                                                     init_timeout=init_timeout)
        self._registry = registry_lib.Registry(store)
        self._tables = []        # partitioned tables under partitions="auto" (tables.Table)
        self._steps = optimizer_steps.OptimizerSteps(self)  # every compiled model's routing optimizer and step
        self._search = partition_search.new_state()
        logging.info("kparallax: %d worker(s), %d PS task(s), %s", hvd.size(), cluster.num_ps, self._options)
        keras_hooks.install(self)
        ps_writes.watch(self)

    def __getattr__(self, name):
        """Called for attributes the strategy does not have: tf.distribute.Strategy's get an error with kparallax's
        way (``_TF_DISTRIBUTE_NAMES``); any other, Python's own."""
        fix = _TF_DISTRIBUTE_NAMES.get(name)
        if fix is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        raise AttributeError(f"{type(self).__name__} is not a tf.distribute strategy and has no '{name}'. Received: "
                             f"strategy.{name}. {fix}")

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

    @property
    def registry(self):
        """The ``Registry`` of this strategy's PS variables (paths, tasks, tables, helper variables)."""
        return self._registry

    def is_ps_variable(self, variable):
        """True if ``variable`` is a shared variable on a PS task."""
        return self._registry.is_ps(variable)

    def ps_info(self, variable):
        """(path, PS task) of a PS variable."""
        entry = self._registry.entry(variable)
        return entry.path, entry.task

    @property
    def options(self):
        """The validated ``Options`` this strategy trains with."""
        return self._options

    @property
    def partitioned_tables(self):
        """Tables whose partition count the ``partitions="auto"`` search may change."""
        return list(self._tables)

    @property
    def partition_search(self):
        """State of the ``partitions="auto"`` search: ``samples`` {P: s/step}, ``model`` (a, b, c), ``chosen``."""
        return self._search

    def push_counts(self):
        """{PS variable path: pushes received} (every worker's, or one per host with local aggregation)."""
        return self._registry.counts(ps_sync.PUSHES)

    def placement_summary(self):
        """What lives where: [{"path", "task", "shape", "table", "shard"}] of every PS variable."""
        return self._registry.summary()

    # Scope ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self):
        """Context in which variables are placed and ``Model.compile`` wraps the optimizer."""
        with model_state.active(self), tf.variable_creator_scope(self._create_variable):
            yield self

    def load_model(self, filepath, custom_objects=None, compile=True):  # pylint: disable=redefined-builtin
        """``tf.keras.models.load_model`` for training under this strategy; call it on every worker.

        The file (``.keras``, ``.h5`` or SavedModel, written by one process or by kparallax's ``model.save``) is
        loaded as one process loads it; the model is rebuilt from its config inside the scope (tables placed and
        partitioned, compiled by kparallax from the saved compile config), and gets the file's weights and
        optimizer state: ``iterations`` and the replicated variables' slots on every worker, the PS variables'
        slots split over their shards by worker 0. ``fit`` then goes on as it would in the process that saved the
        file. Keras' ``load_model`` itself is refused inside the scope (it cannot split tables or reach the PS-side
        optimizer state).

        Args:
          filepath: the saved model.
          custom_objects: as for ``tf.keras.models.load_model``.
          compile: as for ``tf.keras.models.load_model``; False: an uncompiled model (weights only).

        Returns:
          The model, compiled under this strategy if the file was compiled and ``compile`` is True.
        """
        return loading.load_model(self, filepath, custom_objects=custom_objects, compile=compile)

    def _create_variable(self, next_creator, **kwargs):
        if saving.plain_variables_active():
            return next_creator(**kwargs)
        loader = keras_compat.keras_loader_on_stack()
        if loader:
            raise ValueError(
                f"{loader} inside HybridStrategy.scope() is not supported: Keras would load each table into one "
                "shard and the optimizer state into the wrong optimizer. Received: a variable "
                f"{kwargs.get('name')!r} created by {loader}. Use `model = strategy.load_model(path)` on every "
                "worker (inside or outside the scope), or build the model in the scope and call model.load_weights.")
        path = tf_compat.full_variable_name(kwargs.get("name"))
        layers = keras_compat.layers_on_stack()
        stateful = layers.resetting
        if stateful is not None:
            # Each worker's own rows of the batch, as BatchNormalization's statistics are; shared on a PS (under
            # "ps"), every worker overwrote the others' state (a stateful LSTM: 2.4e-4 off one process, silently).
            logging.info("placement: %s -> replicated (the state of %s %r: each worker's own rows)", path,
                         type(stateful).__name__, stateful.name)
            return next_creator(**kwargs)
        initial_value = kwargs.get("initial_value")
        shape = kwargs.get("shape")
        if shape is None or not tf.TensorShape(shape).is_fully_defined():
            value = initial_value() if callable(initial_value) else initial_value
            shape, initial_value = tf.convert_to_tensor(value).shape, value
        shape = tf.TensorShape(shape)
        dtype = kwargs.get("dtype") or tf.convert_to_tensor(
            initial_value() if callable(initial_value) else initial_value).dtype
        # Keras' step counters (int64 tf.Variables, trainable by tf.Variable's default) are bookkeeping, not weights.
        trainable = kwargs.get("trainable", True) is not False and tf.as_dtype(dtype).is_floating
        layer = layers.built
        embedding = isinstance(layer, keras_compat.Embedding)
        decision = self._placement.decide(path, shape.as_list(), embedding, trainable)
        if decision.where == placement_lib.REPLICATED:
            variable = next_creator(**kwargs)
            if trainable:
                logging.info("placement: %s %s -> replicated (%s)", path, shape.as_list(), decision.why)
            return variable
        constraint = kwargs.get("constraint")
        if layer is not None:
            layer_weights.bind_layer(layer, self)
        if len(decision.rows) == 1 and not decision.auto:
            variable = self._registry.create(path, shape, dtype, initial_value, decision.ps_task,
                                             trainable=trainable, constraint=constraint)
            variable.read_policy = cached_reads.policy
            variable.gather_policy = cached_reads.gather_policy
            logging.info("placement: %s %s -> ps[%d] %s (%s)", path, shape.as_list(), decision.ps_task,
                         self._cluster.ps[decision.ps_task], decision.why)
            return variable
        tables.check_constraint(path, constraint, shape.rank)
        table = tables.Table(path, tuple(shape.as_list()), tf.as_dtype(dtype), [], None)
        tables.create_shards(self._registry, self._cluster, table, decision.rows, decision.ps_tasks, tables.whole_value(initial_value, dtype),
                            trainable, constraint)
        if decision.auto:
            self._tables.append(table)
        logging.info("placement: %s %s -> %d shard(s) of rows %s on ps%s (%s%s)", path, shape.as_list(),
                     len(decision.rows), list(decision.rows), list(decision.ps_tasks), decision.why,
                     ", partitions='auto' search" if decision.auto else "")
        return table.sharded

    def repartition(self, table, partitions, model):
        """Re-splits partitioned ``table`` into ``partitions`` shards; values and optimizer state carry over.

        A collective: every worker calls it between the same two steps. The chief copies the rows into new
        shards (spread round-robin over the PS tasks) and moves the optimizer slots; the model's layer is pointed
        at the new shards and its train step is retraced; the old shards are freed.
        """
        if partitions == len(table.shards):
            return
        tf_compat.async_wait()
        old_shards, old_sharded = table.shards, table.sharded
        rows = placement_lib.shard_rows(table.shape[0], partitions)
        first = self._registry.entry(old_shards[0]).task
        tasks = [(first + i) % self._cluster.num_ps for i in range(partitions)]
        table.generation += 1
        whole = tables.whole_value(old_sharded.whole, table.dtype)
        tables.create_shards(self._registry, self._cluster, table, rows, tasks, whole, old_shards[0].trainable, old_shards[0].constraint)
        if self.is_chief:
            for clones in self._steps.clones:
                clones.move_state(old_shards, table.shards)
        keras_compat.replace_weights(model, old_shards, old_sharded, table.shards, table.sharded)
        keras_compat.reset_train_function(model)
        collectives.eager_barrier(self.num_workers, name=f"kp_repartition_{table.generation}")
        stale = []
        for shard in old_shards:
            stale += self._registry.remove(shard)
        if self.is_chief:
            for variable in list(old_shards) + stale:
                tf_compat.destroy_variable(variable)
        logging.info("repartitioned %s: %d -> %d shard(s) of rows %s on ps%s", table.path, len(old_shards),
                     partitions, list(rows), tasks)

    def moves_sparse(self, variable):
        """Whether ``variable`` (replicated, trainable) goes onto a PS task if its gradient is sparse: under
        ``hybrid``, with PS tasks, and no placement rule naming it (``Placement.moves_sparse``)."""
        return (variable.trainable and not self.is_ps_variable(variable)
                and self._placement.moves_sparse(placement_lib.variable_path(variable)))

    def moved_paths(self, model):
        """The paths of ``model``'s trainable variables that ``move_to_ps`` moved onto PS tasks."""
        entries = [self._registry.get(v) for v in model.trainable_variables]
        return [e.path for e in entries if e is not None and e.moved]

    def move_recorded(self, model, paths):
        """Moves the trainable variables of ``model`` at ``paths`` (``moved_paths`` of the run that wrote a
        checkpoint) onto PS tasks now, if they may move and have not (a restore, before their state is set)."""
        paths = set(paths)
        pending = [v for v in model.trainable_variables
                   if placement_lib.variable_path(v) in paths and self.moves_sparse(v)]
        if pending:
            self.move_to_ps(model, pending)

    def move_to_ps(self, model, variables):
        """Moves replicated ``variables`` of ``model``, whose gradients the first traced step found sparse
        (``tf.IndexedSlices``), onto PS tasks, as if created there (``Registry.move``): each whole, on the
        least-loaded task, with the chief's current value (every worker holds it: replicated weights are broadcast
        before the first step). Every worker calls it at the same point, before any step has run (or while restoring a
        checkpoint that recorded them there); the model's functions are traced again at their next use."""
        for variable in variables:
            path = placement_lib.variable_path(variable)
            decision = self._placement.for_sparse_gradient(path, variable.shape.as_list())
            self._registry.move(variable, path, decision.ps_task)
            for layer in keras_compat.layers_holding(model, variable):
                layer_weights.bind_layer(layer, self)
            logging.info("placement: %s %s -> ps[%d] %s (%s: moved from replicated at the first step)", path,
                         variable.shape.as_list(), decision.ps_task, self._cluster.ps[decision.ps_task], decision.why)
            if self._options.partitions != 1:
                logging.warning(
                    "%s moved onto ps[%d] whole: a variable cannot be split into row shards once made, so "
                    "partitions=%r applies to Embedding tables only. To split it, name it in a placement rule, "
                    "e.g. placement={%r: 'ps:%d'}, which creates it in shards (read it with tf.nn.embedding_lookup).",
                    path, decision.ps_task, self._options.partitions, path,
                    self._options.partitions if isinstance(self._options.partitions, int) else self._cluster.num_ps)
        keras_compat.reset_traced_functions(model)

    def settle_partitions(self, partitions):
        """Ends the ``"auto"`` search: later tables are created with ``partitions`` shards."""
        self._placement.settle_auto(partitions)

    # Used by keras_hooks --------------------------------------------------------------------------------
    def make_optimizer(self, optimizer):
        """(the optimizer to compile with, its ``Step``, its ``Clones``) for ``optimizer``
        (``optimizer_steps.OptimizerSteps.make``)."""
        return self._steps.make(optimizer)

    def extra_step(self, optimizer):
        """The ``Step`` of a second optimizer of a model's own ``train_step`` (``OptimizerSteps.extra_step``)."""
        return self._steps.extra_step(optimizer)
