"""Fast tier: the striped table container (shard i of P holds rows i, i + P, ...) against a plain whole array.

Every whole-table view (lookups in all their forms, gradients, conversion, assignment, scatters, checkpoints) must
see the rows in table order; expected values are numpy indexing of the whole array.
"""

import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from kparallax._compat import striped

V, D, P = 11, 3, 3  # 11 rows in 3 stripes of 4, 4 and 3 rows
WHOLE = np.arange(V * D, dtype=np.float32).reshape(V, D)
IDS = np.array([10, 0, 4, 4, 7, 2])


def _table(value=WHOLE, name="table"):
    return striped.StripedVariable([tf.Variable(part) for part in striped.stripe(value, P)], name=name)


def test_shards_hold_stripes_and_every_whole_view_is_in_table_order():
    table = _table()
    for i, shard in enumerate(table.variables):
        np.testing.assert_array_equal(shard.numpy(), WHOLE[i::P])
    np.testing.assert_array_equal(tf.convert_to_tensor(table).numpy(), WHOLE)
    np.testing.assert_array_equal(table.numpy(), WHOLE)
    for view in (np.asarray(table), np.array(table, dtype=np.float64), table.read_value(), table.value()):
        np.testing.assert_array_equal(view, WHOLE)  # NumPy sees the values (was a 0-d object array)
    assert np.asarray(table).dtype == np.float32 and table.trainable
    np.testing.assert_array_equal(table[2:5].numpy(), WHOLE[2:5])
    np.testing.assert_array_equal((table * 2).numpy(), WHOLE * 2)
    np.testing.assert_array_equal(table.sparse_read(IDS).numpy(), WHOLE[IDS])
    np.testing.assert_array_equal(striped.unstripe([s.numpy() for s in table.variables]), WHOLE)


def test_every_embedding_lookup_form_reads_table_rows():
    table = _table()
    np.testing.assert_array_equal(tf.nn.embedding_lookup(table, IDS).numpy(), WHOLE[IDS])
    for strategy in ("div", "mod"):  # a caller's partition_strategy cannot change which row an id names
        got = tf.compat.v1.nn.embedding_lookup(table, IDS, partition_strategy=strategy)
        np.testing.assert_array_equal(got.numpy(), WHOLE[IDS])
    sparse = tf.sparse.SparseTensor([[0, 0], [0, 1], [1, 0]], tf.constant([10, 3, 5], tf.int64), [2, 2])
    want = np.stack([WHOLE[[10, 3]].mean(0), WHOLE[5]])
    np.testing.assert_allclose(tf.nn.embedding_lookup_sparse(table, sparse, None, combiner="mean"), want)
    np.testing.assert_allclose(tf.nn.safe_embedding_lookup_sparse(table, sparse, None), want)
    got = tf.compat.v1.nn.safe_embedding_lookup_sparse(table, sparse, None, partition_strategy="div")
    np.testing.assert_allclose(got, want)


def test_a_plain_list_of_the_shards_is_not_offered_as_row_blocks():
    table = _table()
    assert isinstance(table.variables, tuple) and not isinstance(table.variables, list)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        tf.nn.embedding_lookup(table.variables, IDS)


def test_lookup_gradients_are_per_shard_local_rows_inside_a_function():
    table = _table()

    @tf.function
    def grads(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.nn.embedding_lookup(table, ids) * 2.0)
        return tape.gradient(loss, list(table.variables))

    got = grads(tf.constant(IDS))
    assert all(isinstance(g, tf.IndexedSlices) for g in got)
    for i, grad in enumerate(got):
        want = sorted(int(x) // P for x in IDS if x % P == i)
        assert sorted(grad.indices.numpy().tolist()) == want


def test_assign_and_scatter_address_table_rows():
    table = _table(np.zeros_like(WHOLE))
    table.assign(WHOLE)
    np.testing.assert_array_equal(table.numpy(), WHOLE)
    table.scatter_add(tf.IndexedSlices(tf.ones([2, D]), tf.constant([10, 1])))
    want = WHOLE.copy()
    want[[10, 1]] += 1
    np.testing.assert_array_equal(table.numpy(), want)


def test_checkpoints_hold_the_table_whole_both_ways(tmp_path):
    path = tf.train.Checkpoint(t=_table()).save(str(tmp_path / "striped"))
    reader = tf.train.load_checkpoint(path)
    np.testing.assert_array_equal(reader.get_tensor("t/.ATTRIBUTES/VARIABLE_VALUE"), WHOLE)
    plain = tf.Variable(np.zeros_like(WHOLE))
    tf.train.Checkpoint(t=plain).restore(path).assert_consumed()
    np.testing.assert_array_equal(plain.numpy(), WHOLE)
    table = _table(np.zeros_like(WHOLE))
    tf.train.Checkpoint(t=table).restore(tf.train.Checkpoint(t=tf.Variable(WHOLE)).save(str(tmp_path / "plain")))
    np.testing.assert_array_equal(table.numpy(), WHOLE)


def test_frequency_sorted_ids_spread_evenly_over_the_stripes():
    rng = np.random.default_rng(0)
    vocab, parts = 100_000, 8
    ids = np.unique(np.floor(np.exp(rng.random(20_000) * np.log(vocab + 1))) - 1).astype(np.int64)  # log-uniform
    striped_load = np.bincount(ids % parts, minlength=parts)
    block_load = np.bincount(ids // -(-vocab // parts), minlength=parts)
    assert striped_load.max() / striped_load.mean() < 1.1
    assert block_load.max() / block_load.mean() > 3  # what contiguous blocks would do with the same ids


def test_wrong_stripe_sizes_are_refused():
    with pytest.raises(ValueError, match=r"have \(4, 4, 3\) rows. Received: \(3, 4, 4\)"):
        striped.StripedVariable([tf.Variable(WHOLE[:3]), tf.Variable(WHOLE[3:7]), tf.Variable(WHOLE[7:])])


def test_a_stripe_of_a_tables_initial_value_is_cut_where_the_value_was_made():
    """The chief makes a partitioned table's whole initial value once, on the first stripe's PS task, and cuts each
    stripe there: only the stripe crosses to its own PS task (before, each stripe was cut on its own task, so the
    whole table crossed once per stripe: lm1b_sparse's 410 MB of tables in 8 stripes, 2.9 GB before the first
    step). Two logical CPUs stand for two PS tasks (set before TensorFlow starts: a process of its own)."""
    code = "\n".join([
        "import tensorflow as tf",
        "cpu = tf.config.list_physical_devices('CPU')[0]",
        "tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)",
        "from kparallax.core import tables",
        "with tf.device('/device:CPU:0'):",
        "    whole = tf.reshape(tf.range(12.0), [6, 2])",
        "with tf.device('/device:CPU:1'):",
        "    part = tables.stripe_where_made(whole, 1, 3, '/device:CPU:0')",
        "assert part.device.endswith('CPU:0'), part.device",
        "assert part.numpy().tolist() == [[2.0, 3.0], [8.0, 9.0]], part.numpy()",
        "print('cut on', part.device)"])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and "cut on" in done.stdout, done.stderr[-2000:]
