"""kparallax-run per-host mode (``--host-index``): this host's tasks, coordinated with the other hosts' launchers.

The same command runs on every host (by hand, a batch scheduler or Kubernetes); host 0's launcher
serves the coordinator (Horovod's rendezvous + a key-value store) at ``hosts[0]:rendezvous_port``. Each launcher
starts its host's PS tasks and workers, and publishes its status there: ``running``, ``done`` (its workers exited
0) or ``failed`` with the failing task's code and name. Every launcher polls the others twice a second, so a
failure anywhere (or Ctrl-C on any host) stops every host within a second or two; a host whose workers are done
keeps its PS tasks serving until every host is done.
"""

import _thread
import os
import select
import socket
import sys
import threading
import time

from kparallax._compat import hosts as hosts_compat
from kparallax.cluster import coordinator as rendezvous
from kparallax.cluster import net
from kparallax.cluster import spec as cluster_lib
from kparallax.launch import env as env_lib
from kparallax.launch import local
from kparallax.launch import tasks as _tasks

POLL_SECONDS = 0.5
COORDINATOR_LOST_SECONDS = 10.0


def _per_host(coordinator, prefix, hosts):
    """{j: the value of key ``<prefix><j>``, or None} for every host j, read from the coordinator in one request
    (each host's exact key: the prefix ``..._host_1`` would also match host 10's)."""
    values = rendezvous.get_prefixed(coordinator, prefix)
    return {j: values.get(f"{prefix}{j}") for j in range(hosts)}


def _status(code, name, what, restartable=True):
    return f"failed|{code}|{int(restartable)}|{name}|{what}"


class _Watcher:
    """Reads the other hosts' status from the coordinator (rate-limited) and turns a failure into a Failure."""

    def __init__(self, coordinator, plan, host_index):
        self._coordinator = coordinator
        self._plan = plan
        self._host_index = host_index
        self._next = 0.0
        self._lost_since = None
        self.attempt = 0  # which start of the group the statuses are of (``--max_restarts``)
        self.last_failure = ""

    def key(self, j):
        """Host ``j``'s status key in the current start of the group."""
        return f"a{self.attempt}_host_{j}"

    def statuses(self):
        """Every host's status (None where not set yet), read in one request."""
        return _per_host(self._coordinator, f"a{self.attempt}_host_", len(self._plan.hosts))

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
                _, code, restartable, name, what = status.split("|", 4)
                return statuses, _tasks.Failure(f"{name} on host {j} ({self._plan.hosts[j].host})", what, int(code),
                                                remote=True, restartable=restartable == "1")
        return statuses, None

    def failure(self):
        return self.poll()[1]


