"""Keras 2 internals (Keras 2.15 as ``tf.keras``; the same code paths exist in tf-keras 2.16-2.18).

- Keras 3 is refused at import: Horovod 0.28.1's Keras wrappers silently stop allreducing there.
- Two optimizer families (``tf.keras.optimizers.*`` since 2.11, and ``tf.keras.optimizers.legacy.*``) build and
  list their variables differently.
- The layer that creates a variable is found on the call stack (``build`` / ``add_weight`` frames): Keras passes no
  layer to variable creators.
- An optimizer reads its learning rate from the private ``_learning_rate`` (2.11+) or its ``learning_rate``
  hyper-parameter (legacy) when an update is built: PS-side clones share the worker's variable there, and the
  synchronous PS path puts a tensor read once per step in its place (``learning_rate_value``).
- Keras' random layers that keep a ``tf.random.Generator`` (``backend.RandomGenerator``, e.g. ``RandomFlip``) seed
  it, when first used, from the private ``backend._SEED_GENERATOR.generator`` that ``set_random_seed`` sets
  (``worker_seed_generator``).
- ``fit`` starts inside an epoch only through the private ``model._training_state`` hook that ``BackupAndRestore``
  uses (``set_initial_counters``; read by ``Model._maybe_load_initial_counters_from_ckpt`` in 2.11-2.15).
"""

import contextlib
import functools
import importlib
import random
import sys
import typing

import tensorflow as tf

if hasattr(tf.keras, "__version__") and tf.keras.__version__.startswith("3."):
    raise ImportError(
        "kparallax needs Keras 2 (tf.keras from TensorFlow 2.15, or tf-keras with TF_USE_LEGACY_KERAS=1). "
        f"Received: tf.keras {tf.keras.__version__}. Horovod's Keras wrappers do not allreduce under Keras 3.")

Model = tf.keras.Model
Layer = tf.keras.layers.Layer
Embedding = tf.keras.layers.Embedding
NewOptimizer = tf.keras.optimizers.Optimizer
LegacyOptimizer = tf.keras.optimizers.legacy.Optimizer
# The batch size Keras' fit, evaluate and predict use for arrays when given none.
DEFAULT_BATCH_SIZE = 32


def internal(name):
    """Keras 2's private module ``name`` (``"engine.data_adapter"``): ``keras.src.<name>`` where ``tf.keras`` is Keras
    2.15, ``tf_keras.src.<name>`` where it is the tf-keras package (TensorFlow 2.16+ with ``TF_USE_LEGACY_KERAS=1``).
    The one place kparallax reaches Keras' internals by module."""
    package = tf.keras.Model.__module__.split(".")[0]  # "keras" or "tf_keras"
    return importlib.import_module(f"{package}.src.{name}")


def weights_created(model):
    """Whether Keras lists ``model``'s variables: Keras 2.15 raises ``ValueError: Weights for model ... have not yet
    been created`` for a model not built yet whose class defines ``build`` (a ``Sequential`` model without an input
    shape, before its first call), where plain Keras' ``compile`` and ``fit`` never ask; so does listing a built
    model holding such a model (a ``WideDeepModel``'s ``LinearModel`` before the first call)."""
    return created_weights(model) is not None


def created_weights(model):
    """``model.weights``, or None where ``weights_created`` is False (listed once)."""
    try:
        model._assert_weights_created()  # pylint: disable=protected-access
        return model.weights
    except ValueError:
        return None


def weight_values(weights):
    """``weights`` (a layer's ``weights``) with each entry repeated once per value Keras' ``get_weights`` /
    ``set_weights`` give or take for it: one for a variable, ``num_tensors`` (none, one or several) for a trackable
    Keras saves through a ``TrackableWeightHandler`` (a lookup layer's vocabulary, a hash table)."""
    values = []
    for weight in weights:
        values += [weight] * weight_count(weight)
    return values


def weight_count(weight):
    """How many values Keras' ``get_weights`` / ``set_weights`` give or take for ``weight`` (see ``weight_values``)."""
    return weight.num_tensors if is_weight_handler(weight) else 1


def is_weight_handler(weight):
    """Whether ``weight`` (an entry of a layer's ``weights``) is a trackable Keras sets through its handler (Keras
    2.15: ``base_layer_utils.TrackableWeightHandler``), not a variable."""
    base_layer_utils = internal("engine.base_layer_utils")
    return isinstance(weight, base_layer_utils.TrackableWeightHandler)


