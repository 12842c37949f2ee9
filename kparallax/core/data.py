"""How each worker reads its own shard of the training data.

Arrays (``x``, ``y``, ``sample_weight``: NumPy arrays, tensors, ``tf.SparseTensor`` and ``tf.RaggedTensor`` inputs,
or lists/dicts of them) are split by global batches: with per-worker ``batch_size=B``, worker ``i`` of ``N`` keeps
the ``i``-th contiguous part of each run of ``N*B`` rows (``dataset_split.part_bounds``). With ``shuffle=False``,
step ``k`` then trains on exactly the rows ``[k*N*B, (k+1)*N*B)`` of the original arrays, the workers' batches
(worker 0's first) in one process's order: the global batch a single process would see with ``batch_size=N*B``, the
partial last one included (the workers' last batches then differ by at most a row), unless it has fewer rows than
workers.

A ``tf.data.Dataset`` (already batched, as Keras expects) is split by whole batches: worker ``i`` keeps batches
``i, i+N, ...`` (``Dataset.shard``). When the batch count is not a multiple of ``N``, the rows of the last
``count % N`` batches (one process's last global batch) are split in order into the workers' last batches, where
the dataset shows that they can be; otherwise those batches are left out, so that every worker runs the same number
of steps. The batches of a ``padded_batch`` are padded to the longest in their step, as one process pads its global
batch (``dataset_split``). A dataset of unknown length needs ``steps_per_epoch``.

A ``keras.utils.Sequence`` is split by whole batches too (batches ``i, i+N, ...`` of its ``__getitem__``: each
worker loads its own batches only; the rows of its last ``len % N`` batches as a dataset's; its ``on_epoch_end``
once per epoch, also under ``fit(workers=K)`` / ``use_multiprocessing``), a Python generator by
drawing every batch and keeping batches ``i, i+N, ...`` (it needs ``steps_per_epoch``, as a dataset of unknown
length does).

A dataset that each worker already reads its own part of (say, its own files) is marked with ``per_worker``, or
with tf.distribute's ``AutoShardPolicy.OFF`` in its options; ``fit`` then uses it as is, after checking that every
worker runs the same number of steps per epoch. A dataset sharded per worker with ``Dataset.shard(N, ...)`` and not
marked is refused (``fit`` would shard it again: each worker would train on 1/N of its part), and so is a dataset
shuffled without a seed (each worker would split its own order: their batches would overlap); ``fit`` also
compares the shuffle seeds across workers (``shuffle_seeds``).
"""

import threading

import numpy as np
import tensorflow as tf

from kparallax import log as logging
from kparallax._compat import tf as tf_compat
from kparallax.core import dataset_split


def _rows(a):
    return int(a.shape[0])


def _row_count(structure):
    """The row count of every array in ``structure`` (None for no arrays); they must agree."""
    counts = {_rows(a) for a in tf.nest.flatten(structure) if a is not None}
    if len(counts) > 1:
        raise ValueError(f"All training arrays need the same number of rows to be sharded. Received row counts "
                         f"{sorted(counts)}.")
    return counts.pop() if counts else None


def _kept_rows(rows, num_workers, batch_size):
    """How many of ``rows`` the split keeps: all when every worker has a row in every step, that is when the last
    global batch (of ``num_workers * batch_size`` rows) is full or has at least ``num_workers`` rows; otherwise that
    last batch's rows are left out. Without a ``batch_size`` (``steps_per_epoch`` given), a multiple of the workers."""
    if batch_size is None:
        return rows - rows % num_workers
    last = rows % (num_workers * batch_size)
    return rows - last if 0 < last < num_workers else rows


