"""Child tasks of a launcher: spawn with a per-task log, stream one task's output, stop all, supervise."""

import ctypes
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, List, Optional

from kparallax import log
from kparallax.cluster import net
from kparallax.launch import env as env_lib

GRACE_SECONDS = 10.0
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig=signal.SIGTERM):
    """Asks the kernel to send ``sig`` to this process when its parent exits (no orphan tasks). Used as
    ``preexec_fn`` of every task."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except OSError:
        pass


@dataclasses.dataclass
class Task:
    role: str
    index: int
    process: subprocess.Popen
    log_path: str
    output: Optional[threading.Thread] = None  # copies the task's output into its log (and the terminal)

    def log_complete(self, seconds=2.0):
        """Waits (up to ``seconds``) until the output of the exited task is all in its log."""
        if self.output is not None:
            self.output.join(seconds)

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
    restartable: bool = True  # False for --timeout (and Ctrl-C): never restarted

    progress: str = ""   # where each worker was when the run failed

    def message(self):
        text = f"{self.name} {self.what}; stopped all tasks."
        if self.progress:
            text += f"\n{self.progress}"
        if self.log_path:
            text += f"\n{self.name}'s log ({self.log_path}) ends with:\n{tail(self.log_path)}"
        return text


QUIET_PREFIX = log.PREFIX.encode()  # kparallax's INFO lines: in the task's log, not the terminal
_OP_FAILED = b"OP_REQUIRES failed at "  # TensorFlow's C++ warning as an op's error unwinds
_SHUT_DOWN = log.HOROVOD_SHUT_DOWN.encode()


def _quiet(line):
    """Lines kept in the task's log but not shown in the terminal: kparallax's INFO lines, and TensorFlow's C++
    warnings of the Horovod ops a worker's collective ended with when another worker stopped (the worker's own
    one-line error says it)."""
    return line.startswith(QUIET_PREFIX) or (_OP_FAILED in line and _SHUT_DOWN in line)


def _tee(stream, log_file, prefix):
    pending = b""
    for chunk in iter(lambda: stream.read1(4096), b""):
        log_file.write(chunk)
        log_file.flush()
        if prefix is not None:
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not _quiet(line):
                    sys.stdout.buffer.write(prefix + line + b"\n")
            sys.stdout.flush()
    if prefix is not None and pending and not _quiet(pending):
        sys.stdout.buffer.write(prefix + pending + b"\n")
        sys.stdout.flush()
    log_file.close()


def spawn(role, index, command, env, log_dir, echo, stdin=subprocess.DEVNULL, raw=False):
    """Starts a task logging to ``log_dir/<role>-<index>.log``.

    ``echo`` also streams its output to this terminal, each line prefixed ``[role index] `` (``raw``: unprefixed).
    """
    log_path = os.path.join(log_dir, f"{role}-{index}.log")
    log_file = open(log_path, "wb")  # pylint: disable=consider-using-with
    try:
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   stdin=stdin, preexec_fn=die_with_parent)
    except OSError as e:  # e.g. not a program this system can run; the caller stops the tasks already started
        log_file.close()
        raise env_lib.UsageError(f"cannot start {role} {index}: {e.strerror}. Received: {' '.join(command)}.") from None
    prefix = (b"" if raw else f"[{role} {index}] ".encode()) if echo else None
    output = threading.Thread(target=_tee, args=(process.stdout, log_file, prefix), daemon=True)
    output.start()
    return Task(role, index, process, log_path, output)


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
    deadline = time.monotonic() + timeout
    for task, address in zip(ps_tasks, addresses):
        while net.probe(address, 1.0) is not None:
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


def read_progress(log_dir, index):
    """(steps finished, state, raw text) of worker ``index``'s progress file, or None if it has none yet."""
    try:
        with open(os.path.join(log_dir, f"progress-worker-{index}"), encoding="utf-8") as f:
            text = f.read().strip()
        fields = text.split()
        return int(fields[0]), (fields[1] if len(fields) > 1 else "training"), text
    except (OSError, ValueError, IndexError):
        return None


def progress_report(tasks, log_dir, header="workers' progress when the run stopped"):
    """One line per local worker: steps finished and whether it is stopped; names the ones behind the others."""
    steps = []
    for task in tasks:
        if task.role == "worker":
            progress = read_progress(log_dir, task.index)
            steps.append((task, progress[0] if progress else None))
    known = [v for _, v in steps if v is not None]
    if not known:
        return ""
    lines = []
    for task, step in steps:
        state = _state(task.process.pid) if task.process.poll() is None else "exited"
        note = " (stopped: SIGSTOP?)" if state == "T" else ""
        behind = " <- behind the others: the collective waited for this worker" if (
            step is not None and step < max(known)) else ""
        lines.append(f"    {task.name}: {step if step is not None else '?'} step(s) finished{note}{behind} "
                     f"(log: {task.log_path})")
    return f"{header}:\n" + "\n".join(lines)


def horovod_stalled_ranks(tasks, max_bytes=65536):
    """The last "Stalled ranks" list Horovod's stall inspector wrote in the tasks' logs ("" if none)."""
    found = ""
    for task in tasks:
        lines = _log_end(task, max_bytes).decode("utf-8", "replace").splitlines()
        for i, line in enumerate(lines):
            if "Stalled ranks:" in line:
                ranks = [x.strip() for x in lines[i + 1:i + 9] if x.strip()[:1].isdigit() and ": [" in x]
                if ranks:
                    found = "\n".join(f"    {r[:300]}" for r in ranks)
    return found


