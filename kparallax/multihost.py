"""kparallax-run on many hosts: per-host mode (``--host-index``) and ssh mode.

Per-host mode: the same command runs on every host (by hand, a batch scheduler or Kubernetes); host 0's launcher
serves the coordinator (Horovod's rendezvous + a key-value store) at ``hosts[0]:rendezvous_port``. Each launcher
starts its host's PS tasks and workers, and publishes its status there: ``running``, ``done`` (its workers exited
0) or ``failed`` with the failing task's code and name. Every launcher polls the others twice a second, so a
failure anywhere (or Ctrl-C on any host) stops every host within a second or two; a host whose workers are done
keeps its PS tasks serving until every host is done.

ssh mode: from one machine, start a per-host launcher on every host over ssh (horovodrun's conventions: ``-H``,
``--ssh-port``, ``-x NAME``), stream host 0's output, and stop everything when any host fails or on Ctrl-C (the
remote launchers stop when their ssh session closes).
"""

import _thread
import os
import select
import shlex
import socket
import subprocess
import sys
import threading
import time

from kparallax import _tasks
from kparallax import cluster as cluster_lib
from kparallax import rendezvous

POLL_SECONDS = 0.5
COORDINATOR_LOST_SECONDS = 10.0


def _log_dir(args, run_id):
    log_dir = os.path.abspath(args.log_dir or os.path.join("kparallax-logs", run_id))
    os.makedirs(log_dir, exist_ok=True)
    return log_dir


def _status(code, name, what):
    return f"failed|{code}|{name}|{what}"


class _Watcher:
    """Reads the other hosts' status from the coordinator (rate-limited) and turns a failure into a Failure."""

    def __init__(self, coordinator, plan, host_index):
        self._coordinator = coordinator
        self._plan = plan
        self._host_index = host_index
        self._next = 0.0
        self._lost_since = None

    def statuses(self):
        return {j: rendezvous.get(self._coordinator, f"host_{j}") for j in range(len(self._plan.hosts))}

    def poll(self, force=False):
        """(statuses or None, Failure or None); reads the coordinator at most every POLL_SECONDS unless ``force``."""
        now = time.monotonic()
        if not force and now < self._next:
            return None, None
        self._next = now + POLL_SECONDS
        try:
            statuses = self.statuses()
            self._lost_since = None
        except OSError as e:
            self._lost_since = self._lost_since or now
            if now - self._lost_since > COORDINATOR_LOST_SECONDS:
                return None, _tasks.Failure("host 0", f"(the coordinator at {self._coordinator}) is unreachable for "
                                            f"{COORDINATOR_LOST_SECONDS:.0f} s ({e})", 1, remote=True)
            return None, None
        for j, status in statuses.items():
            if j != self._host_index and status and status.startswith("failed|"):
                _, code, name, what = status.split("|", 3)
                return statuses, _tasks.Failure(f"{name} on host {j} ({self._plan.hosts[j].host})", what, int(code),
                                                remote=True)
        return statuses, None

    def failure(self):
        return self.poll()[1]


