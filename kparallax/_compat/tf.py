"""TensorFlow internals: shared PS variables, their read hook, the eager context, function graphs and the chain of
datasets a tf.data pipeline is built from.

Versions: TensorFlow 2.15 (seen 2.15.1). Each function names the private API it touches.
"""

import contextlib
import functools
import inspect
import sys

import tensorflow as tf
from tensorflow.python.data.ops import interleave_op as _interleave_op
from tensorflow.python.distribute import distribute_lib as _distribute_lib
from tensorflow.python.distribute import sharded_variable as _sharded
from tensorflow.python.eager import backprop as _backprop
from tensorflow.python.eager import context as _context
from tensorflow.python.eager import record as _record
from tensorflow.python.framework import func_graph as _func_graph
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import gen_math_ops as _gen_math
from tensorflow.python.ops import gen_resource_variable_ops as _gen_rv
from tensorflow.python.ops import gradients_util as _gradients_util
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
    import contextlib  # pylint: disable=import-outside-toplevel

    @contextlib.contextmanager
    def scope():
        with graph.as_default(), _ops.control_dependencies(None):
            yield
    return scope()


@contextlib.contextmanager
def _swapped(owners, name, value):
    """While active, attribute ``name`` of every object in ``owners`` (classes or modules) is ``value``; then each is
    restored to what it was when the context began."""
    previous = [getattr(owner, name) for owner in owners]
    for owner in owners:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, old in zip(owners, previous):
            setattr(owner, name, old)


def recording_gradients(record, outermost_only=False):
    """While active, every ``tf.GradientTape.gradient`` call and every ``tf.gradients`` call (``tf.compat.v1`` too)
    in this process hands ``record(target, sources, gradients)`` what it was asked and what it returns (then returns
    it). Swapped for the duration: the public method on TensorFlow's class
    (``tensorflow.python.eager.backprop.GradientTape``, which ``tf.GradientTape`` is), which Keras' ``train_step`` and
    a user's reach through ``tape.gradient`` or an optimizer's ``compute_gradients``; and the graph gradients' helper
    ``gradients_util._GradientsHelper``, which ``tf.gradients`` calls (and a ``tf.cond``'s or ``tf.while_loop``'s
    gradient, inside the function of its own: its sources are that function's tensors, not variables).

    With ``outermost_only``, a call made while another one computes its gradients is not handed over: it is part of
    that backward pass (``tf.recompute_grad``'s gradient differentiates its function again under a tape of its own;
    a custom gradient may take one), not a loss the step differentiates. A tape inside another's forward pass (a
    gradient penalty) runs before the outer call and is handed over."""
    original = _backprop.GradientTape.gradient
    helper = _gradients_util._GradientsHelper  # pylint: disable=protected-access
    depth = [0]

    def recorded(call, target, sources, args, kwargs):
        depth[0] += 1
        try:
            result = call(target, sources, *args, **kwargs)
        finally:
            depth[0] -= 1
        if not (outermost_only and depth[0]):
            record(target, sources, result)
        return result

    def gradient(self, target, sources, *args, **kwargs):
        return recorded(functools.partial(original, self), target, sources, args, kwargs)

    def graph_gradients(ys, xs, *args, **kwargs):
        return recorded(helper, ys, xs, args, kwargs)

    return _swapped_each([(_backprop.GradientTape, "gradient", gradient),
                          (_gradients_util, "_GradientsHelper", graph_gradients)])


# Packages whose calls of a replica context's collectives are their own business: Keras' optimizers aggregate
# gradients with all_reduce and its synchronized BatchNormalization sums statistics with it (kparallax handles both
# itself); Keras, TensorFlow (tf.nn.compute_average_loss) and Horovod read num_replicas_in_sync. ``tf_keras``: Keras 2
# under TensorFlow 2.16-2.18.
_LIBRARY_PACKAGES = ("tensorflow", "keras", "tf_keras", "horovod", "kparallax")


