"""``get_weights`` / ``set_weights`` of models and layers holding PS variables: partitioned tables presented whole,
PS variables written by worker 0 only; and Keras' savers of a model holding PS variables that was not compiled under
the strategy (the tower of a two-tower model), which write tables whole as a compiled model's do (``saving``).
"""

import contextlib
import functools
import threading

import tensorflow as tf

from kparallax._compat import keras as keras_compat
from kparallax._compat import tf as tf_compat
from kparallax.core import model_state
from kparallax.core import ps_writes
from kparallax.core import saving
from kparallax.core import tables

_LOCAL = threading.local()  # in_weights: inside ``keras_weights``


def whole_tables_before_compile(original, whole):
    """``Model.get_weights``/``set_weights`` presenting partitioned tables whole (``whole``) for a model holding one
    (compiled models have their own bound methods); Keras' ``original`` otherwise, and inside ``whole`` itself."""

    @ps_writes.passing
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        if not getattr(_LOCAL, "in_weights", False):
            strategy = owning_strategy(self, lambda s, v: s.registry.table_of(v))
            if strategy is not None:
                return whole(strategy, self, *args, **kwargs)
        return original(self, *args, **kwargs)
    return method


def saved_whole_uncompiled(original):
    """``Model.save`` / ``save_weights`` / ``export`` / ``load_weights`` of a model holding PS variables that was
    not compiled under a strategy (compiled models have their own bound methods): the tower of a two-tower model,
    a model built from trained layers to serve. They act as a compiled model's do (``saving``): partitioned tables
    written and read whole, files written by worker 0 only."""
    loads = original.__name__ == "load_weights"

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        strategy = owning_strategy(self, lambda s, v: s.is_ps_variable(v))
        if strategy is None:
            return original(self, *args, **kwargs)
        if loads:
            return saving.load_weights(original, strategy, None, self, *args, **kwargs)
        return saving.save(original, strategy, self, *args, **kwargs)
    return method


def owning_strategy(model, owns):
    """The strategy one of whose variables (``owns(strategy, variable)``) ``model`` holds, or None. A model whose
    weights are not all created yet holds none: Keras may still build it (a premade model's parts) or restore into
    it later (a deferred ``load_weights``), and listing its weights would raise."""
    weights = keras_compat.created_weights(model) if model_state.STRATEGIES else None
    if weights is None:
        return None
    return next((s for s in list(model_state.STRATEGIES) if any(owns(s, v) for v in weights)), None)


@contextlib.contextmanager
def keras_weights():
    """Inside, ``Model.get_weights``/``set_weights`` are Keras' own (the shards as weights)."""
    before = getattr(_LOCAL, "in_weights", False)
    _LOCAL.in_weights = True
    try:
        yield
    finally:
        _LOCAL.in_weights = before


def bind_layer(layer, strategy):
    """Gives ``layer`` (which holds a PS variable of ``strategy``) its own ``get_weights``/``set_weights``."""
    if "get_weights" not in layer.__dict__:
        model_state.bind_method(layer, "get_weights", get_weights, strategy)
        model_state.bind_method(layer, "set_weights", set_weights, strategy)


def get_weights(strategy, layer):
    with keras_weights():
        values = model_state.original_method(layer, "get_weights")(layer)
    slots = keras_compat.weight_values(layer.weights)
    table_of = strategy.registry.table_of
    if len(slots) != len(values) or not any(table_of(v) for v in slots):
        return values
    return tables.merge_weights(slots, values, table_of)


def set_weights(strategy, layer, weights):
    """Whole tables are split over their shards; only worker 0 writes PS variables (one shared copy: the others'
    writes would race with worker 0's later ones, e.g. a checkpoint restore). Every worker sets its own replicated
    variables and what Keras sets through a handler (a lookup layer's vocabulary), as Keras' ``set_weights`` does."""
    params = layer.weights
    slots = keras_compat.weight_values(params)
    weights = list(weights)
    table_of = strategy.registry.table_of
    if any(table_of(v) for v in slots) and len(weights) == tables.whole_weight_count(slots, table_of):
        weights = tables.split_weights(slots, weights, table_of)
    model_state.note_ps_write(strategy, layer, "set_weights")
    model_state.weights_set(layer)
    if strategy.is_chief or len(weights) != len(slots):
        with keras_weights():
            result = model_state.original_method(layer, "set_weights")(layer, weights)
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
