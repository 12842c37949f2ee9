"""Parameter-server task: ``python -m kparallax.ps`` (started by kparallax-run).

Reads its role from the ``KPARALLAX_*`` environment (or ``TF_CONFIG``) and serves a ``tf.distribute.Server``
until it receives SIGTERM or SIGINT, then exits 0.
"""

import signal
import sys
import time

from kparallax import _compat
from kparallax import _proc

_compat.quiet_tensorflow_cpp_logs()


def main():
    from absl import logging
    import tensorflow as tf
    from kparallax.cluster import Cluster

    _proc.die_with_parent()
    try:
        cluster = Cluster.from_env()
    except ValueError as e:
        print(f"kparallax.ps: {e}", file=sys.stderr)
        return 2
    if cluster.task_type != "ps":
        print("kparallax.ps: this process is not a PS task. "
              f"Received: task_type={cluster.task_type!r}. Set KPARALLAX_TASK_TYPE=ps.", file=sys.stderr)
        return 2
    stop = {"now": False}

    def _stop(signum, frame):  # pylint: disable=unused-argument
        stop["now"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster.cluster_spec_dict()), job_name="ps",
                                  task_index=cluster.task_index, protocol="grpc", start=True)
    logging.set_verbosity(logging.INFO)
    logging.info("kparallax PS task %d serving at %s (run %s)", cluster.task_index,
                 cluster.ps[cluster.task_index], cluster.run_id)
    print(f"kparallax PS task {cluster.task_index} ready at {cluster.ps[cluster.task_index]}", flush=True)
    while not stop["now"] and server is not None:
        time.sleep(0.2)
    logging.info("kparallax PS task %d stopping", cluster.task_index)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    _proc.hard_exit(code)
