"""kparallax: sparsity-aware data-parallel training of unchanged tf.keras models (Parallax for TF2).

Public API::

    kp.Cluster          who is PS / worker (from kparallax-run's environment, TF_CONFIG or arguments)
    kp.HybridStrategy   dense variables allreduced with Horovod, embedding tables on shared PS tasks
    kp.callbacks        Keras callbacks (Throughput, StepLogger, LearningRateWarmup, TensorBoardScalars, Checkpoint)
    kp.checkpoint       save / latest / restore: atomic, lossless checkpoints (PS tables and slots included)
    kp.options          Options (the validated strategy options), architecture_from_env
    kp.data.per_worker  mark a dataset each worker already reads its own part of (fit then does not shard it)
    kp.all_gather       the global batch's rows of a tensor in the training step (in-batch negatives), with
    kp.row_offset       where this worker's rows are among them

Names are imported on first use: ``import kparallax`` (and the launcher) load neither TensorFlow nor Horovod.
"""

import importlib

__version__ = "0.1.0"
__all__ = ["Cluster", "HybridStrategy", "all_gather", "callbacks", "checkpoint", "data", "options", "row_offset",
           "__version__"]

_NAMES = {
    "Cluster": ("kparallax.cluster.spec", "Cluster"),
    "HybridStrategy": ("kparallax.core.strategy", "HybridStrategy"),
    "all_gather": ("kparallax.step.rows", "all_gather"),
    "row_offset": ("kparallax.step.rows", "row_offset"),
    "callbacks": ("kparallax.callbacks", None),
    "checkpoint": ("kparallax.checkpoint", None),
    "data": ("kparallax.core.data", None),
    "options": ("kparallax.core.options", None),
}


def __getattr__(name):
    if name not in _NAMES:
        raise AttributeError(f"module 'kparallax' has no attribute {name!r}")
    module_name, attribute = _NAMES[name]
    if name == "HybridStrategy":
        importlib.import_module("kparallax._compat.keras")  # refuses Keras 3 before anything else
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_NAMES))
