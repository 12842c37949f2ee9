import logging
import re
import time

import numpy as np
import pytest
import tensorflow as tf

from kparallax.core import data


def test_shards_joined_in_worker_order_are_one_process_s_global_batches_in_its_order():
    # Each worker keeps its contiguous part of each global batch. Before, worker i kept rows i, i+N, ...: the same
    # rows in another order, so pairs of consecutive rows joined by a reshape were other pairs than one process's.
    x = np.arange(20)
    for workers, b in ((2, 3), (3, 2)):
        shards = [data.shard_arrays(x, workers, i, step_rows=b) for i in range(workers)]
        for step in range(3):
            joined = np.concatenate([s[step * b:(step + 1) * b] for s in shards])
            np.testing.assert_array_equal(joined, np.arange(step * workers * b, (step + 1) * workers * b))


def test_shards_are_equal_length_and_structures_are_kept():
    x = {"a": np.arange(11), "b": np.arange(11) * 2}
    parts = [data.shard_arrays((x, np.arange(11), None), 3, i) for i in range(3)]
    assert [len(p[0]["a"]) for p in parts] == [3, 3, 3]
    np.testing.assert_array_equal(parts[1][0]["b"], parts[1][1] * 2)
    assert parts[0][2] is None


def test_with_a_batch_size_the_last_partial_global_batch_is_shared_by_the_workers():
    """Per-worker batches of B: step k's batches are one process's step k with batches of N*B, the partial last one
    included (23 rows, N=2, B=4: 8 + 8 + 7 rows; the workers' last batches are 4 and 3 rows), unless it has fewer
    rows than workers (25 rows: its 1 row is left out, with a warning)."""
    x = np.arange(23)
    shards = [data.shard_arrays((x, x * 2), 2, i, batch_size=4) for i in range(2)]
    assert data.arrays_uneven((x, x * 2), 2, 4) and [len(s[0]) for s in shards] == [12, 11]
    for step in range(3):
        joined = np.concatenate([s[0][step * 4:(step + 1) * 4] for s in shards])
        np.testing.assert_array_equal(joined, np.arange(step * 8, min(step * 8 + 8, 23)))
    np.testing.assert_array_equal(shards[1][1], shards[1][0] * 2)
    assert [len(data.shard_arrays(np.arange(25), 2, i, batch_size=4)) for i in range(2)] == [12, 12]
    assert not data.arrays_uneven(np.arange(25), 2, 4) and not data.arrays_uneven(np.arange(24), 2, 4)
    [message] = _warnings_of(lambda: data.shard_arrays(np.arange(25), 2, 0, batch_size=4))
    assert message.startswith("fit trains on 24 of the 25 rows in each epoch: the last 1 row(s), which one process "
                              "would train on, are left out: with the global batch of 8 rows they would make a last "
                              "step of fewer rows than the 2 workers.")
    assert _warnings_of(lambda: data.shard_arrays(x, 2, 0, batch_size=4)) == []


def test_sparse_and_ragged_inputs_are_sharded_by_rows_like_dense_ones():
    dense = np.array([[0, 1, 0], [2, 0, 0], [0, 0, 3], [4, 5, 0], [0, 0, 0], [6, 0, 7], [8, 0, 0]], np.float32)
    ragged = tf.ragged.constant([[r] * (r % 3) for r in range(7)])
    for worker in range(3):
        sparse, ragged_part, expected = data.shard_arrays((tf.sparse.from_dense(dense), ragged, dense), 3, worker)
        assert isinstance(sparse, tf.SparseTensor)
        np.testing.assert_array_equal(tf.sparse.to_dense(sparse).numpy(), expected)
        assert ragged_part.to_list() == [[r] * (r % 3) for r in range(2 * worker, 2 * worker + 2)]
        # With a batch size of 3, all 7 rows are kept (3 + 2 + 2): the sparse shard has its own row count.
        sparse, ragged_part, expected = data.shard_arrays((tf.sparse.from_dense(dense), ragged, dense), 3, worker,
                                                          batch_size=3)
        assert len(expected) == (3 if worker == 0 else 2)
        np.testing.assert_array_equal(tf.sparse.to_dense(sparse).numpy(), expected)
        first = [0, 3, 5][worker]
        assert ragged_part.to_list() == [[r] * (r % 3) for r in range(first, first + len(expected))]
        np.testing.assert_array_equal(expected, dense[first:first + len(expected)])


