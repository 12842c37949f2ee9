"""Keras' savers and loaders of a model compiled under a strategy: partitioned tables are written and read whole.

``model.save`` (``.keras``, ``.h5``, SavedModel), ``save_weights``, ``export`` and ``load_weights`` are bound per
model (``keras_hooks``) to these functions: for the duration of the call each partitioned table is one ordinary
local variable holding the whole table, so the files are what a plain process would write and load in a process
that has never imported kparallax. Only worker 0 writes files. A model holding PS variables that was not compiled
under the strategy (a two-tower model's tower) gets ``save`` and ``load_weights`` through Keras' ``Model`` class
(``layer_weights.saved_whole_uncompiled``): its own weights only, as plain Keras saves an uncompiled model.
"""

import contextlib
import os
import threading

import tensorflow as tf

from kparallax._compat import keras as keras_compat
from kparallax._compat import optimizers as optimizer_compat
from kparallax._compat import tf as tf_compat
from kparallax.core import saved_optimizer

_LOCAL = threading.local()


def plain_variables_active():
    """True while kparallax creates ordinary local variables inside a scope (whole tables for saving)."""
    return getattr(_LOCAL, "plain", False)


@contextlib.contextmanager
def plain_variables():
    previous = plain_variables_active()
    _LOCAL.plain = True
    try:
        yield
    finally:
        _LOCAL.plain = previous


def refuse_direct_tracking(optimizer, save_type):
    """Raises for a ``tf.train.Checkpoint`` reaching kparallax's routing ``optimizer`` directly (not through a saver
    or loader of this module): it would hold the optimizer Keras trains with but not the PS variables' slots (they
    live on the PS), and restoring it would leave them as they are. A SavedModel (``tf.saved_model.save``, a serving
    export) is let through: it needs the weights, not the training state."""
    if getattr(_LOCAL, "whole", 0) or "SAVEDMODEL" in str(save_type).upper():
        return
    raise ValueError(
        "A tf.train.Checkpoint that holds a model compiled under HybridStrategy would miss the optimizer state of its "
        "PS variables (it lives on the PS, not in model.optimizer). Received: a "
        f"{save_type} of {type(optimizer).__name__} {optimizer.name!r}. Use model.save_weights(path) / "
        "model.load_weights(path) (TensorFlow format, the whole state as one process has it), model.save, "
        "strategy.load_model, or kparallax.checkpoint.")


def refuse_optimizer_list(model, received, keras_savers=True):
    """Raises for ``received`` (what would save or load the optimizer state) of a model compiled with a list of
    optimizers. Keras' savers and loaders (``keras_savers``) take such a list where kparallax can tell the variables
    of the last one (``optimizer_compat.step_optimizer_variables``: Keras' ``WideDeepModel``'s): that one, which updates
    the PS variables, is written as one process has it, its slots joined from the PS; kparallax's own checkpoints and
    ``strategy.load_model``'s optimizer state never take a list. The weights save and load either way."""
    listed = optimizer_compat.optimizer_list(model.optimizer)
    if listed is None or (keras_savers and optimizer_compat.knows_listed_variables(model)):
        return
    names = [type(o).__name__ for o in listed]  # a routing optimizer has its class's name
    supported = ("Keras' savers support it for Keras' WideDeepModel only, whose train_step says which variables each "
                 "optimizer updates" if keras_savers else "Keras' savers support it for Keras' WideDeepModel "
                 "(model.save_weights(path) / load_weights in TensorFlow format, BackupAndRestore)")
    raise ValueError(
        f"Saving or loading the optimizer state of a model compiled with a list of optimizers: {supported}. "
        f"Received: {received} of model {model.name!r} ({type(model).__name__}), compiled with optimizer={names}. "
        "Save and load its weights alone (model.save(path, include_optimizer=False), "
        "model.save_weights('weights.h5'), model.export(path), strategy.load_model(path, compile=False)), or "
        "compile it with one optimizer.")


@contextlib.contextmanager
def whole_tables(strategy, model):
    """Inside: each partitioned table of ``model`` is one ordinary local variable holding the whole table (read
    from its shards), so Keras' savers write -- and loaders read -- it whole, as a plain process has it."""
    _LOCAL.whole = getattr(_LOCAL, "whole", 0) + 1
    try:
        with _whole_tables_swapped(strategy, model) as swaps:
            yield swaps
    finally:
        _LOCAL.whole -= 1


@contextlib.contextmanager
def _whole_tables_swapped(strategy, model):
    tables_seen, swaps = set(), []
    for variable in model.weights:
        owner = strategy.registry.table_of(variable)
        if owner is not None and id(owner[0]) not in tables_seen:
            tables_seen.add(id(owner[0]))
            swaps.append(owner[0])
    if not swaps:
        yield []
        return
    wholes = []
    with plain_variables(), tf.init_scope():
        for table in swaps:
            value = table.sharded.whole()
            wholes.append(tf.Variable(value, trainable=table.shards[0].trainable, name=table.path.split("/")[-1]))
    for table, whole in zip(swaps, wholes):
        keras_compat.replace_weights(model, table.shards, table.sharded, [whole], whole)
    try:
        yield list(zip(swaps, wholes))
    finally:
        for table, whole in zip(swaps, wholes):
            keras_compat.replace_weights(model, [whole], whole, table.shards, table.sharded)