def run_host(args):
    """Per-host mode: this host's PS tasks and workers, coordinated with the other hosts' launchers."""
    plan, i = args.plan, args.host_index
    spec = plan.hosts[i]
    from kparallax import launch  # pylint: disable=import-outside-toplevel
    run_id = args.run_id or launch.default_run_id(plan, args.command)
    log_dir = _log_dir(args, run_id)
    ps_hosts, worker_hosts = plan.ps_addresses, plan.worker_addresses
    launch._write_cluster_json(  # pylint: disable=protected-access
        log_dir, cluster_lib.Cluster(ps=ps_hosts, workers=worker_hosts, run_id=run_id), plan)
    base_env = launch._base_env(args, ps_hosts, worker_hosts, run_id, log_dir)  # pylint: disable=protected-access
    interface = spec.interface or rendezvous.interface_of(spec.host)
    if interface is None:
        print(f"kparallax-run: no network interface of this host holds {spec.host} (host {i} of the cluster). Run "
              "on that host, or give the host an 'interface' in the cluster file. "
              f"Received: host={spec.host}, --host-index={i}.", file=sys.stderr)
        return 2
    try:
        base_env.update(launch.bind_env(args, spec.host))
    except (RuntimeError, OSError) as e:
        print(f"kparallax-run: {e}", file=sys.stderr)
        return 2
    problem = _hostname_problem(plan, spec) or _port_in_use(plan, i)
    if problem:
        print(f"kparallax-run: {problem}", file=sys.stderr)
        return 2
    tasks, coordinator, failure, key = [], None, None, f"host_{i}"
    restore = launch._interruptible()  # pylint: disable=protected-access
    if args.stdin_watch:
        threading.Thread(target=_interrupt_on_stdin_eof, daemon=True).start()
    watcher = _Watcher(plan.coordinator, plan, i)
    start = time.monotonic()
    try:
        slots = rendezvous.slot_plan([(h.host, h.workers) for h in plan.hosts])
        if i == 0:
            coordinator = rendezvous.Coordinator(spec.host, plan.rendezvous_port, slots)
        else:
            rendezvous.wait_reachable(plan.coordinator, timeout=120.0)
        rendezvous.put(plan.coordinator, key, "running")
        failure = launch.start_ps(plan.ps_indices(i), [ps_hosts[j] for j in plan.ps_indices(i)], base_env, log_dir,
                                  tasks)
        if failure is None:
            host, port = plan.coordinator.rsplit(":", 1)
            for rank in plan.worker_ranks(i):
                env = dict(base_env, **rendezvous.horovod_env(slots[rank], host, int(port), interface))
                env.update({cluster_lib.ENV_TASK_TYPE: "worker", cluster_lib.ENV_TASK_INDEX: str(rank)})
                tasks.append(_tasks.spawn("worker", rank, args.command, env, log_dir,
                                          echo=rank == 0 and not args.quiet))
            failure = _tasks.supervise(tasks, args.timeout, elsewhere=watcher.failure, start=start)
            if failure is not None:
                failure.progress = _tasks.progress_report(tasks, log_dir)
        if failure is None:
            rendezvous.put(plan.coordinator, key, "done")
            failure = _wait_for_every_host(tasks, watcher, plan, i, args.timeout, start)
        elif not failure.remote:
            _publish(plan.coordinator, key, _status(failure.code, failure.name, failure.what))
    except KeyboardInterrupt:
        failure = _tasks.Failure(f"host {i}", "was interrupted (Ctrl-C, SIGTERM or its ssh session closed)", 130)
        _publish(plan.coordinator, key, _status(130, f"launcher of host {i}", "was interrupted"))
    except (ConnectionError, OSError) as e:
        failure = _tasks.Failure(f"host {i}", f"could not coordinate: {e}", 1)
        _publish(plan.coordinator, key, _status(1, f"launcher of host {i}", f"could not coordinate: {e}"))
    finally:
        _tasks.stop_all(tasks)
        if coordinator is not None:
            _linger(watcher, plan)
            coordinator.stop()
        restore()
    if failure is not None:
        print(f"kparallax-run (host {i}): {failure.message()}", file=sys.stderr)
        return failure.code
    return 0


def _hostname_problem(plan, spec):
    """Horovod 0.28.1 builds the Gloo contexts of process sets on the address of the host's *name*, ignoring
    HOROVOD_GLOO_IFACE; across hosts that name must therefore resolve to a reachable address, not loopback."""
    if len(plan.hosts) == 1:
        return None
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        address = None
    if address is None or address.startswith("127."):
        return (f"this host's name {name!r} resolves to {address or 'nothing'}; Horovod's Gloo process sets connect "
                f"through that address, so on a multi-host cluster it must resolve to this host's cluster address "
                f"{spec.host} (fix /etc/hosts or DNS). Received: {name} -> {address}.")
    return None


def _port_in_use(plan, i):
    """The first of this host's ports (PS, workers, and the rendezvous on host 0) that something already uses."""
    spec = plan.hosts[i]
    ports = [("ps_port", spec.ps_port + k) for k in range(spec.ps)]
    ports += [("worker_port", spec.worker_port + k) for k in range(spec.workers)]
    if i == 0:
        ports.append(("rendezvous_port", plan.rendezvous_port))
    for key, port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            # As the servers do: connections of a previous run lingering in TIME_WAIT do not block the port.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((socket.gethostbyname(spec.host), port))
            except OSError as e:
                return (f"port {port} on {spec.host} ({key}) cannot be used ({e.strerror}); another process holds it. "
                        f"Stop it or choose other ports in the cluster file. Received: {key} -> {port}.")
    return None


def _publish(coordinator, key, value):
    try:
        rendezvous.put(coordinator, key, value, timeout=2.0)
    except OSError:
        pass  # the coordinator is gone: the other hosts notice that themselves