def _warnings_of(action):
    """The kparallax log records ``action()`` emits."""
    records, handler = [], logging.Handler()
    handler.emit = records.append
    logging.getLogger("kparallax").addHandler(handler)
    try:
        action()
    finally:
        logging.getLogger("kparallax").removeHandler(handler)
    return [r.getMessage() for r in records if r.levelno == logging.WARNING]


def test_dataset_shards_whole_batches_and_equal_steps():
    ds = tf.data.Dataset.range(7).batch(1)
    shards = [list(data.shard_dataset(ds, 2, i).as_numpy_iterator()) for i in range(2)]
    assert [len(s) for s in shards] == [3, 3]
    assert [int(b[0]) for b in shards[1]] == [1, 3, 5]


def test_data_left_out_to_give_every_worker_the_same_steps_is_named_by_worker_0():
    rows = (np.zeros((7, 2)), np.zeros(7))
    assert _warnings_of(lambda: data.shard_arrays(rows, 2, 0)) == [
        "fit trains on 6 of the 7 rows in each epoch: the last 1 row(s), which one process would train on, are left "
        "out: the row count is cut to a multiple of the 2 workers (steps_per_epoch is given). Give a row count "
        "without such a remainder to train on every row."]
    assert _warnings_of(lambda: data.shard_arrays(rows, 2, 1)) == []  # worker 0 says it, once
    assert _warnings_of(lambda: data.shard_arrays(rows, 7, 0)) == []
    [message] = _warnings_of(lambda: data.shard_dataset(tf.data.Dataset.range(7).batch(1), 3, 0))
    assert message.startswith("fit trains on 6 of the dataset's 7 batches in each epoch")
    assert "(their rows are not split over the workers: the last 1 batch(es) hold 1 row(s), fewer than the 3 " \
           "workers)" in message
    assert _warnings_of(lambda: data.shard_dataset(tf.data.Dataset.range(6).batch(1), 3, 0)) == []
    [message] = _warnings_of(lambda: data.shard_sequence(_Rows(np.arange(9), 2), 4, 0))
    assert message.startswith("fit trains on 4 of the Sequence's 5 batches in each epoch")
    assert "(their rows are not split over the workers: they hold 1 row(s), fewer than the 4 workers)" in message


