"""Horovod collectives of a step: the dense gradient allreduce, the per-table allgathers, the barrier and the checked sum
that carries the step's logs (``logs.py``).

Every collective here has a fixed name (Horovod matches tensors across workers by name) and every output the step
does not otherwise use is read by a stateful op (``_compat.horovod.KeepAlive``): the Grappler workaround is written
once, here. Ordering between a worker's ops and remote (PS) ops is expressed with *data* edges only: a "token" is
an int64 scalar >= 1 read from a PS-side counter after the ops it stands for, and ``tie`` makes a tensor depend on
tokens without changing its value. TensorFlow's multi-device functions do not keep cross-device control edges
(seen with TF 2.15.1: a collective ordered after a remote op only by a control edge was pruned on one worker and
the others waited forever).
"""

import zlib

import horovod.tensorflow as hvd
import tensorflow as tf

from kparallax._compat import horovod as hvd_compat
from kparallax._compat import tf as tf_compat

_COMPRESSION = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}


def ready(tokens):
    """int64 scalar 1 that exists only once every token does (``tokens``: int64 scalars >= 1). Tokens made on one
    task (a PS task's updates of its variables and shards) are combined there first: they cross to the device
    reading them as one tensor, one message per task instead of one per token."""
    if not tokens:
        return tf.constant(1, tf.int64)
    combined = []
    for group in _by_task(tokens):
        if len(group) > 1 and group[0].device:
            with tf.device(group[0].device):
                group = [_at_least_one(group)]
        combined += group
    return _at_least_one(combined)


def _at_least_one(tokens):
    """1 once every one of ``tokens`` (int64 scalars >= 1) exists."""
    return tf.minimum(tf.add_n([tf.cast(t, tf.int64) for t in tokens]), 1)


def _by_task(tokens):
    """``tokens`` grouped by the task they are made on (tokens without a device are one group), in order."""
    groups = {}
    for token in tokens:
        groups.setdefault(task_of(token.device), []).append(token)
    return list(groups.values())


def task_of(device):
    """The task part of ``device`` (a device string, e.g. ``/job:ps/replica:0/task:1/device:CPU:0`` ->
    ``/job:ps/replica:0/task:1``); "" for ""."""
    return tf.DeviceSpec.from_string(device or "").replace(device_type=None, device_index=None).to_string()


def tie(tensor, tokens):
    """``tensor`` (an integer tensor), unchanged in value but computed only after ``tokens`` (a data edge)."""
    if not tokens:
        return tensor
    return tensor + tf.cast(ready(tokens) - 1, tensor.dtype)


def average_gradients(grads_and_vars, num_workers, compression="none", sparse_as_dense=False, name="kp"):
    """Averages gradients of replicated variables across workers, one Horovod collective per gradient.

    Dense gradients are allreduced; ``tf.IndexedSlices`` are allgathered (values and indices, Horovod's default)
    unless ``sparse_as_dense``, which densifies them first. Each gradient gets its own collective (named by its
    position, the same on every worker), as Horovod's ``DistributedOptimizer`` does: a collective starts as soon as
    its gradient exists, while backprop computes the rest, and Horovod's background thread fuses whatever is ready
    into one buffer. (A single grouped collective would wait for the last gradient, the first layer's, before
    sending anything.)

    Args:
      grads_and_vars: list of (gradient, replicated variable).
      num_workers: Horovod size.
      compression: ``"none"`` or ``"fp16"`` (dense tensors travel as float16).
      sparse_as_dense: densify IndexedSlices before reducing.
      name: prefix of the collectives' names.

    Returns:
      List of (averaged gradient, variable), in the same order.
    """
    grads = [tf.convert_to_tensor(g) if sparse_as_dense and isinstance(g, tf.IndexedSlices) else g
             for g, _ in grads_and_vars]
    variables = [v for _, v in grads_and_vars]
    if num_workers == 1 or not grads:
        return list(zip(grads, variables))
    out = []
    for i, grad in enumerate(grads):
        if isinstance(grad, tf.IndexedSlices):
            values = hvd.allgather(grad.values, name=f"{name}_replicated_sparse_values_{i}")
            indices = hvd.allgather(tf.cast(grad.indices, tf.int64), name=f"{name}_replicated_sparse_indices_{i}")
            out.append(tf.IndexedSlices(values / tf.cast(num_workers, values.dtype), indices, grad.dense_shape))
        else:
            out.append(hvd.allreduce(grad, op=hvd.Average, compression=_COMPRESSION[compression],
                                     name=f"{name}_dense_grad_{i}"))
    return list(zip(out, variables))


