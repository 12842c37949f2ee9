"""The Horovod side: the one place where gradients of replicated variables are averaged across workers."""

import horovod.tensorflow as hvd
import tensorflow as tf

_COMPRESSION = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}


def average_gradients(grads_and_vars, num_workers, control_inputs=(), compression="none", sparse_as_dense=False):
    """Averages gradients of replicated variables across workers with one fused (grouped) allreduce.

    Dense gradients are allreduced; ``tf.IndexedSlices`` are allgathered (values and indices, Horovod's default)
    unless ``sparse_as_dense``, which densifies them first.

    Args:
      grads_and_vars: list of (gradient, replicated variable).
      num_workers: Horovod size.
      control_inputs: ops that must finish before the allreduce starts (it then also acts as a barrier
        ordering them before every worker's next step).
      compression: ``"none"`` or ``"fp16"`` (dense tensors travel as float16).
      sparse_as_dense: densify IndexedSlices before reducing.

    Returns:
      List of (averaged gradient, variable), in the same order.
    """
    grads = [tf.convert_to_tensor(g) if sparse_as_dense and isinstance(g, tf.IndexedSlices) else g
             for g, _ in grads_and_vars]
    variables = [v for _, v in grads_and_vars]
    with tf.control_dependencies(list(control_inputs)):
        if num_workers == 1 or not grads:
            return [(_identity(g), v) for g, v in zip(grads, variables)]
        # Explicit collective names: Horovod matches tensors across workers by name, and auto-generated names
        # differ when the workers' graphs differ (the chief's PS update adds ops).
        dense = [i for i, g in enumerate(grads) if not isinstance(g, tf.IndexedSlices)]
        sparse = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
        out = list(grads)
        if dense:
            reduced = hvd.grouped_allreduce([grads[i] for i in dense], op=hvd.Average,
                                            compression=_COMPRESSION[compression], name="kp_dense_grads")
            for i, g in zip(dense, reduced):
                out[i] = g
        if sparse:
            values = hvd.grouped_allgather([grads[i].values for i in sparse], name="kp_replicated_sparse_values")
            indices = hvd.grouped_allgather([tf.cast(grads[i].indices, tf.int64) for i in sparse],
                                            name="kp_replicated_sparse_indices")
            for i, v, ids in zip(sparse, values, indices):
                out[i] = tf.IndexedSlices(v / tf.cast(num_workers, v.dtype), ids, grads[i].dense_shape)
    return list(zip(out, variables))


def _identity(grad):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(grad.values), grad.indices, grad.dense_shape)
    return tf.identity(grad)


def barrier(num_workers, control_inputs=(), name="kp_barrier"):
    """Returns a tensor that is ready only when every worker has passed this point and ``control_inputs`` ran."""
    with tf.control_dependencies(list(control_inputs)):
        token = tf.constant(1.0)
        if num_workers == 1:
            return tf.identity(token)
        return hvd.allreduce(token, op=hvd.Sum, name=name)


def allgather_ints(values, name):
    """Every worker's list of ``len(values)`` integers, as a list per worker (a tensor collective: nothing is
    unpickled from the network)."""
    local = tf.constant([list(values)], tf.int64)
    return [list(map(int, row)) for row in hvd.allgather(local, name=name).numpy()]


def allgather_text(text, name, width=256):
    """Every worker's short string (UTF-8, at most ``width`` bytes), sent as a fixed-width byte tensor."""
    data = text.encode("utf-8")
    if len(data) > width:
        raise ValueError(f"{name}: {text!r} is longer than {width} bytes. Received: {len(data)} bytes.")
    rows = allgather_ints([len(data)] + list(data) + [0] * (width - len(data)), name)
    return [bytes(row[1:1 + row[0]]).decode("utf-8") for row in rows]
