"""Tier 3: kparallax-run with real PS tasks and Horovod workers; failures are fast and name the task."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from kparallax import testing
from kparallax.cluster import net
from kparallax.cluster import spec as spec_lib
from kparallax.launch import tasks as tasks_lib

PROGRAMS = os.path.join(os.path.dirname(__file__), "programs")


def _processes_of_run(log_dir):
    """PIDs of live processes started for the run whose logs are in ``log_dir``."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"KPARALLAX_LOG_DIR={log_dir}".encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


@pytest.mark.multiprocess
def test_successful_run_stops_ps_and_exits_zero(tmp_path):
    run = testing.run_local([sys.executable, os.path.join(PROGRAMS, "worker_behaviour.py"), "ok"],
                            log_dir=str(tmp_path), workers=2, ps=1, timeout=120)
    assert run.returncode == 0, run.report()
    logs = run.logs()
    assert "worker 0 of 2 ok" in logs["worker-0.log"] and "worker 1 of 2 ok" in logs["worker-1.log"]
    assert "stopping" in logs["ps-0.log"]
    assert os.path.exists(tmp_path / "cluster.json")
    assert _processes_of_run(str(tmp_path)) == []


@pytest.mark.multiprocess
def test_failing_worker_ends_the_run_with_its_code(tmp_path):
    start = time.monotonic()
    run = testing.run_local([sys.executable, os.path.join(PROGRAMS, "worker_behaviour.py"), "fail_rank1"],
                            log_dir=str(tmp_path), workers=2, ps=1, timeout=120)
    assert run.returncode == 3, run.report()
    assert "worker 1 failed with exit code 3" in run.output
    assert "worker 1 failing on purpose" in run.output  # the failing task's log tail is shown
    assert time.monotonic() - start < 60
    assert _processes_of_run(str(tmp_path)) == []


@pytest.mark.multiprocess
def test_the_worker_whose_error_stopped_the_run_is_named_not_the_one_left_waiting(tmp_path):
    """Worker 1's batch holds an id past a striped table: its error (the id and the table's rows, as one process
    names them) is the cause the launcher names, though worker 0, whose collective Horovod shut down, often exits
    first; worker 0 says in one line why it stopped."""
    run = testing.run_local([sys.executable, os.path.join(PROGRAMS, "worker_behaviour.py"), "bad_id_rank1"],
                            log_dir=str(tmp_path), workers=2, ps=1, timeout=120, quiet=False)
    assert run.returncode == 1, run.report()
    assert "worker 1 failed with exit code 1" in run.output, run.report()
    assert ("ValueError: The input holds id 70, outside an embedding table of 60 rows" in run.output.split(
        "worker 1's log")[-1]), run.report()
    assert "RuntimeError: This worker stopped because another worker failed" in run.logs()["worker-0.log"]
    assert "Graph execution error" not in run.logs()["worker-0.log"], run.report()
    # The terminal shows worker 0's one line, not TensorFlow's C++ warnings of its ended Horovod ops (in its log).
    terminal = run.output.split("kparallax-run: worker 1 failed")[0]
    assert "[worker 0] RuntimeError: This worker stopped because another worker failed" in terminal, run.report()
    assert "OP_REQUIRES failed" not in terminal, run.report()