def sum_over_workers(tensor, num_workers, name):
    """The sum of ``tensor`` over all workers (identity on one worker)."""
    if num_workers == 1:
        return tensor
    return hvd.allreduce(tensor, op=hvd.Sum, name=name)


def from_first_worker(tensor, num_workers, name):
    """Worker 0's ``tensor`` on every worker (in a step: a Horovod broadcast of each worker's own value; an allreduce
    of zeros from the others would have a constant input, which Grappler may fold, collective included)."""
    if num_workers == 1:
        return tensor
    return hvd.broadcast(tensor, root_rank=0, name=name)


def allgather(tensors, num_workers, name, process_set=None):
    """Grouped allgather of ``tensors`` (identity when ``num_workers``, the size of the group, is 1).

    The group carries one more tensor, one element computed by a worker-local stateful op, and drops it from the
    result: Horovod ops are not stateful, so Grappler's common subexpression elimination merges two allgathers of
    one step whose inputs are the same tensors. Where that happens on one worker only, the others wait forever for
    the collective it dropped (seen: a worker that does not push, under local aggregation, sends empty ids for every
    table; lm1b's softmax weights and biases are looked up with the same ids, so their two allgathers became one
    there, and the pushing worker hung in the other's).
    """
    if num_workers == 1 or not tensors:
        return list(tensors)
    tensors = list(tensors)
    salt = tf.reshape(tf.cast(ready([_LOCAL_COUNTER.next()]), tensors[0].dtype), [1])
    kwargs = {} if process_set is None else {"process_set": process_set}
    return list(hvd.grouped_allgather(tensors + [salt], name=name, **kwargs))[:-1]


def allgather_groups(tensors, groups, num_workers, name, process_set=None):
    """``tensors`` allgathered group by group, results in the order of ``tensors``.

    One grouped allgather (``allgather``) per group, named ``{name}_{k}`` for the k-th group. A group starts as
    soon as its own tensors exist: the unit is one table (a variable or all shards of a partitioned table), so a
    table whose gradient comes early in backprop is exchanged while the layers below it are still computed.

    Args:
      tensors: the tensors to gather.
      groups: lists of positions in ``tensors``; together they cover each position once.
      num_workers: the size of the group of workers (the process set's, if any).
      name: prefix of the collectives' names (the same on every worker).
      process_set: a Horovod process set, or None for all workers.
    """
    out = [None] * len(tensors)
    for k, members in enumerate(groups):
        gathered = allgather([tensors[i] for i in members], num_workers, f"{name}_{k}", process_set)
        for i, tensor in zip(members, gathered):
            out[i] = tensor
    return out


def barrier(num_workers, tokens=(), name="kp_barrier"):
    """A float scalar ready only when every worker has passed this point with its ``tokens`` (int64 scalars).

    The result feeds data edges (``tie``) or ``keep_alive``; a barrier nobody reads is pruned by Grappler. Its
    input is scaled by a constant derived from ``name`` (>= 1): Horovod ops are not stateful, so Grappler's common
    subexpression elimination would merge two barriers of one step that receive the same tokens (seen: a worker
    ran ``kp_ps_pushed`` but never ``kp_step_done``, and the others waited for it). Its input also always
    depends on a worker-local counter incremented here: with a constant input (a worker with no tokens), Grappler's
    constant folding would evaluate the collective while optimizing the graph (seen: a hang at the first step).
    """
    salt = 1.0 + float(zlib.crc32(name.encode()) % 1009)
    with tf.name_scope(name):  # profiles see when the tokens arrived (``kparallax_bench.op_profile``)
        token = tf.cast(ready(list(tokens) + [_LOCAL_COUNTER.next()]), tf.float32) * salt
    if num_workers == 1:
        return token
    return hvd.allreduce(token, op=hvd.Sum, name=name)


STEP_SKEW_MESSAGE = "kparallax step check: the optimizers of the workers are at different steps"


def step_skew_error(iterations):
    """The error every worker raises when ``sum_checked`` found the workers' optimizers at different steps."""
    return RuntimeError(
        "The workers' optimizers are at different steps: a step was applied on some workers only, e.g. a "
        "mixed_float16 loss-scale skip decided by one worker. Training stopped before the workers' collectives "
        f"went out of step. Received: iterations={int(iterations)} on this worker.")