def run_host(args):
    """Per-host mode: this host's PS tasks and workers, coordinated with the other hosts' launchers."""
    plan, i = args.plan, args.host_index
    spec = plan.hosts[i]
    run_id = args.run_id or env_lib.default_run_id(plan, args.command)
    log_dir = env_lib.log_dir_for(args, run_id)
    ps_hosts, worker_hosts = plan.ps_addresses, plan.worker_addresses
    env_lib.write_cluster_json(log_dir, cluster_lib.Cluster(ps=ps_hosts, workers=worker_hosts, run_id=run_id), plan)
    base_env = env_lib.base_env(args, ps_hosts, worker_hosts, run_id, log_dir)
    interface = spec.interface or net.interface_of(spec.host)
    if interface is None:
        print(f"kparallax-run: no network interface of this host holds {spec.host} (host {i} of the cluster). Run "
              "on that host, or give the host an 'interface' in the cluster file. "
              f"Received: host={spec.host}, --host-index={i}.", file=sys.stderr)
        return 2
    try:
        base_env.update(env_lib.bind_env(args, spec.host))
    except (RuntimeError, OSError) as e:
        print(f"kparallax-run: {e}", file=sys.stderr)
        return 2
    problem = hosts_compat.hostname_problem(spec.host, len(plan.hosts) > 1) or _port_in_use(plan, i)
    if problem:
        print(f"kparallax-run: {problem}", file=sys.stderr)
        return 2
    coordinator, failure, attempt = None, None, 0
    restore = env_lib.interruptible()
    if args.stdin_watch:
        threading.Thread(target=_interrupt_on_stdin_eof, daemon=True).start()
    watcher = _Watcher(plan.coordinator, plan, i)
    start = time.monotonic()
    slots = rendezvous.slot_plan([(h.host, h.workers) for h in plan.hosts])
    try:
        if i == 0:
            coordinator = rendezvous.Coordinator(spec.host, plan.rendezvous_port, slots)
        else:
            rendezvous.wait_reachable(plan.coordinator, timeout=120.0)
        while True:
            failure = _run_attempt(args, plan, i, base_env, log_dir, interface, slots, watcher, attempt, start)
            if failure is None or not failure.restartable or attempt >= args.max_restarts:
                break
            failure = _agree_on_restart(plan, i, attempt, coordinator, slots, watcher)
            if failure is not None:
                break
            attempt += 1
            local.keep_logs(log_dir, attempt, [f"ps-{j}.log" for j in plan.ps_indices(i)]
                            + [n for r in plan.worker_ranks(i) for n in (f"worker-{r}.log", f"progress-worker-{r}")])
            print(f"kparallax-run (host {i}): restart {attempt}/{args.max_restarts} after {watcher.last_failure}",
                  file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        failure = _tasks.Failure(f"host {i}", "was interrupted (Ctrl-C, SIGTERM or its ssh session closed)", 130)
        _publish(plan.coordinator, watcher.key(i), _status(130, f"launcher of host {i}", "was interrupted", False))
    except (ConnectionError, OSError) as e:
        failure = _tasks.Failure(f"host {i}", f"could not coordinate: {e}", 1)
        _publish(plan.coordinator, watcher.key(i),
                 _status(1, f"launcher of host {i}", f"could not coordinate: {e}", False))
    finally:
        if coordinator is not None:
            _linger(watcher, plan)
            coordinator.stop()
        restore()
    return _tasks.finish(failure, attempt, f"kparallax-run (host {i})")


def _run_attempt(args, plan, i, base_env, log_dir, interface, slots, watcher, attempt, start):
    """Starts this host's tasks for start number ``attempt``, supervises them, stops them; returns the failure."""
    watcher.attempt = attempt
    key = watcher.key(i)
    tasks = []
    env = dict(base_env, **{cluster_lib.ENV_RESTART_COUNT: str(attempt)})
    try:
        rendezvous.put(plan.coordinator, key, "running")
        failure = _tasks.start_ps(plan.ps_indices(i), [plan.ps_addresses[j] for j in plan.ps_indices(i)], env,
                                  log_dir, tasks)
        if failure is None:
            host, port = plan.coordinator.rsplit(":", 1)
            for rank in plan.worker_ranks(i):
                worker_env = dict(env, **rendezvous.horovod_env(slots[rank], host, int(port), interface))
                worker_env.update({cluster_lib.ENV_TASK_TYPE: "worker", cluster_lib.ENV_TASK_INDEX: str(rank)})
                tasks.append(_tasks.spawn("worker", rank, args.command, worker_env, log_dir,
                                          echo=rank == 0 and not args.quiet))
            failure = _tasks.supervise(tasks, args.timeout, elsewhere=watcher.failure, start=start,
                                       stall=_tasks.StallWatch(tasks, log_dir, args.stall_timeout))
            if failure is not None:
                failure.progress = _tasks.progress_report(tasks, log_dir)
        if failure is None:
            rendezvous.put(plan.coordinator, key, "done")
            failure = _wait_for_every_host(tasks, watcher, plan, i, args.timeout, start)
        elif not failure.remote:
            _publish(plan.coordinator, key, _status(failure.code, failure.name, failure.what, failure.restartable))
    finally:
        _tasks.stop_all(tasks)
    if failure is not None:
        watcher.last_failure = f"{failure.name} {failure.what}"
    return failure


RESTART_AGREEMENT_SECONDS = 60.0


def _final_failure(watcher):
    """Another host's failure that is never restarted (Ctrl-C, --timeout there), if one was published."""
    _, failure = watcher.poll(force=True)
    return failure if failure is not None and not failure.restartable else None


def _agree_on_restart(plan, i, attempt, coordinator, slots, watcher):
    """Every host has stopped start ``attempt``'s tasks before any host starts the next one. Host 0 then clears
    Horovod's rendezvous and says go; this host re-checks its ports. Returns a Failure if that does not happen."""
    rendezvous.put(plan.coordinator, f"a{attempt}_stopped_{i}", "1")
    deadline = time.monotonic() + RESTART_AGREEMENT_SECONDS
    go = f"a{attempt + 1}_go"
    if i == 0:
        while True:
            stopped = _per_host(plan.coordinator, f"a{attempt}_stopped_", len(plan.hosts))
            waiting = [j for j, value in stopped.items() if not value]
            if not waiting:
                break
            final = _final_failure(watcher)
            if final is not None:
                return final
            if time.monotonic() > deadline:
                return _tasks.Failure(f"host {waiting[0]} ({plan.hosts[waiting[0]].host})",
                                      f"did not stop its tasks for a restart within {RESTART_AGREEMENT_SECONDS:.0f} s",
                                      1, restartable=False)
            time.sleep(POLL_SECONDS / 5)
        coordinator.reset_rendezvous(slots)
        rendezvous.put(plan.coordinator, go, "1")
    else:
        while not rendezvous.get(plan.coordinator, go):
            final = _final_failure(watcher)
            if final is not None:
                return final
            if time.monotonic() > deadline:
                return _tasks.Failure(f"host 0 ({plan.hosts[0].host})", "did not start the restart within "
                                      f"{RESTART_AGREEMENT_SECONDS:.0f} s", 1, restartable=False)
            time.sleep(POLL_SECONDS / 5)
    while True:  # the stopped tasks' ports are free a moment after they exit
        problem = _port_in_use(plan, i, rendezvous_too=False)
        if problem is None:
            return None
        if time.monotonic() > deadline:
            return _tasks.Failure(f"host {i}", f"cannot restart: {problem}", 2, restartable=False)
        time.sleep(0.5)


def _port_in_use(plan, i, rendezvous_too=True):
    """The first of this host's ports (PS, workers, and the rendezvous on host 0) that something already uses."""
    spec = plan.hosts[i]
    ports = [("ps_port", spec.ps_port + k) for k in range(spec.ps)]
    ports += [("worker_port", spec.worker_port + k) for k in range(spec.workers)]
    if i == 0 and rendezvous_too:
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
                _publish(plan.coordinator, watcher.key(i), _status(failure.code, failure.name, failure.what))
                return failure
        statuses, failure = watcher.poll(force=True)
        if failure is not None:
            return failure
        statuses = statuses or {}
        if statuses and all(s == "done" for s in statuses.values()):
            _publish(plan.coordinator, f"a{watcher.attempt}_ack_{i}", "1")
            return None
        if timeout and time.monotonic() - start > timeout:
            waiting = [f"host {j}" for j, s in statuses.items() if s != "done"]
            return _tasks.Failure(", ".join(waiting) or "the coordinator",
                                  f"did not finish within --timeout={timeout:.0f}s", 124, restartable=False)
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
            if all(_per_host(plan.coordinator, f"a{watcher.attempt}_ack_", len(plan.hosts)).values()):
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