def test_the_terminal_shows_a_tasks_output_without_kparallax_info_and_tensorflows_horovod_shutdown_warnings(
        tmp_path, capfdbinary):
    lines = ["Epoch 1/2", "INFO:kparallax:placement: embedding/embeddings [60, 4] -> ps[0]",
             "2026-11-27 08:43:51.174192: W tensorflow/core/framework/op_kernel.cc:1839] OP_REQUIRES failed at "
             "mpi_ops.cc:515 : UNKNOWN: Horovod has been shut down. This was caused by an exception on one of the "
             "ranks",
             "2026-11-27 08:43:51.2: W tensorflow/core/framework/op_kernel.cc:1839] OP_REQUIRES failed at "
             "gather_op.cc:90 : INVALID_ARGUMENT: indices[3] = 70 is not in [0, 60)",
             "RuntimeError: This worker stopped because another worker failed (Horovod has been shut down).",
             "INFO:kparallax:no newline at the end"]
    program = f"import sys; sys.stdout.write({chr(10).join(lines)!r})"
    task = tasks_lib.spawn("worker", 0, [sys.executable, "-c", program], dict(os.environ), str(tmp_path), echo=True)
    assert task.process.wait(timeout=60) == 0
    task.log_complete(30)
    shown = capfdbinary.readouterr().out.decode().splitlines()
    assert shown == [f"[worker 0] {line}" for line in (lines[0], lines[3], lines[4])], shown
    with open(task.log_path, encoding="utf-8") as f:
        assert f.read() == "\n".join(lines)  # the log keeps every line


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode, ps, where, message", [
    # the copy's table took the name the others gave the model they train: worker 1 joined it (initialized), silently
    ("chief_only_model", 1, "worker-0.log", "The workers' models do not hold the same PS variables, so each would "
     "train its own: PS variable #0 of 'sequential' is 'embedding/embeddings' (embedding/embeddings_2@ps[0]"),
    # the copy's stripes moved worker 0's later ones to other PS tasks: worker 1 waited for them (300 s, then an
    # error blaming worker 0's model)
    ("chief_only_model_placed", 2, "worker-1.log", "Shared variable 'embedding_1/embeddings/part_0_of_3' is on ps[1] "
     "on this worker, but the chief (worker 0) put it on ps[0]"),
])
def test_a_model_built_inside_the_scope_on_worker_0_only_is_named_with_the_fix(tmp_path, mode, ps, where, message):
    run = testing.run_local([sys.executable, os.path.join(PROGRAMS, "worker_behaviour.py"), mode],
                            log_dir=str(tmp_path), workers=2, ps=ps, timeout=120)
    assert run.returncode != 0, run.report()
    assert message in run.logs()[where], run.report()
    assert "built inside strategy.scope() on some workers only" in run.logs()[where], run.report()


@pytest.mark.multiprocess
def test_variables_made_before_the_strategy_are_refused_with_the_fix(tmp_path):
    """TensorFlow cannot use them once the process connects to the PS tasks (before: compile failed with
    'Client for target /job:localhost/replica:0/task:0 not found', or a later call did)."""
    run = testing.run_local([sys.executable, os.path.join(PROGRAMS, "worker_behaviour.py"), "made_before"],
                            log_dir=str(tmp_path), workers=2, ps=1, timeout=120)
    assert run.returncode == 2, run.report()
    found = re.search(r"kparallax error: Create kp.HybridStrategy\(\) before any TensorFlow variable or resource.*"
                      r"Received: [0-9]+ created before the strategy: (.*)\. Create the strategy first", run.output)
    assert found, run.report()
    assert set(found.group(1).split(", ")[:3]) == {"variable 'iteration'", "variable 'learning_rate'",
                                                   "resource StaticHashTable"}, run.report()


@pytest.mark.multiprocess
def test_two_workers_with_the_same_index(tmp_path):
    run = testing.run_local([sys.executable, os.path.join(PROGRAMS, "worker_behaviour.py"), "same_index"],
                            log_dir=str(tmp_path), workers=2, ps=1, timeout=120)
    assert run.returncode == 2, run.report()
    assert "two workers end up with the same index" in run.output and "HOROVOD_RANK=1" in run.output, run.report()


