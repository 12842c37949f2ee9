"""Keras 2 internals (Keras 2.15 as ``tf.keras``; the same code paths exist in tf-keras 2.16+). Optimizers:
``optimizers.py``.

- Keras 3 is refused at import: Horovod 0.28.1's Keras wrappers stop allreducing there.
- The layer that creates a variable is found on the call stack (``build`` / ``add_weight`` frames): Keras passes no
  layer to variable creators.
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
