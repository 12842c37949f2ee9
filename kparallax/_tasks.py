"""Child tasks of a launcher: spawn with a per-task log, stream one task's output, stop all, supervise."""

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, List, Optional

from kparallax import _proc

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


@dataclasses.dataclass
class Failure:
    name: str        # "worker 1", "ps 0", "host 1", ...
    what: str        # "failed with exit code 3", ...
    code: int        # the launcher's exit code
    log_path: str = ""
    remote: bool = False  # reported by another host's launcher

    progress: str = ""   # where each worker was when the run failed

    def message(self):
        text = f"{self.name} {self.what}; stopped all tasks."
        if self.progress:
            text += f"\n{self.progress}"
        if self.log_path:
            text += f"\n{self.name}'s log ({self.log_path}) ends with:\n{tail(self.log_path)}"
        return text


def _tee(stream, log_file, prefix):
    pending = b""
    for chunk in iter(lambda: stream.read1(4096), b""):
        log_file.write(chunk)
        log_file.flush()
        if prefix is not None:
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                sys.stdout.buffer.write(prefix + line + b"\n")
            sys.stdout.flush()
    if prefix is not None and pending:
        sys.stdout.buffer.write(prefix + pending + b"\n")
        sys.stdout.flush()
    log_file.close()


def spawn(role, index, command, env, log_dir, echo, stdin=subprocess.DEVNULL, raw=False):
    """Starts a task logging to ``log_dir/<role>-<index>.log``.

    ``echo`` also streams its output to this terminal, each line prefixed ``[role index] `` (``raw``: unprefixed).
    """
    log_path = os.path.join(log_dir, f"{role}-{index}.log")
    log_file = open(log_path, "wb")  # pylint: disable=consider-using-with
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               stdin=stdin, preexec_fn=_proc.die_with_parent)
    prefix = (b"" if raw else f"[{role} {index}] ".encode()) if echo else None
    threading.Thread(target=_tee, args=(process.stdout, log_file, prefix), daemon=True).start()
    return Task(role, index, process, log_path)


def tail(path, lines=15):
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join("    " + line for line in text.replace("\r", "\n").splitlines()[-lines:])


def stop_all(tasks):
    """SIGTERM every running task, SIGKILL what is left after GRACE_SECONDS."""
    for task in tasks:
        if task.process.poll() is None:
            task.process.send_signal(signal.SIGTERM)
            task.process.send_signal(signal.SIGCONT)  # a stopped (SIGSTOP) task handles SIGTERM only once resumed
    wait_or_kill(tasks, GRACE_SECONDS)


def wait_or_kill(tasks, seconds):
    """Waits up to ``seconds`` in total for the tasks to exit, then SIGKILLs the rest."""
    deadline = time.monotonic() + seconds
    for task in tasks:
        try:
            task.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            task.process.kill()
            task.process.wait()


def exit_code(returncode):
    return 128 - returncode if returncode < 0 else returncode


def wait_ps_ready(ps_tasks, addresses, timeout=60.0):
    """Waits until each PS task listens; returns the first task that died or never listened, else None."""
    from kparallax import runtime  # pylint: disable=import-outside-toplevel
    deadline = time.monotonic() + timeout
    for task, address in zip(ps_tasks, addresses):
        while runtime._probe(address, 1.0) is not None:  # pylint: disable=protected-access
            if task.process.poll() is not None or time.monotonic() > deadline:
                return task
            time.sleep(0.1)
    return None


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def progress_report(tasks, log_dir):
    """One line per local worker: steps finished and whether it is stopped; names the ones behind the others."""
    steps = []
    for task in tasks:
        if task.role != "worker":
            continue
        try:
            with open(os.path.join(log_dir, f"progress-worker-{task.index}"), encoding="utf-8") as f:
                steps.append((task, int(f.read().strip() or 0)))
        except (OSError, ValueError):
            steps.append((task, None))
    known = [v for _, v in steps if v is not None]
    if not known:
        return ""
    lines = []
    for task, step in steps:
        state = _state(task.process.pid) if task.process.poll() is None else "exited"
        note = " (stopped: SIGSTOP?)" if state == "T" else ""
        behind = " <- behind the others: the collective waited for this worker" if (
            step is not None and step < max(known)) else ""
        lines.append(f"    {task.name}: {step if step is not None else '?'} step(s) finished{note}{behind}")
    return "workers' progress when the run stopped:\n" + "\n".join(lines)


def supervise(tasks: List[Task], timeout: float, elsewhere: Optional[Callable[[], Optional[Failure]]] = None,
              start: Optional[float] = None) -> Optional[Failure]:
    """Waits until every local worker has exited; returns the first failure (local, or ``elsewhere()``'s), else None."""
    start = time.monotonic() if start is None else start
    while True:
        workers_running = False
        for task in tasks:
            code = task.process.poll()
            if code is None:
                workers_running |= task.role == "worker"
                continue
            if task.role == "ps":
                return Failure(task.name, f"exited unexpectedly with code {code}", exit_code(code) or 1, task.log_path)
            if code != 0:
                return Failure(task.name, f"failed with exit code {code}", exit_code(code), task.log_path)
        if not workers_running:
            return None
        failure = elsewhere() if elsewhere is not None else None
        if failure is not None:
            return failure
        if timeout and time.monotonic() - start > timeout:
            stalled = [t for t in tasks if t.role == "worker" and t.process.poll() is None]
            names = ", ".join(t.name for t in stalled)
            return Failure(stalled[0].name, f"did not finish within --timeout={timeout:.0f}s (still running: {names})",
                           124, stalled[0].log_path)
        time.sleep(0.1)