class StallWatch:
    """Reports a run in which no worker finished a batch for ``stall_timeout`` seconds while training.

    Workers write ``LOG_DIR/progress-worker-<rank>`` (``fit_callbacks.ProgressFile``): ``<steps> <state>
    <batches>``. Whatever a worker waits on (a collective, a remote op, the PS), its file stops changing.
    """

    def __init__(self, tasks, log_dir, stall_timeout):
        self._workers = [t for t in tasks if t.role == "worker"]
        self._log_dir, self._timeout = log_dir, stall_timeout
        self._seen, self._changed = None, time.monotonic()

    def check(self):
        if not self._timeout or not self._log_dir:
            return None
        progress = [read_progress(self._log_dir, t.index) for t in self._workers]
        now = time.monotonic()
        if progress != self._seen:
            self._seen, self._changed = progress, now
            return None
        training = [p for p in progress if p is not None and p[1] == "training"]
        if not training or now - self._changed < self._timeout:
            return None
        report = progress_report(self._workers, self._log_dir)
        stalled = horovod_stalled_ranks(self._workers)
        if stalled:
            report += "\nHorovod's stall inspector: ranks a collective waits for (rank: [tensors]):\n" + stalled
        first = self._workers[0]
        return Failure(first.name if len(self._workers) == 1 else "the run",
                       f"made no progress for --stall_timeout={self._timeout:.0f}s (no worker finished a step)",
                       124, progress=report)


def supervise(tasks: List[Task], timeout: float, elsewhere: Optional[Callable[[], Optional[Failure]]] = None,
              start: Optional[float] = None, stall: Optional[StallWatch] = None) -> Optional[Failure]:
    """Waits until every local worker has exited; returns the first failure (local, ``elsewhere()``'s, or a stall
    ``stall`` reports), else None."""
    start = time.monotonic() if start is None else start
    last_stall_check = 0.0
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
                return _cause(tasks, task, elsewhere)
        if not workers_running:
            return None
        failure = elsewhere() if elsewhere is not None else None
        if failure is not None:
            return failure
        if stall is not None and time.monotonic() - last_stall_check > 1.0:
            last_stall_check = time.monotonic()
            failure = stall.check()
            if failure is not None:
                return failure
        if timeout and time.monotonic() - start > timeout:
            stalled = [t for t in tasks if t.role == "worker" and t.process.poll() is None]
            names = ", ".join(t.name for t in stalled)
            return Failure(stalled[0].name, f"did not finish within --timeout={timeout:.0f}s (still running: {names})",
                           124, stalled[0].log_path, restartable=False)
        time.sleep(0.1)


CAUSE_SECONDS = 5.0


def _log_end(task, max_bytes):
    """The last ``max_bytes`` of ``task``'s log (b"" if it cannot be read)."""
    try:
        with open(task.log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(task.log_path) - max_bytes))
            return f.read()
    except OSError:
        return b""


def _collateral(task, max_bytes=16384):
    """Whether the exited worker ``task`` stopped only because another worker left a collective (its log ends with
    Horovod's shutdown error)."""
    task.log_complete()
    return _SHUT_DOWN in _log_end(task, max_bytes)


def _cause(tasks, failed, elsewhere=None):
    """The failure to report once worker ``failed`` exited with an error.

    When one worker fails inside a step, Horovod shuts down the others' collectives and they fail too, often first
    (the failing worker is still unwinding its own error). If ``failed`` is such a worker, the launcher waits up to
    ``CAUSE_SECONDS`` for a worker that failed with an error of its own, here or on another host (``elsewhere``),
    and names it instead.
    """
    def failure(task):
        code = task.process.poll()
        return Failure(task.name, f"failed with exit code {code}", exit_code(code), task.log_path)

    if not _collateral(failed):
        return failure(failed)
    pending = [t for t in tasks if t.role == "worker" and t is not failed]
    deadline = time.monotonic() + CAUSE_SECONDS
    while time.monotonic() < deadline:
        for task in [t for t in pending if t.process.poll() is not None]:
            pending.remove(task)
            if task.process.returncode != 0 and not _collateral(task):
                return failure(task)
        remote = elsewhere() if elsewhere is not None else None
        if remote is not None:
            return remote
        if not pending and elsewhere is None:
            break
        time.sleep(0.1)
    return failure(failed)


def finish(failure: Optional[Failure], restarts: int, who: str = "kparallax-run") -> int:
    """The launcher's exit code; a failure is printed, with the number of restarts made before it."""
    if failure is None:
        return 0
    if restarts:
        failure.what += f" (after {restarts} restart(s))"
    print(f"{who}: {failure.message()}", file=sys.stderr)
    return failure.code


PS_COMMAND = [sys.executable, "-m", "kparallax.cluster.ps_server"]


def start_ps(indices, addresses, base_env, log_dir, tasks):
    """Starts PS tasks ``indices`` (appended to ``tasks``) and waits until each listens at its address.

    Returns a Failure naming the first one that died or never listened, else None.
    """
    from kparallax.cluster import spec  # pylint: disable=import-outside-toplevel
    started = []
    for index in indices:
        env = dict(base_env, **{spec.ENV_TASK_TYPE: "ps", spec.ENV_TASK_INDEX: str(index)})
        started.append(spawn("ps", index, PS_COMMAND, env, log_dir, echo=False))
    tasks.extend(started)
    not_ready = wait_ps_ready(started, addresses)
    if not_ready is not None:
        return Failure(not_ready.name, "did not start listening", 1, not_ready.log_path)
    return None
