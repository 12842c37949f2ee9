"""Joins this worker process to the cluster: connects to the PS tasks, then initializes Horovod.

An unreachable PS fails fast (``connect_timeout``), never hangs. First connections are serialized across workers
(``kparallax._compat.connect`` says why). Under ``TF_CONFIG`` without the launcher, worker 0 serves the job's
coordinator (Horovod's rendezvous) at its own address and the others join it.
"""

import os

import horovod.tensorflow as hvd
from kparallax import log as logging

from kparallax._compat import connect as connect_compat
from kparallax._compat import horovod as hvd_compat
from kparallax.cluster import coordinator as coordinator_lib
from kparallax.cluster import net

_STATE = {"connected_to": None, "horovod": False}


def _own_address(cluster, port_taken=False):
    """This worker's TensorFlow server address: its cluster address, or a free port on its host when the
    address has port 0 or its port serves the coordinator (worker 0 under TF_CONFIG)."""
    address = cluster.workers[cluster.task_index]
    host, port = address.rsplit(":", 1)
    if port == "0" or port_taken:
        address = f"{'localhost' if port == '0' else host}:{net.free_port()}"
    return address


def _join_tf_config_job(cluster, connect_timeout):
    """Gives a TF_CONFIG worker (no launcher) its Horovod Gloo environment; worker 0 serves the rendezvous.

    The rendezvous (and the coordinator store) listens at worker 0's TF_CONFIG address; worker 0's own TensorFlow
    server then takes a free port. Ranks are the worker indices; workers sharing a host form its local group.
    """
    hosts = [w.rsplit(":", 1)[0] for w in cluster.workers]
    slots = coordinator_lib.slot_plan_for_hosts(hosts)
    address, port = cluster.workers[0].rsplit(":", 1)
    if cluster.task_index == 0:
        _STATE["coordinator"] = coordinator_lib.Coordinator(address, int(port), slots)
    else:
        coordinator_lib.wait_reachable(f"{address}:{port}", connect_timeout)
    interface = os.environ.get("HOROVOD_GLOO_IFACE") or net.interface_of(hosts[cluster.task_index])
    if interface is None:
        raise ValueError(f"No network interface of this host holds worker {cluster.task_index}'s TF_CONFIG address "
                         f"{cluster.workers[cluster.task_index]}; set HOROVOD_GLOO_IFACE to the interface to use. "
                         f"Received: {cluster.workers[cluster.task_index]}.")
    os.environ.update(coordinator_lib.horovod_env(slots[cluster.task_index], address, int(port), interface))


def _check_index_is_rank(cluster, rank, source):
    """A worker's task index must be its Horovod rank; ranks are unique, so this also rules out duplicate indices."""
    if rank != cluster.task_index:
        raise ValueError(
            f"Worker task_index must equal its Horovod rank, or two workers end up with the same index. "
            f"Received: task_index={cluster.task_index}, {source}={rank}. Let kparallax-run set KPARALLAX_TASK_INDEX.")


