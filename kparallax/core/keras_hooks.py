"""Keras under a HybridStrategy: hooks bound per model instance when it is compiled inside ``scope()``.

Process-wide, ``tf.keras.Model.compile`` is wrapped (``install()``, once): outside any scope it calls Keras
unchanged (in a multi-worker job, that model's ``fit`` and ``train_on_batch`` are refused: each worker would train
alone). So are ``Model.get_weights``/``set_weights``, for models not compiled yet: a model holding a partitioned
table presents it whole from its creation on (every other model gets Keras' methods unchanged). Compiled inside a
scope, the model gets its own ``fit``, ``train_on_batch``, ``evaluate``, ``predict``, ``get_weights``,
``set_weights``, ``make_train_function`` (``steps_per_execution``) and the savers of ``saving.py`` (instance
attributes bound to this model; every other model keeps Keras' methods), and a layer that holds a PS variable gets
its own ``get_weights``/``set_weights`` when the variable is created.

Under a strategy:
  * ``compile`` wraps the optimizer (``kparallax.step``); ``jit_compile=True`` is refused.
  * ``fit`` shards the training data per worker (``data``), runs inside the strategy's scope, adds the callbacks of
    ``fit_callbacks`` in front of the user's (and ``SameStop`` after them: every worker stops where any asked), and
    shows the progress bar on worker 0 only. ``validation_split`` takes the last fraction of the full arrays.
  * ``train_on_batch`` takes this worker's own batch (one synchronous step over all workers' batches) and, at its
    first call and after any worker set the model's weights, broadcasts worker 0's replicated weights as ``fit``
    does.
  * ``get_weights``/``set_weights`` present a partitioned table whole; only worker 0 writes PS variables.
  * ``evaluate`` / ``predict`` (and ``fit``'s validation) run on the full input on every worker, so their
    results are exact and identical everywhere; only worker 0 prints. Validation arrays are batched by the global
    batch unless ``validation_batch_size`` is given, as one process's ``fit`` batches them.
"""

import contextlib
import dataclasses
import functools
import inspect
import os
import re
import threading
import types
import weakref
import zlib

import tensorflow as tf

from kparallax import callbacks as kp_callbacks
from kparallax import log
from kparallax._compat import keras as keras_compat
from kparallax._compat import striped
from kparallax._compat import tf as tf_compat
from kparallax.core import backup
from kparallax.core import data as data_lib
from kparallax.core import fit_callbacks
from kparallax.core import partition_search
from kparallax.core import placement
from kparallax.core import ps_writes
from kparallax.core import resume
from kparallax.core import saving
from kparallax.core import tables
from kparallax.step import batch_norm
from kparallax.step import collectives
from kparallax.step import logs as logs_lib
from kparallax.step import global_losses
from kparallax.step import gradient_transforms
from kparallax.step import metric_states
from kparallax.step import padded_widths
from kparallax.step import replica_context
from kparallax.step import rows_meet
from kparallax.step import scalar_metrics
from kparallax.step import state_variables
from kparallax.step import train_step

_LOCAL = threading.local()
_STRATEGIES = weakref.WeakSet()
_ORIGINAL_COMPILE = []
_STATE = "_kparallax_compiled"
_BOUND = ("fit", "train_on_batch", "evaluate", "predict", "get_weights", "set_weights", "make_train_function",
          "train_step", "save", "save_weights", "export", "load_weights")


@dataclasses.dataclass
class Compiled:
    """What a model compiled under a strategy trains with: the strategy, its ``Step`` and its PS ``Clones``."""
    strategy: object
    step: object
    clones: object
    resume: object = None  # a ``resume.Pending`` left by ``kparallax.checkpoint.restore`` for the next ``fit``
    # Whether ``train_on_batch`` broadcast worker 0's replicated weights (through ``weights``): False before its first
    # call and after this worker set or loaded the model's weights (then they are broadcast again).
    on_batch_synced: bool = False
    # Whether the workers' batches may differ in size (a dataset without a fixed batch dimension, train_on_batch):
    # then the traced step weights each worker's gradient by its share of the global batch.
    uneven_batches: bool = False
    # The ``fit_callbacks.ReplicatedWeights`` of the latest ``fit`` or ``train_on_batch`` that broadcast worker 0's
    # weights: the train function's first call broadcasts through it the variables its trace created.
    weights: object = None
    # Whether ``train_on_batch`` compared the replicated non-trainable variables after its first call
    # (``fit_callbacks.check_same_state``; ``fit`` compares after each call's first step).
    state_checked: bool = False


def compiled(model):
    """The ``Compiled`` record of ``model``, or None if it was not compiled inside a strategy's scope."""
    return model.__dict__.get(_STATE)


def current_strategy():
    """The strategy whose ``scope()`` is active in this thread, or None."""
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def active(strategy):
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    stack.append(strategy)
    try:
        yield
    finally:
        stack.pop()


@contextlib.contextmanager
def outside_scopes():
    """Inside: no strategy's scope is active in this thread (``compile`` is Keras' own), as in a plain process."""
    stack = getattr(_LOCAL, "stack", None)
    _LOCAL.stack = []
    try:
        yield
    finally:
        _LOCAL.stack = stack


