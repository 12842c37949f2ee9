"""TensorFlow internals: shared PS variables, their read hook, the eager context, function graphs and the chain of
datasets a tf.data pipeline is built from.

Versions: TensorFlow 2.15 (seen 2.15.1). Each function names the private API it touches.
"""

import contextlib
import functools
import inspect

import tensorflow as tf
from tensorflow.python.data.ops import interleave_op as _interleave_op
from tensorflow.python.distribute import sharded_variable as _sharded
from tensorflow.python.eager import context as _context
from tensorflow.python.eager import record as _record
from tensorflow.python.framework import func_graph as _func_graph
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import gen_resource_variable_ops as _gen_rv
from tensorflow.python.ops import handle_data_util as _handle_data_util
from tensorflow.python.ops import resource_variable_ops as _rv

ShardedVariable = _sharded.ShardedVariable  # TF's container of row shards; Keras lists the shards as weights


def async_wait():
    """Blocks until every op this process dispatched (remote PS ops included) has run.

    Remote eager ops are asynchronous in TF 2.15: without this, a worker's write on a PS may not have landed when a
    later collective (which orders workers, not PS ops) returns.
    """
    _context.async_wait()


def full_variable_name(name):
    """The variable name TensorFlow would give ``name`` in the current name scope (no ``:0``)."""
    with _ops.name_scope(name or "Variable", skip_on_eager=False) as scope:
        return _ops.name_from_scope_name(scope)


class SharedResourceVariable(_rv.BaseResourceVariable):
    """A resource variable on a PS device whose dense reads and row gathers can be redirected (``read_policy``,
    ``gather_policy``).

    ``read_policy(variable, read)``: called instead of ``_read_variable_op`` (the private method every dense read,
    ``value()``, ``read_value()`` and tensor conversion of a resource variable goes through in TF 2.15); ``read()``
    performs the normal read. None: normal reads.
    ``gather_policy(variable, ids, gather)``: called instead of ``sparse_read`` (what ``tf.gather`` and
    ``tf.nn.embedding_lookup`` of a resource variable call); ``gather(ids)`` performs the normal gather. None:
    normal gathers.
    """

    read_policy = None
    gather_policy = None

    def _read_variable_op(self, no_copy=False):
        policy = self.read_policy
        if policy is None:
            return super()._read_variable_op(no_copy)
        return policy(self, lambda: super(SharedResourceVariable, self)._read_variable_op(no_copy))

    def sparse_read(self, indices, name=None):
        policy = self.gather_policy
        if policy is None:
            return super().sparse_read(indices, name)
        return policy(self, indices, lambda ids: super(SharedResourceVariable, self).sparse_read(ids, name))


def shared_variable(shared_name, container, shape, dtype, device, trainable, constraint=None, name=None):
    """Returns a ``SharedResourceVariable`` whose handle names a shared resource on ``device``.

    Every process that calls this with the same ``shared_name`` and ``container`` on the same PS device gets a
    handle to the same variable (``VarHandleOp`` with a fixed shared name; a ``tf.Variable`` made under a PS device
    is private to its process). The object has no deleter: dropping it never frees the shared resource. Eager
    handles carry no shape unless set by hand (private ``_set_handle_shapes_and_types``); Keras needs it.
    """
    shape = tf.TensorShape(shape)
    dtype = tf.as_dtype(dtype)
    with tf.device(device):
        handle = _gen_rv.var_handle_op(shape=shape, dtype=dtype, shared_name=shared_name,
                                       container=container, debug_name=shared_name)
    _rv._set_handle_shapes_and_types(  # pylint: disable=protected-access
        handle, _handle_data_util.create_handle_data(shape, dtype), graph_mode=False)
    return SharedResourceVariable(
        trainable=trainable, shape=shape, dtype=dtype, handle=handle, constraint=constraint,
        unique_id=f"{shared_name}_{_ops.uid()}", handle_name=name or shared_name, in_graph_mode=False)


