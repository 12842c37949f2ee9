"""kparallax-run: starts PS tasks and Horovod workers on this machine and supervises them.

    kparallax-run --workers 2 --ps 1 -- python train.py --flag=value

Every task gets the ``KPARALLAX_*`` variables (``Cluster.from_env()``) and the ``HOROVOD_*`` variables of a Gloo
job (this launcher runs Horovod's rendezvous server itself). Each task logs to ``LOG_DIR/<role>-<index>.log``;
worker 0's output is also streamed to this terminal. The run ends when all workers have exited; PS tasks are then
stopped. If any task fails (or the run exceeds ``--timeout``), every task is stopped and the launcher exits with
the failing task's exit code, naming the task and its log.
"""

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import portpicker

from kparallax import _proc
from kparallax import cluster as cluster_lib
from kparallax import options as options_lib

GRACE_SECONDS = 10.0


@dataclasses.dataclass
class Task:
    role: str
    index: int
    process: subprocess.Popen
    log_path: str

    @property
    def name(self):
        return f"{self.role} {self.index}"


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="kparallax-run", description="Start PS tasks and Horovod workers on this machine.",
        usage="kparallax-run [--workers N] [--ps M] [--architecture A] [--log_dir DIR] [--timeout S] -- command [args...]")
    parser.add_argument("--workers", "-np", type=int, default=2, help="number of worker processes (default 2)")
    parser.add_argument("--ps", type=int, default=1, help="number of parameter-server tasks (default 1)")
    parser.add_argument("--log_dir", default=None, help="directory for per-task logs (default kparallax-logs/<run>)")
    parser.add_argument("--run_id", default=None, help="name shared by the tasks of this run (default: random)")
    parser.add_argument("--timeout", type=float, default=0.0,
                        help="stop every task and fail if the run takes longer than this many seconds (0: never)")
    parser.add_argument("--architecture", default=None, choices=options_lib.ARCHITECTURES,
                        help="hybrid | allreduce | ps: sets $KPARALLAX_ARCHITECTURE, which HybridStrategy reads when "
                             "its architecture argument is not given (default: the script's choice, else hybrid)")
    parser.add_argument("--quiet", action="store_true", help="do not stream worker 0's output to the terminal")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the training command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no training command. Received: nothing after '--'. Example: kparallax-run --workers 2 --ps 1 "
                     "-- python train.py")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1. Received: --workers={args.workers}.")
    if args.ps < 0:
        parser.error(f"--ps must be >= 0. Received: --ps={args.ps}.")
    if args.timeout < 0:
        parser.error(f"--timeout must be >= 0. Received: --timeout={args.timeout}.")
    args.command = command
    return args


def _start_rendezvous(num_workers):
    from horovod.runner.common.util import hosts  # pylint: disable=import-outside-toplevel
    from horovod.runner.http.http_server import RendezvousServer  # pylint: disable=import-outside-toplevel
    plan = hosts.get_host_assignments(hosts.parse_hosts(f"localhost:{num_workers}"), num_workers)
    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init(plan)
    return server, port, plan


def _horovod_env(slot, port):
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": "lo",
        "HOROVOD_HOSTNAME": slot.hostname,
        "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
    }


def _tee(stream, log_file, echo):
    for chunk in iter(lambda: stream.read1(4096), b""):
        log_file.write(chunk)
        log_file.flush()
        if echo:
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
    log_file.close()


def _spawn(role, index, command, env, log_dir, echo):
    log_path = os.path.join(log_dir, f"{role}-{index}.log")
    log_file = open(log_path, "wb")  # pylint: disable=consider-using-with
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, preexec_fn=_proc.die_with_parent)
    threading.Thread(target=_tee, args=(process.stdout, log_file, echo), daemon=True).start()
    return Task(role, index, process, log_path)


def _tail(path, lines=15):
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join("    " + line for line in text.replace("\r", "\n").splitlines()[-lines:])


def _stop_all(tasks):
    for task in tasks:
        if task.process.poll() is None:
            task.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for task in tasks:
        try:
            task.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            task.process.kill()
            task.process.wait()


def _exit_code(returncode):
    return 128 - returncode if returncode < 0 else returncode