def install(strategy):
    """Remembers ``strategy`` and wraps ``tf.keras.Model.compile`` once (idempotent)."""
    _STRATEGIES.add(strategy)
    if _ORIGINAL_COMPILE:
        return
    original = keras_compat.Model.compile
    _ORIGINAL_COMPILE.append(original)

    @functools.wraps(original)
    def compile(self, *args, **kwargs):  # pylint: disable=redefined-builtin
        return _compile(self, *args, **kwargs)

    keras_compat.Model.compile = compile
    for name, whole in (("get_weights", _layer_get_weights), ("set_weights", _layer_set_weights)):
        setattr(keras_compat.Model, name, _whole_tables_before_compile(getattr(keras_compat.Model, name), whole))
    for name in ("save", "save_weights", "export", "load_weights"):
        setattr(keras_compat.Model, name, _saved_whole_uncompiled(getattr(keras_compat.Model, name)))
    for base in (keras_compat.NewOptimizer, keras_compat.LegacyOptimizer):
        base.apply_gradients = _only_owned_optimizers_in_jobs(base.apply_gradients)
    batch_norm.install()
    rows_meet.install()
    padded_widths.install()


def _only_owned_optimizers_in_jobs(original):
    """``apply_gradients`` of Keras' optimizer base classes. In a model's synchronous training step, an optimizer
    kparallax did not make (a second optimizer of a custom ``train_step``, as a GAN has) gets its gradients averaged
    over the workers like the compiled one's (replicated variables only). Elsewhere, in a job of several workers, it
    is refused, as it would update each worker's copy alone: in an asynchronous step with its own message, outside
    a model's step as a custom training loop. (The compiled one refuses a loop in its own ``apply_gradients``,
    ``train_step._RoutingMixin``.)"""

    @functools.wraps(original)
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        if keras_compat.is_owned(self):
            return original(self, grads_and_vars, *args, **kwargs)
        strategy = train_step.model_step_strategy()
        if strategy is not None and strategy.options.sync:
            grads_and_vars = list(grads_and_vars)
            _refuse_extra_optimizer_on_ps(strategy, self, grads_and_vars)
            return train_step.route(self, strategy.extra_step(self), grads_and_vars,
                                    lambda averaged: original(self, averaged, *args, **kwargs))
        if strategy is not None and strategy.num_workers > 1:
            name = type(self).__name__
            raise ValueError(
                f"A second optimizer ({name}) in an asynchronous training step (sync=False) is not supported: each "
                "worker would update its own copy of its variables alone (asynchronous training shares only the "
                f"compiled optimizer's updates, through the PS). Received: {name}.apply_gradients in the train_step "
                f"of a model trained with sync=False in a job of {strategy.num_workers} workers. Train with "
                "sync=True (a second optimizer's gradients are then averaged over the workers), or apply every "
                "gradient with self.optimizer.")
        jobs = [s.num_workers for s in list(_STRATEGIES) if s.num_workers > 1]
        if jobs:
            train_step.refuse_custom_loop(self, jobs[0], compiled=False)
        return original(self, grads_and_vars, *args, **kwargs)
    return apply_gradients


def _refuse_extra_optimizer_on_ps(strategy, optimizer, grads_and_vars):
    on_ps = [v for g, v in grads_and_vars if g is not None and strategy.is_ps_variable(v)]
    if on_ps:
        paths = [placement.variable_path(v) for v in on_ps]
        scope = os.path.commonprefix([p.split("/")[:-1] for p in paths])  # whole path components
        rule = re.escape("/".join(scope)) + "/.*" if scope else re.escape(paths[0])
        raise ValueError(
            f"A second optimizer ({type(optimizer).__name__}) updates PS variables in a model's train_step: under "
            "HybridStrategy only the optimizer passed to compile (the last one of a list of optimizers) can, because "
            f"the PS-side copies of it hold those variables' slots. Received: {type(optimizer).__name__}"
            f".apply_gradients with PS variable(s) {[v.name for v in on_ps]}. Update them with that optimizer, or keep "
            f"them on the workers with HybridStrategy(placement={{{rule!r}: 'replicated'}}).")


def _whole_tables_before_compile(original, whole):
    """``Model.get_weights``/``set_weights`` presenting partitioned tables whole (``whole``) for a model holding one
    (compiled models have their own bound methods); Keras' ``original`` otherwise, and inside ``whole`` itself."""

    @ps_writes.passing
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        if not getattr(_LOCAL, "in_weights", False):
            strategy = _owning_strategy(self, lambda s, v: s.registry.table_of(v))
            if strategy is not None:
                return whole(strategy, self, *args, **kwargs)
        return original(self, *args, **kwargs)
    return method


def _saved_whole_uncompiled(original):
    """``Model.save`` / ``save_weights`` / ``export`` / ``load_weights`` of a model holding PS variables that was
    not compiled under a strategy (compiled models have their own bound methods): the tower of a two-tower model,
    a model built from trained layers to serve. They act as a compiled model's do (``saving``): partitioned tables
    written and read whole, files written by worker 0 only. Before, such a file held a table's stripes as separate
    weights, which a plain process refused to load (a SavedModel was refused)."""
    loads = original.__name__ == "load_weights"

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        strategy = _owning_strategy(self, lambda s, v: s.is_ps_variable(v))
        if strategy is None:
            return original(self, *args, **kwargs)
        if loads:
            return saving.load_weights(original, strategy, None, self, *args, **kwargs)
        return saving.save(original, strategy, self, *args, **kwargs)
    return method


def _owning_strategy(model, owns):
    """The strategy one of whose variables (``owns(strategy, variable)``) ``model`` holds, or None. A model whose
    weights are not all created yet holds none: Keras may still build it (a premade model's parts) or restore into
    it later (a deferred ``load_weights``), and listing its weights would raise."""
    weights = keras_compat.created_weights(model) if _STRATEGIES else None
    if weights is None:
        return None
    return next((s for s in list(_STRATEGIES) if any(owns(s, v) for v in weights)), None)


