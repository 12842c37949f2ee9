"""Checkpoint and resume: a run killed mid-way (SIGKILL to a worker) resumes to the same weights as an unbroken
run, also on a different PS / partition count; atomic writes; clear errors for mismatches."""

import json
import os
import sys

import numpy as np
import pytest

from kparallax import checkpoint
from kparallax import testing
from kparallax_bench import recovery

PROGRAMS = os.path.join(os.path.dirname(__file__), "programs")
RESUME = os.path.join(PROGRAMS, "train_resume.py")
LM1B = os.path.join(os.path.dirname(__file__), "..", "scripts", "train_lm1b.py")
RTOL, ATOL = 1e-5, 1e-6


def _run(tmp_path, name, ps, out, model_dir, total, kill_at=None, launcher_args=(), always=False):
    argv = [sys.executable, RESUME, str(out), str(model_dir), str(total)] + ([str(kill_at)] if kill_at else [])
    argv += ["always"] if always else []
    return testing.run_local(argv, log_dir=str(tmp_path / f"logs_{name}"), workers=2, ps=ps, timeout=300,
                             launcher_args=launcher_args)


@pytest.mark.multiprocess
def test_killed_run_resumes_to_the_same_weights_even_with_other_ps_and_partitions(tmp_path):
    a_out, b_out, c_out = (tmp_path / n for n in ("a", "b", "c"))
    for d in (a_out, b_out, c_out):
        d.mkdir()
    unbroken = _run(tmp_path, "a", 2, a_out, tmp_path / "ckpt_a", 20)
    assert unbroken.returncode == 0, unbroken.report()
    killed = _run(tmp_path, "b1", 2, b_out, tmp_path / "ckpt_b", 20, kill_at=12)
    assert killed.returncode == 137 and "worker 1 failed with exit code -9" in killed.output, killed.report()
    assert checkpoint.latest(str(tmp_path / "ckpt_b")).endswith("ckpt-10")
    shutil_copy(tmp_path / "ckpt_b", tmp_path / "ckpt_c")
    resumed = _run(tmp_path, "b2", 2, b_out, tmp_path / "ckpt_b", 20)
    assert resumed.returncode == 0 and "resumed from step 10" in resumed.logs()["worker-0.log"], resumed.report()
    other = _run(tmp_path, "c", 1, c_out, tmp_path / "ckpt_c", 20)  # 1 PS task, unpartitioned table now
    assert other.returncode == 0 and "resumed from step 10" in other.logs()["worker-0.log"], other.report()
    # kparallax-run --max_restarts: the same kill, and the launcher restarts the group, which resumes by itself.
    d_out = tmp_path / "d"
    d_out.mkdir()
    restarted = _run(tmp_path, "d", 2, d_out, tmp_path / "ckpt_d", 20, kill_at=12, launcher_args=["--max_restarts", "2"])
    assert restarted.returncode == 0, restarted.report()
    assert "restart 1/2 after worker 1 failed with exit code -9" in restarted.output, restarted.report()
    assert "resumed from step 10" in restarted.logs()["worker-0.log"], restarted.report()
    assert (tmp_path / "logs_d" / "attempt-1" / "worker-1.log").exists()
    a = np.load(a_out / "final.npz")
    for got in (np.load(b_out / "final.npz"), np.load(c_out / "final.npz"), np.load(d_out / "final.npz")):
        assert int(got["iterations"]) == int(a["iterations"]) == 20
        for key in [k for k in a.files if k.startswith("arr_")]:
            np.testing.assert_allclose(got[key], a[key], rtol=RTOL, atol=ATOL, err_msg=key)