# What ``rehome`` takes from the shared variable: the resource handle and what TF 2.15's ``BaseResourceVariable``
# derives from it (private attributes set in its ``__init__``). The name, unique id, trainable flag, constraint,
# shape and dtype stay the variable's own.
_HANDLE_STATE = ("_handle", "_graph_element", "_cached_value", "_initializer_op", "_is_initialized_op",
                 "_initial_value", "_caching_device", "_in_graph_mode")


def rehome(variable, shared):
    """Points the resource variable ``variable`` at ``shared``'s resource (a ``shared_variable`` on a PS task).

    Every reference to the ``variable`` object (a layer's attribute, a list of a user's, Keras' weight lists, an
    ``AutoCastVariable`` around it) then reads and writes the shared variable; its name and unique id (Keras'
    optimizer keys) do not change. The old resource is emptied (0 rows): a function traced before still reads it,
    so trace such functions again. Replaces the private attributes of ``_HANDLE_STATE`` on the object (TF 2.15; it
    has no public way to move a variable)."""
    if not isinstance(variable, _rv.BaseResourceVariable) or variable.shape != shared.shape \
            or variable.dtype != shared.dtype:
        raise TypeError(f"Only a resource variable can move onto a PS variable of its shape and dtype. Received: "
                        f"{type(variable).__name__} {getattr(variable, 'name', variable)!r} and {shared!r}.")
    old = variable.handle
    for name in _HANDLE_STATE:
        setattr(variable, name, getattr(shared, name))
    # Eager resources live as long as a handle to them (a function traced before holds one): empty the old copy
    # instead (0 rows), which frees its memory and makes a gather from it by such a function fail.
    with tf.device(old.device):
        _gen_rv.assign_variable_op(old, tf.zeros([0] + variable.shape.as_list()[1:], variable.dtype),
                                   validate_shape=False)


def unwrapped(variable):
    """The resource variable inside a Keras ``AutoCastVariable`` (mixed precision; private ``_variable``), else
    ``variable``."""
    inner = getattr(variable, "_variable", None) if isinstance(variable, tf.Variable) else None
    return inner if isinstance(inner, tf.Variable) else variable


def is_initialized(variable):
    return bool(_gen_rv.var_is_initialized_op(variable.handle).numpy())


def destroy_variable(variable):
    """Frees a (shared) variable's resource on its device; later reads of it fail."""
    with tf.device(variable.device):
        _gen_rv.destroy_resource_op(variable.handle, ignore_lookup_error=True)


def outermost_function_graph():
    """The tf.function graph being traced that encloses the current one (a while/cond body is nested in it), or
    None when executing eagerly."""
    graph = _ops.get_default_graph()
    if not isinstance(graph, _func_graph.FuncGraph):
        return None
    while isinstance(getattr(graph, "outer_graph", None), _func_graph.FuncGraph):
        graph = graph.outer_graph
    return graph


def graph_attached(graph, name):
    """A dict attached to ``graph`` (an attribute of it), empty at first use: it lives and dies with the graph. A
    ``WeakKeyDictionary`` keyed by the graph would keep every graph alive, through the tensors its values hold."""
    key = "_kparallax_" + name
    attached = getattr(graph, key, None)
    if attached is None:
        attached = {}
        setattr(graph, key, attached)
    return attached


def uncolocated():
    """Context in which new ops are not colocated with an op by an enclosing ``colocate_with`` (private
    ``ops.colocate_with(None, ignore_existing=True)``: ``tf.nn.embedding_lookup`` colocates its gather, and all it
    builds, with the table)."""
    return _ops.colocate_with(None, ignore_existing=True)


def not_recording():
    """Context in which no gradient tape records (private ``record.stop_recording``)."""
    return _record.stop_recording()


