"""TensorFlow errors of ``fit`` / ``train_on_batch`` / ``evaluate`` / ``predict`` that kparallax says plainly: an id
outside an embedding table, the step check of ``collectives.sum_checked``, a collective ended by another worker's
failure. Every other error is raised as it is.
"""

import contextlib
import re

import tensorflow as tf

from kparallax import log
from kparallax._compat import optimizers as optimizer_compat
from kparallax._compat import striped
from kparallax.step import collectives

_OUT_OF_RANGE = re.compile(r"indices\[[0-9,]+\] = (-?[0-9]+) is not in \[0, ([0-9]+)\)")


_OUT_OF_STRIPES = re.compile(re.escape(striped.ID_CHECK_MESSAGE) + r"\] \[(-?[0-9]+)\] \[(-?[0-9]+)\] \[([0-9]+)\]")


@contextlib.contextmanager
def errors_explained(model):
    """TensorFlow errors of ``fit`` / ``train_on_batch`` / ``evaluate`` / ``predict`` that ``explained`` knows are
    raised said plainly (without TensorFlow's graph trace); others as they are."""
    try:
        yield
    except tf.errors.OpError as e:
        said = explained(e, model)
        if said is e:
            raise
        raise said from None


def explained(error, model):
    """Said plainly (other errors unchanged): an id outside a table (TensorFlow's CPU gather error, or a striped
    table's id check), the step check of ``collectives.sum_checked`` (in the step or at an epoch's end), and a
    collective that ended because another worker stopped."""
    text = str(error)
    if collectives.STEP_SKEW_MESSAGE in text:
        return collectives.step_skew_error(optimizer_compat.step_optimizer(model).iterations.numpy())
    match = _OUT_OF_RANGE.search(text)
    if match:
        return _id_error(match.group(1), match.group(2))
    match = _OUT_OF_STRIPES.search(text)
    if match:
        low, high, rows = match.groups()
        return _id_error(low if int(low) < 0 else high, rows)
    if log.HOROVOD_SHUT_DOWN in text:
        return RuntimeError(
            "This worker stopped because another worker failed and left the collective this one was waiting on "
            "(Horovod has been shut down). The other worker's own error is the cause: kparallax-run names that "
            "worker and shows its log; without the launcher, look in each worker's output.")
    return error


def _id_error(value, rows):
    return ValueError(f"The input holds id {value}, outside an embedding table of {rows} rows: ids must be in "
                      "[0, vocabulary size). Check the data against the vocabulary (or raise the Embedding's "
                      f"input_dim). Received: id={value}.")
