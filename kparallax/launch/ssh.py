"""kparallax-run ssh mode: from one machine, a per-host launcher on every host, as horovodrun starts workers.

horovodrun's conventions: ``-H``, ``--ssh-port``, ``-x NAME``. A host that is this machine (loopback, its name or
one of its addresses) gets its launcher started directly, without ssh, as horovodrun does. Host 0's output is
streamed; any host failing, or Ctrl-C, stops everything (the remote launchers stop when their session closes).
"""

import os
import shlex
import subprocess
import sys
import time

from kparallax.cluster import net
from kparallax.launch import env as env_lib
from kparallax.launch import tasks as _tasks


def run(args):
    """ssh mode: a per-host launcher on every host, started over ssh like horovodrun starts remote workers."""
    plan = args.plan
    run_id = args.run_id or env_lib.default_run_id(plan, args.command)
    log_dir = env_lib.log_dir_for(args, run_id)
    missing = [name for name in args.forward_env if name not in os.environ]
    if missing:
        print(f"kparallax-run: -x {missing[0]}: no such variable in this environment. Received: -x {missing[0]}.",
              file=sys.stderr)
        return 2
    forwarded = " ".join(f"{n}={shlex.quote(os.environ[n])}" for n in args.forward_env)
    hosts, restore, failure = [], env_lib.interruptible(), None
    try:
        for i, spec in enumerate(plan.hosts):
            remote = [sys.executable, "-m", "kparallax.launch", "--cluster-json", plan.to_json(), "--host-index", str(i),
                      "--run_id", run_id, "--log_dir", log_dir, "--stdin-watch", "--timeout", str(args.timeout),
                      "--stall_timeout", str(args.stall_timeout), "--max_restarts", str(args.max_restarts)]
            if args.architecture:
                remote += ["--architecture", args.architecture]
            if args.quiet:
                remote.append("--quiet")
            if args.bind_all:
                remote.append("--bind-all")
            remote += ["--"] + list(args.command)
            if net.is_local_host(spec.host):  # this machine: no ssh (and no sshd needed), like horovodrun
                argv = remote
            else:
                remote_command = (f"cd {shlex.quote(os.getcwd())} > /dev/null 2>&1 && "
                                  f"env {forwarded} {shlex.join(remote)}")
                argv = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no"]
                if args.ssh_port:
                    argv += ["-p", str(args.ssh_port)]
                argv += [spec.host, remote_command]
            hosts.append(_tasks.spawn("host", i, argv, dict(os.environ), log_dir, echo=not args.quiet,
                                      stdin=subprocess.PIPE, raw=True))
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
