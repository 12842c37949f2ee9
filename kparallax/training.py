"""Model.compile / fit / evaluate / predict under a HybridStrategy.

``install()`` wraps these four ``tf.keras.Model`` methods once. A model compiled inside ``strategy.scope()``
remembers its strategy; for every other model the wrappers call Keras unchanged.

Under a strategy:
  * ``compile`` wraps the optimizer (``kparallax.optimizer``); ``jit_compile=True`` is refused.
  * ``fit`` shards the training data per worker (``kparallax.data``), runs inside the strategy's scope, adds the
    callbacks that synchronize replicated weights at the start and average logged metrics over workers, and
    shows the progress bar on worker 0 only. ``validation_split`` takes the last fraction of the full arrays.
  * ``Layer.get_weights`` / ``set_weights`` (and so the Model's) present a partitioned table whole.
  * ``evaluate`` / ``predict`` (and ``fit``'s validation) run on the full input on every worker, so their
    results are exact and identical everywhere; only worker 0 prints.
"""

import contextlib
import functools
import inspect
import os
import re
import threading

import tensorflow as tf

from kparallax import _compat
from kparallax import callbacks as kp_callbacks
from kparallax import data as data_lib
from kparallax import partition
from kparallax import partition_search

_LOCAL = threading.local()
_ORIGINAL = {}
_ATTR = "_kparallax_strategy"


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


def _bind(name, model, args, kwargs):
    bound = inspect.signature(_ORIGINAL[name]).bind(model, *args, **kwargs)
    bound.apply_defaults()
    return bound


def _call(name, bound):
    return _ORIGINAL[name](*bound.args, **bound.kwargs)


def _compile(model, *args, **kwargs):
    strategy = current_strategy()
    if strategy is None:
        model.__dict__.pop(_ATTR, None)
        return _ORIGINAL["compile"](model, *args, **kwargs)
    bound = _bind("compile", model, args, kwargs)
    if bound.arguments.get("jit_compile"):
        raise ValueError("jit_compile=True is not supported under HybridStrategy (XLA cannot compile the remote "
                         "PS ops of a training step). Received: jit_compile=True. Leave it unset or False.")
    bound.arguments["optimizer"] = strategy.make_optimizer(bound.arguments["optimizer"])
    model.__dict__[_ATTR] = strategy
    return _call("compile", bound)


def _fit(model, *args, **kwargs):
    strategy = model.__dict__.get(_ATTR)
    if strategy is None:
        return _ORIGINAL["fit"](model, *args, **kwargs)
    bound = _bind("fit", model, args, kwargs)
    a = bound.arguments
    n, index = strategy.num_workers, strategy.worker_index
    data_lib.check_supported(a["x"])
    if data_lib.is_per_worker(a["x"]):
        _check_same_steps(strategy, data_lib.local_steps(a["x"], a["steps_per_epoch"]))
    elif data_lib.is_dataset(a["x"]):
        a["x"] = data_lib.shard_dataset(a["x"], n, index, a["steps_per_epoch"])
    else:
        arrays = (a["x"], a["y"], a["sample_weight"])
        if a["validation_split"] and a["validation_data"] is None:
            arrays, a["validation_data"] = _compat.train_validation_split(arrays, a["validation_split"])
            a["validation_split"] = 0.0
        a["x"], a["y"], a["sample_weight"] = data_lib.shard_arrays(arrays, n, index)
    user_callbacks = list(a["callbacks"] or [])
    ours = [kp_callbacks.SyncReplicatedVariables(strategy), kp_callbacks.AverageMetrics(strategy)]
    if strategy.partitioned_tables and not strategy.partition_search["done"]:
        ours.insert(1, partition_search.PartitionSearch(strategy))
    log_dir = os.environ.get("KPARALLAX_LOG_DIR")
    if log_dir and strategy.num_workers > 1:
        ours.append(kp_callbacks.ProgressFile(log_dir, strategy.worker_index))
    if not strategy.is_chief:
        a["verbose"] = 0
    elif a["verbose"] != 0:
        ours.append(_compat.progbar_logger())
    a["callbacks"] = ours + user_callbacks
    with strategy.scope():
        try:
            return _call("fit", bound)
        except _compat.InvalidArgumentError as e:
            raise _explained(e) from None


