"""Keras' ``BackupAndRestore`` under the strategy: one writer, and the PS-side optimizer state in the backup.

Keras' callback writes ``tf.train.Checkpoint(model=model, ...)`` from every process that has it (outside
tf.distribute each process counts as the chief), and that checkpoint holds ``model.optimizer``, which under
kparallax lacks the slots of PS variables (they live in the PS-side clones). A resumed ``fit`` then trained on with
fresh slots for the tables, silently off one process. ``adapt`` binds ``on_train_begin`` of one callback
instance, which then binds two methods of the ``WorkerTrainingState`` Keras made:

- ``on_train_begin``: if a backup exists (every worker must see the same ``backup_dir``; checked), Keras restores it
  inside ``saving.whole_state`` (each table one whole variable, ``model.optimizer`` a plain optimizer); then the
  restored state goes to the optimizer Keras trains with, worker 0 writes the tables and the PS-side slots, and
  every worker waits for that;
- the backup (``WorkerTrainingState.back_up``): worker 0 only, inside ``saving.whole_state``, so the checkpoint is
  the one a plain process would write;
- deleting the backup at the end of ``fit``: worker 0 only.
"""

import functools
import os
import types

import tensorflow as tf

from kparallax._compat import keras as keras_compat
from kparallax.core import saving
from kparallax.step import collectives

_ADAPTED = "_kp_backup_adapted"


def adapt(callback, strategy, clones):
    """Makes ``callback`` (a ``tf.keras.callbacks.BackupAndRestore``) back up and restore the whole training state
    of a model compiled under ``strategy`` (idempotent)."""
    if callback.__dict__.get(_ADAPTED) is clones:
        return
    callback.__dict__[_ADAPTED] = clones
    original = type(callback).on_train_begin
    callback.on_train_begin = types.MethodType(functools.partial(_on_train_begin, original, strategy, clones),
                                               callback)


def _on_train_begin(original, strategy, clones, callback, logs=None):
    model = callback.model
    if not _backup_found(strategy, callback.backup_dir):
        original(callback, logs)  # nothing to restore
    elif not keras_compat.weights_created(model):
        # Keras' own error otherwise ("Weights for model ... have not yet been created"), from inside the restore.
        raise ValueError(
            f"BackupAndRestore found a backup to resume from, but model {model.name!r} has not created all its "
            "weights yet (a part of it built by its first call, as a WideDeepModel's LinearModel is): kparallax "
            "restores the tables and their optimizer state into existing variables. Received: backup_dir="
            f"{callback.backup_dir!r} and a model not built. Build it before fit: call it on one batch "
            "(model(x[:1])), then fit.")
    else:
        with saving.whole_state(strategy, model, clones, restore=True), saving.plain_variables():
            original(callback, logs)  # Keras' WorkerTrainingState, then its restore
        collectives.eager_barrier(strategy.num_workers, name="kp_backup_restored")
    state = keras_compat.backup_training_state(callback)
    if strategy.is_chief:
        state.back_up = types.MethodType(functools.partial(_back_up, type(state).back_up, strategy, clones), state)
    else:
        state.back_up = lambda epoch, batch=0: None
        state.delete_backup = lambda: None


def _backup_found(strategy, backup_dir):
    """Whether a backup exists in ``backup_dir``, which every worker must see alike (a collective)."""
    found = tf.train.latest_checkpoint(os.path.join(backup_dir, "chief")) is not None
    seen = [row[0] for row in collectives.allgather_ints([int(found)], name="kp_backup_found")]
    if len(set(seen)) > 1:
        raise ValueError(
            "BackupAndRestore's backup_dir must be one directory every worker sees (worker 0 writes it, every worker "
            f"restores from it). Received: backup_dir={backup_dir!r}, where workers "
            f"{[i for i, s in enumerate(seen) if s]} find a backup and workers "
            f"{[i for i, s in enumerate(seen) if not s]} do not. Use a shared file system path.")
    return found


def _back_up(original, strategy, clones, state, epoch, batch=0):
    model = keras_compat.training_state_model(state)
    with saving.whole_state(strategy, model, clones):
        return original(state, epoch, batch)
