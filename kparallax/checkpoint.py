"""Lossless, atomic checkpoints of everything a kparallax run needs to continue.

A checkpoint holds the model's weights (PS tables whole, whatever their partitioning), the state of the optimizer
Keras trains with (replicated: slots and ``iterations``), the state of every PS-side optimizer clone (slots of each
table, joined over shards), the step, and what the caller adds (epoch, data position, ...). Worker 0 writes it into
a temporary directory, fsyncs, renames it to ``DIR/ckpt-<step>`` and then atomically replaces ``DIR/checkpoint.json``
(the pointer to the latest): a crash at any moment leaves the previous checkpoint intact and pointed to. With
``metric_states`` (what ``kp.callbacks.Checkpoint`` passes) it also holds every worker's metric variables.

Restoring is a collective: every worker reads the files (``DIR`` must be visible to all workers) and sets its
replicated weights and optimizer state; worker 0 alone writes the PS tables and PS-side slots; a barrier then
ensures nobody trains before the PS holds the restored values. Because tables and slots are stored whole, a run
may resume with a different number of PS tasks or partitions. With ``continue_fit=True``, the next ``fit`` of the
restored model starts at the checkpoint's epoch and step within it, with each worker's metric averages as they were
(``core/resume.py``). A checkpoint that cannot be read (damaged, or written for another model) is refused before
anything of the model is set.
"""

import json
import os
import shutil
import zipfile

import numpy as np
import tensorflow as tf
from kparallax import log as logging

from kparallax._compat import optimizers as optimizer_compat
from kparallax._compat import striped
from kparallax._compat import tf as tf_compat
from kparallax.core import model_state
from kparallax.core import resume
from kparallax.core import saving
from kparallax.step import collectives

POINTER = "checkpoint.json"


def _clones(model):
    state = model_state.compiled(model)
    if state is None:
        raise ValueError("Checkpoints need a model compiled inside HybridStrategy.scope(). Received: a model whose "
                         f"optimizer is {type(model.optimizer).__name__}.")
    saving.refuse_optimizer_list(model, "a kparallax checkpoint", keras_savers=False)
    return state.clones


def _whole_weights(strategy, model):
    """The model's weights as saved: one list of variables per whole weight (a partitioned table's shards)."""
    groups = []
    for variable in model.weights:
        owner = strategy.registry.table_of(variable)
        if owner is None:
            groups.append([variable])
        elif owner[1] == 0:
            groups.append(list(owner[0].shards))
    return groups


def _dense_variables(strategy, model):
    return [v for v in model.trainable_variables if not strategy.is_ps_variable(v)]


def _ps_groups(strategy, model):
    """[(table path, [shard variables in order])] for the model's trainable PS variables."""
    groups, seen = [], set()
    for variable in model.trainable_variables:
        if not strategy.is_ps_variable(variable):
            continue
        owner = strategy.registry.table_of(variable)
        if owner is None:
            groups.append((strategy.ps_info(variable)[0], [variable]))
        elif id(owner[0]) not in seen:
            seen.add(id(owner[0]))
            groups.append((owner[0].path, list(owner[0].shards)))
    return groups


def save(strategy, model, directory, extra=None, keep=3, metric_states=None):
    """Writes ``DIR/ckpt-<step>`` atomically and points ``DIR/checkpoint.json`` at it, keeping the ``keep`` newest
    checkpoints (0: all). Call on worker 0 only.

    ``metric_states``: every worker's metrics as ``resume.gather_metric_states`` returns them (a collective the
    caller runs on all workers), so that a resumed ``fit`` continues their averages; None: they restart.
    """
    clones = _clones(model)
    tf_compat.async_wait()
    step = int(model.optimizer.iterations.numpy())
    weights = model.get_weights()  # each table read once, whole
    arrays = {f"weight_{i}": w for i, w in enumerate(weights)}
    optimizer_compat.build_optimizer(model.optimizer, _dense_variables(strategy, model))  # idempotent; as training builds it
    dense_state = optimizer_compat.optimizer_variables(model.optimizer)
    arrays.update({f"dense_optimizer_{j}": v.numpy() for j, v in enumerate(dense_state)})
    tables = []
    for path, shards in _ps_groups(strategy, model):
        merged = clones.state(shards)
        if merged is None:
            continue  # never updated yet: nothing beyond the initial state
        arrays.update({f"table_optimizer_{len(tables)}_{j}": v for j, v in enumerate(merged)})
        tables.append({"path": path, "variables": len(merged), "shards": len(shards)})
    meta = {"step": step, "extra": extra or {}, "num_weights": len(weights),
            "dense_optimizer_variables": len(dense_state), "tables": tables,
            "moved": strategy.moved_paths(model)}
    if metric_states is not None:
        meta["metrics"], arrays["metric_states"] = metric_states
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, f"ckpt-{step}")
    tmp = os.path.join(directory, f".ckpt-{step}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with open(os.path.join(tmp, "state.npz"), "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    _write_json(os.path.join(tmp, "meta.json"), meta)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    _write_json(os.path.join(directory, POINTER), {"latest": os.path.basename(final), "step": step})
    _prune(directory, keep)
    logging.info("checkpoint: step %d written to %s", step, final)
    return final


def _write_json(path, data):
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _steps(directory):
    """The steps of the ``ckpt-<step>`` directories in ``directory``, in ascending order."""
    return sorted(int(name[5:]) for name in os.listdir(directory) if name.startswith("ckpt-") and name[5:].isdigit())


def _prune(directory, keep):
    steps = _steps(directory)
    for step in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(directory, f"ckpt-{step}"), ignore_errors=True)


