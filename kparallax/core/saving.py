"""Keras' savers and loaders of a model compiled under a strategy: partitioned tables are written and read whole.

``model.save`` (``.keras``, ``.h5``, SavedModel), ``save_weights``, ``export`` and ``load_weights`` are bound per
model (``keras_hooks``) to these functions: for the duration of the call each partitioned table is one ordinary
local variable holding the whole table, so the files are what a plain process would write and load in a process
that has never imported kparallax. Only worker 0 writes files.
"""

import contextlib
import threading

import tensorflow as tf

from kparallax._compat import keras as keras_compat
from kparallax._compat import tf as tf_compat

_LOCAL = threading.local()


def plain_variables_active():
    """True while kparallax creates ordinary local variables inside a scope (whole tables for saving)."""
    return getattr(_LOCAL, "plain", False)


@contextlib.contextmanager
def _plain_variables():
    _LOCAL.plain = True
    try:
        yield
    finally:
        _LOCAL.plain = False


@contextlib.contextmanager
def _whole_tables(strategy, model):
    """Inside: each partitioned table of ``model`` is one ordinary local variable holding the whole table (read
    from its shards), so Keras' savers write -- and loaders read -- it whole, as a plain process has it."""
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
    with _plain_variables(), tf.init_scope():
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


def save(original, strategy, model, *args, **kwargs):
    """Keras' ``save`` / ``save_weights`` / ``export`` on worker 0 only (one writer), each table saved whole: the
    files load in a plain TensorFlow process, whatever the partitioning."""
    if not strategy.is_chief:
        return None
    with _whole_tables(strategy, model):
        return original(model, *args, **kwargs)


def load_weights(original, strategy, model, *args, **kwargs):
    """Keras' ``load_weights`` of a file holding whole tables; worker 0 writes them into the shards on the PS."""
    with _whole_tables(strategy, model) as swaps:
        result = original(model, *args, **kwargs)
        if strategy.is_chief:
            for table, whole in swaps:
                table.sharded.assign(whole.read_value())
    tf_compat.async_wait()
    return result
