"""Row-striped tables: shard ``i`` of ``P`` holds the table's rows ``i, i + P, i + 2P, ...``.

TensorFlow 2's ``ShardedVariable`` splits a table into contiguous row blocks ("div"). Vocabularies are sorted by
frequency, so the first block holds most of the rows a step touches: with a Zipf-distributed 8,192-id sample of
100,000 ids, the first of 8 blocks holds 55% of them, and the PS task holding it carries 4.4x the average traffic.
Striping (TensorFlow 1's ``partition_strategy="mod"``) gives each shard every P-th row: about 1/P of any id range.

``StripedVariable`` is a ``ShardedVariable`` whose every whole-table view uses the striped layout:
  - ``tf.nn.embedding_lookup`` (and its v1, sparse and safe-sparse forms) gathers row ``id`` from shard
    ``id % P`` at ``id // P``, so each shard gets its own ``IndexedSlices`` gradient (only touched rows);
  - tensor conversion, operators, ``numpy()``, NumPy's ``np.asarray``, ``read_value()``, ``value()``,
    ``__getitem__``, ``sparse_read``, ``assign*`` and ``scatter_*`` see the rows in table order (iterating it
    yields the shards, as ``ShardedVariable``'s does: Keras' ``add_weight`` relies on that);
  - ``tf.train.Checkpoint`` saves the table whole (a plain process restores it) and restores it into stripes.
Writing it to a SavedModel directly is refused (``model.save`` / ``export`` under the strategy write tables whole).

Versions: TensorFlow 2.15 (seen 2.15.1). Touches ``ShardedVariable``'s private ``_variables`` and
``_decompose_indices``, the dispatch decorators of ``tensorflow.python.util.dispatch``, the tensor conversion
registry and ``saveable_object``.
"""

import typing

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import sharded_variable as _sharded
from tensorflow.python.framework import tensor_conversion_registry as _conversion
from tensorflow.python.ops import embedding_ops as _embedding
from tensorflow.python.ops import resource_variable_ops as _rv
from tensorflow.python.training.saving import saveable_object as _saveable
from tensorflow.python.trackable import base as _trackable
from tensorflow.python.util import dispatch as _dispatch

from kparallax._compat import tf as tf_compat


def stripe_rows(num_rows, partitions):
    """Row counts of the ``partitions`` stripes of a ``num_rows``-row table."""
    return tuple(len(range(i, num_rows, partitions)) for i in range(partitions))


def stripe_of(whole, shard, partitions):
    """Stripe ``shard`` of ``partitions`` of a whole table (an array or tensor): rows shard, shard + P, ...."""
    return whole[shard::partitions]


def stripe(whole, partitions):
    """The ``partitions`` stripes of a whole table (an array or tensor), in shard order."""
    return [stripe_of(whole, i, partitions) for i in range(partitions)]


def unstripe(parts):
    """Inverse of ``stripe`` for arrays: the whole table from its stripes' values, rows in table order."""
    parts = [np.asarray(p) for p in parts]
    whole = np.empty((sum(len(p) for p in parts),) + parts[0].shape[1:], parts[0].dtype)
    for i, part in enumerate(parts):
        whole[i::len(parts)] = part
    return whole


class Stripes(tuple):
    """The shards of a ``StripedVariable``, as a tuple.

    Not a list: ``tf.nn.embedding_lookup`` reads a list of tensors as contiguous row blocks, which would silently
    gather the wrong rows of a striped table. A tuple is packed into one tensor instead, which fails (shards of
    unequal rows) or gathers out of range; pass the table itself.
    """


