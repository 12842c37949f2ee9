"""How a batched ``tf.data.Dataset`` is split into the workers' steps where whole batches do not do it.

``data.shard_dataset`` gives worker ``i`` of ``N`` the batches ``i, i+N, ...``: step ``k`` trains on batches
``kN .. kN+N-1``, one process's global batch ``k`` with batches of ``N`` times the rows. Two cases need more, and get
it from one pass over the dataset (a ``scan`` over its enumerated batches, which every worker reads whole anyway, as
``Dataset.shard`` does):

* **A batch count that is not a multiple of N.** One process's last global batch is the rows of the last
  ``count % N`` batches. They are joined and split in order (worker ``i`` keeps the ``i``-th contiguous part, the
  first ``rows % N`` parts a row longer: ``part``), as each global batch of arrays is split, when
  ``last_rows_blocker`` finds nothing against it. The workers' parts, worker 0's first, are then one process's batch
  in its order, which rows joined by their order (pairs laid out row after row, ``[B, d] -> [-1, 2, d]``) need.
* **``padded_batch`` to each batch's longest element.** One process pads its global batch to the longest element in
  it; each worker's batch is padded to the longest in the step's ``N`` batches, with the dataset's padding values, so
  that a model that does not mask the padding (a pooling over time, a convolution) sees one process's inputs.

Batches shaped by a ``map`` after the batch (a ``TextVectorization`` padding each batch to its longest text) are
each worker's own, by contract: the training-contract page tells how to fix the length.
"""

import numpy as np
import tensorflow as tf

from kparallax._compat import tf as tf_compat


def varying(spec):
    """Whether batches of ``spec`` (one flattened component) are dense with sizes after the rows that may vary from
    batch to batch (shaped by their own rows: padded to their longest element)."""
    return isinstance(spec, tf.TensorSpec) and spec.shape.rank is not None and not spec.shape[1:].is_fully_defined()


def padding_values(dataset):
    """The padding value of each component of ``dataset``'s batches (flattened, None where no padding is needed),
    when they come from a ``padded_batch`` and some are padded to each batch's longest element; else None."""
    values = tf_compat.padding_values(dataset)
    if values is None:
        return None
    specs = tf.nest.flatten(dataset.element_spec)
    padded = [value if varying(spec) else None for spec, value in zip(specs, tf.nest.flatten(values))]
    return padded if any(value is not None for value in padded) else None


def last_rows_blocker(dataset, batches, num_workers, padding=None):
    """Why the rows of ``dataset``'s last ``batches % num_workers`` batches cannot be split over the workers (a
    sentence), or None when they can: batches of dense tensors of fixed inner shapes or padded by a
    ``padded_batch`` (``padding``), and sparse tensors, whose batch dimension is not fixed (a fixed one,
    ``drop_remainder=True``, asks for batches of that size), made by a ``batch`` whose size and input rows show that
    those batches hold a row for each worker."""
    pads = padding or [None] * len(tf.nest.flatten(dataset.element_spec))
    for spec, pad in zip(tf.nest.flatten(dataset.element_spec), pads):
        if isinstance(spec, tf.RaggedTensorSpec):
            return "it holds ragged tensors, which tf.data cannot join in its state (TF 2.15)"
        if not isinstance(spec, (tf.TensorSpec, tf.SparseTensorSpec)) or not spec.shape.rank:
            return f"its elements are not batches of tensors (a {spec})"
        if spec.shape[0] is not None:
            return (f"its batches have a fixed size ({spec.shape[0]}: drop_remainder=True), and a last batch of the "
                    f"split rows would not")
        if varying(spec) and pad is None:
            return (f"its batches' shapes vary ({spec.shape}), and kparallax cannot tell how to pad them (no "
                    f"padded_batch last), so they do not concatenate")
    found = tf_compat.batching(dataset)
    if found is None:
        return "kparallax cannot tell from the dataset how many rows they hold (no batch with a static size last)"
    batch_size, rows = found
    last = batches % num_workers
    least = rows - (batches - last) * batch_size if rows is not None else (last - 1) * batch_size + 1
    if least < num_workers:
        held = f"hold {least} row(s)" if rows is not None else "may hold just 1 row"
        return f"the last {last} batch(es) {held}, fewer than the {num_workers} workers"
    return None