def finalize_states(layer):
    """What Keras' ``set_weights`` does after setting the values: each layer recomputes what it derives from its
    weights (``finalize_state``: a ``Normalization`` layer's mean and variance as it applies them)."""
    for sublayer in layer._flatten_layers():  # pylint: disable=protected-access
        sublayer.finalize_state()


def optimizer_family(optimizer):
    """``"new"`` for Keras 2.11+ optimizers, ``"legacy"`` for ``tf.keras.optimizers.legacy``."""
    if isinstance(optimizer, LegacyOptimizer):
        return "legacy"
    if isinstance(optimizer, NewOptimizer):
        return "new"
    raise TypeError(
        "kparallax supports tf.keras optimizers (tf.keras.optimizers.* or tf.keras.optimizers.legacy.*). "
        f"Received: {type(optimizer).__name__} from module {type(optimizer).__module__}.")


def optimizer_list(optimizer):
    """The optimizers of ``compile(optimizer=[...])`` (Keras' ``WideDeepModel`` takes one per part), or None for one
    optimizer. ``model.optimizer`` keeps such a list as a ``ListWrapper``, a ``list``."""
    return optimizer if isinstance(optimizer, (list, tuple)) else None


def step_optimizer(model):
    """The optimizer whose ``iterations`` count ``model``'s training steps, the one that may update PS variables:
    ``model.optimizer``, or the last of a compiled list of optimizers (``optimizer_list``)."""
    listed = optimizer_list(model.optimizer)
    return listed[-1] if listed else model.optimizer


def step_optimizer_variables(model):
    """For a model compiled with a list of optimizers, the variables the last one (``step_optimizer``) applies
    gradients to, in the order its ``train_step`` gives them, where Keras' own step fixes them: a
    ``WideDeepModel``'s DNN's (Keras 2.15 ``premade_models/wide_deep.py``; its linear model's go to the first). None
    for any other model (a ``train_step`` of the user's)."""
    if not knows_listed_variables(model):
        return None
    return list(model.dnn_model.trainable_variables)


def knows_listed_variables(model):
    """Whether ``step_optimizer_variables`` tells them for ``model`` (once it is built)."""
    return optimizer_list(model.optimizer) is not None and isinstance(model, tf.keras.experimental.WideDeepModel)


def is_loss_scale_optimizer(optimizer):
    """Whether ``optimizer`` is a Keras ``LossScaleOptimizer`` (either family; matched by class name, the classes
    live in a private module)."""
    return any(c.__name__ == "BaseLossScaleOptimizer" for c in type(optimizer).__mro__)


def clipping(optimizer):
    """The gradient clipping ``optimizer.apply_gradients`` does, in its order: a list of ``("value", c)``
    (``tf.clip_by_value(g, -c, c)``), ``("norm", c)`` (``tf.clip_by_norm(g, c)``, per variable) and
    ``("global", c)`` (``tf.clip_by_global_norm(grads, c)``, over every gradient of the step).

    Keras 2.11+ optimizers clip by ``clipnorm`` if set, else by ``global_clipnorm``, else by ``clipvalue``; legacy
    ones by ``clipvalue``, then by ``clipnorm`` or ``global_clipnorm`` (never both).
    """
    norm, value = getattr(optimizer, "clipnorm", None), getattr(optimizer, "clipvalue", None)
    overall = global_clipnorm(optimizer)
    if optimizer_family(optimizer) == "new":
        if norm and norm > 0:
            return [("norm", float(norm))]
        if overall and overall > 0:
            return [("global", float(overall))]
        return [("value", float(value))] if value and value > 0 else []
    return ([("value", float(value))] if value is not None else []) + \
        ([("norm", float(norm))] if norm is not None else []) + \
        ([("global", float(overall))] if overall is not None else [])


@contextlib.contextmanager
def global_clipnorm_unset(optimizer):
    """While tracing inside it, ``optimizer.apply_gradients`` does not clip by ``global_clipnorm`` (its caller has
    scaled the gradients by the factor of the whole step's norm). Either family reads the attribute when it builds
    the update; the legacy one's setter also remakes its clipping function."""
    value = global_clipnorm(optimizer)
    optimizer.global_clipnorm = None
    try:
        yield
    finally:
        optimizer.global_clipnorm = value


