"""kparallax-run: starts PS tasks and Horovod workers and supervises them, on one host or many.

    kparallax-run --workers 2 --ps 1 -- python train.py                      # this host only (local default)
    kparallax-run --cluster cluster.yaml --host-index 0 -- python train.py   # per-host mode: run on every host
    kparallax-run --cluster cluster.yaml -- python train.py                  # ssh mode: starts every host itself
    kparallax-run -H h1:2,h2:2 --ps-per-host 1 -x PATH -- python train.py     # ssh mode, horovodrun style

Every task gets the ``KPARALLAX_*`` variables (``Cluster.from_env()``) and the ``HOROVOD_*`` variables of a Gloo
job; the launcher (the first host's, in multi-host modes) serves Horovod's rendezvous itself, bound to its cluster
address. Each task logs to ``LOG_DIR/<role>-<index>.log``; worker 0's output is streamed to the terminal with a
``[worker 0]`` prefix; the resolved cluster is written to ``LOG_DIR/cluster.json``. When all workers have exited
0, PS tasks are stopped and the launcher exits 0. If any task fails, exceeds ``--timeout`` or the user presses
Ctrl-C, every task on every host is stopped and the launcher exits with the failing task's code, naming it.
"""

import argparse
import dataclasses
import hashlib
import json
import os
import signal
import sys
import time
import uuid

import portpicker

from kparallax import _tasks
from kparallax import bind_address
from kparallax import cluster as cluster_lib
from kparallax import cluster_file
from kparallax import options as options_lib
from kparallax import rendezvous


def _parser():
    parser = argparse.ArgumentParser(
        prog="kparallax-run", description="Start PS tasks and Horovod workers on this host or on many hosts.",
        usage="kparallax-run [--workers N --ps M | --cluster FILE [--host-index I] | -H HOSTS] [options] "
              "-- command [args...]")
    parser.add_argument("--workers", "-np", type=int, default=None, help="local mode: worker processes (default 2)")
    parser.add_argument("--ps", type=int, default=None, help="local mode: PS tasks (default 1)")
    parser.add_argument("--cluster", default=None, help="cluster file (YAML, or Parallax's 'host: slot,slot' form)")
    parser.add_argument("--host-index", "--host_index", dest="host_index", type=int, default=None,
                        help="per-host mode: this host's position in the cluster file (run the same command on "
                             "every host; host 0 serves the rendezvous)")
    parser.add_argument("-H", "--hosts", dest="hosts", default=None,
                        help="ssh mode, horovodrun style: 'host1:slots,host2:slots'")
    parser.add_argument("--ps-per-host", "--ps_per_host", dest="ps_per_host", type=int, default=1,
                        help="with -H: PS tasks on each host (default 1)")
    parser.add_argument("--ssh-port", "--ssh_port", dest="ssh_port", type=int, default=None, help="ssh mode: port")
    parser.add_argument("-x", dest="forward_env", action="append", default=[], metavar="NAME",
                        help="ssh mode: forward environment variable NAME to every host (repeatable)")
    parser.add_argument("--architecture", default=None, choices=options_lib.ARCHITECTURES,
                        help="hybrid | allreduce | ps: sets $KPARALLAX_ARCHITECTURE, which HybridStrategy reads when "
                             "its architecture argument is not given (default: the script's choice, else hybrid)")
    parser.add_argument("--log_dir", default=None, help="directory for per-task logs (default kparallax-logs/<run>)")
    parser.add_argument("--run_id", default=None, help="name shared by the tasks of this run (default: random in "
                                                       "local mode, derived from the cluster and command otherwise)")
    parser.add_argument("--timeout", type=float, default=0.0,
                        help="stop every task and fail if the run takes longer than this many seconds (0: never)")
    parser.add_argument("--bind-all", "--bind_all", dest="bind_all", action="store_true",
                        help="let TensorFlow's servers listen on all interfaces (default: only the task's cluster "
                             "address, enforced with a small LD_PRELOAD library)")
    parser.add_argument("--stall_timeout", "--stall-timeout", dest="stall_timeout", type=float, default=300.0,
                        help="seconds a collective may wait for a missing worker before Horovod reports the stalled "
                             "rank(s) and shuts down (default 300; warnings start at half of it)")
    parser.add_argument("--quiet", action="store_true", help="do not stream worker 0's output to the terminal")
    parser.add_argument("--cluster-json", dest="cluster_json", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--stdin-watch", dest="stdin_watch", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the training command, after --")
    return parser