def latest(directory):
    """Path of the latest complete checkpoint in ``directory``, or None."""
    pointer = os.path.join(directory, POINTER)
    if not os.path.isfile(pointer):
        return None
    name = _read_json(pointer).get("latest")
    if not isinstance(name, str):
        raise _damaged(directory, f"no checkpoint name under 'latest': {name!r}", None, POINTER)
    path = os.path.join(directory, name)
    if not os.path.isfile(os.path.join(path, "meta.json")):
        raise ValueError(f"{pointer} points at {name}, which is incomplete or missing. Received: {path}.")
    return path


def restore(strategy, model, path, continue_fit=False):
    """Restores the checkpoint at ``path`` into ``model`` (a collective). Returns its ``extra`` dict and step.

    Every worker sets its replicated weights and optimizer state; only worker 0 reads the PS tables' arrays and
    writes them (and the PS-side optimizer state).

    With ``continue_fit=True`` the next ``fit`` of ``model`` continues the interrupted one: it starts at the
    checkpoint's epoch and step within that epoch (pass the same ``epochs`` and ``steps_per_epoch`` as before) and
    with each worker's metric averages as they were. Without it, ``fit`` starts where its arguments say (e.g. a
    program that passes only the remaining data).
    """
    clones = _clones(model)
    tf_compat.async_wait()  # every earlier write of this worker (e.g. set_weights) lands before worker 0 restores
    collectives.eager_barrier(strategy.num_workers, name="kp_restore_begin")
    meta = _read_json(os.path.join(path, "meta.json"), path)
    # Variables the run that wrote it moved onto PS tasks at its first step (sparse gradients) move now, before
    # their state is set, as that run's first step would have moved them.
    strategy.move_recorded(model, meta.get("moved", []))
    groups = _whole_weights(strategy, model)
    if meta["num_weights"] != len(groups):
        raise ValueError(f"Checkpoint {path} holds {meta['num_weights']} weights but the model has {len(groups)}: "
                         f"it was written for another model. Received: {path}.")
    # Everything that can refuse the checkpoint is checked before anything is set: the optimizer's variable count,
    # the PS tables' names, and every array this worker sets (read once, so its CRC-32 is checked, and the weights'
    # shapes); an error leaves the model as it was.
    weights = [(f"weight_{i}", variables) for i, variables in enumerate(groups)
               if strategy.is_chief or not all(strategy.is_ps_variable(v) for v in variables)]
    optimizer_state = []
    if meta["dense_optimizer_variables"]:
        optimizer_compat.build_optimizer(model.optimizer, _dense_variables(strategy, model))
        optimizer_state = optimizer_compat.optimizer_variables(model.optimizer)
        if len(optimizer_state) != meta["dense_optimizer_variables"]:
            raise ValueError(f"Checkpoint {path} holds {meta['dense_optimizer_variables']} optimizer variables, "
                             f"the optimizer has {len(optimizer_state)}: another optimizer? Received: {path}.")
    ps_state = []
    if strategy.is_chief:
        ps_groups = dict(_ps_groups(strategy, model))
        for t, table in enumerate(meta["tables"]):
            if table["path"] not in ps_groups:
                raise ValueError(f"Checkpoint {path} has optimizer state for PS table {table['path']!r}, which "
                                 f"this model does not have. Received: {path}.")
            ps_state.append((ps_groups[table["path"]], [f"table_optimizer_{t}_{j}" for j in range(table["variables"])]))
    resumes = continue_fit and "metrics" in meta
    with _State(path) as data:
        for key, variables in weights:
            _whole_shape(path, data[key], variables)
        data.check([f"dense_optimizer_{j}" for j in range(len(optimizer_state))] +
                   [key for _, keys in ps_state for key in keys] + (["metric_states"] if resumes else []))
        for key, variables in weights:
            value = data[key]
            parts = striped.stripe(value, len(variables)) if len(variables) > 1 else [value]
            for variable, part in zip(variables, parts):
                variable.assign(part)
        for j, variable in enumerate(optimizer_state):
            variable.assign(data[f"dense_optimizer_{j}"])
        for shards, keys in ps_state:
            clones.set_state(shards, [data[key] for key in keys])
        if continue_fit:
            model_state.compiled(model).resume = resume.pending_from_checkpoint(
                strategy, meta["step"], meta.get("metrics"), data["metric_states"] if resumes else None)
    tf_compat.async_wait()
    collectives.eager_barrier(strategy.num_workers, name="kp_restored")
    logging.info("checkpoint: restored step %d from %s", meta["step"], path)
    tf.keras.backend.set_value(model.optimizer.iterations, meta["step"])
    return meta


