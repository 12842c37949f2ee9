"""What a training step reads from PS variables: one read per step of each dense one (what TensorFlow 1's caching
devices did), and each gathered row once per gather (``gather_policy``), by distinct ids the step's push of that
gather's gradient sends again (``distinct``).

Keras' RNN layers read their kernels inside the loop over time steps: an LSTM kernel on a PS is fetched once per
time step (20 reads per step for lm1b). ``policy`` is the ``read_policy`` of dense PS variables: while a train step
is traced and a gradient tape may record (the forward and backward pass), the first dense read of a variable is
built in the outermost function graph and every later read in that trace (in loop and branch bodies too, which
capture it) reuses it; gradients flow through the one read. Outside a tape (the optimizer's update, evaluation,
eager reads) reads are left alone, so an update is never read back stale.
"""

import tensorflow as tf

from kparallax._compat import tf as tf_compat

_READS = "cached_reads"  # attached to the outermost FuncGraph: {variable ref: its read}
_DISTINCT = "distinct_ids"  # attached to a FuncGraph: {a gradient's indices ref: (distinct ids, position)}


def policy(variable, read):
    """``read_policy`` of a dense PS variable (see ``_compat.tf.SharedResourceVariable``)."""
    graph = tf_compat.outermost_function_graph()
    if graph is None or not tf_compat.tape_may_record():
        return read()
    cache = tf_compat.graph_attached(graph, _READS)
    key = variable.ref()
    if key not in cache:
        with tf_compat.enter_graph(graph):
            cache[key] = read()
    tf_compat.mark_accessed(variable)
    tf_compat.record_read(variable, cache[key])  # on the tapes recording now, each read as TensorFlow's would be
    return cache[key]


def gather_policy(variable, ids, gather):
    """``gather_policy`` of a PS variable (see ``_compat.tf.SharedResourceVariable``): while a train step is traced
    and a tape may record, a gather of rows by ``ids`` (an embedding lookup) fetches each distinct id's row once and
    repeats it on the worker. A batch of text repeats its frequent words: LM1B's lookups name each of them once per
    occurrence. The tapes see the gather TensorFlow would make, with its gradient (one slice per id, repeats
    included: the norm a ``clipnorm`` takes, the values a ``clipvalue`` clips, are one process's). Elsewhere (the
    update, evaluation) gathers are left alone."""
    if tf_compat.outermost_function_graph() is None or not tf_compat.tape_may_record():
        return gather(ids)
    ids = tf.convert_to_tensor(ids)
    if ids.shape.rank is None or not ids.shape[1:].is_fully_defined() or not variable.shape[1:].is_fully_defined():
        return gather(ids)
    with tf_compat.not_recording():
        with tf_compat.uncolocated():  # on the worker, not with the table (``tf.nn.embedding_lookup`` colocates)
            # int64: the dtype the push sends its ids in (``local_aggregation.dedup``), so both send one tensor
            distinct, position = tf.unique(tf.cast(tf.reshape(ids, [-1]), tf.int64))
        rows = gather(distinct)
        with tf_compat.uncolocated():
            repeated = tf.reshape(tf.gather(rows, position),
                                  tf.concat([tf.shape(ids), variable.shape[1:].as_list()], 0))
    tf_compat.mark_accessed(variable)

    def indices_made(indices):  # the gradient's indices: ``ids`` flattened, in the same order
        if indices.graph is distinct.graph:
            tf_compat.graph_attached(indices.graph, _DISTINCT)[indices.ref()] = (distinct, position)

    tf_compat.record_gather(variable, ids, repeated, indices_made)
    return repeated


def distinct(indices):
    """``(distinct ids, position)`` as ``tf.unique(tf.cast(indices, tf.int64))`` gives them, for the indices of the
    gradient of a gather ``gather_policy`` made in the same graph: the ids its forward pass pulled rows by, so a
    push of that gradient sends the very tensor the pull sent (it crosses once per step and PS task, not twice),
    and the unique is not computed again. None for any other indices (a gradient's indices a tape concatenated,
    ids allgathered)."""
    if not tf.is_symbolic_tensor(indices):
        return None
    return tf_compat.graph_attached(indices.graph, _DISTINCT).get(indices.ref())