def split(dataset, batches, num_workers, index, padding=None):
    """Worker ``index``'s batches of ``dataset``: ``index, index + N, ...``, then, when ``batches`` (None: not known,
    no end) is not a multiple of N, its part (``part``) of the rows of the last ``batches % N`` joined; with
    ``padding`` (``padding_values``), each padded to the longest in its step's batches."""
    first_last = batches - batches % num_workers if batches is not None else None
    specs = tf.nest.flatten(dataset.element_spec)
    pads = padding or [None] * len(specs)
    empty = tf.nest.map_structure(_no_rows, dataset.element_spec)

    def in_last(position):
        return tf.constant(False) if first_last is None else position >= first_last

    def joined(kept, batch):
        flat = [_joined(a, b, pad) for a, b, pad in zip(tf.nest.flatten(kept, expand_composites=False),
                                                         tf.nest.flatten(batch, expand_composites=False), pads)]
        return tf.nest.pack_sequence_as(dataset.element_spec, flat)

    def step(state, position_and_batch):
        kept, longest = state
        position, batch = position_and_batch
        last = in_last(position)

        def own():
            return tf.cond(position % num_workers == index, lambda: batch, lambda: kept)

        if first_last is None:
            kept = own()
        else:  # the last batches are joined, from no rows at the first of them
            kept = tf.cond(last, lambda: joined(tf.cond(position == first_last, lambda: empty, lambda: kept), batch),
                           own)
        flat = tf.nest.flatten(batch, expand_composites=False)
        longest = tuple(tf.where(position % num_workers == 0, tf.shape(flat[k])[1:],
                                 tf.maximum(previous, tf.shape(flat[k])[1:]))
                        for k, previous in zip(_padded(pads), longest))
        if padding is None:  # only the worker's own batches and the last ones come: each own batch is a step
            end = tf.logical_not(last)
        else:
            end = position % num_workers == num_workers - 1
        if batches is not None:
            end = tf.logical_or(end, position == batches - 1)
        out = _padded_to(kept, longest, pads, dataset.element_spec)
        if first_last is not None:
            out = tf.cond(tf.logical_and(last, end), lambda: _parted(out, index, num_workers, batches - first_last),
                          lambda: out)
        return (kept, longest), (end, out)

    start = (empty, tuple(tf.zeros([specs[k].shape.rank - 1], tf.int32) for k in _padded(pads)))
    positions = dataset.enumerate()
    if padding is None:  # only the worker's own batches and the last ones matter
        positions = positions.filter(
            lambda position, batch: tf.logical_or(position % num_workers == index, in_last(position)))
    out = (positions.scan(start, step)
           .filter(lambda end, batch: end)
           .map(lambda end, batch: batch))
    if batches is None:
        return out
    return out.apply(tf.data.experimental.assert_cardinality(-(-batches // num_workers)))


def _padded(pads):
    return [k for k, pad in enumerate(pads) if pad is not None]


def _padded_to(structure, longest, pads, spec):
    """``structure`` with each padded component padded to ``longest`` (its inner dimensions)."""
    flat = tf.nest.flatten(structure, expand_composites=False)
    for k, target in zip(_padded(pads), longest):
        flat[k] = _pad(flat[k], target, pads[k])
    return tf.nest.pack_sequence_as(spec, flat)


def _pad(tensor, inner, value):
    """``tensor`` padded with ``value`` at the end of each inner dimension to ``inner`` (where it is shorter: the
    scan computes an output for every batch, and keeps those at the steps' ends only)."""
    shape = tf.shape(tensor)
    paddings = tf.stack([tf.zeros_like(shape), tf.concat([[0], tf.maximum(inner - shape[1:], 0)], 0)], axis=1)
    return tf.pad(tensor, paddings, constant_values=tf.cast(value, tensor.dtype))


def _parted(structure, index, num_workers, last_batches):
    """Worker ``index``'s part (``part``) of every component of the joined last batches."""
    flat = tf.nest.flatten(structure, expand_composites=False)
    return tf.nest.pack_sequence_as(structure, _parts(
        flat, index, num_workers,
        f"fit splits the rows of the dataset's last {last_batches} batch(es) over the {num_workers} workers, and they "
        f"hold fewer rows than workers (a map after the batch that changes its rows?): every worker needs a row in "
        f"every step. Received: their row count"))


def _parts(flat, index, num_workers, message):
    """Worker ``index``'s part (``part``) of each of the components ``flat`` (a list), the rows counted on the first
    that has rows (a scalar is kept whole), after checking that there is a row for each worker (else ``message``)."""
    first = next((t for t in flat if t.shape.rank != 0), flat[0])
    if isinstance(first, tf.SparseTensor):
        rows = first.dense_shape[0]
    elif isinstance(first, tf.RaggedTensor):
        rows = first.nrows(out_type=tf.int64)
    else:
        rows = tf.shape(first, out_type=tf.int64)[0]
    check = tf.debugging.assert_greater_equal(rows, tf.cast(num_workers, tf.int64), message=message)
    with tf.control_dependencies([check]):
        return [t if t.shape.rank == 0 else part(t, index, rows, num_workers) for t in flat]


def part_bounds(rows, num_workers, index):
    """(first, size) of worker ``index``'s part of ``rows`` rows split over ``num_workers`` workers in order: one
    contiguous run each, the first ``rows % N`` one row longer. Python ints, or tensors of ``rows``' dtype."""
    base, extra = rows // num_workers, rows % num_workers
    if isinstance(rows, int):
        return index * base + min(index, extra), base + int(index < extra)
    index = tf.constant(index, rows.dtype)
    return index * base + tf.minimum(index, extra), base + tf.cast(index < extra, rows.dtype)


def part(t, index, rows, num_workers):
    """Worker ``index``'s part (``part_bounds``) of the first ``rows`` rows of ``t`` (a dense, ragged or sparse
    tensor, an array): how the joined last batches of a dataset or Sequence are split over the workers, so that the
    workers' parts, worker 0's first, are one process's batch in its order."""
    first, size = part_bounds(rows, num_workers, index)
    if isinstance(t, tf.SparseTensor):  # not subscriptable: keep the part's entries, renumber its rows
        row = t.indices[:, 0]
        kept = tf.sparse.retain(t, tf.logical_and(row >= first, row < first + size))
        indices = tf.concat([kept.indices[:, :1] - first, kept.indices[:, 1:]], axis=1)
        return tf.SparseTensor(indices, kept.values, tf.concat([[size], t.dense_shape[1:]], axis=0))
    return t[first:first + size]


def take_rows(t, positions):
    """The rows of ``t`` (an array, a dense, ragged or sparse tensor, a table with ``iloc``) at ``positions`` (a
    sorted NumPy vector of row numbers), in that order."""
    if isinstance(t, tf.SparseTensor):  # keep the rows' entries, renumber the rows
        sorted_positions = tf.constant(positions, tf.int64)
        row = t.indices[:, 0]
        at = tf.searchsorted(sorted_positions, row, out_type=tf.int64)
        found = tf.equal(tf.gather(sorted_positions, tf.minimum(at, len(positions) - 1)), row)
        kept = tf.sparse.retain(t, found)
        indices = tf.concat([tf.boolean_mask(at, found)[:, None], kept.indices[:, 1:]], axis=1)
        return tf.SparseTensor(indices, kept.values, tf.concat([[len(positions)], t.dense_shape[1:]], axis=0))
    if isinstance(t, (tf.Tensor, tf.RaggedTensor, tf.Variable)):
        return tf.gather(t, positions)
    if hasattr(t, "iloc"):  # a pandas DataFrame or Series
        return t.iloc[positions]
    return np.asarray(t)[positions]


def _no_rows(spec):
    """A value of ``spec`` (batches of dense or sparse tensors) with no rows; unknown inner dimensions are 0."""
    if isinstance(spec, tf.SparseTensorSpec):
        return tf.SparseTensor(tf.zeros([0, spec.shape.rank], tf.int64), tf.zeros([0], spec.dtype),
                               [0] + [d or 0 for d in spec.shape[1:]])
    return tf.zeros([0] + [d or 0 for d in spec.shape[1:]], spec.dtype)


def _joined(a, b, pad):
    """``a`` and ``b`` concatenated along the rows; padded with ``pad`` (not None) to the longer of each inner
    dimension first."""
    if isinstance(a, tf.SparseTensor):
        return tf.sparse.concat(0, [a, b], expand_nonconcat_dims=True)
    if pad is not None:
        inner = tf.maximum(tf.shape(a)[1:], tf.shape(b)[1:])
        a, b = _pad(a, inner, pad), _pad(b, inner, pad)
    return tf.concat([a, b], 0)
