"""Cluster: who is a parameter server, who is a worker, and which one this process is.

A cluster is built from the launcher's environment (``Cluster.from_env()``), from ``TF_CONFIG``
(``Cluster.from_tf_config()``) or from explicit arguments. It is plain data; connecting to it is the
strategy's job.
"""

import dataclasses
import json
import os
from typing import Optional, Tuple

ROLES = ("worker", "ps")

# Environment variables written by kparallax-run for every task it starts.
ENV_PS_HOSTS = "KPARALLAX_PS_HOSTS"
ENV_WORKER_HOSTS = "KPARALLAX_WORKER_HOSTS"
ENV_TASK_TYPE = "KPARALLAX_TASK_TYPE"
ENV_TASK_INDEX = "KPARALLAX_TASK_INDEX"
ENV_RUN_ID = "KPARALLAX_RUN_ID"
ENV_CONNECT_LOCK = "KPARALLAX_CONNECT_LOCK"
ENV_RESTART_COUNT = "KPARALLAX_RESTART_COUNT"  # 0 on the first start, k on the k-th restart
ENV_LOG_DIR = "KPARALLAX_LOG_DIR"


def _check_address(field, address):
    if not isinstance(address, str) or address.count(":") != 1:
        raise ValueError(f"{field} must be 'host:port'. Received: {field}={address!r}.")
    host, port = address.split(":")
    if not host:
        raise ValueError(f"{field} has an empty host. Received: {field}={address!r}.")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{field} needs a port between 1 and 65535. Received: {field}={address!r}.")