@contextlib.contextmanager
def _keras_weights():
    """Inside, ``Model.get_weights``/``set_weights`` are Keras' own (the shards as weights)."""
    before = getattr(_LOCAL, "in_weights", False)
    _LOCAL.in_weights = True
    try:
        yield
    finally:
        _LOCAL.in_weights = before


def _bind_method(obj, name, function, *extra):
    if extra:
        function = functools.partial(function, *extra)
        function.__name__ = function.__qualname__ = name  # AutoGraph reads it (a user's tf.function calling it)
    obj.__dict__[name] = types.MethodType(function, obj)


def bind_layer(layer, strategy):
    """Gives ``layer`` (which holds a PS variable of ``strategy``) its own ``get_weights``/``set_weights``."""
    if "get_weights" not in layer.__dict__:
        _bind_method(layer, "get_weights", _layer_get_weights, strategy)
        _bind_method(layer, "set_weights", _layer_set_weights, strategy)


def _unbind(model):
    model.__dict__.pop(_STATE, None)
    for name in _BOUND:
        model.__dict__.pop(name, None)


def _compile(model, *args, **kwargs):
    original = _ORIGINAL_COMPILE[0]
    strategy = current_strategy()
    if strategy is None:
        owners = [s for s in list(_STRATEGIES)
                  if keras_compat.weights_created(model) and any(s.is_ps_variable(v) for v in model.weights)]
        if owners:
            raise ValueError(
                f"Model {model.name!r} holds variables on PS tasks (created inside HybridStrategy.scope()) but is "
                "compiled outside the scope: it would train without the other workers. Received: compile() outside "
                "the scope. Call compile inside `with strategy.scope():`.")
        _unbind(model)
        jobs = [s for s in list(_STRATEGIES) if s.num_workers > 1]
        if jobs:
            for name in ("fit", "train_on_batch"):
                _bind_method(model, name, _refuse_training, jobs[0].num_workers, name)
        return original(model, *args, **kwargs)
    bound = inspect.signature(original).bind(model, *args, **kwargs)
    bound.apply_defaults()
    if bound.arguments.get("jit_compile"):
        raise ValueError("jit_compile=True is not supported under HybridStrategy (XLA cannot compile the remote "
                         "PS ops of a training step). Received: jit_compile=True. Leave it unset or False.")
    _check_fixed_steps_per_execution(strategy, bound.arguments.get("steps_per_execution") == "auto",
                                     "steps_per_execution='auto'")
    if strategy.options.sync and strategy.num_workers > 1:
        batch_norm.check(model, strategy.num_workers, strategy.options.sync_batch_norm)
    listed = keras_compat.optimizer_list(bound.arguments["optimizer"])
    if listed is not None:
        _check_optimizer_list(strategy, model, listed)
    optimizer, step, clones = strategy.make_optimizer(bound.arguments["optimizer"] if listed is None else listed[-1])
    bound.arguments["optimizer"] = (optimizer if listed is None else
                                   (tuple if isinstance(listed, tuple) else list)([*listed[:-1], optimizer]))
    _guard_tracking(strategy, model, optimizer)
    _unbind(model)
    model.__dict__[_STATE] = Compiled(strategy, step, clones)
    _bind_method(model, "fit", _fit, original_method(model, "fit"))
    _bind_method(model, "train_on_batch", _train_on_batch, original_method(model, "train_on_batch"))
    for name in ("evaluate", "predict"):
        _bind_method(model, name, _run_quietly_on_workers, original_method(model, name))
    _bind_method(model, "get_weights", _layer_get_weights, strategy)
    _bind_method(model, "set_weights", _layer_set_weights, strategy)
    _bind_method(model, "make_train_function", _make_train_function, original_method(model, "make_train_function"))
    _bind_method(model, "train_step", _train_step if strategy.options.sync else _async_train_step,
                 original_method(model, "train_step"))
    _bind_method(model, "save", saving.save_with_optimizer, original_method(model, "save"), strategy, clones)
    _bind_method(model, "save_weights", saving.save_weights, original_method(model, "save_weights"), strategy, clones)
    _bind_method(model, "export", saving.save, original_method(model, "export"), strategy)
    _bind_method(model, "load_weights", _load_weights, original_method(model, "load_weights"), strategy, clones)
    result = original(*bound.args, **bound.kwargs)
    if strategy.options.sync:
        global_losses.install(model)
    if keras_compat.is_loss_scale_optimizer(model.optimizer):  # also async: replicated gradients are allreduced
        keras_compat.skip_steps_together(model.optimizer, functools.partial(
            collectives.any_worker_in_graph, num_workers=strategy.num_workers, name="kp_loss_scale_overflow"))
    return result


