"""Variables shared by all workers: one copy on a PS task, reached through a fixed shared name.

A ``tf.Variable`` created under ``tf.device("/job:ps/...")`` is private to the process that made it. A variable
is shared only when its handle carries a fixed ``shared_name`` and container on the PS device; every worker
builds such a handle, the chief initializes the value, the others wait until it is initialized.
"""

import time

import tensorflow as tf
from kparallax import log as logging

from kparallax._compat import tf as tf_compat

CONTAINER = "kparallax"
# The likely cause of workers disagreeing on their PS variables, and its fix.
ASYMMETRIC_CAUSE = (
    "Likely cause: a model holding PS variables (an embedding table) was built inside strategy.scope() on some "
    "workers only (under `if strategy.is_chief:`, say, to check a saved file), so the PS variables built after it got "
    "other names or PS tasks there. Build a model that only some workers use outside the scope, or on every worker.")


class SharedVariableStore:
    """Creates the shared PS variables of one run.

    Args:
      cluster: the ``Cluster``; its ``run_id`` namespaces the shared names.
      is_initializer: True on the one worker that writes initial values (the chief).
      init_timeout: seconds a non-chief worker waits for the chief to initialize a variable.
    """

    def __init__(self, cluster, is_initializer, init_timeout=300.0):
        self._cluster = cluster
        self._is_initializer = is_initializer
        self._init_timeout = init_timeout
        self._used_names = set()

    def _unique(self, path):
        name, n = path, 0
        while name in self._used_names:
            n += 1
            name = f"{path}_{n}"
        self._used_names.add(name)
        return name

    @tf.autograph.experimental.do_not_convert
    def create(self, path, shape, dtype, initial_value, ps_task, trainable=True, constraint=None):
        """Returns the shared variable ``path`` on PS task ``ps_task``, initialized.

        Args:
          path: variable path (e.g. ``"embedding/embeddings"``); the same on every worker.
          shape, dtype: of the variable.
          initial_value: a tensor, or a callable returning one; evaluated on the PS device by the chief only.
          ps_task: index of the PS task that holds the variable.
        """
        device = self._cluster.ps_device(ps_task)
        shared_name = f"{self._cluster.run_id}/{self._unique(path)}"
        variable = tf_compat.shared_variable(shared_name, CONTAINER, shape, dtype, device, trainable,
                                           constraint=constraint, name=path)
        variable.kp_shared_name = shared_name  # what the workers compare (fit_callbacks.check_same_ps_variables)
        if self._is_initializer:
            with tf.init_scope(), tf.device(device):
                value = initial_value() if callable(initial_value) else initial_value
                variable.assign(tf.cast(value, dtype))
            tf_compat.async_wait()
        else:
            self._wait_initialized(variable, path, ps_task)
        return variable

    @tf.autograph.experimental.do_not_convert
    def _wait_initialized(self, variable, path, ps_task):
        deadline = time.monotonic() + self._init_timeout
        delay = 0.01
        elsewhere = None  # handles to the other PS tasks' variables of this name, made once while waiting
        with tf.init_scope():
            while not tf_compat.is_initialized(variable):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"Shared variable {path!r} on ps[{ps_task}] ({self._cluster.ps[ps_task]}) was not "
                        f"initialized by the chief (worker 0) within {self._init_timeout:.0f} s. Check worker 0's "
                        f"log: it must build the same model. {ASYMMETRIC_CAUSE} Received: init_timeout="
                        f"{self._init_timeout}.")
                if delay == 0.5:
                    if elsewhere is None:
                        elsewhere = self._elsewhere(variable, ps_task)
                    self._refuse_placed_elsewhere(elsewhere, path, ps_task)
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        logging.debug("shared variable %s is initialized", path)

    def _elsewhere(self, variable, ps_task):
        """Handles to ``variable``'s shared name on every other PS task, by task index."""
        return {i: tf_compat.shared_variable(variable.kp_shared_name, CONTAINER, variable.shape, variable.dtype,
                                             self._cluster.ps_device(i), False)
                for i in range(len(self._cluster.ps)) if i != ps_task}

    def _refuse_placed_elsewhere(self, handles, path, ps_task):
        """Raises if the chief initialized this worker's shared variable on another PS task (one of ``handles``):
        the workers placed the same variable differently (they will never agree)."""
        elsewhere = [i for i, handle in handles.items() if tf_compat.is_initialized(handle)]
        if elsewhere:
            raise ValueError(
                f"Shared variable {path!r} is on ps[{ps_task}] on this worker, but the chief (worker 0) put it on "
                f"ps[{elsewhere[0]}]: the workers placed their PS variables differently. {ASYMMETRIC_CAUSE} "
                f"Received: {path!r} -> ps[{ps_task}] here, ps[{elsewhere[0]}] on worker 0.")