def clone_optimizer(optimizer, clip=True):
    """A fresh optimizer of the same class and hyper-parameters, never XLA-compiled (it updates on a PS device).

    With ``clip=False`` it does not clip gradients (``clipnorm`` / ``clipvalue`` / ``global_clipnorm`` unset): its
    caller has clipped.
    A legacy optimizer's ``gradient_transformers`` (not part of its config) are refused.
    """
    if getattr(optimizer, "gradient_transformers", None):
        raise ValueError(
            "An optimizer with gradient_transformers cannot update PS variables: kparallax rebuilds the optimizer "
            "on the PS from its config, which does not hold them. Received: gradient_transformers="
            f"{optimizer.gradient_transformers!r}. Use clipnorm / clipvalue, or transform the gradients in a custom "
            "train_step.")
    overrides = {} if clip else {"clipnorm": None, "clipvalue": None, "global_clipnorm": None}
    clone = copy_optimizer(optimizer, **overrides)
    mark_owned(clone)
    if optimizer_family(clone) == "new":
        clone.jit_compile = False
    return clone


def copy_optimizer(optimizer, cls=None, **overrides):
    """A new optimizer of class ``cls`` (default: ``optimizer``'s) with ``optimizer``'s config and weight-decay
    exclusions; ``overrides`` replace config entries.

    Hyper-parameters that are objects, a ``LearningRateSchedule`` (and a legacy optimizer's callables), are
    ``optimizer``'s own, not copies made through Keras' serialization: a schedule class of the user's needs neither
    ``get_config`` nor registration, as in one process (which serializes it only to save the model), and a legacy
    optimizer's ``learning_rate=lambda: ...`` stays a callable instead of becoming its value at copy time.
    """
    objects = _object_hyperparameters(optimizer)
    with _hyperparameters_replaced(optimizer, {name: 0.0 for name in objects}):
        config = optimizer.get_config()
    config.update(objects)
    config.update(overrides)
    copy = (cls or type(optimizer)).from_config(config)
    copy_weight_decay_exclusion(optimizer, copy)
    return copy


def _object_hyperparameters(optimizer):
    """{config name: object} of ``optimizer``'s hyper-parameters that its config would serialize or evaluate: a
    Keras 2.11+ optimizer's learning-rate schedule; a legacy optimizer's schedules and callables (private
    ``_learning_rate`` / ``_hyper``)."""
    # pylint: disable=protected-access
    schedule = tf.keras.optimizers.schedules.LearningRateSchedule
    if optimizer_family(optimizer) == "new":
        rate = getattr(optimizer, "_learning_rate", None)
        return {"learning_rate": rate} if isinstance(rate, schedule) else {}
    return {name: value for name, value in optimizer._hyper.items()
            if isinstance(value, schedule) or (callable(value) and not isinstance(value, tf.Variable))}


@contextlib.contextmanager
def _hyperparameters_replaced(optimizer, values):
    """While the caller reads ``optimizer``'s config, its hyper-parameters named in ``values`` hold those values
    (set without Keras' tracking or validation, restored after)."""
    # pylint: disable=protected-access
    new = optimizer_family(optimizer) == "new"
    store = optimizer.__dict__ if new else optimizer._hyper
    keys = {name: "_learning_rate" if new else name for name in values}
    saved = {name: store[key] for name, key in keys.items()}
    try:
        for name, value in values.items():
            store[keys[name]] = value
        yield
    finally:
        for name, value in saved.items():
            store[keys[name]] = value


def copy_loss_scale_optimizer(optimizer, inner):
    """A ``LossScaleOptimizer`` of ``optimizer``'s class and loss-scale settings around ``inner`` (its config
    without serializing the inner optimizer: ``copy_optimizer``). The current scale is ``copy_loss_scale``'s."""
    return type(optimizer)(inner, dynamic=optimizer.dynamic, initial_scale=optimizer.initial_scale,
                           dynamic_growth_steps=optimizer.dynamic_growth_steps if optimizer.dynamic else None)


_EXCLUSION = ("_exclude_from_weight_decay", "_exclude_from_weight_decay_names")


