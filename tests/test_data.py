import numpy as np
import pytest
import tensorflow as tf

from kparallax.core import data


def test_strided_shards_make_contiguous_global_batches():
    x = np.arange(20)
    shards = [data.shard_arrays(x, 2, i) for i in range(2)]
    b = 3
    for step in range(3):
        union = np.concatenate([s[step * b:(step + 1) * b] for s in shards])
        np.testing.assert_array_equal(np.sort(union), np.arange(step * 2 * b, (step + 1) * 2 * b))


def test_shards_are_equal_length_and_structures_are_kept():
    x = {"a": np.arange(11), "b": np.arange(11) * 2}
    parts = [data.shard_arrays((x, np.arange(11), None), 3, i) for i in range(3)]
    assert [len(p[0]["a"]) for p in parts] == [3, 3, 3]
    np.testing.assert_array_equal(parts[1][0]["b"], parts[1][1] * 2)
    assert parts[0][2] is None


def test_dataset_shards_whole_batches_and_equal_steps():
    ds = tf.data.Dataset.range(7).batch(1)
    shards = [list(data.shard_dataset(ds, 2, i).as_numpy_iterator()) for i in range(2)]
    assert [len(s) for s in shards] == [3, 3]
    assert [int(b[0]) for b in shards[1]] == [1, 3, 5]


def test_batches_may_differ_in_size_only_for_datasets_without_a_fixed_batch_dimension():
    rows = {"ids": np.zeros((10, 3), np.int32), "w": np.ones(10, np.float32)}
    assert not data.may_be_uneven(rows)  # sharded arrays: equal batches on every worker
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
    with pytest.raises(TypeError, match="Generators and keras.utils.Sequence are not supported yet"):
        data.check_supported(iter([1]))
