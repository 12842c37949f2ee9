"""``fit``, ``train_on_batch``, ``evaluate`` and ``predict`` of a model compiled under a strategy.

``fit`` shards the training data per worker (``data``; seeded shuffles and equal step counts checked over the
workers), runs inside the strategy's scope, adds the callbacks of ``fit_callbacks`` in front of the user's (and
``SameStop`` after them: every worker stops where any asked), and shows the progress bar on worker 0 only.
``validation_split`` takes the last fraction of the full arrays. ``train_on_batch`` takes this worker's own batch (one
synchronous step over all workers' batches) and broadcasts worker 0's replicated weights at its first call and after
any worker set the model's weights. ``evaluate`` / ``predict`` (and ``fit``'s validation) run on the full input on
every worker, so their results are exact and identical everywhere; only worker 0 prints.
"""

import inspect
import os
import zlib

import tensorflow as tf

from kparallax import callbacks as kp_callbacks
from kparallax._compat import keras as keras_compat
from kparallax._compat import optimizers as optimizer_compat
from kparallax.core import backup
from kparallax.core import data as data_lib
from kparallax.core import errors
from kparallax.core import fit_callbacks
from kparallax.core import model_state
from kparallax.core import partition_search
from kparallax.core import ps_writes
from kparallax.core import resume
from kparallax.core import saving
from kparallax.core import train_function
from kparallax.step import collectives