def _parse(argv):
    parser = _parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no training command. Received: nothing after '--'. Example: kparallax-run --workers 2 --ps 1 "
                     "-- python train.py")
    args.command = command
    for name in ("workers", "ps"):
        value = getattr(args, name)
        if value is not None and value < (1 if name == "workers" else 0):
            parser.error(f"--{name} must be >= {1 if name == 'workers' else 0}. Received: --{name}={value}.")
    if args.timeout < 0:
        parser.error(f"--timeout must be >= 0. Received: --timeout={args.timeout}.")
    if args.stall_timeout < 2:
        parser.error(f"--stall_timeout must be >= 2 seconds. Received: --stall_timeout={args.stall_timeout}.")
    if args.ps_per_host < 0:
        parser.error(f"--ps-per-host must be >= 0. Received: --ps-per-host={args.ps_per_host}.")
    sources = [n for n, v in (("--cluster", args.cluster), ("-H", args.hosts), ("--cluster-json", args.cluster_json))
               if v is not None]
    if len(sources) > 1:
        parser.error(f"give one of --cluster and -H. Received: {' and '.join(sources)}.")
    args.plan = None
    try:
        if args.cluster is not None:
            args.plan = cluster_file.load(args.cluster)
        elif args.hosts is not None:
            args.plan = cluster_file.from_hosts_arg(args.hosts, args.ps_per_host)
        elif args.cluster_json is not None:
            args.plan = cluster_file.ClusterPlan.from_json(args.cluster_json)
    except ValueError as e:
        parser.error(str(e))
    if args.plan is None:
        if args.host_index is not None:
            parser.error(f"--host-index needs --cluster FILE. Received: --host-index={args.host_index}.")
        args.workers = 2 if args.workers is None else args.workers
        args.ps = 1 if args.ps is None else args.ps
        return args
    plan = args.plan
    for name, total in (("workers", plan.num_workers), ("ps", plan.num_ps)):
        value = getattr(args, name)
        if value is not None and value != total:
            parser.error(f"--{name}={value} does not match the cluster ({total} {name} in total). Drop --{name} "
                         f"or fix the cluster file. Received: --{name}={value}.")
    if args.host_index is not None and not 0 <= args.host_index < len(plan.hosts):
        parser.error(f"--host-index must be in 0..{len(plan.hosts) - 1} (the cluster has {len(plan.hosts)} hosts). "
                     f"Received: --host-index={args.host_index}.")
    return args


