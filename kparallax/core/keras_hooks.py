"""Keras under a HybridStrategy: ``compile`` inside ``scope()`` binds the model's own methods.

Process-wide, ``tf.keras.Model.compile`` is wrapped (``install()``, once): outside any scope it calls Keras
unchanged (in a multi-worker job, that model's ``fit`` and ``train_on_batch`` are refused: each worker would train
alone). So are ``Model.get_weights``/``set_weights`` and Keras' savers, for models not compiled under the strategy
that hold its variables (``layer_weights``). Compiled inside a scope, the model gets its own ``fit``,
``train_on_batch``, ``evaluate``, ``predict`` (``fitting``), ``make_train_function`` and ``train_step``
(``train_function``), ``get_weights``/``set_weights`` (``layer_weights``) and the savers of ``saving.py``: instance
attributes bound to this model; every other model keeps Keras' methods. ``compile`` wraps the optimizer
(``kparallax.step``); ``jit_compile=True`` is refused.
"""

import functools
import inspect
import os
import re

from kparallax._compat import keras as keras_compat
from kparallax._compat import optimizers as optimizer_compat
from kparallax.core import fitting
from kparallax.core import layer_weights
from kparallax.core import model_state
from kparallax.core import placement
from kparallax.core import saving
from kparallax.core import train_function
from kparallax.step import batch_norm
from kparallax.step import collectives
from kparallax.step import global_losses
from kparallax.step import train_step

_ORIGINAL_COMPILE = []
_BOUND = ("fit", "train_on_batch", "evaluate", "predict", "get_weights", "set_weights", "make_train_function",
          "train_step", "save", "save_weights", "export", "load_weights")


def install(strategy):
    """Remembers ``strategy`` and wraps ``tf.keras.Model.compile`` once (idempotent)."""
    model_state.STRATEGIES.add(strategy)
    if _ORIGINAL_COMPILE:
        return
    original = keras_compat.Model.compile
    _ORIGINAL_COMPILE.append(original)

    @functools.wraps(original)
    def compile(self, *args, **kwargs):  # pylint: disable=redefined-builtin
        return _compile(self, *args, **kwargs)

    keras_compat.Model.compile = compile
    for name, whole in (("get_weights", layer_weights.get_weights), ("set_weights", layer_weights.set_weights)):
        setattr(keras_compat.Model, name, layer_weights.whole_tables_before_compile(getattr(keras_compat.Model, name), whole))
    for name in ("save", "save_weights", "export", "load_weights"):
        setattr(keras_compat.Model, name, layer_weights.saved_whole_uncompiled(getattr(keras_compat.Model, name)))
    for base in (keras_compat.NewOptimizer, keras_compat.LegacyOptimizer):
        base.apply_gradients = _only_owned_optimizers_in_jobs(base.apply_gradients)
    batch_norm.install()


def _only_owned_optimizers_in_jobs(original):
    """``apply_gradients`` of Keras' optimizer base classes. In a model's synchronous training step, an optimizer
    kparallax did not make (a second optimizer of a custom ``train_step``, as a GAN has) gets its gradients averaged
    over the workers like the compiled one's (replicated variables only). Elsewhere, in a job of several workers, it
    is refused, as it would update each worker's copy alone: in an asynchronous step with its own message, outside
    a model's step as a custom training loop. (The compiled one refuses a loop in its own ``apply_gradients``,
    ``train_step._RoutingMixin``.)"""

    @functools.wraps(original)
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        if optimizer_compat.is_owned(self):
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
        jobs = [s.num_workers for s in list(model_state.STRATEGIES) if s.num_workers > 1]
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


def _unbind(model):
    model.__dict__.pop(model_state.STATE, None)
    for name in _BOUND:
        model.__dict__.pop(name, None)