def _split_hosts(text):
    return tuple(a.strip() for a in text.split(",") if a.strip()) if text else ()


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The tasks of one training job.

    Attributes:
      ps: addresses (``host:port``) of the parameter-server tasks, in task order. May be empty.
      workers: addresses of the worker tasks, in rank order. A worker's address is where its own
        TensorFlow server listens; kparallax uses it only for that worker's connection to the PS tasks.
      task_type: this process's role, ``"worker"`` or ``"ps"``.
      task_index: this process's index within its role (a worker's index is its Horovod rank).
      run_id: a name shared by all tasks of one run; PS variables are namespaced by it.
      connect_lock: optional path of a lock file that serializes the workers' first connection to the PS
        tasks (TensorFlow servers can crash on simultaneous first connects).
    """

    ps: Tuple[str, ...] = ()
    workers: Tuple[str, ...] = ("localhost:0",)
    task_type: str = "worker"
    task_index: int = 0
    run_id: str = "kparallax"
    connect_lock: Optional[str] = None

    def __post_init__(self):
        object.__setattr__(self, "ps", tuple(self.ps))
        object.__setattr__(self, "workers", tuple(self.workers))
        if not self.workers:
            raise ValueError("A cluster needs at least one worker. Received: workers=().")
        for i, address in enumerate(self.ps):
            _check_address(f"ps[{i}]", address)
        for i, address in enumerate(self.workers):
            if address != "localhost:0":
                _check_address(f"workers[{i}]", address)
        seen = {}
        for role, addresses in (("ps", self.ps), ("workers", self.workers)):
            for i, address in enumerate(addresses):
                if address.endswith(":0"):
                    continue
                if address in seen:
                    raise ValueError(
                        f"Address {address} is used twice: by {seen[address]} and by {role}[{i}]. "
                        f"Every task needs its own host:port. Received: ps={list(self.ps)}, "
                        f"workers={list(self.workers)}.")
                seen[address] = f"{role}[{i}]"
        if self.task_type not in ROLES:
            raise ValueError(f"task_type must be one of {ROLES}. Received: task_type={self.task_type!r}.")
        count = len(self.workers) if self.task_type == "worker" else len(self.ps)
        if not isinstance(self.task_index, int) or not 0 <= self.task_index < count:
            raise ValueError(
                f"task_index must be in [0, {count}) for task_type={self.task_type!r} "
                f"({count} {self.task_type} task(s) in the cluster). Received: task_index={self.task_index!r}.")
        if not self.run_id or "/" in self.run_id:
            raise ValueError(f"run_id must be a non-empty name without '/'. Received: run_id={self.run_id!r}.")

    @property
    def num_ps(self):
        return len(self.ps)

    @property
    def num_workers(self):
        return len(self.workers)

    @property
    def is_chief(self):
        return self.task_type == "worker" and self.task_index == 0

    def ps_device(self, index):
        return f"/job:ps/replica:0/task:{index}/device:CPU:0"

    def cluster_spec_dict(self):
        """The full cluster as a ``tf.train.ClusterSpec`` dictionary (used by PS servers)."""
        spec = {"worker": list(self.workers)}
        if self.ps:
            spec["ps"] = list(self.ps)
        return spec

    def to_json(self):
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def local(cls):
        """A single-process cluster: one worker (rank 0) and no PS task."""
        return cls(ps=(), workers=("localhost:0",), task_type="worker", task_index=0)

    @classmethod
    def from_env(cls, environ=None):
        """Builds the cluster of this process.

        Reads, in order: the variables kparallax-run sets (``KPARALLAX_*``), then ``TF_CONFIG``. With neither,
        returns a single-worker cluster with no PS task (a plain ``python train.py``).
        """
        env = os.environ if environ is None else environ
        if ENV_WORKER_HOSTS in env:
            index_text = env.get(ENV_TASK_INDEX, "0")
            if not index_text.lstrip("-").isdigit():
                raise ValueError(f"{ENV_TASK_INDEX} must be an integer. Received: {ENV_TASK_INDEX}={index_text!r}.")
            return cls(
                ps=_split_hosts(env.get(ENV_PS_HOSTS, "")),
                workers=_split_hosts(env[ENV_WORKER_HOSTS]),
                task_type=env.get(ENV_TASK_TYPE, "worker"),
                task_index=int(index_text),
                run_id=env.get(ENV_RUN_ID, "kparallax"),
                connect_lock=env.get(ENV_CONNECT_LOCK) or None,
            )
        if env.get("TF_CONFIG"):
            return cls.from_tf_config(env["TF_CONFIG"], run_id=env.get(ENV_RUN_ID, "kparallax"))
        return cls.local()

    @classmethod
    def from_tf_config(cls, tf_config, run_id="kparallax"):
        """Builds the cluster from a ``TF_CONFIG`` JSON string or dict.

        Jobs ``ps`` and ``worker`` are used; a ``chief`` job (Kubernetes TFJob style) becomes worker 0 and the
        ``worker`` tasks follow it.
        """
        if isinstance(tf_config, str):
            try:
                tf_config = json.loads(tf_config)
            except json.JSONDecodeError as e:
                raise ValueError(f"TF_CONFIG is not valid JSON ({e}). Received: TF_CONFIG={tf_config!r}.") from None
        if not isinstance(tf_config, dict) or not isinstance(tf_config.get("cluster"), dict):
            raise ValueError(f"TF_CONFIG needs a 'cluster' object. Received: TF_CONFIG={tf_config!r}.")
        spec = tf_config["cluster"]
        unknown = set(spec) - {"ps", "worker", "chief"}
        if unknown:
            raise ValueError(f"TF_CONFIG cluster has unknown job(s) {sorted(unknown)}; kparallax knows "
                             f"'ps', 'worker' and 'chief'. Received: cluster={spec!r}.")
        chief = list(spec.get("chief", []))
        if len(chief) > 1:
            raise ValueError(f"TF_CONFIG may name at most one chief. Received: chief={chief!r}.")
        workers = chief + list(spec.get("worker", []))
        task = tf_config.get("task", {})
        task_type = task.get("type", "worker")
        task_index = task.get("index", 0)
        if task_type == "chief":
            task_type, task_index = "worker", 0
        elif task_type == "worker" and isinstance(task_index, int):
            task_index += len(chief)
        return cls(ps=tuple(spec.get("ps", [])), workers=tuple(workers), task_type=task_type,
                   task_index=task_index, run_id=run_id)
