"""Compiled losses that sum over the batch (``reduction="sum"`` or ``"none"``), summed over the global batch.

One process with ``reduction="sum"`` differentiates (and logs) the sum of the loss over its whole batch. Each worker
sums over its own part, and the step averages gradients and logged metrics over the workers, which would divide
that loss term by the worker count. While kparallax's synchronous step is traced, such a term is multiplied by the
worker count (value and gradient; for ``"none"``, whose logged value is a mean of per-example values, the gradient
only), as tf.distribute's Keras does in its own way. Terms reduced by a mean over the batch (Keras' default) and
regularization losses are left alone: their average over the workers already is one process's value.
"""

import contextlib
import threading

from kparallax._compat import keras as keras_compat

_ACTIVE = threading.local()


def install(model):
    """Scales ``model``'s compiled SUM / NONE losses inside ``workers``; leaves them alone elsewhere (evaluate)."""
    keras_compat.scale_summed_losses(model, lambda: getattr(_ACTIVE, "workers", None))


@contextlib.contextmanager
def workers(num_workers):
    """While one training step is traced: summed losses count ``num_workers`` workers."""
    previous = getattr(_ACTIVE, "workers", None)
    _ACTIVE.workers = num_workers
    try:
        yield
    finally:
        _ACTIVE.workers = previous
