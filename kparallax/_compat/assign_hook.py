"""``assign``, ``assign_add`` and ``assign_sub`` of TensorFlow's resource variables (TF 2.15: methods of
``resource_variable_ops.BaseResourceVariable`` and of its subclass ``ResourceVariable``, the class of Keras'
``add_weight`` variables and of ``tf.Variable``), hooked once, process-wide, so that a step being traced can
change the value an assignment uses.

Outside ``combining`` (and for the variables its function leaves alone) every assignment is TensorFlow's own; the
hook costs one thread-local lookup per call. Assignments made by other ops (``scatter_*``, ``tf.raw_ops``) are not
seen here.
"""

import contextlib
import threading

from tensorflow.python.ops import resource_variable_ops  # pylint: disable=no-name-in-module

_METHODS = ("assign", "assign_add", "assign_sub")
_ACTIVE = threading.local()
_HOOKED = []


def _hooked(method, original):
    def assign(self, value, *args, **kwargs):
        combine = getattr(_ACTIVE, "combine", None)
        if combine is not None:
            _ACTIVE.combine = None  # what ``combine`` itself assigns is TensorFlow's own
            try:
                value = combine(self, method, value)
            finally:
                _ACTIVE.combine = combine
        return original(self, value, *args, **kwargs)

    assign.__name__, assign.__doc__ = original.__name__, original.__doc__
    return assign


def _install():
    if _HOOKED:
        return
    # TF 2.15 defines the methods on BaseResourceVariable and again on ResourceVariable (tf.Variable's class).
    for cls in (resource_variable_ops.BaseResourceVariable, resource_variable_ops.ResourceVariable):
        for method in _METHODS:
            if method in vars(cls):
                setattr(cls, method, _hooked(method, vars(cls)[method]))
    _HOOKED.append(True)


@contextlib.contextmanager
def combining(combine):
    """While active (in this thread): every ``assign`` / ``assign_add`` / ``assign_sub`` of a resource variable
    uses ``combine(variable, method, value)`` as its value (or delta); ``combine`` returns ``value`` for the
    variables it leaves alone."""
    _install()
    outer, _ACTIVE.combine = getattr(_ACTIVE, "combine", None), combine
    try:
        yield
    finally:
        _ACTIVE.combine = outer
