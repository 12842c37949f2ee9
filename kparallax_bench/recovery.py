"""Recovery trials: ``kparallax-run --max_restarts`` after a kill -9, against an uninterrupted run, bit for bit.

Each trial trains ``scripts/train_lm1b.py --config=lm1b_tiny --data=synthetic`` on 2 workers + 1 PS under
``--max_restarts 2``, kills the victim (worker 1 or PS 0) with SIGKILL right after the step-``kill_after``
checkpoint is written, and compares the final checkpoint with an uninterrupted run's: every array must be equal
(``np.array_equal``). A trial that does not end within its timeout counts as a hang.

    python -m kparallax_bench.recovery --trials 20 --out docs/benchmarks/recovery.json
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

from kparallax import testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "train_lm1b.py")


def _command(model_dir, steps, every):
    return [sys.executable, SCRIPT, "--config=lm1b_tiny", "--data=synthetic", f"--train_steps={steps}",
            f"--checkpoint_every={every}", f"--model_dir={model_dir}", "--eval=false", "--log_every=10"]


def _launcher(log_dir, max_restarts, timeout):
    return [sys.executable, "-m", "kparallax.launch", "--workers", "2", "--ps", "1", "--quiet", "--log_dir", log_dir,
            "--timeout", str(timeout), "--max_restarts", str(max_restarts), "--"]


def final_state(model_dir):
    """{array name: array} of the latest checkpoint in ``model_dir``."""
    with open(os.path.join(model_dir, "checkpoint.json"), encoding="utf-8") as f:
        latest = json.load(f)["latest"]
    with np.load(os.path.join(model_dir, latest, "state.npz")) as data:
        return {k: data[k] for k in data.files}


def differences(a, b):
    """Names of the arrays that are not bit-identical (or present in one state only)."""
    return sorted(k for k in set(a) | set(b) if k not in a or k not in b or not np.array_equal(a[k], b[k]))


def uninterrupted(workdir, steps=60, every=10, timeout=240):
    """Trains without a failure; returns (exit code, model_dir)."""
    model_dir = os.path.join(workdir, "uninterrupted")
    shutil.rmtree(model_dir, ignore_errors=True)
    done = subprocess.run(_launcher(os.path.join(workdir, "logs_uninterrupted"), 0, timeout)
                          + _command(model_dir, steps, every), capture_output=True, text=True,
                          timeout=timeout + 60, check=False)
    return done.returncode, model_dir


def _pointer_step(model_dir):
    try:
        with open(os.path.join(model_dir, "checkpoint.json"), encoding="utf-8") as f:
            return json.load(f)["step"]
    except (OSError, ValueError, KeyError):
        return -1


def trial(workdir, name, victim, reference, steps=60, every=10, kill_after=20, timeout=240):
    """One kill -9 of ``victim`` ("worker": worker 1, "ps": PS 0) after the ``kill_after`` checkpoint.

    Returns a dict: exit code, whether the launcher restarted, the step resumed from, seconds from the kill to the
    resumed run's first trained step and to the end, the arrays that differ from ``reference`` (a state dict) and
    ``recovered`` (exit 0, one restart, no difference). ``hang`` is set when the run outlived ``timeout``.
    """
    model_dir, log_dir = os.path.join(workdir, name), os.path.join(workdir, f"logs_{name}")
    shutil.rmtree(model_dir, ignore_errors=True)
    shutil.rmtree(log_dir, ignore_errors=True)
    launcher = subprocess.Popen(_launcher(log_dir, 2, timeout) + _command(model_dir, steps, every),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = {"victim": victim, "hang": False}
    deadline = time.monotonic() + timeout
    while _pointer_step(model_dir) < kill_after and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    pid = testing.pid_of_task(log_dir, victim, 0 if victim == "ps" else 1)
    if pid is None or launcher.poll() is not None:
        launcher.kill()
        output = launcher.communicate()[0]
        return {**result, "recovered": False, "error": f"no {victim} to kill at step {kill_after}: {output[-800:]}"}
    result["killed_after_checkpoint"] = _pointer_step(model_dir)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    resumed_at = None
    log0 = os.path.join(log_dir, "worker-0.log")
    while launcher.poll() is None and time.monotonic() < deadline + 60:
        if resumed_at is None and _first_step_after_resume(log0):
            resumed_at = time.monotonic()
        time.sleep(0.05)
    if launcher.poll() is None:
        launcher.kill()
        result["hang"] = True
    output = launcher.communicate()[0]
    ended = time.monotonic()
    resumed = re.search(r"resumed from \S+ \(step (\d+) of", _read(log0))
    result.update(exit_code=launcher.returncode, restarted="restart 1/2 after" in output,
                  resumed_step=int(resumed.group(1)) if resumed else None,
                  seconds_to_resume=round(resumed_at - killed, 2) if resumed_at else None,
                  seconds_to_end=round(ended - killed, 2))
    result["different"] = differences(reference, final_state(model_dir)) if launcher.returncode == 0 else ["<no run>"]
    result["recovered"] = (launcher.returncode == 0 and result["restarted"] and not result["different"]
                           and not result["hang"])
    if not result["recovered"]:
        result["output"] = output[-1500:]
    return result


def _read(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _first_step_after_resume(log_path):
    """Whether the restarted worker 0 has trained past its restored step (its first progress line after it)."""
    text = _read(log_path)
    return "resumed from" in text and bool(re.search(r"resumed from[^\n]*\n(.*\n)*step \d+: loss", text))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20, help="trials per victim")
    parser.add_argument("--victims", default="worker,ps", help="comma-separated: worker, ps")
    parser.add_argument("--workdir", default="/tmp/kparallax_recovery")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    victims = args.victims.split(",")
    if args.trials < 1 or any(v not in ("worker", "ps") for v in victims):
        parser.error(f"--trials must be >= 1 and --victims a list of worker, ps. Received: --trials={args.trials} "
                     f"--victims={args.victims}.")
    os.makedirs(args.workdir, exist_ok=True)
    code, model_dir = uninterrupted(args.workdir)
    if code != 0:
        sys.exit(f"the uninterrupted reference run failed with exit code {code}; see {args.workdir}")
    reference = final_state(model_dir)
    trials = []
    for t in range(args.trials):
        for victim in victims:  # alternating
            r = trial(args.workdir, f"{victim}-{t}", victim, reference)
            trials.append(r)
            print(f"trial {t} {victim}: recovered={r['recovered']} resumed_step={r.get('resumed_step')} "
                  f"to_resume={r.get('seconds_to_resume')}s to_end={r.get('seconds_to_end')}s", flush=True)
    summary = {}
    for victim in victims:
        mine = [r for r in trials if r["victim"] == victim]
        times = sorted(r["seconds_to_resume"] for r in mine if r.get("seconds_to_resume") is not None)
        summary[victim] = {"trials": len(mine), "recovered_bit_identical": sum(r["recovered"] for r in mine),
                           "hangs": sum(r["hang"] for r in mine),
                           "median_seconds_to_resume": times[len(times) // 2] if times else None,
                           "max_seconds_to_resume": times[-1] if times else None}
    print(json.dumps(summary, indent=2))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"summary": summary, "trials": trials}, f, indent=2)
    return 0 if all(s["recovered_bit_identical"] == s["trials"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