def copy_weight_decay_exclusion(source, target):
    """Gives ``target`` the variables and name patterns ``source.exclude_from_weight_decay`` was given (Keras
    2.11+ optimizers; private attributes that ``get_config`` does not hold: a copy made from the config would decay
    them)."""
    for name in _EXCLUSION:
        if hasattr(source, name):
            setattr(target, name, list(getattr(source, name)))


def mark_owned(optimizer):
    """Marks an optimizer kparallax made (the routing optimizer, PS-side clones): it may apply gradients in a
    multi-worker job. Kept out of Keras' attribute tracking."""
    optimizer.__dict__["_kp_owned"] = True
    return optimizer


def is_owned(optimizer):
    return optimizer.__dict__.get("_kp_owned", False)


def unclonable_reason(optimizer):
    """Why copies of ``optimizer`` (one per PS variable) cannot reproduce it, or None.

    Keras 2.15's ``tf.keras.optimizers.Nadam`` keeps its ``u_product`` schedule in a Python counter advanced each
    time ``update_step`` is traced, so its math depends on how many variables one optimizer traces and how often:
    one clone per PS variable computes another schedule (seen: NaN weights after 2 epochs). Its legacy class
    computes the schedule from the step count.
    """
    if isinstance(optimizer, tf.keras.optimizers.Nadam) and optimizer_family(optimizer) == "new":
        return ("tf.keras.optimizers.Nadam advances its u_product schedule per traced variable (a Python counter), "
                "which PS-side copies cannot reproduce. Use tf.keras.optimizers.legacy.Nadam (the same algorithm, "
                "exact under kparallax) or architecture='allreduce'.")
    return None


def row_coupled_reason(optimizer):
    """Why ``optimizer``'s update of a table reads across the table's rows, or None (each row's update depends on
    that row's gradient and state only, so a table split into row shards, each with its own clone, trains as one).

    Keras 2.15's ``tf.keras.optimizers.Adafactor`` scales every update by statistics of the whole variable: its RMS,
    the mean of its rows' factored second moments, the RMS of the update (seen on a table in 3 shards: 58% of the
    elements off one process after 2 epochs, by up to 0.04).
    """
    if isinstance(optimizer, getattr(tf.keras.optimizers, "Adafactor", ())):
        return ("tf.keras.optimizers.Adafactor scales each update by statistics of the whole variable (its RMS, the "
                "mean of its rows' second moments, the update's RMS), which each shard would compute over its own "
                "rows only.")
    return None


def global_clipnorm(optimizer):
    return getattr(optimizer, "global_clipnorm", None)


def build_optimizer(optimizer, var_list):
    """Creates an optimizer's slot variables for ``var_list`` now (private ``_create_all_weights`` for legacy)."""
    if optimizer_family(optimizer) == "new":
        optimizer.build(var_list)
    else:
        optimizer._create_all_weights(var_list)  # pylint: disable=protected-access


def skip_steps_together(optimizer, any_worker_overflowed):
    """Makes the dynamic ``LossScaleOptimizer`` ``optimizer`` skip a step when any worker's gradients are not
    finite, not only its own: ``any_worker_overflowed(flag)`` (a bool tensor, this worker's) is the same on every
    worker. Keras decides from gradients it expects aggregated over replicas already; kparallax averages them
    after that decision, inside the step. One process skips when its global batch's gradients overflow, which they
    do when any worker's part of them does. Keras 2.11-2.15 (either family): the decision is made by the private
    ``_loss_scale.update(grads)``, which reads only whether ``grads`` are all finite; it is given one value that
    is, or is not. A fixed loss scale never skips and is left as it is. Idempotent."""
    state = getattr(optimizer, "_loss_scale", None)  # pylint: disable=protected-access
    if not optimizer.dynamic or state is None or "update" in state.__dict__:
        return
    decide = type(state).update

    def update(grads):
        values = [g.values if isinstance(g, tf.IndexedSlices) else g for g in tf.nest.flatten(grads) if g is not None]
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in values]) if values else tf.constant(True)
        overflowed = any_worker_overflowed(tf.logical_not(finite))
        return decide(state, [tf.where(overflowed, float("nan"), 0.0)])

    state.__dict__["update"] = update


