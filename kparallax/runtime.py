"""Joins this worker process to the cluster: connects to the PS tasks, then initializes Horovod.

Facts this module is built on (see shared notes): a worker must connect with a cluster view of the PS tasks
plus itself only (listing the other workers hangs); simultaneous first connects can crash a PS, so the first
connection and first PS op are serialized across workers; an unreachable PS must fail fast, never hang.
"""

import contextlib
import fcntl
import os
import socket
import time

import horovod.tensorflow as hvd
import portpicker
import tensorflow as tf
from absl import logging

from kparallax import _compat
from kparallax import rendezvous

_STATE = {"connected_to": None}


def _probe(address, timeout):
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return None
    except OSError as e:
        return e


def wait_reachable(cluster, timeout):
    """Waits until every PS task accepts TCP connections; raises ConnectionError naming the first that does not."""
    deadline = time.monotonic() + timeout
    for i, address in enumerate(cluster.ps):
        while True:
            error = _probe(address, timeout=min(2.0, timeout))
            if error is None:
                break
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"Parameter server ps[{i}] at {address} is not reachable after {timeout:.0f} s ({error}). "
                    "Check that the PS task is running and that the address is right. "
                    f"Received: ps={list(cluster.ps)}.")
            time.sleep(0.2)


@contextlib.contextmanager
def _serialized(path):
    if not path:
        yield
        return
    with open(path, "a+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _own_address(cluster, port_taken=False):
    """This worker's TensorFlow server address: its cluster address, or a free port on its host when the
    address has port 0 or its port serves the coordinator (worker 0 under TF_CONFIG)."""
    address = cluster.workers[cluster.task_index]
    host, port = address.rsplit(":", 1)
    if port == "0" or port_taken:
        address = f"{'localhost' if port == '0' else host}:{portpicker.pick_unused_port()}"
    return address


def _join_tf_config_job(cluster, connect_timeout):
    """Gives a TF_CONFIG worker (no launcher) its Horovod Gloo environment; worker 0 serves the rendezvous.

    The rendezvous (and the coordinator store) listens at worker 0's TF_CONFIG address; worker 0's own TensorFlow
    server then takes a free port. Ranks are the worker indices; workers sharing a host form its local group.
    """
    hosts = [w.rsplit(":", 1)[0] for w in cluster.workers]
    slots = rendezvous.slot_plan_for_hosts(hosts)
    address, port = cluster.workers[0].rsplit(":", 1)
    if cluster.task_index == 0:
        _STATE["coordinator"] = rendezvous.Coordinator(address, int(port), slots)
    else:
        rendezvous.wait_reachable(f"{address}:{port}", connect_timeout)
    mine = slots[cluster.task_index]
    interface = os.environ.get("HOROVOD_GLOO_IFACE") or rendezvous.interface_of(hosts[cluster.task_index])
    if interface is None:
        raise ValueError(f"No network interface of this host holds worker {cluster.task_index}'s TF_CONFIG address "
                         f"{cluster.workers[cluster.task_index]}; set HOROVOD_GLOO_IFACE to the interface to use. "
                         f"Received: {cluster.workers[cluster.task_index]}.")
    os.environ.update(rendezvous.horovod_env(mine, address, int(port), interface))



def _check_index_is_rank(cluster, rank, source):
    """A worker's task index must be its Horovod rank; ranks are unique, so this also rules out duplicate indices."""
    if rank != cluster.task_index:
        raise ValueError(
            f"Worker task_index must equal its Horovod rank, or two workers end up with the same index. "
            f"Received: task_index={cluster.task_index}, {source}={rank}. Let kparallax-run set KPARALLAX_TASK_INDEX.")


def connect(cluster, connect_timeout=30.0):
    """Connects this worker to the PS tasks (if any) and initializes Horovod. Idempotent within a process."""
    if cluster.task_type != "worker":
        raise ValueError("Only worker tasks train; PS tasks run `python -m kparallax.ps`. "
                         f"Received: task_type={cluster.task_type!r}.")
    port_taken = False
    if "HOROVOD_RANK" not in os.environ and os.environ.get("TF_CONFIG") and cluster.num_workers > 1:
        _join_tf_config_job(cluster, connect_timeout)
        port_taken = cluster.task_index == 0
    launcher_rank = os.environ.get("HOROVOD_RANK", "")
    if launcher_rank.isdigit():  # checked before connecting: two workers with one index crash TensorFlow
        _check_index_is_rank(cluster, int(launcher_rank), "HOROVOD_RANK")
    key = (cluster.ps, cluster.workers, cluster.task_index)
    if _STATE["connected_to"] is not None and _STATE["connected_to"] != key:
        raise RuntimeError("This process is already connected to another cluster; TensorFlow allows one per "
                           f"process. Received: {cluster}.")
    if cluster.ps and _STATE["connected_to"] is None:
        wait_reachable(cluster, connect_timeout)
        spec = tf.train.ClusterSpec({"ps": list(cluster.ps),
                                     "worker": {cluster.task_index: _own_address(cluster, port_taken)}})
        coordinator = rendezvous.coordinator_from_env()
        if coordinator:  # first connections one at a time across hosts
            rendezvous.wait_turn(coordinator, cluster.task_index, timeout=60.0 + 10.0 * cluster.task_index)
        with _serialized(cluster.connect_lock):
            tf.config.experimental_connect_to_cluster(spec, job_name="worker", task_index=cluster.task_index,
                                                      protocol="grpc")
            for i in range(cluster.num_ps):  # first op on each PS, still under the lock
                with tf.device(cluster.ps_device(i)):
                    tf.identity(tf.constant(0)).numpy()
            _compat.async_wait()
        if coordinator:
            rendezvous.put(coordinator, f"connected_{cluster.task_index}", "1")
        logging.info("worker %d connected to %d PS task(s): %s", cluster.task_index, cluster.num_ps,
                     ", ".join(cluster.ps))
    _STATE["connected_to"] = key
    hvd.init(process_sets="dynamic")  # local aggregation adds a per-host process set later
    if hvd.size() != cluster.num_workers:
        raise ValueError(
            f"Horovod reports {hvd.size()} worker process(es) but the cluster lists {cluster.num_workers}. "
            "Start workers with kparallax-run (or horovodrun with as many processes as cluster workers). "
            f"Received: workers={list(cluster.workers)}, HOROVOD_SIZE={os.environ.get('HOROVOD_SIZE')}.")
    _check_index_is_rank(cluster, hvd.rank(), "Horovod rank")


def job_on_one_host(cluster):
    """Whether every worker and PS task of ``cluster`` has the same host (loopback names count as one host)."""
    hosts = set()
    for address in cluster.workers + cluster.ps:
        host = address.rsplit(":", 1)[0].strip("[]")
        hosts.add("localhost" if host in ("localhost", "::1") or host.startswith("127.") else host)
    return len(hosts) == 1


def local_process_set():
    """The Horovod process set of the workers on this host (the global set when all share one host).

    Hosts are told apart by ``HOROVOD_HOSTNAME`` (set by kparallax-run and horovodrun; the machine's hostname
    otherwise). Every worker must call this at the same point: adding process sets is a collective.
    """
    if hvd.local_size() == hvd.size():
        return hvd.global_process_set
    if "local" in _STATE:
        return _STATE["local"]
    from kparallax import allreduce  # pylint: disable=import-outside-toplevel
    hosts = allreduce.allgather_text(os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname(), name="kp_hosts")
    mine = None
    for host in sorted(set(hosts), key=hosts.index):  # same order on every worker
        ranks = [r for r, h in enumerate(hosts) if h == host]
        process_set = hvd.add_process_set(ranks) if len(ranks) > 1 else None
        if hvd.rank() in ranks:
            mine = process_set
    _STATE["local"] = mine
    return mine
