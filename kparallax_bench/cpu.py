"""Where the CPU goes during a benchmark's timed steps: CPU-seconds by role, read from /proc at the marks.

At each start/stop mark the driver takes a ``snapshot``: the machine's busy time (``/proc/stat``: user, nice,
system, irq, softirq) and every process's user+system time (``/proc/<pid>/stat``) under a role read from its
command line and environment: ``worker`` (a benchmark worker; the tf-pss chief is ``chief``), ``ps`` (a kparallax
PS task or a tf-pss PS server), ``other`` for the rest (``kparallax-run``'s launchers among them: before, counted as
workers, their command lines holding the worker's). ``diff`` gives CPU-seconds per role between two snapshots
plus ``kernel`` (busy time no process was charged for: network soft interrupts of the emulated links, mostly);
``peak_memory`` gives the peak resident memory by role at the stop mark.
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
    if b"kparallax.launch" in argv:  # a launcher (its command line holds the worker's after "--")
        return "other"
    if not any(a.endswith(b"kparallax_bench.worker") or a.endswith(b"kparallax_bench/worker.py") for a in argv):
        return "other"
    env = _environ(pid)
    if b"TF_CONFIG" in env:
        task = json.loads(env[b"TF_CONFIG"]).get("task", {}).get("type", "worker")
        return {"ps": "ps", "chief": "chief"}.get(task, "worker")
    return "worker"


def _environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
    except OSError:
        return {}


def _process_seconds(pid):
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK   # utime, stime


def _peak_rss(pid):
    """The process's peak resident set size in bytes (``VmHWM`` of ``/proc/<pid>/status``), or None."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def snapshot(marks=None):
    """{"busy": machine busy seconds, "processes": {pid: (role, seconds)}, "peak_rss": {pid: (role, bytes)}} now;
    {} without /proc. Peak memory is taken of the benchmark's roles only, and with ``marks`` (the run's
    ``KPBENCH_MARKS``) of that run's processes only."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return {}
    busy = sum(ticks[i] for i in (0, 1, 2, 5, 6)) / _TICK  # user nice system irq softirq
    processes, peak = {}, {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            seconds, role = _process_seconds(name), _role(name)
            if seconds is not None and role is not None:
                processes[int(name)] = (role, seconds)
                ours = marks is None or _environ(name).get(b"KPBENCH_MARKS") == marks.encode()
                rss = _peak_rss(name) if role != "other" and ours else None
                if rss is not None:
                    peak[int(name)] = (role, rss)
    return {"busy": busy, "processes": processes, "peak_rss": peak}


def peak_memory(stop):
    """Peak resident memory in bytes by role at a snapshot: the largest worker (``worker``; the tf-pss chief as
    ``chief``) and all PS tasks together (``ps``); {} without /proc."""
    if not stop:
        return {}
    out = {"worker": 0, "chief": 0, "ps": 0}
    for role, rss in stop.get("peak_rss", {}).values():
        out[role] = out[role] + rss if role == "ps" else max(out[role], rss)
    return out


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
