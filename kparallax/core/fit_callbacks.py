"""The callbacks ``fit`` adds under a HybridStrategy, in this order: replicated weights synchronized from worker 0,
(the partition search), epoch metrics averaged over workers, and the per-worker progress file the launcher
watches; then the check that the first step left the model's replicated non-trainable variables equal on every
worker (``SameState``); after the user's callbacks, the agreement on stopping, which also makes the PS variables a
callback wrote seen by every worker's next step (``SameStop``; ``WritePhases``, first, tells which hook runs)."""

import contextlib
import inspect
import os
import threading
import zlib

import tensorflow as tf

from kparallax._compat import keras as keras_compat
from kparallax._compat import optimizers as optimizer_compat
from kparallax._compat import tf as tf_compat
from kparallax.core import ps_writes
from kparallax.core import shared_variables
from kparallax.step import collectives
from kparallax.step import logs as logs_lib
from kparallax.step import state_variables


def check_same_ps_variables(strategy, model):
    """Refuses a ``model`` whose PS variables are not the same on every worker (the same resources on the same PS
    tasks): each worker would train its own, silently. Names the first that differs. One allgather of two numbers;
    a second one, of a number per PS variable, only when they differ."""
    variables = keras_compat.created_weights(model) or []  # checked again once it is built
    entries = [e for e in (strategy.registry.get(v) for v in variables if isinstance(v, tf.Variable)) if e is not None]
    names = [f"{e.shared_name}@ps[{e.task}]" for e in entries]
    rows = collectives.allgather_ints([len(names), zlib.crc32(" ".join(names).encode())], name="kp_ps_variables")
    if len({tuple(row) for row in rows}) == 1:
        return
    width = max(row[0] for row in rows)
    each = collectives.allgather_ints([zlib.crc32(n.encode()) for n in names] + [-1] * (width - len(names)),
                                      name="kp_ps_variables_each")
    first = next(i for i in range(width) if len({row[i] for row in each}) > 1)
    here = (f"{entries[first].path!r} ({names[first].split('/', 1)[-1]}: its resource on the PS task)"
            if first < len(names) else "none")
    others = [w for w, row in enumerate(each) if row[first] != each[strategy.worker_index][first]]
    raise ValueError(
        f"The workers' models do not hold the same PS variables, so each would train its own: PS variable #{first} "
        f"of {model.name!r} is {here} on this worker ({strategy.worker_index}) and another one on worker(s) {others}. "
        f"{shared_variables.ASYMMETRIC_CAUSE} Received: {[row[0] for row in rows]} PS variable(s) per worker.")


