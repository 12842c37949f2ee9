"""Writes of PS variables by the user's code, made as one process makes them, or refused.

One process writes a variable once where its code says so. A PS variable is one copy on a PS task that every
worker's process reads and writes, and every worker runs the same code, so a write of the user's (``assign``,
``assign_add``, ``assign_sub``, ``scatter_*``: hooked by ``_compat/assign_hook.py``; ``set_weights`` and
``load_weights`` of a model or layer holding one) would be made once per worker:

  * In the training step (Keras' ``train_step``, the user's, a layer's ``call``) it is refused when the step is
    traced, before any weight changes: every worker's step would write the one copy, and the optimizer's update of
    it is applied by the step's last push, not where ``apply_gradients`` stands in the step.
  * Between steps (a callback, eager code, a ``tf.function`` of the user's) worker 0 alone makes it; the other
    workers' writes are left out. Each worker's next step must read what worker 0 wrote, so in ``fit`` the workers meet
    (``fit_callbacks.SameStop``) after every callback hook whose code may write (it names ``assign``,
    ``scatter``, ``set_weights`` or ``load_weights``, or cannot be read) and after each epoch; a write from
    anywhere else in ``fit`` (a callback hook that does not name one, the data pipeline) is refused, naming the
    variable. The next ``train_on_batch`` meets the other workers first; ``evaluate`` and ``predict`` do not.
    A write made eagerly has landed on the PS when it returns (with one worker too): remote eager ops are only
    dispatched, and the next step would read the variable before them.

kparallax's own writes (the optimizer's update on the PS, checkpoints, its ``set_weights``) are told from the
user's by the code making them: the first caller outside TensorFlow, Keras and the standard library.
"""

import contextlib
import dataclasses
import functools
import os
import sys
import sysconfig
import weakref

import tensorflow as tf

from kparallax._compat import assign_hook
from kparallax._compat import tf as tf_compat
from kparallax.step import train_step

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# kparallax's code that writes on behalf of its caller: the hook itself, a striped table's own assign.
_PASSING = tuple(os.path.join(_PACKAGE, *parts) for parts in (("_compat", "assign_hook.py"),
                                                                ("_compat", "striped.py"), ("core", "ps_writes.py")))
_PASSING_CODE = set()  # kparallax's wrappers that only pass a call of the user's on to Keras (``passing``)
_STRATEGIES = weakref.WeakSet()
_STATES = weakref.WeakKeyDictionary()
# The callback hooks after which fit's workers meet when a user's hook may write (fit_callbacks.SameStop).
PHASES = {"train_begin": ("on_train_begin",), "epoch_begin": ("on_epoch_begin",),
          "batch_begin": ("on_batch_begin", "on_train_batch_begin"),
          "batch_end": ("on_batch_end", "on_train_batch_end")}
WRITES = ("assign", "scatter", "set_weights", "load_weights")


@dataclasses.dataclass
class _State:
    fitting: bool = False      # a synchronous fit with several workers runs
    meets: frozenset = frozenset()  # the phases after which its workers meet
    phase: str = ""            # the callback hook running now ("" between hooks)
    written: bool = False      # a write since the last train_on_batch


def watch(strategy):
    """Writes of ``strategy``'s PS variables are checked from now on (``_compat/assign_hook``)."""
    _STRATEGIES.add(strategy)
    _STATES[strategy] = _State()
    assign_hook.guarded(_guard)


def _state(strategy):
    return _STATES[strategy]


@functools.lru_cache(maxsize=None)
def _library_dirs():
    """(the standard library's directory, TensorFlow's and Keras' package directories)."""
    packages = []
    for name in ("tensorflow", "keras", "tf_keras"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            packages.append(os.path.dirname(os.path.abspath(module.__file__)) + os.sep)
    return sysconfig.get_paths()["stdlib"] + os.sep, tuple(packages)


def _in_library(path):
    """Whether ``path`` is TensorFlow's, Keras' or the standard library's code (not a package installed in it)."""
    stdlib, packages = _library_dirs()
    return path.startswith(packages) or (path.startswith(stdlib) and "-packages" + os.sep not in path)


def _by_kparallax():
    """Whether the write being made comes from kparallax's own code: the first caller that is not TensorFlow,
    Keras, the standard library or kparallax writing on its caller's behalf (``passing``)."""
    frame = sys._getframe(1)  # pylint: disable=protected-access
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_PACKAGE):
            if not path.startswith(_PASSING) and frame.f_code not in _PASSING_CODE:
                return True
        elif not _in_library(path):
            return False
        frame = frame.f_back
    return True