def _check_optimizer_list(strategy, model, optimizers):
    """``compile(optimizer=[...])``, as Keras' ``WideDeepModel`` takes one optimizer per part: the last is the one
    kparallax routes (it may update PS variables; its ``iterations`` count the steps), each other one applies its
    gradients as a second optimizer of a ``train_step`` does (averaged over the workers; replicated variables only).
    Refused where that does not hold: asynchronous training, loss scaling (Keras wraps each optimizer of the list in
    its own ``LossScaleOptimizer``, which kparallax does not keep in step over the workers)."""
    names = [o if isinstance(o, str) else type(o).__name__ for o in optimizers]
    if not optimizers:
        raise ValueError("compile received an empty list of optimizers. Received: optimizer=[]. Pass one optimizer, "
                         "or one per part of the model (Keras' WideDeepModel: [linear, dnn]).")
    if any(o is optimizers[-1] for o in optimizers[:-1]) and not isinstance(optimizers[-1], str):
        raise ValueError(
            "The same optimizer instance appears twice in the list of optimizers: kparallax makes the last one its "
            "own copy (it updates the PS variables), so the two would no longer share one state as they do in one "
            f"process. Received: optimizer={names} with {names[-1]} repeated. Pass a separate instance per part.")
    if not strategy.options.sync:
        raise ValueError(
            f"A list of optimizers is not supported with sync=False: asynchronous training shares only one "
            f"optimizer's updates, through the PS. Received: optimizer={names} with sync=False. Train with "
            "sync=True, or pass one optimizer.")
    if any(keras_compat.is_loss_scale_optimizer(o) for o in optimizers) or model.dtype_policy.name == "mixed_float16":
        raise ValueError(
            "A list of optimizers with loss scaling (the mixed_float16 policy, or a LossScaleOptimizer in the list) "
            f"is not supported under HybridStrategy. Received: optimizer={names} for model {model.name!r} with "
            f"policy {model.dtype_policy.name!r}. Pass one optimizer, or train this model in float32 "
            "(or mixed_bfloat16, which needs no loss scale).")


def _make_train_function(original, model, force=False):
    """``steps_per_execution = N``: N calls of a one-step train function per execution, each ending at the step's
    barrier (Keras' in-graph loop does not keep the PS update of one step before the reads of the next)."""
    if model.train_function is not None and not force:
        return model.train_function
    single, placed = keras_compat.single_step_train_function(model, original), False

    def train_function(iterator):
        nonlocal single, placed
        creating = contextlib.nullcontext()
        if not placed:
            # The function traced before a move holds the moved variables' old handles: dropped with it.
            single, placed = _placed(original, model, single, iterator), True
            model.train_function = train_function  # Keras' make_train_function, called again there, replaced it
            weights = compiled(model).weights
            if weights is not None:  # a model built by that trace: worker 0's values, before the step
                weights.sync_new()
                if _runs_eagerly(single):  # no trace: the step builds the model as it runs
                    creating = weights.broadcast_created()
        outputs = None
        with creating:
            for _ in range(keras_compat.steps_per_execution(model)):  # Keras lowers it for an epoch's last execution
                outputs = single(iterator)
        if model.__dict__.get("_kparallax_announce_pending"):  # a model built by its first step
            _announce(compiled(model).strategy, model)
        return outputs

    model.train_function = train_function
    return train_function


def _runs_eagerly(single):
    """Whether the one-step train function ``single`` runs eagerly (``run_eagerly=True``: a plain Python function;
    ``tf.config.run_functions_eagerly(True)``)."""
    return not hasattr(single, "get_concrete_function") or tf.config.functions_run_eagerly()


def _placed(original, model, single, iterator):
    """Before the first step of ``single`` (a traced one-step train function): traces it without running it. If
    that trace found replicated variables with sparse gradients (``train_step.route``: under ``hybrid`` they belong
    on PS tasks, as Embedding tables do), moves them there (``HybridStrategy.move_to_ps``) and returns a train
    function traced anew; else ``single``, whose trace the first step reuses. No batch is consumed."""
    state = compiled(model)
    if _runs_eagerly(single) or state.step.moves_sparse is None:
        return single  # run_eagerly: an eager step cannot use PS variables
    state.step.probing, state.step.decided = True, False
    try:
        single.get_concrete_function(iterator)
    finally:
        state.step.probing = False
    moving, state.step.pending_moves = state.step.pending_moves, []
    if not moving:
        return single
    # The optimizer may hold slots for them already (built by a saver or a loader before the first step). Initial
    # ones (no step taken) are the state the PS-side copies start from; trained ones the move would lose.
    optimizer = keras_compat.step_optimizer(model)
    held = [v for v in moving if keras_compat.holds_slots(optimizer, v)]
    steps = int(optimizer.iterations.numpy())
    if held and steps:
        names = [v.name for v in held]
        raise ValueError(
            f"Variable(s) {names} get sparse gradients (tf.IndexedSlices), so under architecture='hybrid' they live on "
            "PS tasks, but the optimizer already holds their trained state here (loaded before the first step, e.g. "
            "by load_weights, BackupAndRestore or strategy.load_model), which moving them would lose. Received: "
            f"optimizer state after {steps} step(s) for replicated variables {names}. Name them in a placement rule "
            f"so they are made where they belong, e.g. placement={{{placement.variable_path(held[0])!r}: 'ps'}} (or "
            "'replicated' to allgather their rows); saved state loads either way.")
    state.strategy.move_to_ps(model, moving)
    _guard_tracking(state.strategy, model, optimizer)
    if state.strategy.is_chief and model.__dict__.get("_kparallax_announced"):
        print("kparallax: moved to PS (sparse gradients): " + "; ".join(
            "{} -> ps[{}]".format(*state.strategy.ps_info(v)) for v in moving), flush=True)
    return keras_compat.single_step_train_function(model, original)