class StripedVariable(_sharded.ShardedVariable):
    """A ``ShardedVariable`` whose shard ``i`` of ``P`` holds rows ``i, i + P, ...`` of the table.

    Args:
      variables: the shards, in stripe order; shard ``i`` has ``stripe_rows(V, P)[i]`` rows.
      name: the table's name.
    """

    def __init__(self, variables, name="StripedVariable"):
        super().__init__(variables, name=name)
        rows, parts = int(self.shape[0]), len(self._variables)
        got = tuple(int(v.shape[0]) for v in self._variables)
        if got != stripe_rows(rows, parts):
            raise ValueError(f"The stripes of a {rows}-row table in {parts} shards have {stripe_rows(rows, parts)} "
                             f"rows. Received: {got}.")

    @property
    def variables(self):
        """The shards, as ``Stripes`` (a tuple, so that no lookup reads them as row blocks)."""
        return Stripes(self._variables)

    @property
    def _type_spec(self):
        return StripedVariableSpec(*(_rv.VariableSpec(v.shape, v.dtype) for v in self._variables))

    def whole(self):
        """The table as one tensor, rows in table order."""
        rows, parts = int(self.shape[0]), len(self._variables)
        if parts == 1:
            return tf.convert_to_tensor(self._variables[0])
        positions = [tf.range(i, rows, parts) for i in range(parts)]
        return tf.dynamic_stitch(positions, [tf.convert_to_tensor(v) for v in self._variables])

    def stripes(self, value):
        """``value`` (the whole table's shape) split into this table's stripes."""
        return stripe(tf.convert_to_tensor(value, dtype=self.dtype), len(self._variables))

    def numpy(self):
        return self.whole().numpy()

    def __array__(self, dtype=None):
        # As a plain variable's: NumPy (np.asarray, np.save) sees the table's values, not a 0-d object array.
        return np.asarray(self.numpy(), dtype=dtype)

    def read_value(self):
        """The table as one tensor, rows in table order (a plain variable's ``read_value``)."""
        return self.whole()

    def value(self):
        """The table as one tensor, rows in table order (a plain variable's ``value``)."""
        return self.whole()

    @property
    def trainable(self):
        return all(v.trainable for v in self._variables)

    def __getitem__(self, slice_spec):
        return self.whole()[slice_spec]

    def assign(self, value, use_locking=None, name=None, read_value=True):
        for variable, part in zip(self._variables, self.stripes(value)):
            variable.assign(part)
        return self

    def assign_add(self, delta, use_locking=False, name=None, read_value=True):
        for variable, part in zip(self._variables, self.stripes(delta)):
            variable.assign_add(part)
        return self

    def assign_sub(self, delta, use_locking=False, name=None, read_value=True):
        for variable, part in zip(self._variables, self.stripes(delta)):
            variable.assign_sub(part)
        return self

    def _decompose_indices(self, indices):
        """Per-shard local indices of table rows ``indices`` (used by ``scatter_*``), and each index's shard."""
        if indices.shape.rank != 1:
            raise ValueError(f"A striped table's sparse operations take 1-D indices. Received shape: {indices.shape}.")
        parts = len(self._variables)
        shard = tf.cast(indices % parts, tf.int32)
        return tf.dynamic_partition(indices // parts, shard, parts), shard

    def sparse_read(self, indices, name=None):
        return _embedding.embedding_lookup(self._variables, _checked(self, indices), partition_strategy="mod",
                                           name=name)

    def _gather_saveables_for_checkpoint(self):
        return {_trackable.VARIABLE_VALUE_KEY: lambda name=self.name: _WholeTableSaveable(self, name)}

    def _copy_trackable_to_cpu(self, object_map):
        raise NotImplementedError(
            "Asynchronous checkpoints of a kparallax partitioned table are not supported. Received: table "
            f"{self.name!r}. Use kparallax's checkpoints (kp.callbacks.Checkpoint) or model.save_weights.")

    def _export_to_saved_model_graph(self, object_map, tensor_map, options, **kwargs):
        raise NotImplementedError(
            f"tf.saved_model.save cannot write kparallax's partitioned table {self.name!r} directly. Received: a "
            "model holding it. Call model.save(...) or model.export(...) inside the strategy: they write each table "
            "whole, loadable by a plain TensorFlow process.")


class StripedVariableSpec(_sharded.ShardedVariableSpec):
    """Type spec of a ``StripedVariable`` (rebuilds the striped container, not a "div" one)."""

    @property
    def value_type(self):
        return StripedVariable

    def _from_components(self, variables):
        return StripedVariable(variables)


class _WholeTableSaveable(_saveable.SaveableObject):
    """Saves a striped table as one tensor in table order; restores it into the stripes."""

    def __init__(self, table, name):
        self._table = table
        spec = _saveable.SaveSpec(table.whole, "", name, dtype=table.dtype, device="/cpu:0")
        super().__init__(table, [spec], name)

    def restore(self, restored_tensors, restored_shapes):
        value = restored_tensors[0]
        if restored_shapes is not None:
            value = tf.reshape(value, restored_shapes[0])
        return tf.group([v.assign(part) for v, part in zip(self._table.variables, self._table.stripes(value))])


def _to_tensor(value, dtype=None, name=None, as_ref=False):
    del name
    if dtype is not None and not dtype.is_compatible_with(value.dtype):
        raise ValueError(f"A striped table of {value.dtype.name} cannot be converted to {dtype.name}. Received: "
                         f"dtype={dtype.name}.")
    if as_ref:
        raise NotImplementedError(f"A striped table cannot be used as a reference. Received: {value.name!r}.")
    return value.whole()


# Before ShardedVariable's own conversion (priority 100), which concatenates the shards as blocks.
_conversion.register_tensor_conversion_function(StripedVariable, _to_tensor, priority=90)


def _overload_operators():
    for operator in tf.Tensor.OVERLOADABLE_OPERATORS:
        if operator == "__getitem__":
            continue
        tensor_operator = getattr(tf.Tensor, operator)
        setattr(StripedVariable, operator,
                lambda v, *args, _op=tensor_operator, **kwargs: _op(v.whole(), *args, **kwargs))


_overload_operators()

_Params = typing.Union[StripedVariable, typing.List[StripedVariable]]


def _shards(params):
    """The shard variables of a striped table, or of a one-element list holding it."""
    return list((params[0] if isinstance(params, list) else params).variables)


# The message of a striped lookup's id check; core/errors.explained reads it (and the three values after it).
ID_CHECK_MESSAGE = "kparallax: an id outside the table; smallest id, largest id, table rows:"


def _checked(params, ids, negative_ok=False):
    """``ids`` (a tensor, ragged or sparse), after a check that every id is a row of the striped table.

    Without it an id past the table reaches shard ``id % P`` as row ``id // P``: TensorFlow's error then names that
    row and the shard's size, not the id and the table's, and a negative id can fail on another shard. One process's
    gather names the id; so does this check, at the cost of a min and a max over the ids. ``negative_ok``: the safe
    sparse lookups drop negative ids, as they do for one table.
    """
    rows = sum(int(v.shape[0]) for v in _shards(params))
    values = ids.flat_values if isinstance(ids, tf.RaggedTensor) else ids.values if isinstance(
        ids, tf.SparseTensor) else tf.convert_to_tensor(ids)
    # The same ids checked again for a table of as many rows in the same graph (a sampled softmax's weights and
    # biases) give the same tensor: the lookups' splits of it over the stripes are then one computation, and each
    # stripe's distinct ids one tensor crossing to its task for both tables.
    graph = tf.compat.v1.get_default_graph()
    checked = (tf_compat.graph_attached(graph, "checked_ids") if tf.is_symbolic_tensor(values) and values.graph is graph
               else {})
    key = (values.ref(), rows, bool(negative_ok))
    if key not in checked:
        low, high = tf.reduce_min(values), tf.reduce_max(values)
        check = tf.debugging.Assert(tf.logical_and(negative_ok or low >= 0, high < tf.cast(rows, high.dtype)),
                                    [ID_CHECK_MESSAGE, low, high, rows])
        with tf.control_dependencies([check]):
            checked[key] = tf.identity(values)
    values = checked[key]
    if isinstance(ids, tf.RaggedTensor):
        return ids.with_flat_values(values)
    if isinstance(ids, tf.SparseTensor):
        return tf.SparseTensor(ids.indices, values, ids.dense_shape)
    return values


# Every embedding lookup of a striped table is a "mod" lookup of its shards, whatever partition_strategy the
# caller names: the strategy describes how a list of tensors splits a table; this table's split is fixed.
@_dispatch.dispatch_for_api(_embedding.embedding_lookup_v2, {"params": _Params})
def _lookup_v2(params, ids, max_norm=None, name=None):
    return _embedding.embedding_lookup(_shards(params), _checked(params, ids), "mod", name, max_norm=max_norm)


@_dispatch.dispatch_for_api(_embedding.embedding_lookup, {"params": _Params})
def _lookup_v1(params, ids, partition_strategy="mod", name=None, validate_indices=True, max_norm=None):
    del partition_strategy
    return _embedding.embedding_lookup(_shards(params), _checked(params, ids), "mod", name, validate_indices, max_norm)


@_dispatch.dispatch_for_api(_embedding.embedding_lookup_sparse_v2, {"params": _Params})
def _lookup_sparse_v2(params, sp_ids, sp_weights, combiner=None, max_norm=None, name=None,
                      allow_fast_lookup=False):
    return _embedding.embedding_lookup_sparse(_shards(params), _checked(params, sp_ids), sp_weights, "mod", name,
                                              combiner, max_norm, allow_fast_lookup)


@_dispatch.dispatch_for_api(_embedding.embedding_lookup_sparse, {"params": _Params})
def _lookup_sparse_v1(params, sp_ids, sp_weights, partition_strategy="mod", name=None, combiner=None,
                      max_norm=None, allow_fast_lookup=False):
    del partition_strategy
    return _embedding.embedding_lookup_sparse(_shards(params), _checked(params, sp_ids), sp_weights, "mod", name,
                                              combiner, max_norm, allow_fast_lookup)


@_dispatch.dispatch_for_api(_embedding.safe_embedding_lookup_sparse_v2, {"embedding_weights": _Params})
def _safe_lookup_sparse_v2(embedding_weights, sparse_ids, sparse_weights=None, combiner="mean", default_id=None,
                           max_norm=None, name=None, allow_fast_lookup=False):
    return _embedding.safe_embedding_lookup_sparse(
        _shards(embedding_weights), _checked(embedding_weights, sparse_ids, negative_ok=True), sparse_weights,
        combiner, default_id, name, "mod", max_norm, allow_fast_lookup)


# TensorFlow registers its own ShardedVariable target for the v1 form (blocks, the caller's partition_strategy); two
# targets matching one call are an error, so this one replaces it and keeps its behaviour for other containers.
_dispatch.unregister_dispatch_for(_sharded.safe_embedding_lookup_sparse)


@_dispatch.dispatch_for_api(_embedding.safe_embedding_lookup_sparse,
                            {"embedding_weights": typing.Union[_sharded.ShardedVariable, _Params]})
def _safe_lookup_sparse_v1(embedding_weights, sparse_ids, sparse_weights=None, combiner="mean", default_id=None,
                           name=None, partition_strategy="div", max_norm=None, allow_fast_lookup=False):
    if not isinstance(embedding_weights, (StripedVariable, list)):
        return _sharded.safe_embedding_lookup_sparse(embedding_weights, sparse_ids, sparse_weights, combiner,
                                                     default_id, name, partition_strategy, max_norm,
                                                     allow_fast_lookup)
    return _embedding.safe_embedding_lookup_sparse(
        _shards(embedding_weights), _checked(embedding_weights, sparse_ids, negative_ok=True), sparse_weights,
        combiner, default_id, name, "mod", max_norm, allow_fast_lookup)