def _caller_is_library():
    """Whether the function that called the caller of this function is in one of ``_LIBRARY_PACKAGES``, past
    TensorFlow's autograph frames (a ``tf.function`` traced with autograph calls the callees of converted code through
    ``tensorflow.python.autograph``; converted code keeps its module's globals)."""
    frame = sys._getframe(2)  # pylint: disable=protected-access
    while frame is not None and frame.f_globals.get("__name__", "").startswith("tensorflow.python.autograph"):
        frame = frame.f_back
    module = (frame.f_globals.get("__name__") if frame is not None else None) or ""
    return module.split(".")[0] in _LIBRARY_PACKAGES


def _default_strategy_swapped(owner, name, replacement, users_only):
    """While active, member ``name`` (a method or a property) of class ``owner`` (a replica context's, a strategy's or
    a strategy's ``extended``), on an object of TensorFlow's default strategy, calls ``replacement`` instead, with the
    method's arguments (none for a property); with ``users_only``, only when the caller is outside
    ``_LIBRARY_PACKAGES``. Other strategies' objects get the original. The default strategy (the private
    ``distribute_lib._get_default_strategy()``) is what ``tf.distribute.get_strategy()`` returns outside a
    tf.distribute strategy and inside Keras' train function, which runs its step through that strategy's ``run``
    (one replica), and what a ``merge_call``'s function gets there. Swapped for the duration on the class of
    ``owner``'s MRO that defines it."""
    cls = next(base for base in owner.__mro__ if name in base.__dict__)
    original = cls.__dict__[name]
    is_property = isinstance(original, property)
    function = original.fget if is_property else original
    default = _distribute_lib._get_default_strategy()  # pylint: disable=protected-access
    if issubclass(owner, _distribute_lib.StrategyBase):
        strategy_of = lambda strategy: strategy
    elif issubclass(owner, _distribute_lib.StrategyExtendedV2):
        strategy_of = lambda extended: extended._container_strategy()  # pylint: disable=protected-access
    else:
        strategy_of = lambda context: context.strategy

    def member(self, *args, **kwargs):
        if strategy_of(self) is not default or (users_only and _caller_is_library()):
            return function(self, *args, **kwargs)
        return replacement(*args, **kwargs)

    return _swapped([cls], name, property(member, doc=original.__doc__) if is_property else member)


# How the default strategy's objects are named in messages: its replica context and the strategy itself (whose
# ``extended`` follows the strategy's name).
_CONTEXT = "tf.distribute.get_replica_context()"
_STRATEGY = "tf.distribute.get_strategy()"


@contextlib.contextmanager
def _default_strategy_swaps(swaps):
    """While active, every ``(owner, name, replacement, users_only)`` of ``swaps`` is swapped in
    (``_default_strategy_swapped``); each is restored when the context ends."""
    with contextlib.ExitStack() as stack:
        for owner, name, replacement, users_only in swaps:
            stack.enter_context(_default_strategy_swapped(owner, name, replacement, users_only))
        yield


def default_gathers(gather):
    """While active, ``all_gather`` on a replica context of TensorFlow's default strategy (whose gather returns its
    value: one replica) calls ``gather(where, value, axis)`` instead, ``where`` naming the method; so does the default
    strategy's ``gather`` (which a ``merge_call``'s function gets) when called by code outside TensorFlow, Keras,
    Horovod and kparallax (``_default_strategy_swapped``)."""
    return _default_strategy_swaps([
        (tf.distribute.ReplicaContext, "all_gather",
         lambda value, axis, options=None: gather(f"{_CONTEXT}.all_gather", value, axis), False),
        (tf.distribute.Strategy, "gather", lambda value, axis: gather(f"{_STRATEGY}.gather", value, axis), True),
    ])