def connect(cluster, connect_timeout=30.0):
    """Connects this worker to the PS tasks (if any) and initializes Horovod. Idempotent within a process.

    A process may hold one TensorFlow cluster connection; a cluster without PS tasks needs none, so a process may
    first run strategies without PS tasks and later connect to one cluster.
    """
    if cluster.task_type != "worker":
        raise ValueError("Only worker tasks train; PS tasks run `kparallax-ps` (python -m kparallax.cluster.ps_server)."
                         f" Received: task_type={cluster.task_type!r}.")
    port_taken = False
    if "HOROVOD_RANK" not in os.environ and os.environ.get("TF_CONFIG") and cluster.num_workers > 1:
        _join_tf_config_job(cluster, connect_timeout)
        port_taken = cluster.task_index == 0
    launcher_rank = os.environ.get("HOROVOD_RANK", "")
    if launcher_rank.isdigit():  # checked before connecting: two workers with one index crash TensorFlow
        _check_index_is_rank(cluster, int(launcher_rank), "HOROVOD_RANK")
    if cluster.ps:
        key = (cluster.ps, cluster.workers, cluster.task_index)
        if _STATE["connected_to"] is not None and _STATE["connected_to"] != key:
            raise RuntimeError("This process is already connected to another cluster; TensorFlow allows one per "
                               f"process. Received: {cluster}.")
        if _STATE["connected_to"] is None:
            _connect_to_ps(cluster, connect_timeout, port_taken)
            _STATE["connected_to"] = key
    if not _STATE["horovod"]:
        # Local aggregation (PS jobs only) needs a process set per host; Horovod takes them at init only.
        _STATE["local_sets"] = hvd_compat.init(host_groups(cluster) if cluster.ps else ())
        _STATE["workers"] = cluster.workers
        _STATE["horovod"] = True
    if hvd.size() != cluster.num_workers:
        raise ValueError(
            f"Horovod reports {hvd.size()} worker process(es) but the cluster lists {cluster.num_workers}. "
            "Start workers with kparallax-run (or horovodrun with as many processes as cluster workers). "
            f"Received: workers={list(cluster.workers)}, HOROVOD_SIZE={os.environ.get('HOROVOD_SIZE')}.")
    _check_index_is_rank(cluster, hvd.rank(), "Horovod rank")


def _connect_to_ps(cluster, connect_timeout, port_taken):
    existing = connect_compat.created_before()
    if existing:
        shown = ", ".join(existing[:3]) + (f" and {len(existing) - 3} more" if len(existing) > 3 else "")
        raise ValueError(
            "Create kp.HybridStrategy() before any TensorFlow variable or resource: creating it connects this "
            "process to the PS tasks, and TensorFlow cannot use what was created before that (its device, "
            "/job:localhost, is gone: 'Client for target /job:localhost/replica:0/task:0 not found'). "
            f"Received: {len(existing)} created before the strategy: {shown}. Create the strategy first, then the "
            "models, optimizers, metrics and adapted preprocessing layers.")
    net.wait_ps_reachable(cluster.ps, connect_timeout)
    coordinator = coordinator_lib.coordinator_from_env()
    if coordinator:  # first connections one at a time across hosts
        coordinator_lib.wait_turn(coordinator, cluster.task_index, timeout=60.0 + 10.0 * cluster.task_index)
    connect_compat.connect(cluster.ps, cluster.task_index, _own_address(cluster, port_taken),
                           [cluster.ps_device(i) for i in range(cluster.num_ps)], cluster.connect_lock)
    if coordinator:
        coordinator_lib.put(coordinator, coordinator_lib.connected_key(cluster.task_index), "1")
    logging.info("worker %d connected to %d PS task(s): %s", cluster.task_index, cluster.num_ps,
                 ", ".join(cluster.ps))


def job_on_one_host(cluster):
    """Whether every worker and PS task of ``cluster`` has the same host."""
    return net.job_on_one_host(list(cluster.workers) + list(cluster.ps))


def host_groups(cluster):
    """The ranks (worker indices) of each host of ``cluster``, hosts told apart by their worker addresses."""
    hosts = [w.rsplit(":", 1)[0] for w in cluster.workers]
    return [[r for r, h in enumerate(hosts) if h == host] for host in sorted(set(hosts), key=hosts.index)]


def local_process_set():
    """The Horovod process set of the workers on this host: the global set when all share one host, None when this
    worker is alone on its host. The sets were registered by ``connect`` (``host_groups``)."""
    if hvd.local_size() == hvd.size():
        return hvd.global_process_set
    mine = _STATE.get("local_sets", {}).get(hvd.rank())
    ranks = len(mine.ranks) if mine is not None else 1
    if ranks != hvd.local_size():
        raise ValueError(
            f"Local aggregation needs the workers of each host in one Horovod process set, but this worker's host "
            f"has {hvd.local_size()} Horovod rank(s) and its cluster address groups it with {ranks}. List every "
            "worker of a host under the same address (kparallax-run does), or pass local_aggregation=False. "
            f"Received: workers={list(_STATE.get('workers', ()))}, HOROVOD_LOCAL_SIZE={hvd.local_size()}.")
    return mine