def passing(function):
    """Marks ``function`` (a wrapper of kparallax's around a Keras method the user calls) as passing the user's call
    on: a write it leads to is the user's. Returns ``function``."""
    _PASSING_CODE.add(function.__code__)
    return function


def _owner(variable):
    for strategy in list(_STRATEGIES):
        if strategy.is_ps_variable(variable):
            return strategy
    return None


def _guard(variable, method):
    strategy = _owner(variable)
    if strategy is None or _by_kparallax():
        return True
    if train_step.model_step_strategy() is not None and not tf.executing_eagerly():
        entry = strategy.registry.entry(variable)
        path = entry.table.path if entry.table is not None else entry.path
        raise ValueError(
            f"PS variable {variable.name!r} is written in the training step ({method} in the model's train_step or "
            "a layer's call): its one copy on a PS task is shared by every worker, whose steps would each write "
            "it where one process writes once, while the optimizer's update of it is applied at the step's end, "
            f"so training would part from one process's, silently. Received: {method} of a PS variable in the "
            "step. Let the optimizer change it: a constraint (e.g. Embedding(embeddings_constraint=...), applied "
            "after each update as in one process) for a clip or a projection, the optimizer's weight_decay for a "
            f"decay; or keep the variable replicated (placement={{{path!r}: 'replicated'}}), where each worker's "
            "step writes its own copy; or write it between steps, in a callback.")
    made = note(strategy, f"{method} of {variable.name!r}")
    if made and tf.executing_eagerly():
        # A remote eager write is dispatched, not run (TF 2.15): the next step's function could read the PS
        # variable before it lands (measured on one worker: a table halved between steps was read unhalved by the
        # next step after 16 of 300 halvings). A write in a function of the user's has run when the call returns.
        return tf_compat.async_wait
    return made


def note(strategy, what):
    """A write of ``strategy``'s PS variables by the user's code between steps (``what``: the write, for the
    error): refused inside a synchronous ``fit`` where its workers do not meet next, else recorded. Returns whether
    this worker makes it (worker 0; every worker in a job of one)."""
    if strategy.num_workers == 1:
        return True
    state = _state(strategy)
    if state.fitting and state.phase != "train_end" and state.phase not in state.meets:
        where = f"callback hook {state.phase!r}" if state.phase else "fit, outside its callbacks' hooks"
        raise ValueError(
            f"A PS variable is written during fit ({what}, in {where}) where the workers do not meet next: worker "
            "0 alone writes a PS variable between steps (one copy, shared), and the other workers' next step could "
            "read it before that write lands, so training would part from one process's, silently. kparallax "
            "makes the workers meet after a callback hook whose code names assign, scatter, set_weights or "
            f"load_weights, and after each epoch. Received: {what} in {where}. Write it in a callback's own hook "
            "(on_train_batch_end, on_epoch_end, ...), naming the write there, not in a function defined elsewhere "
            "or in the data pipeline.")
    state.written = True
    return strategy.is_chief


@contextlib.contextmanager
def fitting(strategy, meets):
    """While a synchronous ``fit`` of ``strategy`` runs on several workers: its workers meet after the hooks in
    ``meets``; writes elsewhere are refused (``note``)."""
    state = _state(strategy) if strategy.num_workers > 1 and strategy.options.sync else None
    if state is None:
        yield
        return
    state.fitting, state.meets, state.phase = True, frozenset(meets), ""
    try:
        yield
    finally:
        state.fitting, state.phase = False, ""


def enter_phase(strategy, phase):
    """The callback hook ``phase`` starts (``""``: it ended)."""
    _state(strategy).phase = phase


def take_written(strategy):
    """Whether this worker noted a write since the last call (and forgets it)."""
    state = _state(strategy)
    written, state.written = state.written, False
    return written
