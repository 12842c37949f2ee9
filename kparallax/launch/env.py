"""What every task of a run gets: the ``KPARALLAX_*`` and Horovod variables, the bind shim, the run id and the
log directory, plus the launcher's own signal handling."""

import dataclasses
import hashlib
import json
import os
import signal
import tempfile

from kparallax._compat import bind_shim
from kparallax.cluster import spec as spec_lib
from kparallax.core import options as options_lib  # TF-free: the architecture names and their variable


class UsageError(ValueError):
    """Bad launcher input found after parsing (``kparallax-run: error: ...``, exit 2)."""


def log_dir_for(args, run_id):
    """The run's log directory, created; a directory that cannot be created or written is a ``UsageError``."""
    log_dir = os.path.abspath(args.log_dir or os.path.join("kparallax-logs", run_id))
    try:
        os.makedirs(log_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=log_dir):
            pass
    except OSError as e:
        flag = f"--log_dir={args.log_dir}" if args.log_dir else f"the default log directory {log_dir}"
        raise UsageError(f"cannot write the tasks' logs to {log_dir} ({e.strerror}). Pass --log_dir a directory "
                         f"this user can create and write. Received: {flag}.") from None
    return log_dir


def default_run_id(plan, command):
    """The same on every host of a per-host launch (all run the same command with the same cluster)."""
    digest = hashlib.sha1((plan.to_json() + "\0" + "\0".join(command)).encode()).hexdigest()[:10]
    return f"run-{digest}"


# Seconds without a finished step before a run is stopped (--stall_timeout's default); Gloo's own wait for a silent
# peer is the same (``gloo_env``).
STALL_TIMEOUT = 300.0


def gloo_env(stall_timeout):
    """Horovod's Gloo waits for a silent peer as long as the launcher lets a run stall (``stall_timeout`` s)."""
    return {"HOROVOD_GLOO_TIMEOUT_SECONDS": str(int(stall_timeout))}


def base_env(args, ps_hosts, worker_hosts, run_id, log_dir, connect_lock=None):
    """The environment shared by every task of the run."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # TensorFlow's C++ INFO lines off; its warnings and errors stay
    env.update({
        spec_lib.ENV_PS_HOSTS: ",".join(ps_hosts),
        spec_lib.ENV_WORKER_HOSTS: ",".join(worker_hosts),
        spec_lib.ENV_RUN_ID: run_id,
        spec_lib.ENV_LOG_DIR: log_dir,
    })
    env.pop(spec_lib.ENV_CONNECT_LOCK, None)
    if connect_lock:
        env[spec_lib.ENV_CONNECT_LOCK] = connect_lock
    if args.architecture:
        env[options_lib.ARCHITECTURE_ENV] = args.architecture
    # The launcher stops a run whose workers' progress files stop changing for --stall_timeout (tasks.StallWatch),
    # whatever they wait on. Horovod's stall inspector warns at half of it (naming the ranks a collective waits
    # for) and shuts Horovod down later, as a backstop when no progress files are written.
    env["HOROVOD_STALL_CHECK_TIME_SECONDS"] = str(max(1, int(args.stall_timeout // 2)))
    env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = str(int(args.stall_timeout * 1.5))
    env.update(gloo_env(args.stall_timeout))
    return env


def bind_env(args, host):
    """LD_PRELOAD + KPARALLAX_BIND_ADDRESS so that the tasks' servers listen on ``host`` only (unless --bind-all)."""
    if args.bind_all:
        return {}
    return bind_shim.env_for(host, bind_shim.library())


def write_cluster_json(log_dir, cluster, plan=None):
    data = dataclasses.asdict(cluster)
    if plan is not None:
        data["hosts"] = [dataclasses.asdict(h) for h in plan.hosts]
        data["coordinator"] = plan.coordinator
    with open(os.path.join(log_dir, "cluster.json"), "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)


def interruptible():
    """SIGTERM behaves like Ctrl-C; returns a function restoring the previous handlers."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def _interrupt(signum, frame):  # pylint: disable=unused-argument
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)

    def restore():
        for s, handler in previous.items():
            signal.signal(s, handler)
    return restore
