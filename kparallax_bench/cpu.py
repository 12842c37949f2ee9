"""Where the CPU goes during a benchmark's timed steps: CPU-seconds by role, read from /proc at the marks.

At each start/stop mark the driver takes a ``snapshot``: the machine's busy time (``/proc/stat``: user, nice,
system, irq, softirq) and every process's user+system time (``/proc/<pid>/stat``) under a role read from its
command line and environment: ``worker`` (a benchmark worker; the tf-pss chief is ``chief``), ``ps`` (a kparallax
PS task or a tf-pss PS server), ``other`` for the rest. ``diff`` gives CPU-seconds per role between two snapshots
plus ``kernel`` (busy time no process was charged for: network soft interrupts of the emulated links, mostly).
Linux only; elsewhere the snapshot is empty and nothing is reported.
"""

import json
import os

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _role(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return None
    if b"kparallax.cluster.ps_server" in argv:
        return "ps"
    if not any(a.endswith(b"kparallax_bench.worker") or a.endswith(b"kparallax_bench/worker.py") for a in argv):
        return "other"
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
    except OSError:
        env = {}
    if b"TF_CONFIG" in env:
        task = json.loads(env[b"TF_CONFIG"]).get("task", {}).get("type", "worker")
        return {"ps": "ps", "chief": "chief"}.get(task, "worker")
    return "worker"


def _process_seconds(pid):
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK   # utime, stime


def snapshot():
    """{"busy": machine busy seconds, "processes": {pid: (role, seconds)}} now; {} without /proc."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return {}
    busy = sum(ticks[i] for i in (0, 1, 2, 5, 6)) / _TICK  # user nice system irq softirq
    processes = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            seconds, role = _process_seconds(name), _role(name)
            if seconds is not None and role is not None:
                processes[int(name)] = (role, seconds)
    return {"busy": busy, "processes": processes}


def diff(start, stop):
    """CPU-seconds by role between two snapshots (a process that started in between counts from zero)."""
    if not start or not stop:
        return {}
    out = {"worker": 0.0, "chief": 0.0, "ps": 0.0, "other": 0.0}
    for pid, (role, seconds) in stop["processes"].items():
        before = start["processes"].get(pid)
        out[role] += seconds - (before[1] if before and before[0] == role else 0.0)
    out["total"] = stop["busy"] - start["busy"]
    out["kernel"] = max(out["total"] - sum(out[k] for k in ("worker", "chief", "ps", "other")), 0.0)
    return {k: round(v, 3) for k, v in out.items()}