def _whole_shape(path, value, variables):
    """Refuses an array of checkpoint ``path`` whose shape is not the whole of ``variables`` (a table's stripes)."""
    whole = (sum(int(v.shape[0]) for v in variables),) + tuple(variables[0].shape[1:]) \
        if len(variables) > 1 else tuple(variables[0].shape)
    if tuple(np.shape(value)) != whole:
        raise ValueError(f"Checkpoint {path}: {variables[0].name} has shape {np.shape(value)} there but "
                         f"{whole} in the model (another vocabulary or model size?). Received: {path}.")


def _read_json(file, path=None):
    """The JSON object in ``file`` of checkpoint ``path`` (None: ``file`` is the pointer); a ``ValueError`` with the
    fix if it cannot be read."""
    directory = os.path.dirname(path or file)
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise _damaged(directory, e, path, os.path.basename(file)) from None
    if not isinstance(data, dict):
        raise _damaged(directory, f"a JSON {type(data).__name__}, not an object", path, os.path.basename(file))
    return data


class _State:
    """A checkpoint's ``state.npz``, read array by array; one that cannot be read is a ``ValueError`` with the fix
    (``np.load`` raises zipfile, EOF, OS or value errors for a truncated or overwritten file)."""

    _ERRORS = (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile)

    def __init__(self, path):
        self._path = path
        try:
            self._data = np.load(os.path.join(path, "state.npz"))
        except self._ERRORS as e:
            raise _damaged(os.path.dirname(path), e, path, "state.npz") from None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._data.close()

    def check(self, keys):
        """Reads each of ``keys`` once (which checks its CRC-32), keeping none."""
        for key in keys:
            self[key]  # pylint: disable=pointless-statement

    def __getitem__(self, key):
        try:
            return self._data[key]
        except self._ERRORS as e:
            raise _damaged(os.path.dirname(self._path), e, self._path, f"state.npz ({key})") from None


def _damaged(directory, reason, path, what):
    """The error for a file ``what`` of checkpoint ``path`` (None: the pointer ``what`` of ``directory``) that cannot
    be read; it names the latest other complete checkpoint in ``directory`` to resume from."""
    pointer = os.path.join(directory, POINTER)
    reason = f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else reason
    others = [step for step in reversed(_steps(directory)) if os.path.join(directory, f"ckpt-{step}") != path
              and os.path.isfile(os.path.join(directory, f"ckpt-{step}", "meta.json"))]
    fix = "No other checkpoint is there: train from the start in a new directory"
    if others:
        fix = (f"To resume from ckpt-{others[0]}, " + (f"move {path} away and " if path else "") +
               f'write {{"latest": "ckpt-{others[0]}", "step": {others[0]}}} into {pointer}')
    what = f"Checkpoint {path} is damaged: its {what}" if path else f"The checkpoint pointer {pointer}"
    return ValueError(f"{what} cannot be read ({reason}). {fix}. Received: {path or pointer}.")