def record_gather(variable, ids, output, indices_made=None):
    """Records ``output`` on the active tapes as the gather of ``variable``'s rows at ``ids`` (private
    ``record.record_operation``), with the gradient TensorFlow gives that gather (``ResourceGather``'s: one slice per
    id, repeats included, of the table's shape), however ``output`` was computed. ``indices_made``, if given, is
    called with that gradient's indices tensor each time a tape builds it."""
    shape = tf.constant(variable.shape.as_list(), tf.int32)

    def backward(upstream):
        size = tf.size(ids)[None]
        values = tf.reshape(upstream, tf.concat([size, shape[1:]], 0))
        indices = tf.reshape(ids, size)
        if indices_made is not None:
            indices_made(indices)
        return [tf.IndexedSlices(values, indices, shape), None]

    _record.record_operation("ResourceGather", [output], [variable.handle, ids], backward)


def record_read(variable, output):
    """Records ``output`` on the tapes recording now as a read of ``variable`` (private ``record.record_operation``,
    as TensorFlow's own graph-mode read records itself: ``ReadVariableOp``, the gradient passed to the handle),
    however and whenever ``output`` was made. A read made once and reused (``cached_reads``) reaches a tape that was
    not recording when it was made: a tape opened later in the step, the tape ``tf.recompute_grad``'s gradient
    recomputes its function under, or any tape when the read was made under ``tf.recompute_grad``'s forward, which
    stops recording. A tape that recorded it already maps it to the same gradient again. Nothing while recording is
    stopped."""
    _record.record_operation("ReadVariableOp", [output], [variable.handle], backward_function=lambda x: [x],
                             forward_function=lambda x: [x])


def tape_may_record():
    """Whether a gradient tape is active (private ``record.could_possibly_record``)."""
    return _record.could_possibly_record()


def mark_accessed(variable):
    """Tells active tapes that ``variable`` was read (what every read of a resource variable does)."""
    _rv.variable_accessed(variable)


def enter_graph(graph):
    """Context to build ops in ``graph`` with no control dependencies of the current one."""
    @contextlib.contextmanager
    def scope():
        with graph.as_default(), _ops.control_dependencies(None):
            yield
    return scope()


def dataset_chain(dataset):
    """The datasets ``dataset`` is built from, itself first, through tf.data's private links between datasets
    (``DatasetV2._inputs()``, TF 2.15). Functions of ``interleave`` / ``flat_map`` are not entered."""
    chain, pending, seen = [], [dataset], set()
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        chain.append(current)
        try:
            pending.extend(current._inputs())  # pylint: disable=protected-access
        except NotImplementedError:
            pass
    return chain


def shard_of(dataset):
    """``(num_shards, index)`` of a ``Dataset.shard`` dataset (static values, None where not known), else None.
    Reads ``_ShardDataset``'s ``_num_shards`` and ``_index`` (TF 2.15)."""
    if type(dataset).__name__ != "_ShardDataset":
        return None
    return _static_int(dataset._num_shards), _static_int(dataset._index)  # pylint: disable=protected-access


def order_seeds(dataset):
    """``(seed, seed2)`` of a dataset that draws a random order (``Dataset.shuffle``) or random numbers
    (``Dataset.random``, which ``sample_from_datasets`` draws its choices from): static values, None where not known;
    None for other datasets. Reads ``_ShuffleDataset``'s and ``_RandomDataset``'s ``_seed`` and ``_seed2`` (TF 2.15).
    ``(0, 0)``: no seed and no global seed, so TensorFlow draws new random seeds in every process."""
    if type(dataset).__name__ not in ("_ShuffleDataset", "_RandomDataset"):
        return None
    return _static_int(dataset._seed), _static_int(dataset._seed2)  # pylint: disable=protected-access


