"""Parameter-server task: ``kparallax-ps`` or ``python -m kparallax.cluster.ps_server`` (kparallax-run starts it).

Reads its role from the ``KPARALLAX_*`` environment (or ``TF_CONFIG``) and serves a ``tf.distribute.Server``
until it receives SIGTERM or SIGINT, then exits 0.
"""

import os
import signal
import sys
import time

from kparallax import log as logging
from kparallax._compat import process
from kparallax.cluster.spec import Cluster


def main():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ INFO lines belong nowhere here
    try:
        cluster = Cluster.from_env()
    except ValueError as e:
        print(f"kparallax-ps: {e}", file=sys.stderr)
        return 2
    if cluster.task_type != "ps":
        print("kparallax-ps: this process is not a PS task. "
              f"Received: task_type={cluster.task_type!r}. Set KPARALLAX_TASK_TYPE=ps.", file=sys.stderr)
        return 2
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    stop = {"now": False}

    def _stop(signum, frame):  # pylint: disable=unused-argument
        stop["now"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster.cluster_spec_dict()), job_name="ps",
                                  task_index=cluster.task_index, protocol="grpc", start=True)
    logging.info("kparallax PS task %d serving at %s (run %s)", cluster.task_index,
                 cluster.ps[cluster.task_index], cluster.run_id)
    print(f"kparallax PS task {cluster.task_index} ready at {cluster.ps[cluster.task_index]}", flush=True)
    while not stop["now"] and server is not None:
        time.sleep(0.2)
    logging.info("kparallax PS task %d stopping", cluster.task_index)
    return 0


def run():
    process.hard_exit(main())


if __name__ == "__main__":
    run()
