"""Joining the PS tasks from a worker process (eager client of remote TF servers).

Workarounds for TensorFlow 2.15 (seen 2.15.1):
- a worker connects with a cluster view of all PS tasks plus *itself only*: a view listing every worker hangs in
  context initialization (each client tries to create contexts on the other workers);
- first connections are serialized across workers (a lock file on one host, the coordinator across hosts): when two
  clients create their context on one PS at nearly the same instant, the PS can segfault in
  ``EagerServiceImpl::ExecuteOp`` (seen in 20-50% of synchronized starts; clients then see
  ``UnavailableError: Socket closed``). The first op on each PS runs inside the same critical section.
- ``connect_to_cluster`` logs the whole session config (about 15 lines) at INFO through absl's logger, which
  absl-flag programs show; that logger is held at WARNING during the call.
- Variables and resources (lookup tables) created before the connection live on ``/job:localhost``, which no longer
  exists after it: any later use fails with ``Client for target /job:localhost/replica:0/task:0 not found``
  (a Keras optimizer made before the strategy: at ``compile``; a model built before: at ``fit``; an adapted
  ``TextVectorization``: when called). ``created_before`` finds them (live objects, after a garbage collection).
"""

import contextlib
import fcntl
import gc
import logging

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops as _rv
from tensorflow.python.trackable import resource as _resource

from kparallax._compat import tf as tf_compat


@contextlib.contextmanager
def _file_lock(path):
    if not path:
        yield
        return
    with open(path, "a+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def connect(ps_addresses, task_index, own_address, ps_devices, lock_path=None):
    """Connects this worker (job ``worker``, ``task_index``) to the PS tasks and runs a first op on each."""
    spec = tf.train.ClusterSpec({"ps": list(ps_addresses), "worker": {task_index: own_address}})
    logger = logging.getLogger("absl")
    level = logger.level
    with _file_lock(lock_path):
        logger.setLevel(max(level, logging.WARNING))
        try:
            tf.config.experimental_connect_to_cluster(spec, job_name="worker", task_index=task_index,
                                                      protocol="grpc")
        finally:
            logger.setLevel(level)
        for device in ps_devices:
            with tf.device(device):
                tf.identity(tf.constant(0)).numpy()
        tf_compat.async_wait()


def created_before():
    """Descriptions of the live eager variables and created resources of this process (they would be unusable
    once it connects), e.g. ``["variable 'iteration'", "resource StaticHashTable"]``."""
    gc.collect()
    found = []
    for obj in gc.get_objects():
        if isinstance(obj, _rv.BaseResourceVariable) and not getattr(obj, "_in_graph_mode", True):
            found.append(f"variable {obj.name.split(':')[0]!r}")
        elif isinstance(obj, _resource.CapturableResource) and tf.is_tensor(getattr(obj, "_resource_handle", None)):
            found.append(f"resource {type(obj).__name__}")
    # Named variables (a layer's weights, an optimizer's) first, then resources, then unnamed variables.
    return sorted(found, key=lambda d: 2 if d == "variable 'Variable'" else d.startswith("resource"))