@pytest.mark.multiprocess
def test_a_crash_loop_ends_after_max_restarts_with_the_last_failure(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run = _run(tmp_path, "loop", 1, out, tmp_path / "ckpt", 20, kill_at=7, launcher_args=["--max_restarts", "1"],
               always=True)
    assert run.returncode == 137, run.report()
    assert "restart 1/1 after worker 1 failed with exit code -9" in run.output, run.report()
    assert "worker 1 failed with exit code -9 (after 1 restart(s)); stopped all tasks." in run.output, run.report()


def shutil_copy(src, dst):
    import shutil  # pylint: disable=import-outside-toplevel
    shutil.copytree(src, dst)


def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path):
    (tmp_path / "ckpt-10").mkdir()
    (tmp_path / "ckpt-10" / "meta.json").write_text("{}")
    (tmp_path / "checkpoint.json").write_text(json.dumps({"latest": "ckpt-10", "step": 10}))
    partial = tmp_path / ".ckpt-15.tmp-4242"   # what a save killed before its rename leaves behind
    partial.mkdir()
    (partial / "state.npz").write_bytes(b"PK\x03\x04 truncated")
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "ckpt-10")
    (tmp_path / "checkpoint.json").write_text(json.dumps({"latest": "ckpt-99", "step": 99}))
    with pytest.raises(ValueError, match=r"points at ckpt-99, which is incomplete or missing"):
        checkpoint.latest(str(tmp_path))


@pytest.mark.multiprocess
def test_lm1b_script_resumes_from_its_model_dir(tmp_path):
    common = [sys.executable, LM1B, "--config=lm1b_tiny", "--data=synthetic", "--synthetic_windows=512",
              f"--model_dir={tmp_path}", "--checkpoint_every=10", "--log_every=10", "--eval=false"]
    first = testing.run_local(common + ["--train_steps=20"], log_dir=str(tmp_path / "l1"), workers=2, ps=1,
                              timeout=300)
    assert first.returncode == 0, first.report()
    assert json.loads((tmp_path / "checkpoint.json").read_text())["step"] == 20
    second = testing.run_local(common + ["--train_steps=30"], log_dir=str(tmp_path / "l2"), workers=2, ps=1,
                               timeout=300)
    assert second.returncode == 0, second.report()
    log = second.logs()["worker-0.log"]
    assert "(step 20 of 30)" in log and "step 30: loss" in log and "step 20: loss" not in log  # 10 more steps
    assert json.loads((tmp_path / "checkpoint.json").read_text())["step"] == 30
    mismatch = testing.run_local([sys.executable, LM1B, "--config=lm1b_small", "--data=synthetic",
                                  "--synthetic_windows=64", f"--model_dir={tmp_path}", "--train_steps=1"],
                                 log_dir=str(tmp_path / "l3"), workers=2, ps=1, timeout=300)
    assert mismatch.returncode != 0
    assert "has shape" in mismatch.output and "another vocabulary or model size" in mismatch.output
    assert "Traceback" not in mismatch.logs()["worker-0.log"]


@pytest.fixture(scope="module")
def uninterrupted_lm1b(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("recovery"))
    code, model_dir = recovery.uninterrupted(workdir)
    assert code == 0, f"the uninterrupted run failed ({code}); logs in {workdir}"
    return workdir, recovery.final_state(model_dir)


@pytest.mark.multiprocess
@pytest.mark.parametrize("victim", ["worker", "ps"])
def test_max_restarts_after_kill_9_ends_bit_identical_to_the_uninterrupted_run(victim, uninterrupted_lm1b):
    """Issue 15's trial (README: 20 of each): train_lm1b lm1b_tiny, 60 steps, checkpoints every 10, kill -9 of
    worker 1 / PS 0 after the step-20 checkpoint under --max_restarts 2: the final checkpoint equals the
    uninterrupted run's bit for bit (weights, both optimizers' state, metric states)."""
    workdir, reference = uninterrupted_lm1b
    assert "metric_states" in reference and "table_optimizer_0_0" in reference
    result = recovery.trial(workdir, victim, victim, reference)
    assert not result["hang"], result
    assert result["exit_code"] == 0 and result["restarted"], result
    assert result["resumed_step"] >= 20 and result["different"] == [], result