class ReplicatedWeights:
    """Worker 0's values of a model's replicated variables, broadcast to every worker (``fit`` and
    ``train_on_batch`` use it before their first step).

    ``sync()`` first waits for this worker's pending PS writes, then broadcasts the replicated variables not
    broadcast yet (a collective, so it is also a barrier) and returns them. A model built by its first call gets its
    variables when the train function is first traced, before that step runs: ``sync_new()`` there broadcasts them
    (``train_function``). A step that runs eagerly creates them while it runs: inside ``broadcast_created()`` each one
    takes worker 0's value as it is created, before the step reads it. Any other variable that first appears during
    a step is broadcast by ``sync_late()`` after it, with a warning.
    """

    def __init__(self, strategy, model):
        self._strategy = strategy
        self._model = model
        self._synced = set()

    def _variables(self):
        if not keras_compat.weights_created(self._model):
            return []
        # Keras lists non-variables too (the vocabulary handlers of lookup layers, which each worker adapts itself).
        return [v for v in self._model.variables
                if isinstance(v, tf.Variable) and not self._strategy.is_ps_variable(v)]

    def sync(self):
        variables = [v for v in self._variables() if v.ref() not in self._synced]
        tf_compat.async_wait()
        if self._strategy.num_workers > 1:
            check_same_ps_variables(self._strategy, self._model)
        if self._strategy.num_workers > 1 and variables:
            collectives.broadcast_variables(variables, name="kp_replicated_weights")
        elif self._strategy.num_workers > 1:
            collectives.eager_barrier(self._strategy.num_workers, name="kp_start_barrier")
        self._synced.update(v.ref() for v in variables)
        return variables

    def sync_new(self):
        """Broadcasts the variables created since the last ``sync`` and returns them (none: no collective; the
        model is the same on every worker, so all workers agree)."""
        if all(v.ref() in self._synced for v in self._variables()):
            return []
        return self.sync()

    @contextlib.contextmanager
    def broadcast_created(self):
        """Inside (a train function's first eager call): each replicated variable created eagerly is set to worker
        0's value as it is created, one broadcast per variable (every worker creates the same ones in the same
        order)."""
        def creator(next_creator, **kwargs):
            variable = next_creator(**kwargs)
            if (self._strategy.num_workers > 1 and tf.executing_eagerly() and isinstance(variable, tf.Variable)
                    and not self._strategy.is_ps_variable(variable)):
                collectives.broadcast_variables([variable], name=f"kp_created_{len(self._synced)}")
                self._synced.add(variable.ref())
            return variable

        with tf.variable_creator_scope(creator):
            yield

    def sync_late(self):
        """``sync_new`` after a step, with a warning if that step created variables."""
        late = self.sync_new()
        if late:
            tf.get_logger().warning(
                "%d replicated variable(s) were created during the first step and were synchronized after it. "
                "Build the model before training (give it an input shape) for exact single-process equivalence.",
                len(late))
        return late


class SyncReplicatedVariables(tf.keras.callbacks.Callback):
    """``fit``'s start: every worker starts from worker 0's replicated weights (``ReplicatedWeights``)."""

    def __init__(self, weights):
        super().__init__()
        self._weights = weights

    def on_train_begin(self, logs=None):
        self._weights.sync()

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            self._weights.sync_late()


class AverageMetrics(tf.keras.callbacks.Callback):
    """Replaces each epoch's logged loss/metrics with their values over all workers (``step/logs.py``).

    Keras reads an epoch's logs from the model's metric variables, which hold each worker's own running values:
    metrics are computed from their states aggregated over the workers (one process's value, also for ratios such
    as AUC), other float values are averaged. Validation resets those variables before ``on_epoch_end``, so
    with validation the training states are taken when it begins (``on_test_begin``; every worker validates).
    Batch logs are taken over the workers inside the synchronous step instead. Asynchronous PS training does it per
    epoch only: a per-batch collective would put the workers back in lock-step, so its batches show worker 0's own
    values.

    The same collective checks that every worker's optimizer made the same number of steps
    (``collectives.sum_checked``, as the in-step one does).
    """

    def __init__(self, strategy):
        super().__init__()
        self._strategy = strategy
        self._in_epoch = False
        self._training = None  # the epoch's training results, taken before validation reset the metrics

    def _over_workers(self, logs, metrics, tag):
        # A failed step check raises InvalidArgumentError here; ``fit`` (errors.explained) says it plainly.
        merged = logs_lib.over_workers(dict(logs), metrics, optimizer_compat.step_optimizer(self.model).iterations.numpy(),
                                       self._strategy.num_workers, name=f"kp_metrics_{tag}",
                                       worker_index=self._strategy.worker_index)
        # As Keras gives a log: a number, or an array for a metric's non-scalar result (F1Score's per class).
        return {key: value.numpy() if value.shape.rank else float(value.numpy())
                for key, value in merged.items() if isinstance(value, tf.Tensor)}

    def on_epoch_begin(self, epoch, logs=None):
        self._in_epoch, self._training = True, None

    def on_test_begin(self, logs=None):
        if self._strategy.num_workers > 1 and self._in_epoch and self._training is None:
            keys = logs_lib.result_keys(self.model.metrics)
            self._training = self._over_workers({key: 0.0 for key in keys}, self.model.metrics, "training")

    def on_epoch_end(self, epoch, logs=None):
        self._in_epoch = False
        if self._strategy.num_workers == 1 or logs is None:
            return
        if self._training is None:
            logs.update(self._over_workers(logs, self.model.metrics, "epoch"))
            return
        others = {key: value for key, value in logs.items() if key not in self._training}
        logs.update(self._over_workers(others, [], "epoch"))
        logs.update({key: value for key, value in self._training.items() if key in logs})


