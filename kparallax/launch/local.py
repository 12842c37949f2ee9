"""The local default of kparallax-run: every task on this host, addresses on 127.0.0.1.

With ``--max_restarts N``, a failed group (any task exited, or the run stalled) is stopped and started again with
the same run id and new ports, up to N times; the tasks see ``KPARALLAX_RESTART_COUNT`` and resume from their
checkpoints. The logs of each failed attempt are kept under ``LOG_DIR/attempt-<k>/``.
"""

import glob
import os
import shutil
import sys
import time
import uuid

from kparallax.cluster import coordinator as coordinator_lib
from kparallax.cluster import net
from kparallax.cluster import spec as spec_lib
from kparallax.launch import env as env_lib
from kparallax.launch import tasks as tasks_lib



def run(args):
    run_id = args.run_id or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    log_dir = env_lib.log_dir_for(args, run_id)
    restore = env_lib.interruptible()
    attempt, failure = 0, None
    try:
        while True:
            failure = _run_once(args, run_id, log_dir, attempt)
            if failure is None or not failure.restartable or attempt >= args.max_restarts:
                break
            attempt += 1
            keep_logs(log_dir, attempt)
            print(f"kparallax-run: restart {attempt}/{args.max_restarts} after {failure.name} {failure.what}",
                  file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print(f"kparallax-run: interrupted; stopped all tasks. Logs: {log_dir}", file=sys.stderr)
        return 130
    finally:
        restore()
    return tasks_lib.finish(failure, attempt)


def keep_logs(log_dir, attempt, names=None):
    """Moves the failed attempt's task logs and progress files (``names``: only these files of ``log_dir``, e.g.
    one host's when hosts share it) to ``LOG_DIR/attempt-<attempt>/``."""
    kept = os.path.join(log_dir, f"attempt-{attempt}")
    os.makedirs(kept, exist_ok=True)
    if names is None:
        paths = glob.glob(os.path.join(log_dir, "*.log")) + glob.glob(os.path.join(log_dir, "progress-worker-*"))
    else:
        paths = [os.path.join(log_dir, name) for name in names if os.path.exists(os.path.join(log_dir, name))]
    for path in paths:
        shutil.move(path, os.path.join(kept, os.path.basename(path)))


def _run_once(args, run_id, log_dir, attempt):
    """Starts the PS tasks and workers, supervises them, stops them all; returns the failure or None."""
    ps_hosts = [f"127.0.0.1:{net.free_port()}" for _ in range(args.ps)]
    worker_hosts = [f"127.0.0.1:{net.free_port()}" for _ in range(args.workers)]
    cluster = spec_lib.Cluster(ps=ps_hosts, workers=worker_hosts, run_id=run_id,
                               connect_lock=os.path.join(log_dir, "connect.lock"))
    env_lib.write_cluster_json(log_dir, cluster)
    base_env = env_lib.base_env(args, ps_hosts, worker_hosts, run_id, log_dir, cluster.connect_lock)
    base_env[spec_lib.ENV_RESTART_COUNT] = str(attempt)
    try:
        base_env.update(env_lib.bind_env(args, "127.0.0.1"))
    except RuntimeError as e:
        return tasks_lib.Failure("kparallax-run", f"cannot start: {e}", 2, restartable=False)
    tasks, coordinator = [], None
    try:
        failure = tasks_lib.start_ps(range(args.ps), ps_hosts, base_env, log_dir, tasks)
        if failure is None:
            slots = coordinator_lib.slot_plan([("localhost", args.workers)])
            port = net.free_port()
            coordinator = coordinator_lib.Coordinator("127.0.0.1", port, slots)
            for slot in slots:
                env = dict(base_env, **coordinator_lib.horovod_env(slot, "127.0.0.1", port, "lo"))
                env.pop(coordinator_lib.ENV_COORDINATOR)  # one host: the lock file orders first connections
                env.update({spec_lib.ENV_TASK_TYPE: "worker", spec_lib.ENV_TASK_INDEX: str(slot.rank)})
                tasks.append(tasks_lib.spawn("worker", slot.rank, args.command, env, log_dir,
                                             echo=slot.rank == 0 and not args.quiet))
            failure = tasks_lib.supervise(tasks, args.timeout,
                                          stall=tasks_lib.StallWatch(tasks, log_dir, args.stall_timeout))
            if failure is not None and not failure.progress:
                failure.progress = tasks_lib.progress_report(tasks, log_dir)
        return failure
    finally:
        tasks_lib.stop_all(tasks)
        if coordinator is not None:
            coordinator.stop()