def _wait_ps_ready(ps_tasks, cluster, timeout=60.0):
    from kparallax import runtime  # pylint: disable=import-outside-toplevel
    deadline = time.monotonic() + timeout
    for task, address in zip(ps_tasks, cluster.ps):
        while runtime._probe(address, 1.0) is not None:  # pylint: disable=protected-access
            if task.process.poll() is not None:
                return task
            if time.monotonic() > deadline:
                return task
            time.sleep(0.1)
    return None


def run(argv=None):
    args = _parse(sys.argv[1:] if argv is None else argv)
    run_id = args.run_id or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    log_dir = os.path.abspath(args.log_dir or os.path.join("kparallax-logs", run_id))
    os.makedirs(log_dir, exist_ok=True)
    ps_hosts = [f"127.0.0.1:{portpicker.pick_unused_port()}" for _ in range(args.ps)]
    worker_hosts = [f"127.0.0.1:{portpicker.pick_unused_port()}" for _ in range(args.workers)]
    cluster = cluster_lib.Cluster(ps=ps_hosts, workers=worker_hosts, run_id=run_id,
                                  connect_lock=os.path.join(log_dir, "connect.lock"))
    with open(os.path.join(log_dir, "cluster.json"), "w", encoding="utf-8") as f:
        json.dump(dataclasses.asdict(cluster), f, indent=2)
    base_env = dict(os.environ, PYTHONUNBUFFERED="1")
    base_env.update({
        cluster_lib.ENV_PS_HOSTS: ",".join(ps_hosts),
        cluster_lib.ENV_WORKER_HOSTS: ",".join(worker_hosts),
        cluster_lib.ENV_RUN_ID: run_id,
        cluster_lib.ENV_CONNECT_LOCK: cluster.connect_lock,
        cluster_lib.ENV_LOG_DIR: log_dir,
    })
    if args.architecture:
        base_env[options_lib.ARCHITECTURE_ENV] = args.architecture
    tasks, failure, interrupted = [], None, False
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def _interrupt(signum, frame):  # pylint: disable=unused-argument
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    rendezvous = None
    try:
        for i in range(args.ps):
            env = dict(base_env, **{cluster_lib.ENV_TASK_TYPE: "ps", cluster_lib.ENV_TASK_INDEX: str(i)})
            tasks.append(_spawn("ps", i, [sys.executable, "-m", "kparallax.ps"], env, log_dir, echo=False))
        not_ready = _wait_ps_ready(tasks, cluster)
        if not_ready is not None:
            failure = (not_ready, "did not start listening", 1)
        else:
            rendezvous, port, plan = _start_rendezvous(args.workers)
            for slot in plan:
                env = dict(base_env, **_horovod_env(slot, port))
                env.update({cluster_lib.ENV_TASK_TYPE: "worker", cluster_lib.ENV_TASK_INDEX: str(slot.rank)})
                tasks.append(_spawn("worker", slot.rank, args.command, env, log_dir,
                                    echo=slot.rank == 0 and not args.quiet))
            failure = _supervise(tasks, args.timeout)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        _stop_all(tasks)
        if rendezvous is not None:
            rendezvous.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if interrupted:
        print(f"kparallax-run: interrupted; stopped all {len(tasks)} task(s). Logs: {log_dir}", file=sys.stderr)
        return 130
    if failure is not None:
        task, what, code = failure
        print(f"kparallax-run: {task.name} {what}; stopped all tasks. Its log ({task.log_path}) ends with:\n"
              f"{_tail(task.log_path)}", file=sys.stderr)
        return code
    return 0


def _supervise(tasks, timeout):
    """Waits for every worker to finish; returns (task, what, exit code) for the first failure, else None."""
    start = time.monotonic()
    while True:
        workers_running = False
        for task in tasks:
            code = task.process.poll()
            if code is None:
                workers_running |= task.role == "worker"
                continue
            if task.role == "ps":
                return task, f"exited unexpectedly with code {code}", _exit_code(code) or 1
            if code != 0:
                return task, f"failed with exit code {code}", _exit_code(code)
        if not workers_running:
            return None
        if timeout and time.monotonic() - start > timeout:
            stalled = [t for t in tasks if t.role == "worker" and t.process.poll() is None]
            names = ", ".join(t.name for t in stalled)
            return stalled[0], f"did not finish within --timeout={timeout:.0f}s (still running: {names})", 124
        time.sleep(0.1)


def main():
    sys.exit(run())


if __name__ == "__main__":
    main()
