"""Helpers for tests that run real clusters: kparallax-run under a timeout, with the stalled task's log on failure."""

import dataclasses
import glob
import os
import subprocess
import sys

NOISE = ("oneDNN custom operations", "cpu_feature_guard", "AVX2 AVX512", "rebuild TensorFlow with",
         "kernel_and_device.cc", "grpc_server_lib.cc")


@dataclasses.dataclass
class RunResult:
    returncode: int
    output: str
    log_dir: str

    def logs(self):
        """Every task's log, noise removed, keyed by file name (``worker-0.log``...)."""
        result = {}
        for path in sorted(glob.glob(os.path.join(self.log_dir, "*.log"))):
            with open(path, encoding="utf-8", errors="replace") as f:
                result[os.path.basename(path)] = _clean(f.read())
        return result

    def assert_refused(self, parts, workers=2):
        """The job failed, and every worker that failed failed with the refusal: its log holds every one of ``parts``.
        A worker the launcher stopped while it still traced its step (another worker refused first: a refusal needs
        no collective) has no error in its log; one worker at least refused."""
        assert self.returncode != 0, self.report()
        refused, logs = [], self.logs()
        for index in range(workers):
            name = f"worker-{index}.log"
            text = logs.get(name, "")
            if "Traceback" in text or "Error" in text:
                for part in parts:
                    assert part in text, (name, part, self.report())
                refused.append(name)
        assert refused, self.report()

    def report(self):
        parts = [f"exit code {self.returncode}", "launcher output:", _clean(self.output)]
        for name, text in self.logs().items():
            parts += [f"--- {name} (last 40 lines)", "\n".join(text.splitlines()[-40:])]
        return "\n".join(parts)


def _clean(text):
    return "\n".join(line for line in text.splitlines() if not any(n in line for n in NOISE))


def run_local(command, log_dir, workers=2, ps=1, timeout=240.0, env=None, launcher_args=(), quiet=True):
    """Runs ``kparallax-run --workers W --ps P -- command`` with a hard timeout; returns a RunResult.

    The launcher's own ``--timeout`` stops the tasks and names the ones still running; the subprocess timeout
    (a minute longer) guards against the launcher itself hanging. ``quiet=False``: worker 0's output is in the
    result's output too, as the terminal shows it.
    """
    argv = [sys.executable, "-m", "kparallax.launch", "--workers", str(workers), "--ps", str(ps),
            "--log_dir", log_dir, "--timeout", str(timeout)] + (["--quiet"] if quiet else []) + list(
                launcher_args) + ["--"] + list(command)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 60,
                              env=dict(os.environ, **(env or {})), check=False)
        return RunResult(done.returncode, done.stdout + done.stderr, log_dir)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return RunResult(-1, f"kparallax-run itself did not exit within {timeout + 60:.0f}s\n{out}", log_dir)


def reference_and_job(program, tmp_path, job_args=(), workers=2, ps=1, timeout=240.0, args=()):
    """Runs ``program OUT reference *args`` in one plain process (asserting it succeeds), then ``program OUT kparallax
    *args *job_args`` under ``run_local``, each under ``timeout`` seconds; returns (the reference's OUT, the job's OUT,
    the job's RunResult). Each OUT is a new directory under ``tmp_path``."""
    ref, got = os.path.join(tmp_path, "reference"), os.path.join(tmp_path, "kparallax")
    os.makedirs(ref)
    os.makedirs(got)
    done = subprocess.run([sys.executable, program, ref, "reference", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    run = run_local([sys.executable, program, got, "kparallax", *args, *job_args],
                    log_dir=os.path.join(tmp_path, "logs"), workers=workers, ps=ps, timeout=timeout)
    return ref, got, run


def pid_of_task(log_dir, task_type, task_index=0):
    """PID of the live task ``task_type task_index`` of the run logging to ``log_dir`` (None if not found)."""
    wanted = {f"KPARALLAX_LOG_DIR={log_dir}".encode(), f"KPARALLAX_TASK_TYPE={task_type}".encode(),
              f"KPARALLAX_TASK_INDEX={task_index}".encode()}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = set(f.read().split(b"\0"))
        except OSError:
            continue
        if wanted <= environ:
            return int(pid)
    return None
