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
"""

import contextlib
import fcntl
import logging

import tensorflow as tf

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
