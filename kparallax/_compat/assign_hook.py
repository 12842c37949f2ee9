"""``assign``, ``assign_add``, ``assign_sub`` and the ``scatter_*`` writes of TensorFlow's resource variables
(TF 2.15: methods of ``resource_variable_ops.BaseResourceVariable`` and of its subclass ``ResourceVariable``, the
class of Keras' ``add_weight`` variables and of ``tf.Variable``), hooked once, process-wide, so that a step being
traced can change the value an assignment uses (``combining``: the three ``assign`` methods), and so that a write
can be checked, refused or left out, or followed by the guard's own action (``guarded``: every write method).

Outside ``combining`` and ``guarded`` (and for the variables their functions leave alone) every write is
TensorFlow's own; the hook costs a thread-local lookup and a global read per call. Writes made by ops alone
(``tf.raw_ops``, a ``tf.compat.v1.scatter_*`` of a handle) are not seen here.
"""

import contextlib
import threading

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops  # pylint: disable=no-name-in-module

_METHODS = ("assign", "assign_add", "assign_sub")
_SCATTERS = ("scatter_add", "scatter_sub", "scatter_update", "scatter_max", "scatter_min", "scatter_mul",
             "scatter_div", "scatter_nd_add", "scatter_nd_sub", "scatter_nd_update", "scatter_nd_max",
             "scatter_nd_min", "batch_scatter_update")
_ACTIVE = threading.local()
_HOOKED = []
_GUARD = [None]


def _skipped(variable, kwargs):
    """What a write left out returns: the variable (as a lazily read write would), or no op for ``read_value=False``
    in a graph."""
    if kwargs.get("read_value", True) or tf.executing_eagerly():
        return variable
    return tf.no_op()


def _verdict(variable, method):
    """The guard's answer for this write: False (leave it out), True (make it), or a function to call once it is
    made."""
    guard = _GUARD[0]
    return True if guard is None else guard(variable, method)


def _made(verdict, result):
    if callable(verdict):
        verdict()
    return result


def _hooked_scatter(method, original):
    def scatter(self, *args, **kwargs):
        verdict = _verdict(self, method)
        if not verdict:
            return _skipped(self, kwargs)
        return _made(verdict, original(self, *args, **kwargs))

    scatter.__name__, scatter.__doc__ = original.__name__, original.__doc__
    return scatter


def _hooked(method, original):
    def assign(self, value, *args, **kwargs):
        verdict = _verdict(self, method)
        if not verdict:
            return _skipped(self, kwargs)
        combine = getattr(_ACTIVE, "combine", None)
        if combine is not None:
            _ACTIVE.combine = None  # what ``combine`` itself assigns is TensorFlow's own
            try:
                value = combine(self, method, value)
            finally:
                _ACTIVE.combine = combine
        return _made(verdict, original(self, value, *args, **kwargs))

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
        for method in _SCATTERS:
            if method in vars(cls):
                setattr(cls, method, _hooked_scatter(method, vars(cls)[method]))
    _HOOKED.append(True)


@contextlib.contextmanager
def combining(combine):
    """While active (in this thread): every ``assign`` / ``assign_add`` / ``assign_sub`` of a resource variable
    uses ``combine(variable, method, value)`` as its value (or delta); ``combine`` returns ``value`` for the
    variables it leaves alone. Nested, the inner ``combine`` takes what the outer one returns."""
    _install()
    outer = getattr(_ACTIVE, "combine", None)
    _ACTIVE.combine = combine if outer is None else (
        lambda variable, method, value: combine(variable, method, outer(variable, method, value)))
    try:
        yield
    finally:
        _ACTIVE.combine = outer


def guarded(guard):
    """From now on, process-wide (every thread), each write of a resource variable first calls
    ``guard(variable, method)``: it raises to refuse the write, returns False to leave it out, True to make it, or
    a function of no arguments to make it and then call that function (e.g. to wait until it has landed).
    ``guard=None`` removes it."""
    _install()
    _GUARD[0] = guard
