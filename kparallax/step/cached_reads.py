"""One read per step of each dense PS variable (what TensorFlow 1's caching devices did).

Keras' RNN layers read their kernels inside the loop over time steps: an LSTM kernel on a PS is fetched once per
time step (20 reads per step for lm1b). ``policy`` is the ``read_policy`` of dense PS variables: while a train step
is traced and a gradient tape may record (the forward and backward pass), the first dense read of a variable is
built in the outermost function graph and every later read in that trace (in loop and branch bodies too, which
capture it) reuses it; gradients flow through the one read. Outside a tape (the optimizer's update, evaluation,
eager reads) reads are left alone, so an update is never read back stale.
"""

import weakref

from kparallax._compat import tf as tf_compat

_CACHES = weakref.WeakKeyDictionary()  # outermost FuncGraph -> {variable ref: tensor}


def policy(variable, read):
    """``read_policy`` of a dense PS variable (see ``_compat.tf.SharedResourceVariable``)."""
    graph = tf_compat.outermost_function_graph()
    if graph is None or not tf_compat.tape_may_record():
        return read()
    cache = _CACHES.setdefault(graph, {})
    key = variable.ref()
    if key not in cache:
        with tf_compat.enter_graph(graph):
            cache[key] = read()
    tf_compat.mark_accessed(variable)
    return cache[key]