_OUT_OF_RANGE = re.compile(r"indices\[[0-9,]+\] = (-?[0-9]+) is not in \[0, ([0-9]+)\)")


def _explained(error):
    """TensorFlow's CPU gather error for an id outside a table, said plainly (other errors unchanged)."""
    match = _OUT_OF_RANGE.search(str(error))
    if not match:
        return error
    return ValueError(f"The input holds id {match.group(1)}, outside an embedding table (or table shard) of "
                      f"{match.group(2)} rows: ids must be in [0, vocabulary size). Check the data against the "
                      f"vocabulary (or raise the Embedding's input_dim). Received: id={match.group(1)}.")


def _check_same_steps(strategy, steps):
    if strategy.num_workers == 1:
        return
    from kparallax import allreduce  # pylint: disable=import-outside-toplevel
    counts = [row[0] for row in allreduce.allgather_ints([steps], name="kp_steps_per_epoch")]
    if len(set(counts)) != 1:
        raise ValueError(f"Every worker must run the same number of steps per epoch, or the collectives hang. "
                         f"Received: steps per worker {counts}. Pass steps_per_epoch=min(...) (for example "
                         f"{min(counts)}) and repeat the dataset.")


def _run_quietly_on_workers(name, model, *args, **kwargs):
    strategy = model.__dict__.get(_ATTR)
    if strategy is None:
        return _ORIGINAL[name](model, *args, **kwargs)
    bound = _bind(name, model, args, kwargs)
    if not strategy.is_chief:
        bound.arguments["verbose"] = 0
    with strategy.scope():
        return _call(name, bound)


def _get_weights(layer):
    values = _ORIGINAL["get_weights"](layer)
    variables = layer.weights
    if len(variables) != len(values) or not any(partition.table_of(v) for v in variables):
        return values
    return partition.merge_weights(variables, values)


def _set_weights(layer, weights):
    """Whole tables are split over their shards; under a strategy, only worker 0 writes PS variables (one shared
    copy: the others' writes would race with worker 0's later ones, e.g. a checkpoint restore)."""
    variables = layer.weights
    weights = list(weights)
    if any(partition.table_of(v) for v in variables) and len(weights) == partition.whole_weight_count(variables):
        weights = partition.split_weights(variables, weights)
    strategy = layer.__dict__.get(_ATTR) or current_strategy()
    if strategy is None or strategy.is_chief or len(weights) != len(variables):
        return _ORIGINAL["set_weights"](layer, weights)
    pairs = []
    for variable, value in zip(variables, weights):
        if tuple(variable.shape) != tuple(getattr(value, "shape", ())):
            raise ValueError(f"Layer {layer.name} weight {variable.name} has shape {tuple(variable.shape)}; the "
                             f"value given has shape {getattr(value, 'shape', None)}. Received: a mismatched list.")
        if not strategy.is_ps_variable(variable):
            pairs.append((variable, value))
    tf.keras.backend.batch_set_value(pairs)
    return None


def install():
    """Wraps tf.keras.Model.compile/fit/evaluate/predict and Layer.get/set_weights once (idempotent)."""
    if _ORIGINAL:
        return
    for name, replacement in (("get_weights", _get_weights), ("set_weights", _set_weights)):
        original = getattr(_compat.KerasLayer, name)
        _ORIGINAL[name] = original

        @functools.wraps(original)
        def layer_method(self, *args, _replacement=replacement, **kwargs):
            return _replacement(self, *args, **kwargs)

        setattr(_compat.KerasLayer, name, layer_method)
    model_cls = _compat.KerasModel
    replacements = {
        "compile": _compile,
        "fit": _fit,
        "evaluate": functools.partial(_run_quietly_on_workers, "evaluate"),
        "predict": functools.partial(_run_quietly_on_workers, "predict"),
    }
    for name, replacement in replacements.items():
        original = getattr(model_cls, name)
        _ORIGINAL[name] = original

        @functools.wraps(original)
        def method(self, *args, _replacement=replacement, **kwargs):
            return _replacement(self, *args, **kwargs)

        setattr(model_cls, name, method)
