"""``strategy.load_model``: a model saved by Keras (by one process or by kparallax) goes on training in a job.

Keras' ``load_model`` inside the scope cannot do this: it writes each saved weight into the variable of the same
position, but a partitioned table has several shards, and it loads the optimizer state into the optimizer Keras
trains with, while the state of PS variables lives in the PS-side clones. So the file is loaded as one process
loads it (plain variables, Keras' own ``compile``), the model is rebuilt from its config inside the scope (Keras'
``deserialize_keras_object``: its build and compile configs included, so it is compiled by kparallax), and the
state is handed over: weights through ``set_weights`` (tables whole), the optimizer's through ``saved_optimizer``.
"""

import tensorflow as tf

from kparallax._compat import optimizers as optimizer_compat
from kparallax.core import model_state
from kparallax.core import saved_optimizer
from kparallax.core import saving
from kparallax.step import collectives


def load_model(strategy, filepath, custom_objects=None, compile=True):  # pylint: disable=redefined-builtin
    """Loads a Keras model file (``.keras``, ``.h5``, SavedModel) for training under ``strategy``; see
    ``HybridStrategy.load_model``."""
    # Every worker calls this; worker 0 may have just saved the file (``model.save`` writes on worker 0 only and
    # returns at once on the others): nobody reads it before that save returned.
    collectives.eager_barrier(strategy.num_workers, name="kp_model_loading")
    with model_state.outside_scopes(), saving.plain_variables():
        plain = tf.keras.models.load_model(filepath, custom_objects=custom_objects, compile=compile)
        try:
            config = tf.keras.saving.serialize_keras_object(plain)
        except (NotImplementedError, TypeError, ValueError) as error:
            raise ValueError(
                f"strategy.load_model needs a model Keras can rebuild from its config. Received: {filepath!r}, whose "
                f"model {plain.name!r} ({type(plain).__name__}) gives no config ({error}). Build the model inside "
                "the scope, compile it, and load the weights with model.load_weights.") from error
    _inner_optimizer_in_compile_config(config)
    with strategy.scope():
        model = tf.keras.saving.deserialize_keras_object(config, custom_objects=custom_objects)
    if len(model.weights) == 0 and plain.weights:
        raise ValueError(
            f"strategy.load_model could not build the model of {filepath!r} from its config (no build config). "
            f"Received: a {type(model).__name__} without weights. Build it inside the scope and use load_weights.")
    model.set_weights(plain.get_weights())
    compiled = model_state.compiled(model)
    listed = optimizer_compat.optimizer_list(plain.optimizer)
    # Keras 2.15's .keras loader restores no state into a list of optimizers: then both start fresh.
    fresh_list = listed is not None and not any(int(o.iterations.numpy()) for o in listed)
    if compiled is not None and plain.optimizer is not None and not fresh_list:
        saving.refuse_optimizer_list(model, f"strategy.load_model({filepath!r}) with the optimizer state",
                                     keras_savers=False)
        source = plain.optimizer
        inner = source.inner_optimizer if optimizer_compat.is_loss_scale_optimizer(source) else source
        optimizer_compat.build_optimizer(inner, plain.trainable_variables)  # idempotent; restores a SavedModel's state
        with saving.whole_state(strategy, model, compiled.clones, restore=True):
            saved_optimizer.copy_state(source, model.optimizer, filepath)  # here the plain optimizer
    collectives.eager_barrier(strategy.num_workers, name="kp_model_loaded")
    return model


def _inner_optimizer_in_compile_config(config):
    """A model loaded from ``.h5`` / SavedModel under mixed precision lists Keras' ``LossScaleOptimizer`` in its
    compile config; kparallax compiles with the inner optimizer and Keras wraps it again (the model's policy is
    ``mixed_float16``), as when the model was first compiled. The loss scale is copied over afterwards."""
    compile_config = config.get("compile_config") or {}
    optimizer = compile_config.get("optimizer")
    if isinstance(optimizer, dict) and "LossScaleOptimizer" in str(optimizer.get("class_name", "")):
        compile_config["optimizer"] = optimizer["config"]["inner_optimizer"]
