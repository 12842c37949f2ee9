"""One client of the shared-variable test. Usage: shared_client.py PS_ADDRESS ROLE(write|read_then_write|read) INDEX"""

import sys

import numpy as np
import tensorflow as tf

from kparallax import Cluster
from kparallax.cluster import net
from kparallax.core.shared_variables import SharedVariableStore

ps, role, index = sys.argv[1], sys.argv[2], int(sys.argv[3])
cluster = Cluster(ps=[ps], workers=[f"localhost:{net.free_port()}" for _ in range(3)],
                  task_index=index, run_id="sharedtest")
tf.config.experimental_connect_to_cluster(
    tf.train.ClusterSpec({"ps": [ps], "worker": {index: cluster.workers[index]}}), job_name="worker", task_index=index)
store = SharedVariableStore(cluster, is_initializer=(role == "write"), init_timeout=30)
table = store.create("emb/embeddings", [50, 4], tf.float32, lambda: tf.fill([50, 4], 7.0), ps_task=0)
assert "/job:ps/" in table.device, table.device
if role in ("read_then_write", "read"):
    print("READ", float(np.sum(table.numpy())), flush=True)
if role == "read_then_write":
    table.scatter_update(tf.IndexedSlices(tf.fill([1, 4], 100.0), [3]))
    from tensorflow.python.eager import context
    context.async_wait()
