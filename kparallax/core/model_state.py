"""What a model compiled under a strategy carries, and which strategy's scope is active.

``Compiled`` is the record ``compile`` leaves on a model (its strategy, step, PS-side clones and the state of its
``fit`` / ``train_on_batch``); the other functions are the small pieces every Keras hook shares: binding a method to
one model instance, Keras' own method of a class, the guard against savers that reach the routing optimizer.
"""

import contextlib
import dataclasses
import functools
import threading
import types
import weakref

import tensorflow as tf

from kparallax._compat import keras as keras_compat
from kparallax.core import ps_writes
from kparallax.core import saving

_LOCAL = threading.local()


STRATEGIES = weakref.WeakSet()


STATE = "_kparallax_compiled"


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
    return model.__dict__.get(STATE)


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


def bind_method(obj, name, function, *extra):
    if extra:
        function = functools.partial(function, *extra)
        function.__name__ = function.__qualname__ = name  # AutoGraph reads it (a user's tf.function calling it)
    obj.__dict__[name] = types.MethodType(function, obj)


def original_method(obj, name):
    """Keras' own ``name`` of ``obj``'s class (unbound)."""
    return getattr(type(obj), name)


def guard_tracking(strategy, model, optimizer):
    """A model with PS variables: checkpoints and SavedModels that reach its routing optimizer outside kparallax's
    savers are refused (``saving.refuse_direct_tracking``)."""
    if keras_compat.weights_created(model) and any(strategy.is_ps_variable(v) for v in model.trainable_variables):
        routing = getattr(optimizer, "inner_optimizer", optimizer)
        routing.__dict__["_kp_tracking_check"] = saving.refuse_direct_tracking


def note_ps_write(strategy, layer, method):
    """``layer``'s ``method`` writes its PS variables (worker 0 alone): refused in ``fit`` where the workers do not
    meet next (``ps_writes.note``)."""
    if strategy.num_workers > 1 and keras_compat.weights_created(layer) and any(
            strategy.is_ps_variable(v) for v in layer.weights if isinstance(v, tf.Variable)):
        ps_writes.note(strategy, f"{method} of {layer.name!r}")


def weights_set(model):
    """The model's weights were set or loaded on this worker: ``train_on_batch`` broadcasts worker 0's again."""
    state = compiled(model)
    if state is not None:
        state.on_batch_synced = False


def check_fixed_steps_per_execution(strategy, autotuned, received):
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