@contextlib.contextmanager
def whole_state(strategy, model, clones, restore=False):
    """Inside: each partitioned table of ``model`` is one whole variable and ``model.optimizer`` is a plain optimizer
    holding the whole trained state (``saved_optimizer``: PS-side slots joined, in the order one process creates
    them), so Keras' savers write, and its loaders read, what one process would. Of a list of optimizers (Keras'
    ``WideDeepModel``'s), the last one is so replaced; the others are the user's own, saved and loaded as they are.

    ``restore=True``: on a normal exit, what a loader put there goes back: the optimizer state into the optimizer
    Keras trains with and (worker 0) the PS-side clones, the tables (worker 0) into their shards. Those remote eager
    writes are only dispatched: the caller waits for them (``load_weights``' ``async_wait``, or an
    ``eager_barrier``) before any step may read them.
    """
    refuse_optimizer_list(model, "a save or load of the whole training state")
    with whole_tables(strategy, model) as wholes:
        trained = model.optimizer
        listed = optimizer_compat.optimizer_list(trained)
        with plain_variables():  # the plain optimizer's slots are local, as in one process, even inside the scope
            if listed is None:
                model.optimizer, load_back = saved_optimizer.plain_optimizer(strategy, model, clones, wholes)
            else:  # the last one routes, the others are the user's own: Keras saves and loads them as they are
                plain, load_back = saved_optimizer.plain_optimizer(
                    strategy, model, clones, wholes, listed[-1], optimizer_compat.step_optimizer_variables(model))
                model.optimizer = [*listed[:-1], plain]
        try:
            yield
        finally:
            model.optimizer = trained
        if restore:
            with plain_variables():
                load_back()
            _write_tables(strategy, wholes)


def _write_tables(strategy, wholes):
    """Worker 0 writes each whole table a loader filled into its shards on the PS (one writer)."""
    if strategy.is_chief:
        for table, whole in wholes:
            table.sharded.assign(whole.read_value())


def save(original, strategy, model, *args, **kwargs):
    """Keras' ``export`` on worker 0 only (one writer), each table saved whole: the files load in a plain
    TensorFlow process, whatever the partitioning."""
    if not strategy.is_chief:
        return None
    with whole_tables(strategy, model):
        return original(model, *args, **kwargs)


def save_with_optimizer(original, strategy, clones, model, *args, **kwargs):
    """Keras' ``save`` / ``save_weights`` as ``save`` does; in addition, for the call, ``model.optimizer`` is a
    plain optimizer holding the whole trained state (``saved_optimizer``: PS-side slots joined, in the order one
    process creates them), so a plain process that loads the file resumes training where this one stands. Nothing
    is built with ``include_optimizer=False``."""
    if not strategy.is_chief:
        return None
    if model.optimizer is None or not kwargs.get("include_optimizer", True):
        return save(original, strategy, model, *args, **kwargs)
    with whole_state(strategy, model, clones):
        return original(model, *args, **kwargs)


def save_weights(original, strategy, clones, model, *args, **kwargs):
    """Keras' ``save_weights``: a TensorFlow-format checkpoint holds the optimizer too (``save_with_optimizer``),
    an ``.h5`` file only the weights (``save``)."""
    filepath = args[0] if args else kwargs.get("filepath")
    save_format = args[2] if len(args) > 2 else kwargs.get("save_format")
    if save_format in ("tf", "tensorflow") or (save_format is None and _is_tf_checkpoint(filepath)):
        return save_with_optimizer(original, strategy, clones, model, *args, **kwargs)
    return save(original, strategy, model, *args, **kwargs)


def load_weights(original, strategy, clones, model, *args, **kwargs):
    """Keras' ``load_weights`` of a file holding whole tables; worker 0 writes them into the shards on the PS.

    A TensorFlow-format checkpoint also holds the optimizer state (``save_weights`` writes it as one process
    would): for the call, ``model.optimizer`` is the plain optimizer ``save_with_optimizer`` would write, Keras
    restores into it, and its state goes back to the optimizer Keras trains with and (worker 0) the PS-side
    clones, so training goes on as one process's would after ``load_weights``. ``clones`` None: a model not compiled
    under the strategy, whose weights alone are read."""
    filepath = args[0] if args else kwargs.get("filepath")
    if clones is not None and model.optimizer is not None and _is_tf_checkpoint(filepath):
        with whole_state(strategy, model, clones, restore=True):
            result = original(model, *args, **kwargs)
    else:
        with whole_tables(strategy, model) as wholes:
            result = original(model, *args, **kwargs)
            _write_tables(strategy, wholes)
    tf_compat.async_wait()
    return result


def _is_tf_checkpoint(filepath):
    """Whether Keras' ``load_weights`` reads ``filepath`` as a TensorFlow checkpoint (not ``.h5`` / ``.keras``)."""
    if not isinstance(filepath, (str, os.PathLike)):
        return False
    return not str(filepath).endswith((".h5", ".hdf5", ".keras"))