def copy_loss_scale(source, target):
    """Gives the ``LossScaleOptimizer`` ``target`` the current loss scale and growth counter of ``source`` (the
    scale's variable is the private ``_loss_scale.current_loss_scale`` in Keras 2.11-2.15, either family)."""
    if source.dynamic:
        target._loss_scale.current_loss_scale.assign(source.loss_scale)  # pylint: disable=protected-access
        target.dynamic_counter.assign(source.dynamic_counter)


def holds_slots(optimizer, variable):
    """Whether ``optimizer`` (a ``LossScaleOptimizer``: its inner one) has slot variables for ``variable``: it was
    built over it and keeps state per variable (private ``_index_dict`` of Keras 2.11+ optimizers, keyed by
    ``_var_key``; ``_slots`` of legacy ones, keyed by ``optimizer_v2._var_key``)."""
    # pylint: disable=protected-access
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    if optimizer_family(optimizer) == "new":
        return optimizer._var_key(variable) in getattr(optimizer, "_index_dict", {}) and len(optimizer.variables) > 1
    optimizer_v2 = internal("optimizers.legacy.optimizer_v2")
    return bool(getattr(optimizer, "_slots", {}).get(optimizer_v2._var_key(variable)))


def optimizer_variables(optimizer):
    """The optimizer's own variables (iterations, slots, ...) in creation order, for either family."""
    if optimizer_family(optimizer) == "new":
        return list(optimizer.variables)
    return list(optimizer.weights)


def create_learning_rate(optimizer):
    """Creates a legacy optimizer's hyper-parameter variables now (private ``_create_hypers``; Keras 2.11+
    optimizers create theirs in ``__init__``), under the caller's device scope: call it outside the PS's."""
    if optimizer_family(optimizer) == "legacy":
        _ = optimizer.iterations  # first, as ``_create_all_weights`` does: optimizer.weights keep Keras' order
        optimizer._create_hypers()  # pylint: disable=protected-access


def share_learning_rate(clone, source):
    """Makes ``clone`` read ``source``'s learning-rate variable, so callbacks that assign a new rate to the
    optimizer Keras trains with (``ReduceLROnPlateau``, ``LearningRateScheduler``) reach the PS-side clones.
    Keras 2.11+ optimizers: the private ``_learning_rate``; legacy ones: the ``learning_rate`` hyper-parameter
    (``source``'s must exist: ``create_learning_rate``). Rates given as a schedule are cloned and follow the step.
    Returns whether it was shared."""
    if optimizer_family(clone) != optimizer_family(source):
        return False
    rate = _get_rate(source)
    if not isinstance(rate, tf.Variable):
        return False
    if optimizer_family(clone) == "new":
        clone._learning_rate = rate  # pylint: disable=protected-access
    else:  # ``_set_hyper`` also tracks the variable, as the legacy optimizer's own hyper-parameters are
        clone._set_hyper("learning_rate", rate)  # pylint: disable=protected-access
    return True


def _get_rate(optimizer):
    """What ``optimizer`` reads as its learning rate when it builds an update: the private ``_learning_rate``
    (Keras 2.11+ optimizers) or the ``learning_rate`` hyper-parameter (legacy ones); None if it has none."""
    if optimizer_family(optimizer) == "new":
        return getattr(optimizer, "_learning_rate", None)
    return optimizer._hyper.get("learning_rate")  # pylint: disable=protected-access


def _put_rate(optimizer, value):
    """Replaces what ``_get_rate`` returns, without tracking (``learning_rate_value``)."""
    if optimizer_family(optimizer) == "new":
        optimizer._learning_rate = value  # pylint: disable=protected-access
    else:
        optimizer._hyper["learning_rate"] = value  # pylint: disable=protected-access


def shared_learning_rate(clone):
    """The learning-rate variable ``clone`` shares with the optimizer Keras trains with (``share_learning_rate``),
    or None (a schedule, or not shared)."""
    rate = _get_rate(clone)
    return rate if isinstance(rate, tf.Variable) else None


@contextlib.contextmanager
def learning_rate_value(clone, value):
    """While the caller traces an update by ``clone``, the clone's learning rate is the tensor ``value`` (a read of
    its ``shared_learning_rate`` made before) instead of that variable. With ``value`` None, nothing changes."""
    if value is None:
        yield
        return
    saved = _get_rate(clone)
    try:
        _put_rate(clone, value)
        yield
    finally:
        _put_rate(clone, saved)