class ProgressFile(tf.keras.callbacks.Callback):
    """Keeps ``LOG_DIR/progress-worker-<rank>`` holding ``<steps finished> <training|idle> <batches>`` so the
    launcher can tell a stalled run (no worker's file changes for ``--stall_timeout`` while training) and name the
    worker a collective waits for. Added by ``fit`` under kparallax-run. The callback only counts; a daemon thread
    writes the file when the counts changed, at most once per ``every_seconds`` (no file I/O on the step path)."""

    def __init__(self, log_dir, rank, every_seconds=0.5):
        super().__init__()
        self._path = os.path.join(log_dir, f"progress-worker-{rank}")
        self._every = every_seconds
        self._steps, self._batches, self._state = 0, 0, "training"
        self._written = None
        self._wake = threading.Event()
        self._thread = None

    def _write(self):
        text = f"{self._steps} {self._state} {self._batches}"
        if text == self._written:
            return
        tmp = f"{self._path}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, self._path)
            self._written = text
        except OSError:
            pass

    def _loop(self):
        while self._state == "training":
            self._wake.wait(self._every)
            self._write()

    def on_train_begin(self, logs=None):
        self._state = "training"
        self._write()
        self._thread = threading.Thread(target=self._loop, name="kp_progress_file", daemon=True)
        self._thread.start()

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1
        self._batches += 1

    def on_test_batch_end(self, batch, logs=None):
        self._batches += 1

    def on_train_end(self, logs=None):
        self._state = "idle"
        self._wake.set()
        self._thread.join()
        self._write()


_BATCH_HOOKS = ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end")
_OWN_MODULES = ("keras.", "kparallax.", "builtins")


def may_stop_within_epoch(callbacks):
    """Whether a callback in ``callbacks`` may set ``model.stop_training`` on some workers only, within an epoch:
    one of the user's own with a batch hook whose code mentions ``stop_training`` (its classes outside Keras and
    kparallax; a ``LambdaCallback``'s batch functions), or whose code cannot be read. Keras' and kparallax's
    callbacks stop from logs and steps that are the same on every worker (``EarlyStopping``, ``TerminateOnNaN``,
    ``kp.callbacks``); a step timer or a logger never stops."""
    return any(_hooks_mention(callback, _BATCH_HOOKS, ("stop_training",)) for callback in callbacks)


def writing_phases(callbacks):
    """The hooks of ``ps_writes.PHASES`` (``"train_begin"``, ``"epoch_begin"``, ``"batch_begin"``,
    ``"batch_end"``) in which one of the user's ``callbacks`` may write PS variables: its hook's code (as
    ``may_stop_within_epoch`` reads it) names one of ``ps_writes.WRITES``, or cannot be read."""
    return {phase for phase, hooks in ps_writes.PHASES.items()
            if any(_hooks_mention(callback, hooks, ps_writes.WRITES) for callback in callbacks)}


def _hooks_mention(callback, hooks, words):
    if isinstance(callback, tf.keras.callbacks.LambdaCallback):
        code = [hook for name, hook in vars(callback).items() if name in hooks]
    elif _overrides(callback, hooks):
        code = [cls for cls in type(callback).__mro__ if not cls.__module__.startswith(_OWN_MODULES)]
    else:
        return False
    for part in code:
        try:
            source = inspect.getsource(part)
        except (OSError, TypeError):  # no source to read (a builtin, a class made at run time): it may act
            return True
        if any(word in source for word in words):
            return True
    return False