def test_the_last_batches_of_an_odd_count_are_split_by_rows_as_one_process_batches_them():
    # 27 rows (ids, a sparse feature, y, weights) batched by 4: 7 batches, the last of 3 rows. One process with the
    # global batch of N * 4 rows trains on the same rows in each step: its last step's rows are those of the last
    # 7 % N batches, which the workers' last batches share in order (worker 0 the first part; before, by striding).
    dense = np.zeros((27, 5), np.float32)
    dense[np.arange(27), np.arange(27) % 5] = np.arange(1, 28)
    rows = ({"ids": np.arange(27 * 3, dtype=np.int64).reshape(27, 3), "s": tf.sparse.from_dense(dense)},
            np.arange(27), np.linspace(0.5, 1.5, 27).astype(np.float32))
    ds = tf.data.Dataset.from_tensor_slices(rows).batch(4).prefetch(1)
    for workers, last_rows in ((2, [[24, 25], [26]]), (4, [[16, 17, 18], [19, 20, 21], [22, 23, 24], [25, 26]])):
        assert _warnings_of(lambda n=workers: data.shard_dataset(ds, n, 0)) == []
        shards = [list(data.shard_dataset(ds, workers, i)) for i in range(workers)]
        assert {len(s) for s in shards} == {7 // workers + 1}
        for worker, shard in enumerate(shards):
            assert [b[1].numpy().tolist() for b in shard[:-1]] == [list(range(4 * k, 4 * k + 4))
                                                                  for k in range(worker, 7 - 7 % workers, workers)]
            x, y, w = shard[-1]
            y = y.numpy()
            assert y.tolist() == last_rows[worker]
            assert (x["ids"][:, 0] // 3).numpy().tolist() == y.tolist() and w.numpy().tolist() == rows[2][y].tolist()
            assert tf.sparse.to_dense(x["s"]).numpy().max(axis=1).tolist() == (y + 1).tolist()  # each row's entry
        assert data.shard_dataset(ds, workers, 1).cardinality() == 7 // workers + 1
    # The rows are kept where the last batches can be split; otherwise they are left out, and worker 0 says why.
    for ds, workers, why in (
            (tf.data.Dataset.range(9).batch(4), 2, "the last 1 batch(es) hold 1 row(s), fewer than the 2 workers"),
            (tf.data.Dataset.range(20).batch(4, drop_remainder=True), 3, "its batches have a fixed size (4"),
            (tf.data.Dataset.range(6).map(lambda v: tf.range(v)).padded_batch(2).map(lambda b: b * 2).take(3), 2,
             "its batches' shapes vary ((None, None)), and kparallax cannot tell how to pad them"),
            (tf.data.Dataset.from_tensor_slices(tf.ragged.constant([[1], [2, 3], [4]])).batch(1), 2, "ragged"),
            (tf.data.Dataset.range(9).filter(lambda v: v < 7).batch(2).apply(
                tf.data.experimental.assert_cardinality(4)).take(3), 2, "cannot tell from the dataset how many")):
        messages = _warnings_of(lambda d=ds, n=workers: data.shard_dataset(d, n, 0))
        left_out = [m for m in messages if m.startswith("fit trains on")]
        assert len(left_out) == 1 and why in left_out[0], messages
        assert len(messages) == 1, messages
    # A map that changes the rows after the batch is not seen before; the split stops at the last step, naming them.
    shrunk = tf.data.Dataset.range(12).batch(4).map(lambda b: b[:1])
    with pytest.raises(tf.errors.InvalidArgumentError, match="hold fewer rows than workers"):
        list(data.shard_dataset(shrunk, 2, 0))


def _steps_of(shards, by):
    """Each step's rows over all workers' shards, ordered by the ``by`` component of each row."""
    steps = []
    for batches in zip(*shards):
        rows = [np.concatenate([batch[k] for batch in batches]) for k in range(2)]
        order = np.argsort(rows[by], kind="stable")
        steps.append([r[order] for r in rows])
    return steps


def test_padded_batches_are_padded_to_the_longest_in_their_step_as_one_process_pads_its_global_batch():
    # A model that does not mask the padding (a pooling over time) sees one process's inputs only if each worker's
    # batch is padded to the longest element of the step's global batch, with the dataset's padding value.
    lengths = [3, 1, 5, 2, 4, 1, 2, 6, 1, 2]
    rows = tf.data.Dataset.range(10).map(lambda k: (tf.fill([tf.gather(lengths, k)], k), k))
    pad = (tf.constant(-1, tf.int64), tf.constant(0, tf.int64))
    for workers in (2, 3):  # 5 batches of 2: the last rows split 1 + 1 on 2 workers, 2 + 1 + 1 on 3
        one_process = list(rows.padded_batch(2 * workers, padding_values=pad).as_numpy_iterator())
        dataset = rows.padded_batch(2, padding_values=pad).prefetch(1)
        assert _warnings_of(lambda n=workers: data.shard_dataset(dataset, n, 0)) == []
        shards = [list(data.shard_dataset(dataset, workers, i).as_numpy_iterator()) for i in range(workers)]
        assert {len(shard) for shard in shards} == {len(one_process)}
        for got, want in zip(_steps_of(shards, by=1), one_process):
            np.testing.assert_array_equal(got[1], want[1])
            np.testing.assert_array_equal(got[0], want[0])  # the same width and padding (-1) as one process's
    # Repeated, with steps_per_epoch: the steps are padded alike, with no end.
    shards = [list(data.shard_dataset(rows.padded_batch(2, padding_values=pad).repeat(), 2, i,
                                      steps_per_epoch=4).take(3).as_numpy_iterator()) for i in range(2)]
    assert [s[0].shape[1] for s in shards[0]] == [s[0].shape[1] for s in shards[1]] == [5, 6, 3]
    # A map after the padded_batch hides the padding values: batches as they come (each its own width).
    mapped = rows.padded_batch(2, padding_values=pad).map(lambda x, k: (x, k)).take(4)
    assert [b[0].shape[1] for b in data.shard_dataset(mapped, 2, 0).as_numpy_iterator()] == [3, 4]


def test_a_dataset_sharded_per_worker_by_the_user_is_refused_unless_marked():
    # Horovod's pattern: each worker shards its dataset itself; fit sharding it again would keep 1/N of each part.
    files = tf.data.Dataset.from_tensor_slices(["a", "b", "c", "d"])
    for ds in (tf.data.Dataset.range(40).shard(2, 1).batch(4).prefetch(1),
               files.shard(2, 0).interleave(lambda f: tf.data.Dataset.from_tensors(f).repeat(3)).batch(2),
               tf.data.Dataset.zip((tf.data.Dataset.range(8), tf.data.Dataset.range(16).shard(2, 1))).batch(2)):
        with pytest.raises(ValueError, match=r"already split into 2 shards.*Received: a dataset with "
                                             r"shard\(num_shards=2, index=[01]\).*per_worker"):
            data.shard_dataset(ds, 2, 0)
        assert not data.is_per_worker(ds)
        assert data.is_per_worker(data.per_worker(ds))
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        assert data.is_per_worker(ds.with_options(options))  # tf.distribute's way of saying "sharded already"
    # A shard into another number of parts (a subsample) is the user's data; fit shards it by batches as usual.
    subsample = tf.data.Dataset.range(24).shard(3, 0).batch(2)
    assert [list(b) for b in data.shard_dataset(subsample, 2, 1).as_numpy_iterator()] == [[6, 9], [18, 21]]
    assert len(list(data.shard_dataset(tf.data.Dataset.range(8).shard(2, 0).batch(2), 1, 0))) == 2


def test_a_dataset_shuffled_without_a_seed_is_refused_and_a_seeded_one_is_split_into_one_order():
    tf.random.set_seed(None)  # no global seed (another test may have set one)
    unseeded = tf.data.Dataset.range(40).shuffle(40).batch(4).prefetch(1)
    sampled = tf.data.Dataset.sample_from_datasets([tf.data.Dataset.range(20), tf.data.Dataset.range(20, 40)])
    for dataset in (unseeded, sampled.batch(4)):
        with pytest.raises(ValueError, match=r"shuffled \(or sampled.*without a seed.*Received: a dataset with "
                                             r"shuffle\(seed=None\)"):
            data.shard_dataset(dataset, 2, 0)
    seeded = tf.data.Dataset.sample_from_datasets([tf.data.Dataset.range(20), tf.data.Dataset.range(20, 40)], seed=4)
    assert data.shuffle_seeds(seeded.batch(4).shuffle(3, seed=5))[2:] == [87654321, 4]  # TF's default graph seed
    assert len(list(data.shard_dataset(seeded.batch(4), 2, 0, steps_per_epoch=5).take(5))) == 5
    assert len(list(data.shard_dataset(unseeded, 1, 0))) == 10  # one worker: any order is one process's
    assert data.is_per_worker(data.per_worker(tf.data.Dataset.range(40).shuffle(40).batch(4)))
    # Seeded, by the shuffle or by the global seed: each worker (its own process, here its own dataset built after
    # the same global seed) draws one order, and the split partitions it.
    for seed, global_seed in ((3, None), (None, 7)):
        rows = []
        for worker in range(2):
            tf.random.set_seed(global_seed)
            seeded = tf.data.Dataset.range(40).shuffle(40, seed=seed).batch(4)
            rows.append(np.concatenate(list(data.shard_dataset(seeded, 2, worker).as_numpy_iterator())))
        assert sorted(np.concatenate(rows).tolist()) == list(range(40))
        assert rows[0].tolist() != sorted(rows[0].tolist())  # shuffled
    tf.random.set_seed(None)


def _slow_row(x):
    time.sleep(np.random.default_rng().uniform(0, 0.002))  # uneven work per row, as files of different sizes take
    return x


def test_a_dataset_built_to_give_rows_out_of_order_is_refused_and_an_ordered_one_is_not():
    """Each worker runs the pipeline itself and keeps its batches of that run: an interleave with
    deterministic=False gave the two workers' runs different orders (a row trained twice, another missed, in an
    epoch); so can a parallel map or batch with deterministic=False, or any of them under
    Options.deterministic=False."""
    def rows(parallel):
        return tf.data.Dataset.range(64).interleave(
            lambda x: tf.data.Dataset.from_tensors(x).map(lambda y: tf.py_function(_slow_row, [y], tf.int64)),
            cycle_length=4, num_parallel_calls=4 if parallel else None, deterministic=False if parallel else None)

    runs = [np.concatenate(list(rows(True).batch(4).shard(2, worker).as_numpy_iterator())) for worker in range(2)]
    if len(set(np.concatenate(runs).tolist())) == 64:  # one pair of runs may happen to agree: try once more
        runs = [np.concatenate(list(rows(True).batch(4).shard(2, worker).as_numpy_iterator())) for worker in range(2)]
    assert len(set(np.concatenate(runs).tolist())) < 64, "the workers' runs split one order: nothing to refuse"
    unordered_options = tf.data.Options()
    unordered_options.deterministic = False
    for dataset, received in (
            (rows(True).batch(4), "interleave(deterministic=False)"),
            (tf.data.Dataset.range(64).map(lambda x: x, num_parallel_calls=2, deterministic=False).batch(4),
             "map(deterministic=False)"),
            (tf.data.Dataset.range(64).batch(4, num_parallel_calls=2, deterministic=False).prefetch(1),
             "batch(deterministic=False)"),
            (tf.data.Dataset.range(64).map(lambda x: x, num_parallel_calls=2).batch(4).with_options(unordered_options),
             "map(...) under tf.data.Options.deterministic=False")):
        with pytest.raises(ValueError, match=r"another order each time it runs.*Received: a dataset with " +
                           re.escape(received)):
            data.shard_dataset(dataset, 2, 0, steps_per_epoch=8)
        assert len(list(data.shard_dataset(dataset, 1, 0, steps_per_epoch=16))) == 16  # one worker: any order
    ordered = [rows(False).batch(4), tf.data.Dataset.range(64).map(lambda x: x, num_parallel_calls=2).batch(4),
               tf.data.Dataset.range(64).interleave(tf.data.Dataset.from_tensors, cycle_length=2,
                                                    num_parallel_calls=2).batch(4)]
    for dataset in ordered:
        parts = [np.concatenate(list(data.shard_dataset(dataset, 2, w, steps_per_epoch=8).as_numpy_iterator()))
                 for w in range(2)]
        assert sorted(np.concatenate(parts).tolist()) == list(range(64))


def test_batches_may_differ_in_size_only_for_datasets_without_a_fixed_batch_dimension():
    rows = {"ids": np.zeros((10, 3), np.int32), "w": np.ones(10, np.float32)}
    assert not data.may_be_uneven(rows)  # arrays: arrays_uneven tells, from the batch size
    assert data.may_be_uneven(tf.data.Dataset.from_tensor_slices(rows).batch(4))  # a last, partial batch
    assert not data.may_be_uneven(tf.data.Dataset.from_tensor_slices(rows).batch(4, drop_remainder=True))
    mixed = tf.data.Dataset.zip((tf.data.Dataset.from_tensor_slices(rows).batch(4, drop_remainder=True),
                                 tf.data.Dataset.range(10).batch(4)))
    assert data.may_be_uneven(mixed)


def test_dataset_of_unknown_length_needs_steps():
    ds = tf.data.Dataset.range(8).filter(lambda v: v > 2).batch(2)
    with pytest.raises(ValueError, match="Pass steps_per_epoch"):
        data.shard_dataset(ds, 2, 0)
    assert data.shard_dataset(ds, 2, 0, steps_per_epoch=1) is not None


def test_too_little_data():
    with pytest.raises(ValueError, match=r"fewer than the 4 workers; each worker needs at least one. Received: 3 rows"):
        data.shard_arrays(np.arange(3), 4, 0)
    with pytest.raises(ValueError, match=r"The Sequence has 1 batch\(es\), fewer than the 2 workers.*1 row\(s\).*"
                                         r"Received: len\(sequence\)=1"):
        data.shard_sequence(_Rows(np.arange(1), 4), 2, 0)
    with pytest.raises(ValueError, match=r"The Sequence has 0 batch\(es\), fewer than the 2 workers"):
        data.shard_sequence(_Rows(np.arange(0), 4), 2, 0)
    with pytest.raises(TypeError, match="Received: set"):
        data.check_supported({1, 2})


class _Rows(tf.keras.utils.Sequence):
    """Batches of ``rows`` (the last one partial), in an order ``on_epoch_end`` reverses."""

    def __init__(self, rows, batch_size):
        super().__init__()
        self.rows, self.batch_size, self.epochs_ended = rows, batch_size, 0

    def __len__(self):
        return -(-len(self.rows) // self.batch_size)

    def __getitem__(self, k):
        return self.rows[k * self.batch_size:(k + 1) * self.batch_size]

    def on_epoch_end(self):
        self.rows, self.epochs_ended = self.rows[::-1], self.epochs_ended + 1


class _Pairs(_Rows):
    """(x, y) batches: y is -x."""

    def __getitem__(self, k):
        x = super().__getitem__(k)
        return x, -x


class _Padded(tf.keras.utils.Sequence):
    """Five batches padded to their own longest row: (2, 3), (2, 4), ..., then (1, 7)."""

    def __len__(self):
        return 5

    def __getitem__(self, k):
        return np.zeros((1 if k == 4 else 2, 3 + k)), np.zeros(1 if k == 4 else 2)


def test_a_sequence_is_sharded_by_whole_batches_and_keeps_its_epoch_end():
    """Worker i loads batches i, i+N, ... only: with per-worker batches of B, step k's batches are the rows of one
    process's step k with batches of N*B, the partial last batch included."""
    sequence = _Rows(np.arange(23), 3)  # 8 batches, the last of 2 rows
    shards = [data.shard_sequence(sequence, 2, i) for i in range(2)]
    assert [len(s) for s in shards] == [4, 4]
    for step in range(4):
        np.testing.assert_array_equal(np.concatenate([s[step] for s in shards]), np.arange(23)[step * 6:step * 6 + 6])
    with pytest.raises(IndexError):
        shards[0][4]  # pylint: disable=pointless-statement
    shards[1].on_epoch_end()
    assert sequence.epochs_ended == 1 and shards[0][0].tolist() == [22, 21, 20]
    # 7 batches (21 rows): the 7th batch's rows make the workers' last batches, as one process's last global batch.
    shards = [data.shard_sequence(_Rows(np.arange(21), 3), 2, i) for i in range(2)]
    assert [len(s) for s in shards] == [4, 4]
    assert [shards[0][3].tolist(), shards[1][3].tolist()] == [[18, 19], [20]]  # in order: one process's last batch
    for step in range(4):
        np.testing.assert_array_equal(np.concatenate([s[step] for s in shards]), np.arange(21)[step * 6:step * 6 + 6])
    # (x, y) batches of 17 rows by 4 over 3 workers: the last 2 batches' rows (4 + 1) are split 2 + 2 + 1.
    pairs = _Pairs(np.arange(17), 4)
    last = [data.shard_sequence(pairs, 3, i)[1] for i in range(3)]
    assert [(x.tolist(), y.tolist()) for x, y in last] == [([12, 13], [-12, -13]), ([14, 15], [-14, -15]),
                                                           ([16], [-16])]
    # Arrays whose shapes differ beyond the rows (padded to each batch's longest) are not joined: left out, said.
    (left_out,) = _warnings_of(lambda: data.shard_sequence(_Padded(), 3, 0))
    assert "their arrays' shapes differ beyond the row count ([(2, 6), (1, 7)])" in left_out
    assert _warnings_of(lambda: data.shard_sequence(_Padded(), 3, 1)) == []  # worker 0 says it, once
    assert len(data.shard_sequence(_Padded(), 3, 1)) == 1
    assert _warnings_of(lambda: data.shard_sequence(_Rows(np.arange(23), 3), 2, 0)) == []  # rows only differ


def test_a_generator_is_sharded_by_batches_and_needs_steps():
    shards = [list(data.shard_generator(iter(range(7)), 3, i, steps_per_epoch=2)) for i in range(3)]
    assert shards == [[0, 3, 6], [1, 4], [2, 5]]
    with pytest.raises(ValueError, match="A generator's length is unknown.*Received: steps_per_epoch=None"):
        data.shard_generator(iter(range(7)), 2, 0, steps_per_epoch=None)
    assert data.may_be_uneven(iter(range(7))) and data.may_be_uneven(_Rows(np.arange(4), 2))