def _compile(model, *args, **kwargs):
    original = _ORIGINAL_COMPILE[0]
    strategy = model_state.current_strategy()
    if strategy is None:
        owners = [s for s in list(model_state.STRATEGIES)
                  if keras_compat.weights_created(model) and any(s.is_ps_variable(v) for v in model.weights)]
        if owners:
            raise ValueError(
                f"Model {model.name!r} holds variables on PS tasks (created inside HybridStrategy.scope()) but is "
                "compiled outside the scope: it would train without the other workers. Received: compile() outside "
                "the scope. Call compile inside `with strategy.scope():`.")
        _unbind(model)
        jobs = [s for s in list(model_state.STRATEGIES) if s.num_workers > 1]
        if jobs:
            for name in ("fit", "train_on_batch"):
                model_state.bind_method(model, name, _refuse_training, jobs[0].num_workers, name)
        return original(model, *args, **kwargs)
    bound = inspect.signature(original).bind(model, *args, **kwargs)
    bound.apply_defaults()
    if bound.arguments.get("jit_compile"):
        raise ValueError("jit_compile=True is not supported under HybridStrategy (XLA cannot compile the remote "
                         "PS ops of a training step). Received: jit_compile=True. Leave it unset or False.")
    model_state.check_fixed_steps_per_execution(strategy, bound.arguments.get("steps_per_execution") == "auto",
                                     "steps_per_execution='auto'")
    if strategy.options.sync and strategy.num_workers > 1:
        batch_norm.check(model, strategy.num_workers)
    listed = optimizer_compat.optimizer_list(bound.arguments["optimizer"])
    if listed is not None:
        _check_optimizer_list(strategy, model, listed)
    optimizer, step, clones = strategy.make_optimizer(bound.arguments["optimizer"] if listed is None else listed[-1])
    bound.arguments["optimizer"] = (optimizer if listed is None else
                                   (tuple if isinstance(listed, tuple) else list)([*listed[:-1], optimizer]))
    model_state.guard_tracking(strategy, model, optimizer)
    _unbind(model)
    model.__dict__[model_state.STATE] = model_state.Compiled(strategy, step, clones)
    bind, keras_own = model_state.bind_method, model_state.original_method
    bind(model, "fit", fitting.fit, keras_own(model, "fit"))
    bind(model, "train_on_batch", fitting.train_on_batch, keras_own(model, "train_on_batch"))
    for name in ("evaluate", "predict"):
        bind(model, name, fitting.run_quietly_on_workers, keras_own(model, name))
    bind(model, "get_weights", layer_weights.get_weights, strategy)
    bind(model, "set_weights", layer_weights.set_weights, strategy)
    bind(model, "make_train_function", train_function.make_train_function, keras_own(model, "make_train_function"))
    bind(model, "train_step", train_function.train_step_synchronous if strategy.options.sync
         else train_function.train_step_asynchronous, keras_own(model, "train_step"))
    bind(model, "save", saving.save_with_optimizer, keras_own(model, "save"), strategy, clones)
    bind(model, "save_weights", saving.save_weights, keras_own(model, "save_weights"), strategy, clones)
    bind(model, "export", saving.save, keras_own(model, "export"), strategy)
    bind(model, "load_weights", _load_weights, keras_own(model, "load_weights"), strategy, clones)
    result = original(*bound.args, **bound.kwargs)
    if strategy.options.sync:
        global_losses.install(model)
    if optimizer_compat.is_loss_scale_optimizer(model.optimizer):  # also async: replicated gradients are allreduced
        optimizer_compat.skip_steps_together(model.optimizer, functools.partial(
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
    if any(optimizer_compat.is_loss_scale_optimizer(o) for o in optimizers) or model.dtype_policy.name == "mixed_float16":
        raise ValueError(
            "A list of optimizers with loss scaling (the mixed_float16 policy, or a LossScaleOptimizer in the list) "
            f"is not supported under HybridStrategy. Received: optimizer={names} for model {model.name!r} with "
            f"policy {model.dtype_policy.name!r}. Pass one optimizer, or train this model in float32 "
            "(or mixed_bfloat16, which needs no loss scale).")


def _refuse_training(workers, method, model, *args, **kwargs):
    raise ValueError(
        f"Model {model.name!r} was compiled outside HybridStrategy.scope() in a job of {workers} workers: each "
        f"worker would train its own copy alone. Received: {method}() of a model compiled outside the scope. Build "
        "and compile it inside `with strategy.scope():` (evaluate and predict work either way).")


def _load_weights(original, strategy, clones, model, *args, **kwargs):
    model_state.note_ps_write(strategy, model, "load_weights")
    result = saving.load_weights(original, strategy, clones, model, *args, **kwargs)
    model_state.weights_set(model)
    return result