def _train_step(original, model, data):
    """The model's own ``train_step`` (Keras' or the user's), its logs taken over all workers in the step
    (``step/logs.py``: Keras' metrics from their summed states, other scalars averaged; synchronous training only: it
    is a collective; a summed state the step sets instead of adding to is refused, ``step/metric_states.py``). With
    several workers, its BatchNormalization layers take their statistics over all workers' batches
    (``step/batch_norm.py``) and its losses count every worker's part as one process does
    (``step/global_losses.py``: compiled losses summed over the batch or masked, and, when batches may differ in
    size, each worker's gradient and logged scalars weighted by its share of the global batch); a tf.distribute
    replica context's ``all_gather`` and a user's ``all_reduce``, which would gather and reduce nothing, are refused
    (``step/replica_context.py``), and so are the batch's rows scored against each other without ``kp.all_gather``
    (``step/rows_meet.py``)."""
    with rows_meet.checked_first():
        return _synchronous_step(original, model, data)


def _synchronous_step(original, model, data):
    """``_train_step`` but for its checks' order (``rows_meet.checked_first``)."""
    state = compiled(model)
    strategy = state.strategy
    # Before this step's update (program order).
    iterations = keras_compat.step_optimizer(model).iterations.read_value()
    share = (global_losses.batch_share(data, strategy.num_workers)
             if state.uneven_batches and strategy.num_workers > 1 else None)
    statistics = (batch_norm.global_statistics(strategy.num_workers, strategy.options.sync_batch_norm)
                  if strategy.num_workers > 1 else contextlib.nullcontext())
    with (statistics, global_losses.workers(strategy.num_workers, share, strategy.options.backward_passes_per_step),
          _worker_random_seed(strategy),
          train_step.model_step(strategy), replica_context.refused(strategy),
          rows_meet.refused(strategy.num_workers, strategy.options.backward_passes_per_step, data),
          padded_widths.global_widths(strategy.num_workers, strategy.options.backward_passes_per_step,
                                      strategy.is_chief),
          gradient_transforms.recording(),
          scalar_metrics.weighing(model, data, strategy.num_workers, share),
          state_variables.combined(model, strategy.is_ps_variable, strategy.num_workers, share),
          metric_states.checked(model, strategy.num_workers)):
        logs = original(model, data)
    return logs_lib.over_workers(logs, model.metrics, iterations, strategy.num_workers, "kp_step_logs", share,
                                 worker_index=strategy.worker_index)


def _async_train_step(original, model, data):
    """Asynchronous training (``sync=False``): the model's own ``train_step`` as it is, marked as the model's
    training step (``train_step.model_step``), in which its compiled optimizer applies gradients (outside one, in a
    job of several workers, it is refused: a custom training loop)."""
    strategy = compiled(model).strategy
    with train_step.model_step(strategy), replica_context.refused(strategy):
        return original(model, data)


@contextlib.contextmanager
def _worker_random_seed(strategy):
    """While the training step is traced with a global seed set (``tf.keras.utils.set_random_seed``, the same on
    every worker): the random ops of the step (Dropout and other random layers without a generator of their own, a
    custom ``train_step``'s ``tf.random`` noise) draw from a seed of this worker's own, as one process draws
    independent values for the rows of its global batch. With the same seed everywhere, every worker drew the same
    masks and noise for its rows. Random layers that keep a ``tf.random.Generator`` (``RandomFlip``, ...) and create
    it in the step are seeded from a stream of this worker's own too (``keras_compat.worker_seed_generator``). Worker
    0 keeps the global seed; the draws stay reproducible run to run."""
    graph = tf.compat.v1.get_default_graph()
    seed = None if tf.executing_eagerly() else graph.seed
    with keras_compat.worker_seed_generator(strategy.worker_index):
        if seed is None or strategy.worker_index == 0:
            yield
            return
        graph.seed = (seed * 1_000_003 + strategy.worker_index) % (2 ** 31 - 1)
        try:
            yield
        finally:
            graph.seed = seed


def _refuse_training(workers, method, model, *args, **kwargs):
    raise ValueError(
        f"Model {model.name!r} was compiled outside HybridStrategy.scope() in a job of {workers} workers: each "
        f"worker would train its own copy alone. Received: {method}() of a model compiled outside the scope. Build "
        "and compile it inside `with strategy.scope():` (evaluate and predict work either way).")


def _train_on_batch(original, model, *args, **kwargs):
    """Keras' ``train_on_batch`` with this worker's own batch: one step of the model's training step, synchronous
    over the workers, so the global batch is the workers' batches in rank order.

    Before its first call, and before any call after some worker set or loaded the model's weights (one scalar
    allreduce per call tells), worker 0's replicated weights are broadcast, as ``fit`` does at its start: each
    worker may have initialized or loaded its own. A model built by that call gets its new variables broadcast when
    its step is first traced, before it runs (as each is created, if the step runs eagerly). The workers' batches
    may differ in size: the step weights each worker's gradient by its share of the global batch
    (``step/global_losses.py``). After the first call, the replicated non-trainable variables the step may assign
    are compared over the workers, as ``fit`` does after its first step."""
    state = compiled(model)
    strategy = state.strategy
    _guard_tracking(strategy, model, keras_compat.step_optimizer(model))
    written = strategy.num_workers > 1 and ps_writes.take_written(strategy)
    stale = collectives.any_worker(not state.on_batch_synced or written, strategy.num_workers, name="kp_weights_set")
    if stale:
        state.weights, state.on_batch_synced = fit_callbacks.ReplicatedWeights(strategy, model), True
        state.weights.sync()
    _expect_uneven_batches(model, True)
    with strategy.scope(), _errors_explained(model):
        logs = original(model, *args, **kwargs)
    # Variables an eager step created were broadcast only now: the comparison waits for the next call.
    late = state.weights.sync_late() if stale else []
    if not state.state_checked and not late:
        state.state_checked = True
        if strategy.num_workers > 1 and strategy.options.sync:
            fit_callbacks.check_same_state(strategy, model)
    return logs