def _overrides(callback, hooks):
    base = tf.keras.callbacks.Callback
    return any(getattr(getattr(callback, name, None), "__func__", None) is not getattr(base, name)
               for name in hooks)


class _AtPhases(tf.keras.callbacks.Callback):
    """A callback acting at each of ``fit``'s training hooks, named by its phase (``_at``)."""

    def _at(self, phase):
        raise NotImplementedError

    def on_train_begin(self, logs=None):
        self._at("train_begin")

    def on_epoch_begin(self, epoch, logs=None):
        self._at("epoch_begin")

    def on_train_batch_begin(self, batch, logs=None):
        self._at("batch_begin")

    def on_train_batch_end(self, batch, logs=None):
        self._at("batch_end")

    def on_epoch_end(self, epoch, logs=None):
        self._at("epoch_end")


class WritePhases(_AtPhases):
    """First in a synchronous ``fit``'s callbacks on several workers: tells ``ps_writes`` which hook runs (also a
    validation's, ``"test"``, and the end, ``"train_end"``), so that a write of a PS variable where the workers do
    not meet next is refused (``SameStop`` meets them)."""

    def __init__(self, strategy):
        super().__init__()
        self._strategy = strategy

    def _at(self, phase):
        ps_writes.enter_phase(self._strategy, phase)

    def on_test_begin(self, logs=None):
        self._at("test")

    def on_train_end(self, logs=None):
        self._at("train_end")


class SameStop(_AtPhases):
    """Last in ``fit``'s callbacks, so it sees what every other one did: every worker stops ``fit`` where any
    worker's callbacks asked to (``model.stop_training``), as one process stops where its callbacks ask, and
    every worker's next step reads the PS variables a callback wrote (worker 0 writes them: ``ps_writes``).

    A worker that left ``fit`` alone would leave the others waiting in the next step's collectives (before: the run
    hung until ``--stall_timeout``). The workers meet (one scalar allreduce, after this worker's PS writes landed)
    after the hooks in ``meets``: each epoch's end (``"epoch_end"``), and in synchronous training ``"batch_end"``
    when a batch hook may stop (``may_stop_within_epoch``) and any hook that may write PS variables
    (``writing_phases``), 1-7 ms each on 2 workers here.
    """

    def __init__(self, strategy, meets):
        super().__init__()
        self._strategy = strategy
        self._meets = frozenset(meets)

    def _at(self, phase):
        if phase in self._meets:
            tf_compat.async_wait()
            if collectives.any_worker(self.model.stop_training, self._strategy.num_workers,
                                      f"kp_stop_training_{phase}"):
                self.model.stop_training = True
        ps_writes.enter_phase(self._strategy, "")


def check_same_state(strategy, model):
    """Compares the model's replicated non-trainable variables that a step could assign on each worker alone
    (``state_variables.candidates``) and its replicated trainable ones (an update written by hand in a custom
    ``train_step`` would be each worker's own) over the workers (eager; every worker calls it after the same step)
    and raises the fix if the step left any different (one small allgather of their checksums)."""
    variables = state_variables.candidates(model, strategy.is_ps_variable)
    variables += state_variables.trainable_replicas(model, strategy.is_ps_variable)
    if variables:
        different = state_variables.differing(variables, strategy.num_workers, "kp_same_state")
        if different:
            raise state_variables.refuse_differing(different)


class SameState(tf.keras.callbacks.Callback):
    """After ``fit``'s first step, ``check_same_state``: stops ``fit`` with the fix if the step left a replicated
    variable different on the workers (``train_on_batch`` checks after its first call)."""

    def __init__(self, strategy):
        super().__init__()
        self._strategy = strategy
        self._checked = False

    def on_train_batch_end(self, batch, logs=None):
        if self._checked:
            return
        self._checked = True
        check_same_state(self._strategy, self.model)