def fit(original, model, *args, **kwargs):
    strategy = model_state.compiled(model).strategy
    model_state.check_fixed_steps_per_execution(strategy, getattr(model, "autotune_steps_per_execution", False),
                                     "model.autotune_steps_per_execution=True")
    # A model built by its first call: now it has its variables.
    model_state.guard_tracking(strategy, model, optimizer_compat.step_optimizer(model))
    bound = inspect.signature(original).bind(model, *args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    n, index = strategy.num_workers, strategy.worker_index
    data_lib.check_supported(a["x"])
    uneven = data_lib.may_be_uneven(a["x"])
    if data_lib.is_per_worker(a["x"]):
        _check_same_steps(strategy, data_lib.local_steps(a["x"], a["steps_per_epoch"]))
    elif data_lib.is_dataset(a["x"]):
        seeds = data_lib.shuffle_seeds(a["x"])
        a["x"] = data_lib.shard_dataset(a["x"], n, index, a["steps_per_epoch"])
        _check_same_shuffle(strategy, seeds)
    elif data_lib.is_sequence(a["x"]):
        a["x"] = data_lib.shard_sequence(a["x"], n, index)
    elif data_lib.is_generator(a["x"]):
        a["x"] = data_lib.shard_generator(a["x"], n, index, a["steps_per_epoch"])
    else:
        arrays = (a["x"], a["y"], a["sample_weight"])
        if a["validation_split"] and a["validation_data"] is None:
            arrays, a["validation_data"] = keras_compat.train_validation_split(arrays, a["validation_split"])
            a["validation_split"] = 0.0
        # Without steps_per_epoch, Keras batches the arrays by batch_size (32 by default): the split keeps the
        # last, partial global batch, whose rows the workers' last batches then share unevenly.
        batch_size = a["batch_size"] or keras_compat.DEFAULT_BATCH_SIZE
        split_batch = None if a["steps_per_epoch"] else batch_size
        uneven = data_lib.arrays_uneven(arrays, n, split_batch)
        # Each worker's part of each global batch, in order: their batches joined are one process's, in its order.
        step_rows = data_lib.rows_per_step(arrays, n, a["batch_size"] or split_batch, a["steps_per_epoch"])
        a["x"], a["y"], a["sample_weight"] = data_lib.shard_arrays(arrays, n, index, split_batch, step_rows)
        if a["validation_batch_size"] is None and data_lib.is_arrays(a["validation_data"]):
            # Validation runs the full arrays on every worker; one process's fit validates in batches of its
            # batch_size, which is the global batch here (a loss summed over the batch, a masked mean, depend on it).
            a["validation_batch_size"] = n * batch_size
    expect_uneven_batches(model, uneven)
    model_state.compiled(model).weights = fit_callbacks.ReplicatedWeights(strategy, model)
    ours = [fit_callbacks.SyncReplicatedVariables(model_state.compiled(model).weights), fit_callbacks.AverageMetrics(strategy)]
    if strategy.partitioned_tables and not strategy.partition_search["done"]:
        ours.insert(1, partition_search.PartitionSearch(strategy))
    log_dir = os.environ.get("KPARALLAX_LOG_DIR")
    if log_dir and strategy.num_workers > 1:
        ours.append(fit_callbacks.ProgressFile(log_dir, strategy.worker_index))
    if not strategy.is_chief:
        a["verbose"] = 0
        a["callbacks"] = without_file_writers(a["callbacks"])
    elif a["verbose"] != 0:
        ours.append(keras_compat.progbar_logger())
        train_function.announce(strategy, model)
    pending = model_state.compiled(model).resume
    if pending is not None:
        if any(isinstance(c, tf.keras.callbacks.BackupAndRestore) for c in a["callbacks"] or []):
            raise ValueError("fit has a restored kparallax checkpoint and a BackupAndRestore callback, which would "
                             "resume from different places. Received: kparallax.checkpoint.restore() before fit with "
                             "BackupAndRestore in callbacks. Use one of them.")
        ours.append(resume.ResumePosition(pending, lambda: setattr(model_state.compiled(model), "resume", None)))
    for callback in a["callbacks"] or []:
        if isinstance(callback, tf.keras.callbacks.BackupAndRestore):
            saving.refuse_optimizer_list(model, "a BackupAndRestore callback in fit")
            backup.adapt(callback, strategy, model_state.compiled(model).clones)
        if isinstance(callback, kp_callbacks.Checkpoint):
            saving.refuse_optimizer_list(model, "a kparallax.callbacks.Checkpoint in fit", keras_savers=False)
    a["callbacks"] = ours + list(a["callbacks"] or [])
    meets = {"epoch_end"}  # the hooks after which the workers meet (SameStop); a synchronous fit adds those below
    if strategy.num_workers > 1:
        if strategy.options.sync:
            meets |= fit_callbacks.writing_phases(a["callbacks"])
            if fit_callbacks.may_stop_within_epoch(a["callbacks"]):
                meets.add("batch_end")
            a["callbacks"].insert(len(ours), fit_callbacks.SameState(strategy))
            a["callbacks"].insert(0, fit_callbacks.WritePhases(strategy))
        a["callbacks"].append(fit_callbacks.SameStop(strategy, meets))
    with ps_writes.fitting(strategy, meets), strategy.scope(), errors.errors_explained(model):
        return original(*bound.args, **bound.kwargs)


# Keras callbacks that write a file of the run's logs; every worker's logs are the same (taken over the workers).
_FILE_WRITERS = (tf.keras.callbacks.TensorBoard, tf.keras.callbacks.CSVLogger)


def without_file_writers(callbacks):
    """A worker other than 0 leaves out the callbacks that would write the logs to a file: worker 0 writes them, as
    one process would (in one TensorBoard directory every worker would add its own event files, each step shown
    once per worker; in one CSV file their writes would interleave). Model files are written by worker 0 alone too
    (``saving``)."""
    if not isinstance(callbacks, (list, tuple)):
        return callbacks
    return [c for c in callbacks if not isinstance(c, _FILE_WRITERS)]


def _check_same_shuffle(strategy, seeds):
    """Workers splitting one dataset by batches must shuffle it alike: the seeds of its shuffles (a fingerprint and
    the first pair, one allgather) must agree, or each worker would keep its batches of its own order."""
    if strategy.num_workers == 1:
        return
    first = (seeds + [-1, -1])[:2]
    rows = collectives.allgather_ints([zlib.crc32(repr(seeds).encode()), len(seeds)] + first, name="kp_shuffle_seeds")
    if len({tuple(row) for row in rows}) != 1:
        shown = [row[2:] for row in rows]
        raise ValueError(
            "The workers shuffle the dataset with different seeds, so each keeps its batches of its own order and "
            "their batches overlap: an epoch would train on some rows twice and miss others. Received: first shuffle "
            f"seeds per worker {shown}. Build the dataset with the same seeds on every worker (shuffle(n, seed=s), "
            "tf.keras.utils.set_random_seed(s) before building it, or a seed= to the Keras utility that builds it), "
            "or shard it yourself before shuffling and mark it kparallax.data.per_worker(dataset).")


def _check_same_steps(strategy, steps):
    if strategy.num_workers == 1:
        return
    counts = [row[0] for row in collectives.allgather_ints([steps], name="kp_steps_per_epoch")]
    if len(set(counts)) != 1:
        raise ValueError(f"Every worker must run the same number of steps per epoch, or the collectives hang. "
                         f"Received: steps per worker {counts}. Pass steps_per_epoch=min(...) (for example "
                         f"{min(counts)}) and repeat the dataset.")


def run_quietly_on_workers(original, model, *args, **kwargs):
    strategy = model_state.compiled(model).strategy
    bound = inspect.signature(original).bind(model, *args, **kwargs)
    bound.apply_defaults()
    if not strategy.is_chief:
        bound.arguments["verbose"] = 0
        bound.arguments["callbacks"] = without_file_writers(bound.arguments["callbacks"])
    with strategy.scope(), errors.errors_explained(model):
        return original(*bound.args, **bound.kwargs)


def train_on_batch(original, model, *args, **kwargs):
    """Keras' ``train_on_batch`` with this worker's own batch: one step of the model's training step, synchronous
    over the workers, so the global batch is the workers' batches in rank order.

    Before its first call, and before any call after some worker set or loaded the model's weights (one scalar
    allreduce per call tells), worker 0's replicated weights are broadcast, as ``fit`` does at its start: each
    worker may have initialized or loaded its own. A model built by that call gets its new variables broadcast when
    its step is first traced, before it runs (as each is created, if the step runs eagerly). The workers' batches
    may differ in size: the step weights each worker's gradient by its share of the global batch
    (``step/global_losses.py``). After the first call, the replicated non-trainable variables the step may assign
    are compared over the workers, as ``fit`` does after its first step."""
    state = model_state.compiled(model)
    strategy = state.strategy
    model_state.guard_tracking(strategy, model, optimizer_compat.step_optimizer(model))
    written = strategy.num_workers > 1 and ps_writes.take_written(strategy)
    stale = collectives.any_worker(not state.on_batch_synced or written, strategy.num_workers, name="kp_weights_set")
    if stale:
        state.weights, state.on_batch_synced = fit_callbacks.ReplicatedWeights(strategy, model), True
        state.weights.sync()
    expect_uneven_batches(model, True)
    with strategy.scope(), errors.errors_explained(model):
        logs = original(model, *args, **kwargs)
    # Variables an eager step created were broadcast only now: the comparison waits for the next call.
    late = state.weights.sync_late() if stale else []
    if not state.state_checked and not late:
        state.state_checked = True
        if strategy.num_workers > 1 and strategy.options.sync:
            fit_callbacks.check_same_state(strategy, model)
    return logs


def expect_uneven_batches(model, uneven):
    """Traces the training step again if whether the workers' batches may differ in size changed."""
    state = model_state.compiled(model)
    if state.uneven_batches != uneven:
        state.uneven_batches = uneven
        model.train_function = None