def default_reductions(reduce):
    """While active, TensorFlow's default strategy's reductions (each returns its value: one replica), called by code
    outside TensorFlow, Keras, Horovod and kparallax (a user's ``train_step`` or a ``merge_call``'s function in it, a
    library written for tf.distribute), call ``reduce(where, reduce_op, values)`` instead, ``where`` naming the method:
    its replica context's ``all_reduce``, the strategy's ``reduce``, its ``extended.reduce_to`` and
    ``extended.batch_reduce_to`` (``values``: the values of its pairs). Keras' own calls (its optimizers' gradient
    aggregation, synchronized BatchNormalization, its train function's logs) reduce as before
    (``_default_strategy_swapped``)."""
    return _default_strategy_swaps([
        (tf.distribute.ReplicaContext, "all_reduce",
         lambda reduce_op, value, options=None: reduce(f"{_CONTEXT}.all_reduce", reduce_op, value), True),
        (tf.distribute.Strategy, "reduce",
         lambda reduce_op, value, axis: reduce(f"{_STRATEGY}.reduce", reduce_op, value), True),
        (tf.distribute.StrategyExtended, "reduce_to",
         lambda reduce_op, value, destinations, options=None: reduce(
             f"{_STRATEGY}.extended.reduce_to", reduce_op, value), True),
        (tf.distribute.StrategyExtended, "batch_reduce_to",
         lambda reduce_op, value_destination_pairs, options=None: reduce(
             f"{_STRATEGY}.extended.batch_reduce_to", reduce_op, [value for value, _ in value_destination_pairs]),
         True),
    ])


def default_replica_count(count):
    """While active, ``num_replicas_in_sync`` of TensorFlow's default strategy (``tf.distribute.get_strategy()``, a
    Keras model's ``distribute_strategy``) and of its replica context (``tf.distribute.get_replica_context()``), read
    by code outside TensorFlow, Keras, Horovod and kparallax, is ``count(where)``, ``where`` naming which of the two
    was read; their own reads (Keras' loss scaling, ``tf.nn.compute_average_loss``) give 1 as before
    (``_default_strategy_swapped``)."""
    return _default_strategy_swaps([
        (tf.distribute.ReplicaContext, "num_replicas_in_sync", lambda: count(_CONTEXT), True),
        (tf.distribute.Strategy, "num_replicas_in_sync", lambda: count(_STRATEGY), True),
    ])


@functools.lru_cache(maxsize=None)
def _dispatch_target(function):
    """TensorFlow's exported ``function``'s undecorated body and the closure cell through which every call of it
    reaches that body: ``dispatch_target`` of the handler ``dispatch.add_dispatch_support`` wraps it in (private;
    TF 2.15: the exported object is a traceback filter around that handler). One object is exported under every name
    (``tf.nn``, ``tf.compat.v2.nn``, a name a user bound with ``from tensorflow.nn import ...``), so setting the cell
    reaches them all."""
    body = inspect.unwrap(function)
    pending, seen = [function], set()
    while pending:
        wrapper = pending.pop()
        if id(wrapper) in seen:
            continue
        seen.add(id(wrapper))
        for name, cell in zip(wrapper.__code__.co_freevars, wrapper.__closure__ or ()):
            contents = cell.cell_contents
            if name == "dispatch_target" and contents is body:
                return body, cell
            if inspect.isfunction(contents):
                pending.append(contents)
    raise RuntimeError(f"kparallax cannot scale {function.__module__}.{function.__name__} in this TensorFlow version "
                       f"(no dispatch_target cell around it). Received: tensorflow {tf.__version__}; kparallax is "
                       "tested with 2.15 (kparallax/_compat/tf.py: _dispatch_target).")


@contextlib.contextmanager
def average_loss_replaced(wrap):
    """While active, every call of ``tf.nn.compute_average_loss`` (one function, in ``tf.nn`` and
    ``tf.compat.v2.nn``, and under any name bound to it before) runs ``wrap(tensorflow's own body)``; nested, the
    inner one holds until it ends (``wrap=lambda own: own`` restores TensorFlow's). Swapped in the closure cell of
    TensorFlow's dispatch wrapper (``_dispatch_target``), as a name bound before would keep a module attribute's old
    value."""
    body, cell = _dispatch_target(tf.nn.compute_average_loss)
    previous = cell.cell_contents
    cell.cell_contents = wrap(body)
    try:
        yield
    finally:
        cell.cell_contents = previous