def _expect_uneven_batches(model, uneven):
    """Traces the training step again if whether the workers' batches may differ in size changed."""
    state = compiled(model)
    if state.uneven_batches != uneven:
        state.uneven_batches = uneven
        model.train_function = None


def _load_weights(original, strategy, clones, model, *args, **kwargs):
    _note_ps_write(strategy, model, "load_weights")
    result = saving.load_weights(original, strategy, clones, model, *args, **kwargs)
    _weights_set(model)
    return result


def _note_ps_write(strategy, layer, method):
    """``layer``'s ``method`` writes its PS variables (worker 0 alone): refused in ``fit`` where the workers do not
    meet next (``ps_writes.note``)."""
    if strategy.num_workers > 1 and keras_compat.weights_created(layer) and any(
            strategy.is_ps_variable(v) for v in layer.weights if isinstance(v, tf.Variable)):
        ps_writes.note(strategy, f"{method} of {layer.name!r}")


def _weights_set(model):
    """The model's weights were set or loaded on this worker: ``train_on_batch`` broadcasts worker 0's again."""
    state = compiled(model)
    if state is not None:
        state.on_batch_synced = False


def original_method(obj, name):
    """Keras' own ``name`` of ``obj``'s class (unbound)."""
    return getattr(type(obj), name)


def _guard_tracking(strategy, model, optimizer):
    """A model with PS variables: checkpoints and SavedModels that reach its routing optimizer outside kparallax's
    savers are refused (``saving.refuse_direct_tracking``)."""
    if keras_compat.weights_created(model) and any(strategy.is_ps_variable(v) for v in model.trainable_variables):
        routing = getattr(optimizer, "inner_optimizer", optimizer)
        routing.__dict__["_kp_tracking_check"] = saving.refuse_direct_tracking


def _check_fixed_steps_per_execution(strategy, autotuned, received):
    """Refuses Keras' tuning of ``steps_per_execution`` (``compile(steps_per_execution="auto")``, or
    ``model.autotune_steps_per_execution = True``) on several workers: its thread changes the number on each worker
    from that worker's own timing, so the workers' executions, and the steps Keras counts in them, part ways (seen: a
    2-worker ``fit`` hung where one process trains in seconds)."""
    if autotuned and strategy.num_workers > 1:
        raise ValueError(
            f"steps_per_execution='auto' is not supported on several workers ({strategy.num_workers} here): Keras' "
            "tuner changes it on each worker from that worker's own timing, and the workers' steps would no longer "
            f"line up. Received: {received}. Pass a number, e.g. steps_per_execution=8 (the same on every worker), "
            "and leave autotune_steps_per_execution False.")