def rows_per_step(structure, num_workers, batch_size, steps_per_epoch):
    """The rows of each of a worker's steps over its shard of the arrays ``structure``, as Keras batches them: the
    per-worker ``batch_size``, or without one ``ceil(rows / steps_per_epoch)`` of the shard's rows (the row count
    cut to a multiple of N, as ``shard_arrays`` cuts it with ``steps_per_epoch``); None without arrays."""
    if batch_size:
        return batch_size
    rows = _row_count(structure)
    return None if rows is None else -(-(rows // num_workers) // steps_per_epoch)


def arrays_uneven(structure, num_workers, batch_size):
    """Whether the workers' last batches of sharded arrays differ in size (their shards differ by a row)."""
    rows = _row_count(structure)
    return rows is not None and _kept_rows(rows, num_workers, batch_size) % num_workers != 0


def shard_arrays(structure, num_workers, index, batch_size=None, step_rows=None):
    """Worker ``index``'s shard of every array in ``structure`` (None entries stay None): its contiguous part of each
    global batch of ``N * step_rows`` rows, in order (``step_rows``: the worker's rows per step, ``batch_size`` by
    default; without either, one part of all the rows).

    With the per-worker ``batch_size``, step k's batches are the rows of one process's step k with batches of
    ``N * batch_size``, in its order, its last, partial batch included (the workers' last batches may then differ by
    a row), unless that batch has fewer rows than workers: then it is left out, with a warning from worker 0. Without
    one (``steps_per_epoch`` given), the row count is cut to a multiple of N."""
    n = _row_count(structure)
    if n is None:
        return structure
    usable = _kept_rows(n, num_workers, batch_size)
    if usable == 0:
        raise ValueError(f"The training data has {n} row(s), fewer than the {num_workers} workers; each worker "
                         f"needs at least one. Received: {n} rows.")
    if index == 0 and usable < n:
        if batch_size is None:
            why = f"the row count is cut to a multiple of the {num_workers} workers (steps_per_epoch is given)"
        else:
            why = (f"with the global batch of {num_workers * batch_size} rows they would make a last step of fewer "
                   f"rows than the {num_workers} workers")
        logging.warning("fit trains on %d of the %d rows in each epoch: the last %d row(s), which one process would "
                        "train on, are left out: %s. Give a row count without such a remainder to train on every "
                        "row.", usable, n, n - usable, why)
    positions = _worker_rows(usable, num_workers, index, step_rows or batch_size or -(-usable // num_workers))
    return tf.nest.map_structure(lambda a: None if a is None else dataset_split.take_rows(a, positions), structure)


def _worker_rows(usable, num_workers, index, step_rows):
    """The row numbers worker ``index`` keeps of ``usable`` rows: its part of each run of ``N * step_rows``."""
    global_batch = num_workers * step_rows
    runs = []
    for start in range(0, usable, global_batch):
        first, size = dataset_split.part_bounds(min(global_batch, usable - start), num_workers, index)
        runs.append(np.arange(start + first, start + first + size))
    return np.concatenate(runs)


def shard_dataset(dataset, num_workers, index, steps_per_epoch=None):
    """Shards a batched dataset by whole batches so every worker runs the same number of steps.

    When the batch count is not a multiple of the workers, the last global batch is made of the rows of the last
    ``batches % num_workers`` batches, split in order (as each global batch of arrays is), where
    ``dataset_split.last_rows_blocker`` finds nothing against it; otherwise those batches are left out, with a
    warning from worker 0 saying why. Batches of a ``padded_batch`` are padded to the longest in their step."""
    _check_shardable(dataset, num_workers)
    cardinality = int(dataset.cardinality())
    if cardinality == tf.data.UNKNOWN_CARDINALITY and steps_per_epoch is None:
        raise ValueError(
            "The dataset's length is unknown, so kparallax cannot give every worker the same number of steps. "
            "Pass steps_per_epoch=..., or declare the length with "
            "dataset.apply(tf.data.experimental.assert_cardinality(n)). Received: cardinality=UNKNOWN.")
    padding = dataset_split.padding_values(dataset)
    if cardinality >= 0:
        blocker = None
        if cardinality % num_workers:
            blocker = dataset_split.last_rows_blocker(dataset, cardinality, num_workers, padding)
            if blocker is None:
                return dataset_split.split(dataset, cardinality, num_workers, index, padding)
        usable = cardinality - cardinality % num_workers
        if usable == 0:
            raise ValueError(f"The dataset has {cardinality} batch(es), fewer than the {num_workers} workers"
                             f"{_unsplit(blocker)}. Use a smaller batch size or more data. Received: {cardinality} "
                             f"batches.")
        if index == 0 and blocker is not None:
            _warn_batches_left_out("dataset", usable, cardinality, num_workers, blocker)
        dataset = dataset.take(usable)
    if padding is not None:
        return dataset_split.split(dataset, usable if cardinality >= 0 else None, num_workers, index, padding)
    return dataset.shard(num_workers, index)


class _SequenceShard(tf.keras.utils.Sequence):
    """Batches ``index, index + N, ...`` of a ``keras.utils.Sequence`` (whole batches, as a dataset is sharded) of its
    first ``len - len % N``, then, with ``split_last``, one batch of its part (in order) of the rows of its last
    ``len % N`` batches joined (one process's last global batch); its ``on_epoch_end`` is the sequence's, once per
    epoch on every worker."""

    def __init__(self, sequence, num_workers, index, split_last):
        super().__init__()
        self._sequence, self._n, self._index = sequence, num_workers, index
        self._fit_thread = threading.get_ident()  # fit shards the sequence in the thread that runs its epochs
        self._whole = len(sequence) // num_workers
        self._length = self._whole + int(split_last)

    def __len__(self):
        return self._length

    def __getitem__(self, k):
        if not 0 <= k < self._length:
            raise IndexError(f"Batch {k} of a shard of {self._length} batches.")
        if k < self._whole:
            return self._sequence[k * self._n + self._index]
        batches = _last_batches(self._sequence, self._n)
        blocker = _sequence_rows_blocker(batches, self._n)
        if blocker is not None:
            raise ValueError(f"fit splits the rows of the Sequence's last {len(batches)} batch(es) over the {self._n} "
                             f"workers, as it found them when it started, and now it cannot: {blocker}. Give the "
                             f"Sequence a batch count that is a multiple of {self._n}.")
        joined = tf.nest.map_structure(lambda *parts: np.concatenate(parts), *batches)
        rows = len(tf.nest.flatten(joined)[0])
        return tf.nest.map_structure(lambda a: dataset_split.part(a, self._index, rows, self._n), joined)

    def on_epoch_end(self):
        # fit calls this at each epoch's end. Under fit(workers=K > 1) or use_multiprocessing, Keras' OrderedEnqueuer
        # also calls it from its own thread once it has handed out a whole epoch's batches, unless fit's call stops it
        # first (it polls every 0.1 s): an epoch whose last step and epoch end took longer (a collective, validation)
        # reshuffled a sequence twice, on each worker as its timing fell (0.053 off one process, silently).
        if threading.get_ident() == self._fit_thread:
            self._sequence.on_epoch_end()


def _last_batches(sequence, num_workers):
    count = len(sequence)
    return [sequence[k] for k in range(count - count % num_workers, count)]


def _sequence_rows_blocker(batches, num_workers):
    """Why the rows of a Sequence's last ``batches`` cannot be split over the workers (a sentence), or None: they must
    be NumPy arrays (in one structure) whose shapes differ in their row count only, with a row for each worker."""
    try:
        for batch in batches[1:]:
            tf.nest.assert_same_structure(batches[0], batch)
    except (TypeError, ValueError):
        return "their structures differ"
    leaves = [tf.nest.flatten(batch) for batch in batches]
    for position in range(len(leaves[0])):
        parts = [batch[position] for batch in leaves]
        if not all(isinstance(part, np.ndarray) and part.ndim > 0 for part in parts):
            kinds = sorted({type(part).__name__ for part in parts})
            return f"they hold values that are not NumPy arrays with a batch dimension ({', '.join(kinds)})"
        if len({part.shape[1:] for part in parts}) > 1:
            return f"their arrays' shapes differ beyond the row count ({[part.shape for part in parts]})"
    rows = sum(batch[0].shape[0] for batch in leaves) if leaves[0] else 0
    if rows < num_workers:
        return f"they hold {rows} row(s), fewer than the {num_workers} workers"
    return None


def shard_sequence(sequence, num_workers, index):
    """Worker ``index``'s shard of a ``keras.utils.Sequence``: its batches ``index, index + N, ...``, and when the
    batch count is not a multiple of N, its part (in order) of the rows of the last ``len % N`` batches (loaded
    once here, to see that they can be split; otherwise they are left out, with a warning from worker 0)."""
    batches = len(sequence)
    blocker = None
    if batches % num_workers:
        blocker = _sequence_rows_blocker(_last_batches(sequence, num_workers), num_workers)
        if blocker is None:
            return _SequenceShard(sequence, num_workers, index, split_last=True)
    if batches < num_workers:
        raise ValueError(f"The Sequence has {batches} batch(es), fewer than the {num_workers} workers"
                         f"{_unsplit(blocker)}. Use a smaller batch size or more data. Received: "
                         f"len(sequence)={batches}.")
    if index == 0 and blocker is not None:
        _warn_batches_left_out("Sequence", batches - batches % num_workers, batches, num_workers, blocker)
    return _SequenceShard(sequence, num_workers, index, split_last=False)


def _unsplit(blocker):
    return "" if blocker is None else f", and their rows cannot be split over the workers: {blocker}"


def _warn_batches_left_out(kind, usable, batches, num_workers, why):
    logging.warning("fit trains on %d of the %s's %d batches in each epoch: every worker runs the same number of "
                    "steps, so the batch count is cut to a multiple of the %d workers, and the last %d batch(es), "
                    "which one process would train on, are left out (their rows are not split over the workers: %s). "
                    "Give a batch count that is a multiple of %d (another batch size), or repeat the data and give "
                    "steps_per_epoch, to train on every row.",
                    usable, kind, batches, num_workers, batches - usable, why, num_workers)


def shard_generator(generator, num_workers, index, steps_per_epoch):
    """Worker ``index``'s shard of a Python generator of batches: every worker draws every batch and keeps batches
    ``index, index + N, ...`` (as TensorFlow's strategies shard such input); its length is unknown, so every worker
    needs the same ``steps_per_epoch``."""
    if steps_per_epoch is None:
        raise ValueError(
            "A generator's length is unknown, so kparallax cannot give every worker the same number of steps. Pass "
            "steps_per_epoch=... (each step takes one batch per worker from the generator). Received: "
            "steps_per_epoch=None.")
    return (batch for position, batch in enumerate(generator) if position % num_workers == index)


def is_sequence(x):
    return isinstance(x, tf.keras.utils.Sequence)


def is_generator(x):
    """A Python generator or iterator of batches (what Keras' generator adapter takes), not a Sequence."""
    return hasattr(x, "__next__") and hasattr(x, "__iter__") and not is_sequence(x)


def may_be_uneven(x):
    """Whether the workers' batches of training input ``x`` may differ in size: a dataset whose batch dimension is
    not fixed (a last, partial batch; ``drop_remainder=True`` fixes it), or a Sequence or generator (their batches
    are only known when read). For arrays, ``arrays_uneven`` tells (it needs the batch size)."""
    if is_sequence(x) or is_generator(x):
        return True
    if not is_dataset(x):
        return False
    shapes = [spec.shape for spec in tf.nest.flatten(x.element_spec) if hasattr(spec, "shape")]
    return any(shape.rank is None or (shape.rank > 0 and shape[0] is None) for shape in shapes)


def is_dataset(x):
    return isinstance(x, tf.data.Dataset)


def is_arrays(x):
    """Whether ``x`` (an input or ``validation_data``) is arrays or tensors that Keras batches by a batch size: given,
    and not a dataset, Sequence or generator, which bring their own batches."""
    return x is not None and not (is_dataset(x) or is_sequence(x) or is_generator(x))


def check_supported(x):
    if (x is None or is_dataset(x) or is_sequence(x) or is_generator(x) or hasattr(x, "shape")
            or isinstance(x, (list, tuple, dict))):
        return
    raise TypeError(
        "kparallax shards NumPy arrays, tensors, tf.data.Dataset, keras.utils.Sequence and generator inputs. "
        f"Received: {type(x).__name__}.")


_PER_WORKER = "_kparallax_per_worker"


def per_worker(dataset):
    """Marks a batched ``tf.data.Dataset`` as this worker's own share of the data: ``fit`` will not shard it.

    Every worker must run the same number of steps per epoch (give ``steps_per_epoch`` or a dataset of known
    length); ``fit`` checks this across workers before training and names the counts if they differ.
    """
    if not is_dataset(dataset):
        raise TypeError(f"per_worker takes a tf.data.Dataset. Received: {type(dataset).__name__}.")
    setattr(dataset, _PER_WORKER, True)
    return dataset


def is_per_worker(x):
    """A dataset marked with ``per_worker``, or whose options turn tf.distribute's auto-sharding off."""
    if not is_dataset(x):
        return False
    policy = x.options().experimental_distribute.auto_shard_policy
    return getattr(x, _PER_WORKER, False) or policy == tf.data.experimental.AutoShardPolicy.OFF


def _check_shardable(dataset, num_workers):
    """Refuses a dataset that splitting by whole batches would not split into the workers' parts of one order: one
    already sharded into ``num_workers`` parts (Horovod's ``dataset.shard(hvd.size(), hvd.rank())``: each worker
    would keep 1/N of its part), or one shuffled without a seed or built to give its elements out of order
    (``deterministic=False``): each worker would draw its own order, so their batches would overlap, and an epoch
    would train on some rows twice and miss others."""
    if num_workers < 2:
        return
    chain = tf_compat.dataset_chain(dataset)
    for part in chain:
        shard = tf_compat.shard_of(part)
        if shard is not None and shard[0] == num_workers:
            raise ValueError(
                f"The dataset is already split into {num_workers} shards, one per worker (Dataset.shard), and fit "
                f"shards a dataset itself (worker i keeps batches i, i+N, ...): each worker would train on "
                f"1/{num_workers} of its shard. Received: a dataset with shard(num_shards={shard[0]}, "
                f"index={shard[1]}). Remove the shard, or keep it and mark the dataset with "
                "kparallax.data.per_worker(dataset) (or tf.data.Options().experimental_distribute.auto_shard_policy "
                "= AutoShardPolicy.OFF) so fit uses it as it is.")
    unordered = tf_compat.unordered(dataset)
    if unordered:
        raise ValueError(
            "The dataset may give its elements in another order each time it runs, and fit splits each worker's own "
            "run of it by whole batches (worker i keeps batches i, i+N, ...): the workers' batches would overlap, and "
            "an epoch would train on some rows twice and miss others (seen: 29 of 256 rows with an interleave). "
            f"Received: a dataset with {', '.join(unordered)}. Leave deterministic at its default (True), or shard "
            "the dataset yourself, per worker, and mark it with kparallax.data.per_worker(dataset).")
    if any(tf_compat.order_seeds(part) == (0, 0) for part in chain):  # no seed, no global seed: random per process
        raise ValueError(
            "The dataset is shuffled (or sampled: Dataset.random, sample_from_datasets) without a seed, so each "
            "worker draws its own order, and fit splits it by whole batches (worker i keeps batches i, i+N, ...): the "
            "workers' batches would overlap, and an epoch would train on some rows twice and miss others. Received: a "
            "dataset with shuffle(seed=None) (or random(seed=None)) and no global seed. Give it a seed, the same on "
            "every worker (dataset.shuffle(n, seed=s), sample_from_datasets(..., seed=s), or "
            "tf.keras.utils.set_random_seed(s) before the dataset is built), or shard the dataset yourself before "
            "shuffling and mark it kparallax.data.per_worker(dataset).")


def shuffle_seeds(dataset):
    """The seeds of every ``Dataset.shuffle`` (and ``Dataset.random``) in ``dataset``'s chain, as a flat list of ints
    (-1 where not known), outermost first; empty if it draws no random order. Workers splitting one dataset by
    batches must find the same."""
    seeds = [tf_compat.order_seeds(part) for part in tf_compat.dataset_chain(dataset)]
    return [-1 if value is None else value for pair in seeds if pair is not None for value in pair]


def local_steps(dataset, steps_per_epoch):
    if steps_per_epoch is not None:
        return int(steps_per_epoch)
    cardinality = int(dataset.cardinality())
    if cardinality < 0:
        raise ValueError("A per_worker dataset of unknown or infinite length needs steps_per_epoch (the same on "
                         f"every worker). Received: cardinality={cardinality}, steps_per_epoch=None.")
    return cardinality


def min_over_workers(value):
    """The smallest ``value`` over all workers (e.g. steps per epoch of per-worker data). A collective."""
    import horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
    from kparallax.step import collectives  # pylint: disable=import-outside-toplevel
    if hvd.size() == 1:
        return value
    return min(row[0] for row in collectives.allgather_ints([int(value)], name="kp_min_over_workers"))