def reductions_replaced(sum_fn, mean_fn):
    """While active, ``tf.reduce_sum`` and ``tf.reduce_mean`` (and what is built on them: Keras' backend, norms,
    ``count_nonzero``) make their op through ``sum_fn(own, *args, **kwargs)`` and ``mean_fn(own, *args, **kwargs)``,
    ``own`` TensorFlow's op function and the rest its arguments (``input, axis, keep_dims, name``). Swapped in
    ``gen_math_ops`` (``_sum``, ``mean``), which ``math_ops.reduce_sum_with_dims`` and ``reduce_mean`` call by
    module attribute (TensorFlow 2.15)."""
    own_sum, own_mean = _gen_math._sum, _gen_math.mean  # pylint: disable=protected-access
    return _swapped_each([(_gen_math, "_sum", functools.partial(sum_fn, own_sum)),
                          (_gen_math, "mean", functools.partial(mean_fn, own_mean))])


@contextlib.contextmanager
def _swapped_each(swaps):
    """``_swapped`` for each (owner, name, value) of ``swaps``, in order."""
    with contextlib.ExitStack() as stack:
        for owner, name, value in swaps:
            stack.enter_context(_swapped([owner], name, value))
        yield


def captured_from(tensor):
    """The tensor of an enclosing graph that ``tensor`` (a placeholder of a tf.function or cond/while body graph)
    captures, or None (``FuncGraph.captures``: (external, internal) pairs)."""
    graph = tensor.graph
    if not isinstance(graph, _func_graph.FuncGraph):
        return None
    for external, internal in graph.captures:
        if internal is tensor:
            return external
    return None


def called_graphs(op):
    """The graphs of the functions graph op ``op`` calls with its inputs, in order, or None: a ``tf.function``'s body
    (``PartitionedCall`` / ``StatefulPartitionedCall``: its inputs, captures last, are the body's ``inputs``) and a
    ``tf.cond``'s two branches (``If`` / ``StatelessIf``: the inputs after the predicate) and a ``tf.while_loop``'s
    body (``While`` / ``StatelessWhile``: the loop's variables in, their next values out). TF 2.15: the graph's
    function library gives each name's ``AtomicFunction``, whose ``graph`` is the body's ``FuncGraph``; None where
    one is not found (a function of another library, an op of another type)."""
    if op.type in ("PartitionedCall", "StatefulPartitionedCall"):
        names = [op.get_attr("f").name]
    elif op.type in ("If", "StatelessIf"):
        names = [op.get_attr("then_branch").name, op.get_attr("else_branch").name]
    elif op.type in ("While", "StatelessWhile"):
        names = [op.get_attr("body").name]
    else:
        return None
    graphs = []
    for name in names:
        try:
            function = op.graph._get_function(name)  # pylint: disable=protected-access
        except (AttributeError, ValueError):  # another TensorFlow's graph
            return None
        graph = getattr(function, "graph", None)
        if not isinstance(graph, _func_graph.FuncGraph):
            return None
        graphs.append(graph)
    return graphs


def add_control_inputs(op, controls):
    """Makes graph op ``op``, already made, run only after the ops ``controls`` of its graph (TF 2.15:
    ``Operation._add_control_inputs``, before the graph becomes a function)."""
    op._add_control_inputs(controls)  # pylint: disable=protected-access


def run_independently(op):
    """Keeps stateful graph op ``op`` (an ``Assert``) out of the chain in which a ``tf.function``'s automatic control
    dependencies run its stateful ops without resource inputs in the order they were made (TF 2.15:
    ``FuncGraph.experimental_acd_manager.run_independently``); it still runs before the function returns. Without
    that, an ``Assert`` made after ops it must run before (and given control edges to them) would close a cycle
    through the ``Assert`` made before it. Nothing in a graph without that chain (no manager)."""
    manager = getattr(op.graph, "experimental_acd_manager", None)
    if manager is not None:
        manager.run_independently(op)


def computed_from(tensor):
    """The tensors graph tensor ``tensor`` is computed from: for a placeholder a tf.function or cond/while body
    captured, the enclosing graph's tensor (``captured_from``); else its op's inputs. Nothing for an eager value or
    an input of the function itself."""
    if not tf.is_symbolic_tensor(tensor):
        return []
    if tensor.op.type == "Placeholder":
        external = captured_from(tensor)
        return [] if external is None else [external]
    return list(tensor.op.inputs)