def sum_checked(values, iterations, num_workers, name):
    """``values`` (a float32 or float64 vector) summed over the workers by one allreduce of its dtype that also
    checks the steps.

    The allreduce carries ``iterations`` (this worker's optimizer step) modulo 64 and its square, summed: they are
    equal on every worker exactly when ``N * sum(m^2) == sum(m)^2``. If not, a step was applied on some workers only
    (e.g. a mixed_float16 loss-scale skip decided by one worker) and every worker fails at the same point with
    ``STEP_SKEW_MESSAGE`` (an ``InvalidArgumentError``; ``step_skew_error`` says it plainly), before the workers'
    collectives go out of step. Works in a step's graph and eagerly (``fit_callbacks.AverageMetrics``); used by
    ``logs.over_workers``.
    """
    values = tf.convert_to_tensor(values)
    dtype = values.dtype if values.dtype in (tf.float32, tf.float64) else tf.float32
    step = tf.cast(tf.math.floormod(tf.cast(iterations, tf.int64), 64), dtype)
    payload = tf.concat([tf.reshape(tf.cast(values, dtype), [-1]), tf.stack([step, step * step])], 0)
    summed = hvd.allreduce(payload, op=hvd.Sum, name=name)
    total, total_square = tf.cast(summed[-2], tf.float64), tf.cast(summed[-1], tf.float64)
    check = tf.debugging.Assert(
        tf.equal(float(num_workers) * total_square, total * total),
        [STEP_SKEW_MESSAGE, "; mean step modulo 64:", total / num_workers, "this worker's:", step])
    with tf.control_dependencies([check]):
        return tf.identity(summed[:-2])


class _LocalCounter:
    """A worker-local int64 variable; ``next()`` increments it and returns the new value (>= 1)."""

    def __init__(self):
        self._variable = None

    def make(self):
        """Creates the variable if it does not exist yet (before a layer's call that may gather: Keras refuses a
        variable created inside a ``Lambda`` layer's call)."""
        if self._variable is None:
            with tf.init_scope():
                self._variable = tf.Variable(0, dtype=tf.int64, trainable=False, name="kp_barriers_passed")

    @tf.autograph.experimental.do_not_convert
    def next(self):
        self.make()
        return tf.convert_to_tensor(self._variable.assign_add(1))


_LOCAL_COUNTER = _LocalCounter()
_KEEP_ALIVE = hvd_compat.KeepAlive()


def keep_alive(tensors):
    """A stateful op reading one element of each tensor, so that collectives whose outputs the step does not use
    still run on every worker (see ``_compat.horovod``)."""
    return _KEEP_ALIVE.consume([t for t in tensors if t is not None])


def allgather_ints(values, name):
    """Every worker's list of ``len(values)`` integers, as a list per worker (eager; a tensor collective:
    nothing is unpickled from the network)."""
    local = tf.constant([list(values)], tf.int64)
    if hvd.size() == 1:
        return [list(values)]
    return [list(map(int, row)) for row in hvd.allgather(local, name=name).numpy()]


def any_worker(flag, num_workers, name):
    """Whether ``flag`` (a Python bool) is true on any worker (eager; every worker must call it)."""
    return bool(sum_over_workers(tf.constant(float(bool(flag))), num_workers, name).numpy() > 0)


def any_worker_in_graph(flag, num_workers, name):
    """Whether the bool tensor ``flag`` is true on any worker (a tensor; every worker must run it)."""
    return sum_over_workers(tf.cast(flag, tf.float32), num_workers, name) > 0


def broadcast_variables(variables, name):
    """Assigns worker 0's values to ``variables`` on every worker (eager; every worker passes its variables in the
    same order): one Horovod broadcast per dtype, of that dtype's variables packed into one flat buffer.

    Horovod's ``broadcast_variables`` traces one ``tf.function`` per list of variables, so a program that trains a
    few models in one process showed TensorFlow's retracing warnings on the terminal; eager broadcasts trace
    nothing."""
    by_dtype = {}
    for variable in variables:
        by_dtype.setdefault(variable.dtype.base_dtype, []).append(variable)
    for dtype in sorted(by_dtype, key=lambda d: d.name):
        group = by_dtype[dtype]
        values = [v.read_value() for v in group]  # a preprocessing layer's state may have no static shape
        received = hvd.broadcast(tf.concat([tf.reshape(value, [-1]) for value in values], axis=0), root_rank=0,
                                 name=f"{name}_{dtype.name}")
        offset = 0
        for variable, value in zip(group, values):
            size = int(tf.size(value))
            variable.assign(tf.reshape(received[offset:offset + size], tf.shape(value)))
            offset += size


def eager_barrier(num_workers, name):
    """Blocks until every worker reached this point (eager), each worker's remote eager ops landed first (TF 2.15
    only dispatches them: a PS write worker 0 made before the barrier could otherwise land after it)."""
    tf_compat.async_wait()
    if num_workers > 1:
        hvd.allreduce(tf.constant(1.0), op=hvd.Sum, name=name).numpy()