def _base_env(args, ps_hosts, worker_hosts, run_id, log_dir, connect_lock=None):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.update({
        cluster_lib.ENV_PS_HOSTS: ",".join(ps_hosts),
        cluster_lib.ENV_WORKER_HOSTS: ",".join(worker_hosts),
        cluster_lib.ENV_RUN_ID: run_id,
        cluster_lib.ENV_LOG_DIR: log_dir,
    })
    env.pop(cluster_lib.ENV_CONNECT_LOCK, None)
    if connect_lock:
        env[cluster_lib.ENV_CONNECT_LOCK] = connect_lock
    if args.architecture:
        env[options_lib.ARCHITECTURE_ENV] = args.architecture
    # Horovod's stall inspector names the ranks a collective waits for, then shuts Horovod down: a stopped or hung
    # worker ends the run instead of hanging it.
    env["HOROVOD_STALL_CHECK_TIME_SECONDS"] = str(max(1, int(args.stall_timeout // 2)))
    env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = str(int(args.stall_timeout))
    env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(int(args.stall_timeout))  # Gloo's own wait for a silent peer
    return env


def bind_env(args, host):
    """LD_PRELOAD + KPARALLAX_BIND_ADDRESS so that the tasks' servers listen on ``host`` only (unless --bind-all)."""
    if args.bind_all:
        return {}
    return bind_address.env_for(host, bind_address.library())


def start_ps(indices, addresses, base_env, log_dir, tasks):
    """Starts PS tasks ``indices`` (appended to ``tasks``) and waits until each listens at its address.

    Returns a Failure naming the first one that died or never listened, else None.
    """
    for index in indices:
        env = dict(base_env, **{cluster_lib.ENV_TASK_TYPE: "ps", cluster_lib.ENV_TASK_INDEX: str(index)})
        tasks.append(_tasks.spawn("ps", index, [sys.executable, "-m", "kparallax.ps"], env, log_dir, echo=False))
    not_ready = _tasks.wait_ps_ready(tasks, addresses)
    if not_ready is not None:
        return _tasks.Failure(not_ready.name, "did not start listening", 1, not_ready.log_path)
    return None


def _write_cluster_json(log_dir, cluster, plan=None):
    data = dataclasses.asdict(cluster)
    if plan is not None:
        data["hosts"] = [dataclasses.asdict(h) for h in plan.hosts]
        data["coordinator"] = plan.coordinator
    with open(os.path.join(log_dir, "cluster.json"), "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)


def _interruptible():
    """SIGTERM behaves like Ctrl-C; returns a function restoring the previous handlers."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def _interrupt(signum, frame):  # pylint: disable=unused-argument
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)

    def restore():
        for s, handler in previous.items():
            signal.signal(s, handler)
    return restore


def run_local(args):
    """The local default: every task on this host, addresses on 127.0.0.1."""
    run_id = args.run_id or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    log_dir = os.path.abspath(args.log_dir or os.path.join("kparallax-logs", run_id))
    os.makedirs(log_dir, exist_ok=True)
    ps_hosts = [f"127.0.0.1:{portpicker.pick_unused_port()}" for _ in range(args.ps)]
    worker_hosts = [f"127.0.0.1:{portpicker.pick_unused_port()}" for _ in range(args.workers)]
    cluster = cluster_lib.Cluster(ps=ps_hosts, workers=worker_hosts, run_id=run_id,
                                  connect_lock=os.path.join(log_dir, "connect.lock"))
    _write_cluster_json(log_dir, cluster)
    base_env = _base_env(args, ps_hosts, worker_hosts, run_id, log_dir, cluster.connect_lock)
    try:
        base_env.update(bind_env(args, "127.0.0.1"))
    except RuntimeError as e:
        print(f"kparallax-run: {e}", file=sys.stderr)
        return 2
    tasks, failure, interrupted, coordinator = [], None, False, None
    restore = _interruptible()
    try:
        failure = start_ps(range(args.ps), ps_hosts, base_env, log_dir, tasks)
        if failure is None:
            slots = rendezvous.slot_plan([("localhost", args.workers)])
            port = portpicker.pick_unused_port()
            coordinator = rendezvous.Coordinator("127.0.0.1", port, slots)
            for slot in slots:
                env = dict(base_env, **rendezvous.horovod_env(slot, "127.0.0.1", port, "lo"))
                env.pop(rendezvous.ENV_COORDINATOR)  # one host: the lock file orders first connections
                env.update({cluster_lib.ENV_TASK_TYPE: "worker", cluster_lib.ENV_TASK_INDEX: str(slot.rank)})
                tasks.append(_tasks.spawn("worker", slot.rank, args.command, env, log_dir,
                                          echo=slot.rank == 0 and not args.quiet))
            failure = _tasks.supervise(tasks, args.timeout)
            if failure is not None:
                failure.progress = _tasks.progress_report(tasks, log_dir)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        _tasks.stop_all(tasks)
        if coordinator is not None:
            coordinator.stop()
        restore()
    if interrupted:
        print(f"kparallax-run: interrupted; stopped all {len(tasks)} task(s). Logs: {log_dir}", file=sys.stderr)
        return 130
    if failure is not None:
        print(f"kparallax-run: {failure.message()}", file=sys.stderr)
        return failure.code
    return 0


def default_run_id(plan, command):
    """The same on every host of a per-host launch (all run the same command with the same cluster)."""
    digest = hashlib.sha1((plan.to_json() + "\0" + "\0".join(command)).encode()).hexdigest()[:10]
    return f"run-{digest}"


def run(argv=None):
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.plan is None:
        return run_local(args)
    from kparallax import multihost  # pylint: disable=import-outside-toplevel
    if args.host_index is not None:
        return multihost.run_host(args)
    return multihost.run_ssh(args)


def main():
    sys.exit(run())


if __name__ == "__main__":
    main()