class LayersOnStack(typing.NamedTuple):
    """The Keras layers whose methods are on the call stack when a variable is created (each the innermost, or None).

    Attributes:
      built: the layer whose ``build`` / ``add_weight`` is running.
      resetting: the layer whose ``reset_states`` is running: a stateful RNN (``LSTM``, ``GRU``, ``ConvLSTM2D``, ...
        with ``stateful=True``) makes its state variables there (``trainable`` by ``tf.Variable``'s default, though
        no optimizer trains them).
    """
    built: object
    resetting: object


def layers_on_stack(max_depth=40):
    """The ``LayersOnStack`` of the caller's call stack, found in one walk of its ``max_depth`` innermost frames."""
    built = resetting = None
    frame = sys._getframe(1)  # pylint: disable=protected-access
    depth = 0
    while frame is not None and depth < max_depth and (built is None or resetting is None):
        owner = frame.f_locals.get("self")
        if isinstance(owner, Layer):
            name = frame.f_code.co_name
            if built is None and name in ("build", "add_weight"):
                built = owner
            elif resetting is None and name == "reset_states":
                resetting = owner
        frame = frame.f_back
        depth += 1
    return LayersOnStack(built, resetting)


def keras_loader_on_stack(max_depth=200):
    """``"tf.keras.models.load_model"`` if Keras' model loader (any format) is on the call stack, else None."""
    frame = sys._getframe(1)  # pylint: disable=protected-access
    depth = 0
    while frame is not None and depth < max_depth:
        path = frame.f_code.co_filename.replace("\\", "/")
        if frame.f_code.co_name == "load_model" and "/saving/" in path and "keras" in path:
            return "tf.keras.models.load_model"
        frame = frame.f_back
        depth += 1
    return None


def train_validation_split(arrays, validation_split):
    """Keras' own split of (x, y, sample_weight) into training and the last ``validation_split`` fraction."""
    data_adapter = internal("engine.data_adapter")
    return data_adapter.train_validation_split(arrays, validation_split=validation_split)


def progbar_logger():
    return tf.keras.callbacks.ProgbarLogger(count_mode="steps")


def reset_train_function(model):
    """Makes ``Model.fit`` retrace its train step now, and the test and predict functions at their next use (after
    a layer's variables were replaced during ``fit``: every function traced before holds the old variables' handles,
    as a validation's test function traced while a partition search tried another shard count)."""
    reset_traced_functions(model)
    model.train_function = model.make_train_function(force=True)


class _InitialCounters:
    """What ``Model.fit`` asks ``model._training_state`` for (Keras 2.11-2.15, tf-keras 2.16-2.18): the epoch and
    the step within it to start at. ``BackupAndRestore`` installs Keras' own ``WorkerTrainingState`` there."""

    def __init__(self, epoch, step):
        self._epoch, self._step = epoch, step

    def maybe_load_initial_counters_from_ckpt(self, steps_per_epoch, initial_epoch, mode=None):
        del steps_per_epoch, initial_epoch, mode
        return self._epoch, self._step


def set_initial_counters(model, epoch, step=0):
    """Makes the next ``fit`` start at ``epoch`` and ``step`` within it (private ``_training_state``, read after
    ``on_train_begin``); ``epoch=None`` removes it. A ``BackupAndRestore`` callback's own state is left alone."""
    current = getattr(model, "_training_state", None)
    if epoch is None:
        if isinstance(current, _InitialCounters):
            model._training_state = None  # pylint: disable=protected-access
        return
    model._training_state = _InitialCounters(epoch, step)  # pylint: disable=protected-access


def steps_per_execution(model):
    """The model's current ``steps_per_execution`` (private ``_steps_per_execution`` variable; Keras' data
    handler lowers it for the last execution of an epoch)."""
    variable = getattr(model, "_steps_per_execution", None)
    return 1 if variable is None else int(variable.numpy())


def single_step_train_function(model, make_train_function):
    """Keras' train function of ``model`` traced for ONE step per call, whatever ``steps_per_execution`` is.

    Keras 2.15 chooses at trace time between one step per call and a ``tf.range`` loop of ``steps_per_execution``
    steps inside one ``tf.function`` (private ``_steps_per_execution`` variable). Inside that loop, the next
    iteration may start before the previous iteration's remote PS update and barrier have finished (their ops
    are not loop-carried values): training silently diverged from the single process (1.2e-2 after 3 epochs).
    """
    variable = getattr(model, "_steps_per_execution", None)
    if variable is None:
        return make_train_function(model, force=True)
    saved = variable.numpy()
    variable.assign(1)
    try:
        return make_train_function(model, force=True)
    finally:
        variable.assign(saved)