def _wait_for_every_host(tasks, watcher, plan, i, timeout, start):
    """This host's workers are done; keep its PS tasks serving until every host is done, or one fails."""
    while True:
        for task in tasks:
            if task.role == "ps" and task.process.poll() is not None:
                failure = _tasks.Failure(task.name, f"exited unexpectedly with code {task.process.returncode}",
                                         _tasks.exit_code(task.process.returncode) or 1, task.log_path)
                _publish(plan.coordinator, f"host_{i}", _status(failure.code, failure.name, failure.what))
                return failure
        statuses, failure = watcher.poll(force=True)
        if failure is not None:
            return failure
        statuses = statuses or {}
        if statuses and all(s == "done" for s in statuses.values()):
            _publish(plan.coordinator, f"ack_{i}", "1")
            return None
        if timeout and time.monotonic() - start > timeout:
            waiting = [f"host {j}" for j, s in statuses.items() if s != "done"]
            return _tasks.Failure(", ".join(waiting) or "the coordinator",
                                  f"did not finish within --timeout={timeout:.0f}s", 124)
        time.sleep(POLL_SECONDS)


def _linger(watcher, plan, seconds=10.0):
    """Host 0 keeps the coordinator up until every host has read the final status (or ``seconds`` pass)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            statuses = watcher.statuses()
            if any(s and s.startswith("failed|") for s in statuses.values()):
                time.sleep(2 * POLL_SECONDS + 0.5)  # long enough for every launcher's next poll
                return
            acks = [rendezvous.get(plan.coordinator, f"ack_{j}") for j in range(len(plan.hosts))]
            if all(acks):
                return
        except OSError:
            return
        time.sleep(0.2)


def _interrupt_on_stdin_eof():
    """ssh mode: the remote launcher stops (as on Ctrl-C) when its ssh session, hence its stdin, closes."""
    fd = sys.stdin.fileno()
    while True:
        readable, _, _ = select.select([fd], [], [], 0.5)
        if readable:
            try:
                if not os.read(fd, 4096):
                    break
            except OSError:
                break
    _thread.interrupt_main()


def run_ssh(args):
    """ssh mode: a per-host launcher on every host, started over ssh like horovodrun starts remote workers."""
    plan = args.plan
    from kparallax import launch  # pylint: disable=import-outside-toplevel
    run_id = args.run_id or launch.default_run_id(plan, args.command)
    log_dir = _log_dir(args, run_id)
    missing = [name for name in args.forward_env if name not in os.environ]
    if missing:
        print(f"kparallax-run: -x {missing[0]}: no such variable in this environment. Received: -x {missing[0]}.",
              file=sys.stderr)
        return 2
    forwarded = " ".join(f"{n}={shlex.quote(os.environ[n])}" for n in args.forward_env)
    hosts, restore, failure = [], launch._interruptible(), None  # pylint: disable=protected-access
    try:
        for i, spec in enumerate(plan.hosts):
            remote = [sys.executable, "-m", "kparallax.launch", "--cluster-json", plan.to_json(), "--host-index", str(i),
                      "--run_id", run_id, "--log_dir", log_dir, "--stdin-watch", "--timeout", str(args.timeout),
                      "--stall_timeout", str(args.stall_timeout)]
            if args.architecture:
                remote += ["--architecture", args.architecture]
            if args.quiet:
                remote.append("--quiet")
            if args.bind_all:
                remote.append("--bind-all")
            remote_command = (f"cd {shlex.quote(os.getcwd())} > /dev/null 2>&1 && "
                              f"env {forwarded} {shlex.join(remote + ['--'] + list(args.command))}")
            ssh = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no"]
            if args.ssh_port:
                ssh += ["-p", str(args.ssh_port)]
            hosts.append(_tasks.spawn("host", i, ssh + [spec.host, remote_command], dict(os.environ), log_dir,
                                      echo=not args.quiet, stdin=subprocess.PIPE, raw=True))
        failure = _supervise_hosts(hosts)
    except KeyboardInterrupt:
        failure = _tasks.Failure("kparallax-run", "was interrupted", 130)
    finally:
        _stop_hosts(hosts)
        restore()
    if failure is not None:
        print(f"kparallax-run: {failure.message()}", file=sys.stderr)
        return failure.code
    return 0


def _supervise_hosts(hosts):
    while True:
        running = False
        for task in hosts:
            code = task.process.poll()
            if code is None:
                running = True
            elif code != 0:
                return _tasks.Failure(task.name, f"failed with exit code {code}", _tasks.exit_code(code),
                                      task.log_path)
        if not running:
            return None
        time.sleep(0.2)


def _stop_hosts(hosts, seconds=30.0):
    """Closes every ssh session's stdin (the remote launchers then stop their tasks) and waits for them."""
    for task in hosts:
        try:
            task.process.stdin.close()
        except OSError:
            pass
    _tasks.wait_or_kill(hosts, seconds)