@pytest.mark.multiprocess
def test_unreachable_ps_fails_within_30s_naming_the_address():
    port = net.free_port()  # nothing listens there
    env = dict(os.environ, KPARALLAX_PS_HOSTS=f"127.0.0.1:{port}", KPARALLAX_WORKER_HOSTS="127.0.0.1:1",
               KPARALLAX_TASK_INDEX="0")
    start = time.monotonic()
    done = subprocess.run([sys.executable, os.path.join(PROGRAMS, "worker_behaviour.py"), "ok"], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    elapsed = time.monotonic() - start
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"Parameter server ps[0] at 127.0.0.1:{port} is not reachable after 30 s" in done.stderr
    assert elapsed < 45  # 30 s budget plus interpreter and TensorFlow start-up


def test_launcher_rejects_bad_flags(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "not_a_program").write_bytes(b"\x00\x01 not a program\n")
    (tmp_path / "not_a_program").chmod(0o755)
    logs = tmp_path / "logs"
    for argv, message in ((["--workers", "0", "--", "true"], "--workers must be >= 1. Received: --workers=0"),
                          (["--workers", "2"], "no training command"),
                          (["--log_dir", f"{tmp_path}/file/logs", "--", "true"],
                           f"cannot write the tasks' logs to {tmp_path}/file/logs (Not a directory). Pass --log_dir "
                           f"a directory this user can create and write. Received: --log_dir={tmp_path}/file/logs."),
                          (["--", "/nonexistent/train", "x"], "cannot start the training command: '/nonexistent/train' "
                           "is not an executable file. Give its path or a program on PATH (e.g. python train.py). "
                           "Received: /nonexistent/train x."),
                          (["--", "kparallax-no-such-program"], "'kparallax-no-such-program' is not on PATH"),
                          (["--ps", "1", "--log_dir", str(logs), "--", str(tmp_path / "not_a_program")],
                           "cannot start worker 0: Exec format error. Received: ")):
        done = subprocess.run([sys.executable, "-m", "kparallax.launch"] + argv, capture_output=True, text=True,
                              timeout=60, check=False)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
    # The PS task started before the worker could not start was stopped with the launcher (before: a traceback).
    assert (logs / "ps-0.log").exists() and not _processes_with(f"{spec_lib.ENV_LOG_DIR}={logs}".encode())


def _processes_with(environment_entry):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if environment_entry in f.read().split(b"\0"):
                    found.append(pid)
        except OSError:
            pass
    return found


def _start_long_run(tmp_path, *extra):
    demo = os.path.join(os.path.dirname(__file__), "..", "examples", "demo.py")
    launcher = subprocess.Popen([sys.executable, "-m", "kparallax.launch", "--workers", "2", "--ps", "1", "--quiet",
                                 "--log_dir", str(tmp_path), "--timeout", "240", *extra, "--", sys.executable, demo,
                                 "--epochs", "50"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = tmp_path / "worker-0.log"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "Epoch 2/" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.5)
    return launcher


@pytest.mark.multiprocess
@pytest.mark.parametrize("victim", ["ps", "worker"])
def test_kill_9_ends_the_run_within_60s_naming_the_lost_task(victim, tmp_path, failure_trials):
    """Repeated trials (pytest --failure-trials N; CI runs 2): never a hang, always the task's name."""
    for trial in range(failure_trials):
        log_dir = tmp_path / f"trial{trial}"
        launcher = _start_long_run(log_dir)
        pid = testing.pid_of_task(str(log_dir), victim, 0 if victim == "ps" else 1)
        assert pid, f"trial {trial}: {victim} task not found"
        if victim == "ps" and trial == 0:
            port = json.loads((log_dir / "cluster.json").read_text())["ps"][0].rsplit(":", 1)[1]
            listening = [line.split()[3] for line in subprocess.run(["ss", "-Hltn"], capture_output=True, text=True,
                                                                       check=True).stdout.splitlines()]
            mine = [address for address in listening if address.endswith(f":{port}")]
            assert mine and all("127.0.0.1" in a for a in mine), f"PS must listen on 127.0.0.1 only: {mine}"
        os.kill(pid, 9)
        killed = time.monotonic()
        try:
            output, _ = launcher.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            launcher.kill()
            raise AssertionError(f"trial {trial}: the run did not end within 60 s of kill -9 {victim}") from None
        assert time.monotonic() - killed < 60
        expected = "ps 0 exited unexpectedly with code -9" if victim == "ps" else "worker 1 failed with exit code -9"
        assert launcher.returncode != 0 and expected in output, f"trial {trial}: {output[-2000:]}"
        assert _processes_of_run(str(log_dir)) == []


@pytest.mark.multiprocess
def test_a_stopped_worker_is_reported_within_the_stall_timeout(tmp_path):
    launcher = _start_long_run(tmp_path, "--stall_timeout", "10")
    pid = testing.pid_of_task(str(tmp_path), "worker", 1)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        output, _ = launcher.communicate(timeout=90)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert time.monotonic() - stopped < 60
    assert launcher.returncode != 0
    assert "workers' progress when the run stopped" in output
    assert "worker 1: " in output and "(stopped: SIGSTOP?)" in output.split("worker 1: ")[1].splitlines()[0], output
    assert _processes_of_run(str(tmp_path)) == []


@pytest.mark.multiprocess
def test_a_step_blocked_inside_a_worker_is_reported_within_the_stall_timeout(tmp_path):
    """The worker process runs on (not stopped, not dead): only the progress files show that no step finishes."""
    start = time.monotonic()
    run = testing.run_local([sys.executable, os.path.join(PROGRAMS, "blocked_step.py")], log_dir=str(tmp_path),
                            workers=2, ps=1, timeout=200, launcher_args=["--stall_timeout", "12"])
    assert time.monotonic() - start < 150, run.report()
    assert run.returncode != 0, run.report()
    assert "made no progress for --stall_timeout=12s" in run.output, run.report()
    lines = {line.split(":")[0].strip(): line for line in run.output.splitlines() if "step(s) finished" in line}
    assert "3 step(s) finished" in lines["worker 0"] and "3 step(s) finished" in lines["worker 1"], run.output
    assert str(tmp_path / "worker-1.log") in lines["worker 1"], run.output
    assert _processes_of_run(str(tmp_path)) == []


@pytest.mark.multiprocess
def test_a_cluster_file_of_this_host_only_starts_it_without_ssh(tmp_path):
    """horovodrun starts local hosts directly; so does kparallax-run (an `ssh` on the PATH that fails proves it)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ssh").write_text("#!/bin/sh\necho 'ssh was called' >&2\nexit 255\n")
    (fake / "ssh").chmod(0o755)
    cluster = tmp_path / "c.yaml"
    cluster.write_text(f"rendezvous_port: {net.free_port()}\n"
                       "hosts:\n  - {host: 127.0.0.1, workers: 2, ps: 1}\n")
    done = subprocess.run([sys.executable, "-m", "kparallax.launch", "--cluster", str(cluster), "--log_dir",
                           str(tmp_path / "logs"), "--timeout", "120", "--", sys.executable,
                           os.path.join(PROGRAMS, "worker_behaviour.py"), "ok"],
                          capture_output=True, text=True, timeout=180, check=False,
                          env=dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "ssh was called" not in done.stdout + done.stderr
    assert "worker 0 of 2 ok" in done.stdout, done.stdout[-2000:]


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode, message", [
    ("compile_outside", ("refused: Model 'sequential' was compiled outside HybridStrategy.scope() in a job of 2 "
                         "workers: each worker would train its own copy alone. Received: fit()",
                         "Received: train_on_batch() of a model compiled outside the scope")),
    ("custom_loop", tuple(f"refused ({what}, {how}): {name}.apply_gradients was called outside kparallax's training "
                          f"step in a job of 2 workers: {why}"
                          for what, name, why in (("own", "SGD", "each worker would update its own copy"),
                                                  ("compiled", "Adam", "its gradients would be averaged, but"))
                          for how in ("eager", "tf.function"))),
    ("async_two_optimizers", ("refused: A second optimizer (SGD) in an asynchronous training step (sync=False) is "
                              "not supported: each worker would update its own copy of its variables alone",
                              "Received: SGD.apply_gradients in the train_step of a model trained with sync=False in "
                              "a job of 2 workers.")),
    ("virtual_batch", "refused: BatchNormalization layer 'vbn' is synchronized and normalizes sub-batches of 2 rows"),
    ("autotuned_steps", ("refused at compile: steps_per_execution='auto' is not supported on several workers (2 "
                         "here)", "Received: steps_per_execution='auto'", "a number: trained",
                         "refused at fit: steps_per_execution='auto' is not supported",
                         "Received: model.autotune_steps_per_execution=True")),
    ("shuffle_seeds", ("refused: The workers shuffle the dataset with different seeds, so each keeps its batches of "
                       "its own order", "Received: first shuffle seeds per worker [[", "100], [", "101]]",
                       "one seed: trained")),
    ("unaggregated_state", ("refused: Variable(s) ['running/moving:0'] changed differently on the workers in the "
                            "first training step", "aggregation=tf.VariableAggregation.MEAN",
                            "refused after 0 train_on_batch call(s) (built before): Variable(s) "
                            "['running/moving:0'] changed differently", "refused after 0 train_on_batch call(s) "
                            "(built by its first call): Variable(s) ['running/moving:0'] changed differently")),
    ("manual_update", ("refused: Trainable variable(s) ['out/kernel:0', 'out/bias:0'] differ between the workers "
                       "after the first training step: the step changed them by other means than the optimizer",
                       "Apply the gradients with an optimizer (self.optimizer.apply_gradients")),
    ("ps_write_unseen", ("refused: A PS variable is written during fit (assign of 'embedding/embeddings:0', in "
                         "callback hook 'batch_end') where the workers do not meet next",
                         "Received: assign of 'embedding/embeddings:0' in callback hook 'batch_end'.")),
])
def test_training_outside_the_strategy_is_refused_in_a_multi_worker_job(tmp_path, mode, message):
    """fit and train_on_batch of a model compiled outside the scope, and a custom training loop's optimizer: each
    worker would train its own copy alone (the loop's own optimizer), or drift from one process without the rest of
    kparallax's step; eager and traced, refused before any weight changes. A synchronized BatchNormalization with
    virtual_batch_size would normalize sub-batches one process never forms. A layer's running statistic assigned in
    the step without an aggregation would move its own way on each worker (its 'calls' counter, the same on every
    worker, is not named), in fit and in a train_on_batch loop after its first call (also for a model built by that
    call). Weights a custom train_step updates by hand (no optimizer) would each take its worker's own gradient. A
    custom train_step's second optimizer under sync=False would update each worker's copy of its variables alone. A
    callback writing a PS table through a function defined elsewhere (its hook's code names no write, so the workers
    do not meet after it) would let worker 1's next step read the table before worker 0's write."""
    run = testing.run_local([sys.executable, os.path.join(PROGRAMS, "worker_behaviour.py"), mode],
                            log_dir=str(tmp_path), workers=2, ps=1, timeout=120)
    assert run.returncode == 0, run.report()
    for name in ("worker-0.log", "worker-1.log"):
        for part in (message,) if isinstance(message, str) else message:
            assert part in run.logs()[name], run.report()


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode, means", [("batch_norm_global", ("3.5000", "3.5000")),
                                         ("batch_norm_per_worker", ("1.5000", "5.5000"))])
def test_batch_normalization_statistics_span_the_workers_when_synchronized(tmp_path, mode, means):
    """Worker 0's batch has mean 1.5, worker 1's mean 5.5: the global batch's mean, 3.5, with Keras'
    synchronized=True (one process on the global batch); each worker's own by default (as under Horovod and
    tf.distribute)."""
    run = testing.run_local([sys.executable, os.path.join(PROGRAMS, "worker_behaviour.py"), mode],
                            log_dir=str(tmp_path), workers=2, ps=1, timeout=120)
    assert run.returncode == 0, run.report()
    for name, mean in zip(("worker-0.log", "worker-1.log"), means):
        assert f"moving mean {mean}" in run.logs()[name], run.report()


@pytest.mark.multiprocess
def test_workers_draw_their_own_dropout_masks_under_one_global_seed(tmp_path):
    """Every worker sets the same global seed: each still draws its own dropout masks and RandomFlip flips for its
    rows (one process draws independent values for the rows of its global batch; before, both workers drew the
    same), and a second run draws the same values again."""
    masks, flips = [], []
    for run_index in range(2):
        run = testing.run_local([sys.executable, os.path.join(PROGRAMS, "worker_behaviour.py"), "dropout_masks"],
                                log_dir=str(tmp_path / str(run_index)), workers=2, ps=1, timeout=120)
        assert run.returncode == 0, run.report()
        found = [re.search(r"dropout mask ([01]{32})", run.logs()[f"worker-{i}.log"]) for i in range(2)]
        assert all(found), run.report()
        masks.append([m.group(1) for m in found])
        flips.append([re.search(r"flipped rows ([01]{4})", run.logs()[f"worker-{i}.log"]).group(1) for i in range(2)])
    assert masks[0][0] != masks[0][1], masks
    assert all(0 < mask.count("1") < 32 for mask in masks[0]), masks
    assert masks[1] == masks[0], masks
    # 4 rows: the two workers' flips could coincide by chance with probability 1/16; with this seed they do not
    assert flips[0][0] != flips[0][1] and flips[1] == flips[0], flips


@pytest.mark.multiprocess
def test_a_script_training_several_models_starts_each_from_worker_0s_weights_quietly(tmp_path):
    """Eight models trained one after another in one script: each fit starts from worker 0's replicated weights (the
    workers end with equal weights), and no function of kparallax's is retraced (Horovod's broadcast_variables
    traced one per model: TensorFlow's retracing warnings on the terminal, beside Keras' own for its train
    functions)."""
    run = testing.run_local([sys.executable, os.path.join(PROGRAMS, "worker_behaviour.py"), "several_models"],
                            log_dir=str(tmp_path), workers=2, ps=1, timeout=120)
    assert run.returncode == 0, run.report()
    sums = [re.findall(r"model \d weights sum \S+", run.logs()[f"worker-{i}.log"]) for i in range(2)]
    assert len(sums[0]) == 8 and sums[1] == sums[0], run.report()
    # Keras warns about its own train functions retracing, as in one process; nothing else may retrace.
    with open(tmp_path / "worker-0.log", encoding="utf-8") as f:
        retraced = set(re.findall(r"calls to <function (\S+) at", f.read()))
    assert retraced <= {"Model.make_train_function.<locals>.train_function"}, retraced


@pytest.mark.multiprocess
def test_models_built_by_their_first_call_compile_train_and_show_their_placement(tmp_path):
    """A Sequential model without an input shape compiles inside and outside the scope (before: Keras' 'Weights for
    model ... have not yet been created' at compile, a regression of 2026-11-25), and worker 0's terminal shows
    where a model's variables live once its first step has built it, with the table on the PS (a model announced
    at fit's start had none yet)."""
    run = testing.run_local([sys.executable, os.path.join(PROGRAMS, "worker_behaviour.py"), "built_by_first_call"],
                            log_dir=str(tmp_path), workers=2, ps=1, timeout=120, quiet=False)
    assert run.returncode == 0, run.report()
    assert "outside the scope: loss " in run.output, run.report()
    shown = re.findall(r"kparallax: 2 worker\(s\), 1 PS task\(s\), architecture hybrid; on PS: (.*); (\d+) replicated "
                       r"variable\(s\)", run.output)
    assert shown == [("nothing", "4"), ("pooled/table/embeddings -> ps[0] (640 B)", "2")], run.report()


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["skew_steps", "skew_steps_async"])
def test_workers_whose_optimizers_are_at_different_steps_stop_with_an_error(tmp_path, mode):
    """Synchronous training checks in every step; asynchronous training (no per-step collective of logs) at the
    epoch's end. The same check (``collectives.sum_checked``) and message either way."""
    run = testing.run_local([sys.executable, os.path.join(PROGRAMS, "worker_behaviour.py"), mode],
                            log_dir=str(tmp_path), workers=2, ps=1, timeout=120)
    assert run.returncode != 0, run.report()
    assert "The workers' optimizers are at different steps" in run.output, run.report()
    assert "Received: iterations=" in run.output, run.report()