def _recording_interleave_order():
    """Makes the dataset of ``Dataset.interleave(..., num_parallel_calls=...)`` keep its ``deterministic`` argument
    as ``_kp_deterministic`` ("default", "true", "false"), as tf.data's parallel ``map`` and ``batch`` datasets keep
    theirs as ``_deterministic``: TF 2.15's ``_ParallelInterleaveDataset`` gives it to its op only. Wraps that private
    class's ``__init__`` (idempotent)."""
    cls = _interleave_op._ParallelInterleaveDataset  # pylint: disable=protected-access
    original = cls.__init__
    if getattr(original, "kp_records_order", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        deterministic = signature.bind(self, *args, **kwargs).arguments.get("deterministic")
        self._kp_deterministic = "default" if deterministic is None else "true" if deterministic else "false"
        original(self, *args, **kwargs)

    __init__.kp_records_order = True
    cls.__init__ = __init__


_recording_interleave_order()
_UNORDERED_NAMES = {"_ParallelMapDataset": "map", "_ParallelInterleaveDataset": "interleave",
                    "_ParallelBatchDataset": "batch", "ParallelInterleaveDataset": "parallel_interleave",
                    "_ParseExampleDataset": "parse_example_dataset"}


def unordered(dataset):
    """What in ``dataset``'s chain may give its elements out of order, as ``"interleave(deterministic=False)"``
    strings: a parallel ``map`` / ``interleave`` / ``batch`` (or a legacy ``parallel_interleave(sloppy=True)``,
    ``parse_example_dataset``) built with ``deterministic=False``, or left at the default while the dataset's
    options say ``deterministic=False``. Reads their private ``_deterministic`` (TF 2.15) or the ``_kp_deterministic``
    recorded above; an ``interleave`` built before kparallax was imported is not seen."""
    options_unordered = dataset.options().deterministic is False
    found = []
    for part in dataset_chain(dataset):
        flag = getattr(part, "_deterministic", None) or getattr(part, "_kp_deterministic", None)
        name = _UNORDERED_NAMES.get(type(part).__name__, type(part).__name__)
        if flag == "false":
            found.append(f"{name}(deterministic=False)")
        elif flag == "default" and options_unordered:
            found.append(f"{name}(...) under tf.data.Options.deterministic=False")
    return found


# Datasets that give their input's elements as they are; and those that give one element per element of their
# input, unchanged in count and, as far as kparallax can tell, in rows (a ``map`` could change a batch's rows; the
# split of the last batches checks their rows when it runs).
_SAME_ELEMENTS = ("_PrefetchDataset", "_OptionsDataset", "CacheDataset", "_AssertCardinalityDataset")
_ONE_TO_ONE = _SAME_ELEMENTS + ("_MapDataset", "_ParallelMapDataset")
# Datasets that pass on some of their input's elements, unchanged, in another count or order.
_PASSED_ON = ("_RepeatDataset", "_TakeDataset", "_SkipDataset", "_ShuffleDataset")
_BATCHING = ("_BatchDataset", "_ParallelBatchDataset", "_PaddedBatchDataset")


def batching(dataset):
    """``(batch_size, rows)`` of the ``batch`` (or ``padded_batch``) that makes ``dataset``'s elements, found under
    one-to-one datasets only (``prefetch``, ``map``, ``cache``, options): its static batch size and the row count of
    its input (None where not known); None if there is no such batch or its size is not static. Reads the private
    ``_input_dataset`` and ``_batch_size`` of tf.data's Python classes (TF 2.15)."""
    current = dataset
    while type(current).__name__ in _ONE_TO_ONE:
        current = current._input_dataset  # pylint: disable=protected-access
    if type(current).__name__ not in _BATCHING:
        return None
    size = _static_int(current._batch_size)  # pylint: disable=protected-access
    if size is None or size < 1:
        return None
    rows = int(current._input_dataset.cardinality())  # pylint: disable=protected-access
    return size, (rows if rows >= 0 else None)


def padding_values(dataset):
    """The ``padding_values`` (a structure like the elements', of scalar tensors) of the ``padded_batch`` that makes
    ``dataset``'s elements, found under datasets that pass its elements on unchanged (``prefetch``, ``cache``,
    options, ``repeat``, ``take``, ``skip``, ``shuffle``); else None. Reads ``_PaddedBatchDataset``'s
    ``_padding_values`` (TF 2.15)."""
    current = dataset
    while type(current).__name__ in _SAME_ELEMENTS + _PASSED_ON:
        current = current._input_dataset  # pylint: disable=protected-access
    if type(current).__name__ != "_PaddedBatchDataset":
        return None
    return current._padding_values  # pylint: disable=protected-access


def _static_int(tensor):
    value = tf.get_static_value(tensor)
    return None if value is None else int(value)