def fold_back(tensor, memo, value_of):
    """``value_of(t, computed_from(t))`` for graph tensor ``tensor`` and every tensor it is computed from, each after
    its inputs, kept in ``memo`` (by ``ref()``; a tensor already there is neither recomputed nor walked past). Walks
    iteratively: a forward pass is deep. Returns ``memo[tensor.ref()]``."""
    stack = [(tensor, False)]
    while stack:
        current, expanded = stack.pop()
        if current.ref() in memo:
            continue
        inputs = computed_from(current)
        if not expanded and any(x.ref() not in memo for x in inputs):
            stack.append((current, True))
            stack.extend((x, False) for x in inputs if x.ref() not in memo)
            continue
        memo[current.ref()] = value_of(current, inputs)
    return memo[tensor.ref()]


def copy_op(op, inputs):
    """A copy of graph op ``op`` in the current graph, with ``inputs`` instead of its own (same type and attributes,
    a new name; private ``Graph._create_op_internal``, which captures inputs of enclosing graphs). Returns its
    outputs."""
    graph = _ops.get_default_graph()
    attrs = {key: value for key, value in op.node_def.attr.items() if not key.startswith("_class")}
    with tf.device(op.device) if op.device else contextlib.nullcontext():
        copied = graph._create_op_internal(  # pylint: disable=protected-access
            op.type, list(inputs), dtypes=[t.dtype for t in op.outputs], attrs=attrs,
            name=op.name.split("/")[-1])
    return list(copied.outputs)


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


# Datasets built again above a batch of ``scale`` times the rows by ``rebatched`` (a cache in memory only: a cache
# file would hold, or find, other batches under the same name).
_REBUILT = ("_MapDataset", "_ParallelMapDataset", "_PrefetchDataset", "_OptionsDataset", "CacheDataset")
_ORDER_FLAGS = {"default": None, "true": True, "false": False}


def rebatched(dataset, scale):
    """``dataset`` built again with its ``batch`` (or ``padded_batch``) of ``scale`` times the rows and the same
    ``map`` / ``prefetch`` / in-memory ``cache()`` / options above it, so that a ``map`` that shapes each batch by its
    own rows shapes the larger batches as it would if they had been asked for; None where anything else is above the
    batch, or the batch's size is not static, or its remainder is dropped. Re-applies each ``map``'s own Python
    function (``StructuredFunctionWrapper._func``) with its parallelism; reads the private ``_input_dataset``,
    ``_batch_size``, ``_drop_remainder``, ``_padded_shapes``, ``_padding_values``, ``_num_parallel_calls``,
    ``_deterministic``, ``_map_func``, ``_buffer_size``, ``_filename`` and ``_options_attr`` of tf.data's classes
    (TF 2.15)."""
    # pylint: disable=protected-access
    above, current = [], dataset
    while type(current).__name__ in _REBUILT:
        if type(current).__name__ == "CacheDataset" and tf.get_static_value(current._filename) != b"":
            return None
        above.append(current)
        current = current._input_dataset
    kind = type(current).__name__
    if kind not in _BATCHING:
        return None
    size = _static_int(current._batch_size)
    drop = tf.get_static_value(current._drop_remainder)
    if size is None or size < 1 or drop is None or bool(drop):
        return None
    source = current._input_dataset
    if kind == "_PaddedBatchDataset":
        rebuilt = source.padded_batch(size * scale, padded_shapes=current._padded_shapes,
                                      padding_values=current._padding_values)
    elif kind == "_ParallelBatchDataset":
        rebuilt = source.batch(size * scale, num_parallel_calls=_static_int(current._num_parallel_calls),
                               deterministic=_ORDER_FLAGS[current._deterministic])
    else:
        rebuilt = source.batch(size * scale)
    for part in reversed(above):
        kind = type(part).__name__
        if kind == "_MapDataset":
            rebuilt = rebuilt.map(part._map_func._func)
        elif kind == "_ParallelMapDataset":
            rebuilt = rebuilt.map(part._map_func._func, num_parallel_calls=_static_int(part._num_parallel_calls),
                                  deterministic=_ORDER_FLAGS[part._deterministic])
        elif kind == "_PrefetchDataset":
            rebuilt = rebuilt.prefetch(part._buffer_size)
        elif kind == "CacheDataset":
            rebuilt = rebuilt.cache()
        else:
            rebuilt = rebuilt.with_options(part._options_attr)
    return rebuilt


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
