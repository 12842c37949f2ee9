"""kparallax: sparsity-aware data-parallel training of unchanged tf.keras models (Parallax for TF2).

Public API::

    kp.Cluster          who is PS / worker (from kparallax-run's environment, TF_CONFIG or arguments)
    kp.HybridStrategy   dense variables allreduced with Horovod, embedding tables on shared PS tasks
    kp.callbacks        Keras callbacks (Throughput, LearningRateWarmup, TensorBoardScalars; and those fit adds)
    kp.checkpoint       save / latest / restore: atomic, lossless checkpoints (PS tables and slots included)
    kp.options          Options (the validated strategy options), architecture_from_env
    kp.data.per_worker  mark a dataset each worker already reads its own part of (fit then does not shard it)
"""

from kparallax import _compat  # noqa: F401  (checks the Keras version first)
from kparallax import callbacks
from kparallax import checkpoint
from kparallax import data
from kparallax import options
from kparallax.cluster import Cluster
from kparallax.strategy import HybridStrategy

__version__ = "0.1.0"
__all__ = ["Cluster", "HybridStrategy", "callbacks", "checkpoint", "data", "options", "__version__"]
