"""Every TensorFlow / Keras / Horovod version-specific detail kparallax relies on.

The pinned stack is tensorflow-cpu 2.15.1 (Keras 2.15 as ``tf.keras``) and horovod 0.28.1. Private API used by
kparallax is reached only through this module so that supporting another pin (for example TF 2.18 + tf-keras
with ``TF_USE_LEGACY_KERAS=1``) means editing one file.
"""

import os
import sys

import tensorflow as tf
from tensorflow.python.distribute import sharded_variable as _sharded
from tensorflow.python.eager import context as _context
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import gen_resource_variable_ops as _gen_rv
from tensorflow.python.ops import handle_data_util as _handle_data_util
from tensorflow.python.ops import resource_variable_ops as _rv

if hasattr(tf.keras, "__version__") and tf.keras.__version__.startswith("3."):
    raise ImportError(
        "kparallax needs Keras 2 (tf.keras from TensorFlow 2.15, or tf-keras with TF_USE_LEGACY_KERAS=1). "
        f"Received: tf.keras {tf.keras.__version__}. Horovod's Keras wrappers do not allreduce under Keras 3.")

InvalidArgumentError = tf.errors.InvalidArgumentError
KerasModel = tf.keras.Model
KerasLayer = tf.keras.layers.Layer
ShardedVariable = _sharded.ShardedVariable  # Keras lists its shards as the layer's weights
KerasEmbedding = tf.keras.layers.Embedding
NewOptimizer = tf.keras.optimizers.Optimizer
LegacyOptimizer = tf.keras.optimizers.legacy.Optimizer


def async_wait():
    """Blocks until every op this process dispatched (including remote PS ops) has run."""
    _context.async_wait()


def full_variable_name(name):
    """Returns the variable name TensorFlow would give ``name`` in the current name scope (no ``:0``)."""
    with _ops.name_scope(name or "Variable", skip_on_eager=False) as scope:
        return _ops.name_from_scope_name(scope)


def shared_variable(shared_name, container, shape, dtype, device, trainable, constraint=None, name=None):
    """Returns a ResourceVariable whose handle names a shared resource on ``device``.

    Every process that calls this with the same ``shared_name`` and ``container`` on the same PS device gets a
    handle to the same variable. The returned object has no deleter: dropping it never frees the shared resource.
    The variable is not initialized here.
    """
    shape = tf.TensorShape(shape)
    dtype = tf.as_dtype(dtype)
    with tf.device(device):
        handle = _gen_rv.var_handle_op(shape=shape, dtype=dtype, shared_name=shared_name,
                                       container=container, debug_name=shared_name)
    # Eager handles carry no shape information unless it is set by hand; Keras needs it.
    _rv._set_handle_shapes_and_types(  # pylint: disable=protected-access
        handle, _handle_data_util.create_handle_data(shape, dtype), graph_mode=False)
    return _rv.BaseResourceVariable(
        trainable=trainable, shape=shape, dtype=dtype, handle=handle, constraint=constraint,
        unique_id=f"{shared_name}_{_ops.uid()}", handle_name=name or shared_name, in_graph_mode=False)


def is_initialized(variable):
    return bool(_gen_rv.var_is_initialized_op(variable.handle).numpy())


def optimizer_family(optimizer):
    """Returns "new" for Keras 2.11+ optimizers and "legacy" for ``tf.keras.optimizers.legacy``."""
    if isinstance(optimizer, LegacyOptimizer):
        return "legacy"
    if isinstance(optimizer, NewOptimizer):
        return "new"
    raise TypeError(
        "kparallax supports tf.keras optimizers (tf.keras.optimizers.* or tf.keras.optimizers.legacy.*). "
        f"Received: {type(optimizer).__name__} from module {type(optimizer).__module__}.")


def clone_optimizer(optimizer):
    """Returns a fresh optimizer of the same class and hyper-parameters, never compiled with XLA.

    The clone applies updates on a PS device, where XLA compilation of a remote update is not wanted.
    """
    clone = type(optimizer).from_config(optimizer.get_config())
    if optimizer_family(clone) == "new":
        clone.jit_compile = False
    return clone


def global_clipnorm(optimizer):
    return getattr(optimizer, "global_clipnorm", None)


def embedding_being_built(max_depth=40):
    """Returns the Embedding layer whose ``build``/``add_weight`` is on the call stack, or None."""
    frame = sys._getframe(1)  # pylint: disable=protected-access
    depth = 0
    while frame is not None and depth < max_depth:
        owner = frame.f_locals.get("self")
        if isinstance(owner, KerasEmbedding) and frame.f_code.co_name in ("build", "add_weight"):
            return owner
        frame = frame.f_back
        depth += 1
    return None


def quiet_tensorflow_cpp_logs():
    """Keeps TensorFlow's C++ logging quiet unless the user asked otherwise."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def build_optimizer(optimizer, var_list):
    """Creates an optimizer's slot variables for ``var_list`` now (on the current device scope)."""
    if optimizer_family(optimizer) == "new":
        optimizer.build(var_list)
    else:
        optimizer._create_all_weights(var_list)  # pylint: disable=protected-access


def train_validation_split(arrays, validation_split):
    """Keras's own split of (x, y, sample_weight) into training and the last ``validation_split`` fraction."""
    from keras.src.engine import data_adapter  # pylint: disable=import-outside-toplevel
    return data_adapter.train_validation_split(arrays, validation_split=validation_split)


def progbar_logger():
    return tf.keras.callbacks.ProgbarLogger(count_mode="steps")


def optimizer_variables(optimizer):
    """The optimizer's own variables (iterations, slots, ...) in creation order, for either optimizer family."""
    if optimizer_family(optimizer) == "new":
        return list(optimizer.variables)
    return list(optimizer.weights)


def destroy_variable(variable):
    """Frees a (shared) variable's resource on its device; later reads of it fail."""
    with tf.device(variable.device):
        _gen_rv.destroy_resource_op(variable.handle, ignore_lookup_error=True)


def reset_train_function(model):
    """Makes ``Model.fit`` retrace its train step (for example after a layer's variables were replaced)."""
    model.train_function = None
    model.train_function = model.make_train_function(force=True)


def share_learning_rate(clone, source):
    """Makes ``clone`` read ``source``'s learning-rate variable, so callbacks that assign a new rate to the
    optimizer Keras trains with (LearningRateScheduler, ReduceLROnPlateau, warm-up) reach the PS-side clones too.
    Only for Keras 2.11+ optimizers with a constant (variable) rate; schedules are cloned and follow the step."""
    if optimizer_family(clone) != "new" or optimizer_family(source) != "new":
        return False
    rate = getattr(source, "_learning_rate", None)
    if isinstance(rate, tf.Variable):
        clone._learning_rate = rate  # pylint: disable=protected-access
        return True
    return False
