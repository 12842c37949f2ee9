"""Keras 2 optimizers (Keras 2.15 as ``tf.keras``; tf-keras 2.16+ keeps the same code paths).

- Two optimizer families (``tf.keras.optimizers.*`` since 2.11, and ``tf.keras.optimizers.legacy.*``) build and
  list their variables differently, and clone from their configs with private state copied over (schedules,
  ``exclude_from_weight_decay``, a loss scale).
- An optimizer reads its learning rate from the private ``_learning_rate`` (2.11+) or its ``learning_rate``
  hyper-parameter (legacy) when an update is built: PS-side clones share the worker's variable there, and the
  synchronous PS path puts a tensor read once per step in its place (``learning_rate_value``).
"""

import contextlib

import tensorflow as tf

from kparallax._compat import keras as keras_compat


def optimizer_family(optimizer):
    """``"new"`` for Keras 2.11+ optimizers, ``"legacy"`` for ``tf.keras.optimizers.legacy``."""
    if isinstance(optimizer, keras_compat.LegacyOptimizer):
        return "legacy"
    if isinstance(optimizer, keras_compat.NewOptimizer):
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
    optimizer_v2 = keras_compat.internal("optimizers.legacy.optimizer_v2")
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
