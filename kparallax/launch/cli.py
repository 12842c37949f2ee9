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
import os
import shutil
import sys

from kparallax.core import options as options_lib  # TF-free: the architecture names
from kparallax.launch import cluster_file
from kparallax.launch import env as env_lib


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
    parser.add_argument("--stall_timeout", "--stall-timeout", dest="stall_timeout", type=float,
                        default=env_lib.STALL_TIMEOUT,
                        help="seconds without any worker finishing a step (whatever it waits on: a collective, a "
                             "remote op, the PS) before the run is stopped, naming the workers behind (default "
                             f"{env_lib.STALL_TIMEOUT:g}; Horovod's stall warnings start at half of it)")
    parser.add_argument("--max_restarts", "--max-restarts", dest="max_restarts", type=int, default=0,
                        help="when a task fails (on any host), stop every task and start the whole group again, up "
                             "to this many times (same run id; local mode picks new ports, cluster files keep theirs "
                             "and re-check them; hosts agree through the coordinator; tasks see "
                             "$KPARALLAX_RESTART_COUNT). Ctrl-C and --timeout never restart (default 0)")
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
    if args.max_restarts < 0:
        parser.error(f"--max_restarts must be >= 0. Received: --max_restarts={args.max_restarts}.")
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


def missing_program(command):
    """Why this host cannot start ``command`` (its program is not an executable file, or not on ``PATH``), or None."""
    program = command[0]
    if os.sep in program:
        if os.path.isfile(program) and os.access(program, os.X_OK):
            return None
        return f"{program!r} is not an executable file"
    return None if shutil.which(program) else f"{program!r} is not on PATH"


def run(argv=None):
    args = _parse(sys.argv[1:] if argv is None else argv)
    try:
        return _run(args)
    except env_lib.UsageError as e:
        print(f"kparallax-run: error: {e}", file=sys.stderr)
        return 2


def _run(args):
    if args.plan is None or args.host_index is not None:  # the tasks start here: their program must be here
        why = missing_program(args.command)
        if why:
            raise env_lib.UsageError(f"cannot start the training command: {why}. Give its path or a program on PATH "
                                     f"(e.g. python train.py). Received: {' '.join(args.command)}.")
    if args.plan is None:
        from kparallax.launch import local  # pylint: disable=import-outside-toplevel
        return local.run(args)
    if args.host_index is not None:
        from kparallax.launch import multihost  # pylint: disable=import-outside-toplevel
        return multihost.run_host(args)
    from kparallax.launch import ssh  # pylint: disable=import-outside-toplevel
    return ssh.run(args)


def main():
    sys.exit(run())


if __name__ == "__main__":
    main()