def minimum_control_deps(outputs):
    """Keras' own choice of what ``_train_counter`` waits for after a step (private ``_minimum_control_deps``)."""
    keras_training = internal("engine.training")
    return keras_training._minimum_control_deps(outputs)  # pylint: disable=protected-access


def reset_traced_functions(model):
    """Makes ``model`` trace its train, test and predict functions again at their next use (after one of its
    variables moved to a PS task: the functions traced before hold the old variable's handle)."""
    model.train_function = None
    model.test_function = None
    model.predict_function = None


def layers_holding(model, variable):
    """The layers of ``model`` that list ``variable`` among their own weights (Keras' private weight lists, by
    object identity)."""
    return [layer for layer in model._flatten_layers()  # pylint: disable=protected-access
            if any(w is variable for w in getattr(layer, "_trainable_weights", []) + getattr(
                layer, "_non_trainable_weights", []))]


def replace_weights(model, old_shards, old_sharded, new_shards, new_sharded):
    """Points every layer of ``model`` holding ``old_shards`` at the new shards (after a re-partitioning, or for a
    save with the table whole): Keras' private weight lists are edited by object identity, and the layer's weight
    regularizers are rebound."""
    for layer in model._flatten_layers():  # pylint: disable=protected-access
        for attr in ("_trainable_weights", "_non_trainable_weights"):
            weights = getattr(layer, attr, None)
            if not weights:
                continue
            positions = [i for i, w in enumerate(weights) if any(w is s for s in old_shards)]
            if positions:
                weights[positions[0]:positions[-1] + 1] = new_shards
        for name, value in list(vars(layer).items()):
            if value is old_sharded:
                setattr(layer, name, new_sharded)
        _rebind_weight_regularizers(layer, old_shards, new_shards)


def _rebind_weight_regularizers(layer, old_shards, new_shards):
    """Points the weight-regularization losses ``add_weight`` gave ``layer`` for ``old_shards`` at ``new_shards``.
    Keras keeps one per shard of a split variable (a ``ShardedVariable`` is iterated) in the private
    ``_callable_losses``, as ``partial(_tag_callable, partial(_loss_for_variable, shard))``; the first old shard's
    becomes one per new shard, in its place, and the other old shards' are dropped."""
    losses = getattr(layer, "_callable_losses", None)
    if not losses:
        return
    rebound, done = [], False
    for loss in losses:
        inner = loss.args[0] if isinstance(loss, functools.partial) and len(loss.args) == 1 else None
        held = inner.args[0] if isinstance(inner, functools.partial) and len(inner.args) == 1 else None
        if held is None or not any(held is s for s in old_shards):
            rebound.append(loss)
        elif not done:
            rebound += [functools.partial(loss.func, functools.partial(inner.func, s)) for s in new_shards]
            done = True
    losses[:] = rebound


@contextlib.contextmanager
def worker_seed_generator(worker_index):
    """Inside: the Python generator Keras seeds its random layers' ``tf.random.Generator`` from (set by
    ``tf.keras.utils.set_random_seed``, the same on every worker) is a copy moved to a stream of this worker's own;
    the original is left as it was. No change for worker 0, or when no such generator is set."""
    backend = sys.modules[tf.keras.backend.clear_session.__module__]
    local = backend._SEED_GENERATOR  # pylint: disable=protected-access
    original = getattr(local, "generator", None)
    if original is None or worker_index == 0:
        yield
        return
    copy = random.Random()
    copy.setstate(original.getstate())
    local.generator = random.Random(copy.getrandbits(62) * 1_000_003 + worker_index)
    try:
        yield
    finally:
        local.generator = original



def backup_training_state(callback):
    """The ``WorkerTrainingState`` of a ``BackupAndRestore`` callback (its private ``_training_state``, made in its
    ``on_train_begin``)."""
    return callback._training_state  # pylint: disable=protected-access


def training_state_model(state):
    """The model a ``WorkerTrainingState`` backs up (its private ``_model``)."""
    return state._model  # pylint: disable=protected-access