def _fit(original, model, *args, **kwargs):
    strategy = compiled(model).strategy
    _check_fixed_steps_per_execution(strategy, getattr(model, "autotune_steps_per_execution", False),
                                     "model.autotune_steps_per_execution=True")
    # A model built by its first call: now it has its variables.
    _guard_tracking(strategy, model, keras_compat.step_optimizer(model))
    bound = inspect.signature(original).bind(model, *args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    n, index = strategy.num_workers, strategy.worker_index
    data_lib.check_supported(a["x"])
    uneven = data_lib.may_be_uneven(a["x"])
    if data_lib.is_per_worker(a["x"]):
        _check_same_steps(strategy, data_lib.local_steps(a["x"], a["steps_per_epoch"]))
    elif data_lib.is_dataset(a["x"]):
        seeds = data_lib.shuffle_seeds(a["x"])
        a["x"] = data_lib.shard_dataset(a["x"], n, index, a["steps_per_epoch"])
        _check_same_shuffle(strategy, seeds)
    elif data_lib.is_sequence(a["x"]):
        a["x"] = data_lib.shard_sequence(a["x"], n, index)
    elif data_lib.is_generator(a["x"]):
        a["x"] = data_lib.shard_generator(a["x"], n, index, a["steps_per_epoch"])
    else:
        arrays = (a["x"], a["y"], a["sample_weight"])
        if a["validation_split"] and a["validation_data"] is None:
            arrays, a["validation_data"] = keras_compat.train_validation_split(arrays, a["validation_split"])
            a["validation_split"] = 0.0
        # Without steps_per_epoch, Keras batches the arrays by batch_size (32 by default): the split keeps the
        # last, partial global batch, whose rows the workers' last batches then share unevenly.
        batch_size = a["batch_size"] or keras_compat.DEFAULT_BATCH_SIZE
        split_batch = None if a["steps_per_epoch"] else batch_size
        uneven = data_lib.arrays_uneven(arrays, n, split_batch)
        # Each worker's part of each global batch, in order: their batches joined are one process's, in its order.
        step_rows = data_lib.rows_per_step(arrays, n, a["batch_size"] or split_batch, a["steps_per_epoch"])
        a["x"], a["y"], a["sample_weight"] = data_lib.shard_arrays(arrays, n, index, split_batch, step_rows)
        if a["validation_batch_size"] is None and data_lib.is_arrays(a["validation_data"]):
            # Validation runs the full arrays on every worker; one process's fit validates in batches of its
            # batch_size, which is the global batch here (a loss summed over the batch, a masked mean, depend on it).
            a["validation_batch_size"] = n * batch_size
    _expect_uneven_batches(model, uneven)
    compiled(model).weights = fit_callbacks.ReplicatedWeights(strategy, model)
    ours = [fit_callbacks.SyncReplicatedVariables(compiled(model).weights), fit_callbacks.AverageMetrics(strategy)]
    if strategy.partitioned_tables and not strategy.partition_search["done"]:
        ours.insert(1, partition_search.PartitionSearch(strategy))
    log_dir = os.environ.get("KPARALLAX_LOG_DIR")
    if log_dir and strategy.num_workers > 1:
        ours.append(fit_callbacks.ProgressFile(log_dir, strategy.worker_index))
    if not strategy.is_chief:
        a["verbose"] = 0
        a["callbacks"] = _without_file_writers(a["callbacks"])
    elif a["verbose"] != 0:
        ours.append(keras_compat.progbar_logger())
        _announce(strategy, model)
    pending = compiled(model).resume
    if pending is not None:
        if any(isinstance(c, tf.keras.callbacks.BackupAndRestore) for c in a["callbacks"] or []):
            raise ValueError("fit has a restored kparallax checkpoint and a BackupAndRestore callback, which would "
                             "resume from different places. Received: kparallax.checkpoint.restore() before fit with "
                             "BackupAndRestore in callbacks. Use one of them.")
        ours.append(resume.ResumePosition(pending, lambda: setattr(compiled(model), "resume", None)))
    for callback in a["callbacks"] or []:
        if isinstance(callback, tf.keras.callbacks.BackupAndRestore):
            saving.refuse_optimizer_list(model, "a BackupAndRestore callback in fit")
            backup.adapt(callback, strategy, compiled(model).clones)
        if isinstance(callback, kp_callbacks.Checkpoint):
            saving.refuse_optimizer_list(model, "a kparallax.callbacks.Checkpoint in fit", keras_savers=False)
    a["callbacks"] = ours + list(a["callbacks"] or [])
    meets = {"epoch_end"}  # the hooks after which the workers meet (SameStop); a synchronous fit adds those below
    if strategy.num_workers > 1:
        if strategy.options.sync:
            meets |= fit_callbacks.writing_phases(a["callbacks"])
            if fit_callbacks.may_stop_within_epoch(a["callbacks"]):
                meets.add("batch_end")
            a["callbacks"].insert(len(ours), fit_callbacks.SameState(strategy))
            a["callbacks"].insert(0, fit_callbacks.WritePhases(strategy))
        a["callbacks"].append(fit_callbacks.SameStop(strategy, meets))
    with ps_writes.fitting(strategy, meets), strategy.scope(), _errors_explained(model):
        return original(*bound.args, **bound.kwargs)


# Keras callbacks that write a file of the run's logs; every worker's logs are the same (taken over the workers).
_FILE_WRITERS = (tf.keras.callbacks.TensorBoard, tf.keras.callbacks.CSVLogger)


def _without_file_writers(callbacks):
    """A worker other than 0 leaves out the callbacks that would write the logs to a file: worker 0 writes them, as
    one process would (in one TensorBoard directory every worker would add its own event files, each step shown
    once per worker; in one CSV file their writes would interleave). Model files are written by worker 0 alone too
    (``saving``)."""
    if not isinstance(callbacks, (list, tuple)):
        return callbacks
    return [c for c in callbacks if not isinstance(c, _FILE_WRITERS)]


def _announce(strategy, model):
    """Prints, once per model on worker 0, where its variables live (tables -> PS tasks, sizes); for a model not
    built yet, after its first step (``_make_train_function``), which creates them."""
    if model.__dict__.get("_kparallax_announced"):
        return
    if not model.built:
        model.__dict__["_kparallax_announce_pending"] = True
        return
    model.__dict__.pop("_kparallax_announce_pending", None)
    model.__dict__["_kparallax_announced"] = True
    on_ps = {}
    for variable in model.trainable_variables:
        entry = strategy.registry.get(variable)
        if entry is not None:
            path = entry.table.path if entry.table is not None else entry.path
            tasks, size = on_ps.get(path, ([], 0))
            on_ps[path] = (tasks + [entry.task], size + variable.shape.num_elements() * variable.dtype.size)
    replicated = [v for v in model.trainable_variables if strategy.registry.get(v) is None]
    shown = "; ".join(f"{path} -> ps{sorted(set(tasks))} ({_bytes(size)})" for path, (tasks, size) in on_ps.items())
    print(f"kparallax: {strategy.num_workers} worker(s), {strategy.cluster.num_ps} PS task(s), architecture "
          f"{strategy.options.architecture}; on PS: {shown or 'nothing'}; {len(replicated)} replicated variable(s) "
          f"({_bytes(sum(v.shape.num_elements() * v.dtype.size for v in replicated))})", flush=True)


def _bytes(n):
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


_OUT_OF_RANGE = re.compile(r"indices\[[0-9,]+\] = (-?[0-9]+) is not in \[0, ([0-9]+)\)")
_OUT_OF_STRIPES = re.compile(re.escape(striped.ID_CHECK_MESSAGE) + r"\] \[(-?[0-9]+)\] \[(-?[0-9]+)\] \[([0-9]+)\]")


@contextlib.contextmanager
def _errors_explained(model):
    """TensorFlow errors of ``fit`` / ``train_on_batch`` / ``evaluate`` / ``predict`` that ``_explained`` knows are
    raised said plainly (without TensorFlow's graph trace); others as they are."""
    try:
        yield
    except tf.errors.OpError as e:
        explained = _explained(e, model)
        if explained is e:
            raise
        raise explained from None


def _explained(error, model):
    """Said plainly (other errors unchanged): an id outside a table (TensorFlow's CPU gather error, or a striped
    table's id check), the step check of ``collectives.sum_checked`` (in the step or at an epoch's end), and a
    collective that ended because another worker stopped."""
    text = str(error)
    if collectives.STEP_SKEW_MESSAGE in text:
        return collectives.step_skew_error(keras_compat.step_optimizer(model).iterations.numpy())
    match = _OUT_OF_RANGE.search(text)
    if match:
        return _id_error(match.group(1), match.group(2))
    match = _OUT_OF_STRIPES.search(text)
    if match:
        low, high, rows = match.groups()
        return _id_error(low if int(low) < 0 else high, rows)
    if log.HOROVOD_SHUT_DOWN in text:
        return RuntimeError(
            "This worker stopped because another worker failed and left the collective this one was waiting on "
            "(Horovod has been shut down). The other worker's own error is the cause: kparallax-run names that "
            "worker and shows its log; without the launcher, look in each worker's output.")
    return error


def _id_error(value, rows):
    return ValueError(f"The input holds id {value}, outside an embedding table of {rows} rows: ids must be in "
                      "[0, vocabulary size). Check the data against the vocabulary (or raise the Embedding's "
                      f"input_dim). Received: id={value}.")


def _check_same_shuffle(strategy, seeds):
    """Workers splitting one dataset by batches must shuffle it alike: the seeds of its shuffles (a fingerprint and
    the first pair, one allgather) must agree, or each worker would keep its batches of its own order."""
    if strategy.num_workers == 1:
        return
    first = (seeds + [-1, -1])[:2]
    rows = collectives.allgather_ints([zlib.crc32(repr(seeds).encode()), len(seeds)] + first, name="kp_shuffle_seeds")
    if len({tuple(row) for row in rows}) != 1:
        shown = [row[2:] for row in rows]
        raise ValueError(
            "The workers shuffle the dataset with different seeds, so each keeps its batches of its own order and "
            "their batches overlap: an epoch would train on some rows twice and miss others. Received: first shuffle "
            f"seeds per worker {shown}. Build the dataset with the same seeds on every worker (shuffle(n, seed=s), "
            "tf.keras.utils.set_random_seed(s) before building it, or a seed= to the Keras utility that builds it), "
            "or shard it yourself before shuffling and mark it kparallax.data.per_worker(dataset).")


def _check_same_steps(strategy, steps):
    if strategy.num_workers == 1:
        return
    counts = [row[0] for row in collectives.allgather_ints([steps], name="kp_steps_per_epoch")]
    if len(set(counts)) != 1:
        raise ValueError(f"Every worker must run the same number of steps per epoch, or the collectives hang. "
                         f"Received: steps per worker {counts}. Pass steps_per_epoch=min(...) (for example "
                         f"{min(counts)}) and repeat the dataset.")


def _run_quietly_on_workers(original, model, *args, **kwargs):
    strategy = compiled(model).strategy
    bound = inspect.signature(original).bind(model, *args, **kwargs)
    bound.apply_defaults()
    if not strategy.is_chief:
        bound.arguments["verbose"] = 0
        bound.arguments["callbacks"] = _without_file_writers(bound.arguments["callbacks"])
    with strategy.scope(), _errors_explained(model):
        return original(*bound.args, **bound.kwargs)


def _layer_get_weights(strategy, layer):
    with _keras_weights():
        values = original_method(layer, "get_weights")(layer)
    slots = keras_compat.weight_values(layer.weights)
    table_of = strategy.registry.table_of
    if len(slots) != len(values) or not any(table_of(v) for v in slots):
        return values
    return tables.merge_weights(slots, values, table_of)


def _layer_set_weights(strategy, layer, weights):
    """Whole tables are split over their shards; only worker 0 writes PS variables (one shared copy: the others'
    writes would race with worker 0's later ones, e.g. a checkpoint restore). Every worker sets its own replicated
    variables and what Keras sets through a handler (a lookup layer's vocabulary), as Keras' ``set_weights`` does."""
    params = layer.weights
    slots = keras_compat.weight_values(params)
    weights = list(weights)
    table_of = strategy.registry.table_of
    if any(table_of(v) for v in slots) and len(weights) == tables.whole_weight_count(slots, table_of):
        weights = tables.split_weights(slots, weights, table_of)
    _note_ps_write(strategy, layer, "set_weights")
    _weights_set(layer)
    if strategy.is_chief or len(weights) != len(slots):
        with _keras_weights():
            result = original_method(layer, "set_weights")(layer, weights)
        if any(isinstance(v, tf.Variable) and strategy.is_ps_variable(v) for v in slots):
            # Remote eager writes are only dispatched: the next step would read the PS variables before them
            # (one worker, a callback scaling the weights with set_weights after every batch: 0.0032 off).
            tf_compat.async_wait()
        return result
    pairs, start = [], 0
    for param in params:
        count = keras_compat.weight_count(param)
        values, start = weights[start:start + count], start + count
        if keras_compat.is_weight_handler(param):
            param.set_weights(values)
            continue
        (value,) = values
        shape = getattr(value, "shape", ())
        if not param.shape.is_compatible_with(shape):  # as Keras checks it (an adapted layer's [2, None] state)
            raise ValueError(f"Layer {layer.name} weight {param.name} has shape {param.shape}; the value given "
                             f"has shape {shape}. Received: a mismatched list.")
        if not strategy.is_ps_variable(param):
            pairs.append((param, value))
    tf.keras.backend.batch_set_value(pairs)
    keras_compat.finalize_states(layer)
    return None
