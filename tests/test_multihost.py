"""Multi-host runs for real on one machine: two network namespaces are two hosts (per-host and ssh modes),
TF_CONFIG jobs without the launcher, and failure propagation across hosts."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kparallax import testing
from kparallax.cluster import net

from netns import ADDRESSES, NetnsPair

PROGRAMS = os.path.join(os.path.dirname(__file__), "programs")
from programs import equivalence_common as common

RTOL, ATOL = 1e-5, 1e-6
NAMES = ("adam", "momentum")
CLUSTER = f"""
hosts:
  - host: {ADDRESSES[0]}
    workers: 1
    ps: 1
  - host: {ADDRESSES[1]}
    workers: 1
"""
LAUNCH = [sys.executable, "-m", "kparallax.launch"]


@pytest.fixture(scope="module")
def hosts():
    pair = NetnsPair()
    reason = pair.up()
    if reason:
        pytest.skip(f"multi-host tests need network namespaces: {reason}")
    yield pair
    pair.down()


def _train_reference(out, names, env=None):
    """The single plain-Keras process on the concatenated batch (``KP_EQUIVALENCE_WORKERS`` in ``env`` sets N)."""
    done = subprocess.run([sys.executable, os.path.join(PROGRAMS, "train_reference.py"), str(out), ",".join(names)],
                          capture_output=True, text=True, timeout=300, check=False, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _train_reference(tmp_path_factory.mktemp("reference"), NAMES)


def _cluster_file(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER)
    return str(path)


def _start_hosts(hosts, cluster, tmp_path, args, order=(1, 0), env=None):
    """One per-host launcher in each namespace (``--cluster``, ``--host-index``, ``--log_dir tmp_path/host<i>``, then
    ``args``), started in ``order``."""
    return [subprocess.Popen(hosts.command(i, LAUNCH + ["--cluster", str(cluster), "--host-index", str(i),
                                                       "--log_dir", str(tmp_path / f"host{i}")] + args),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            for i in order]


def _assert_matches_reference(out, reference, names=NAMES):
    for name in names:
        got, ref = np.load(out / f"{name}.npz"), np.load(reference / f"{name}.npz")
        for key in [k for k in ref.files if k.startswith("arr_")]:
            np.testing.assert_allclose(got[key], ref[key], rtol=RTOL, atol=ATOL, err_msg=f"{name} {key}")


def _wait_all(processes, timeout):
    deadline = time.monotonic() + timeout
    outputs = []
    for p in processes:
        try:
            out, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in processes:
                q.kill()
            raise AssertionError("a launcher did not exit in time: " + " | ".join(
                (q.communicate()[0] or "")[-2000:] for q in processes)) from None
        outputs.append(out)
    return outputs


@pytest.mark.multiprocess
def test_per_host_mode_two_hosts_matches_single_process(hosts, reference, tmp_path):
    cluster, out = _cluster_file(tmp_path), tmp_path / "out"
    out.mkdir()
    train = ["--", sys.executable, os.path.join(PROGRAMS, "train_kparallax.py"), str(out), ",".join(NAMES)]
    launchers = _start_hosts(hosts, cluster, tmp_path, ["--timeout", "240"] + train)
    outputs = _wait_all(launchers, 300)
    assert [p.returncode for p in launchers] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    _assert_matches_reference(out, reference)
    assert "[worker 0] adam: trained 12 steps" in outputs[1]
    resolved = json.loads((tmp_path / "host0" / "cluster.json").read_text())
    assert resolved["ps"] == [f"{ADDRESSES[0]}:2222"] and resolved["coordinator"] == f"{ADDRESSES[0]}:29400"
    assert (tmp_path / "host1" / "worker-1.log").exists() and (tmp_path / "host0" / "ps-0.log").exists()


@pytest.mark.multiprocess
def test_two_workers_per_host_aggregate_per_host_and_match_single_process(hosts, tmp_path):
    """2 hosts x 2 workers, a PS on each host: local aggregation (on by default across hosts) sums each host's
    sparse gradients in that host's Horovod process set (registered at start-up) and pushes once per host."""
    env = dict(os.environ, KP_EQUIVALENCE_WORKERS="4")
    reference, out = tmp_path / "reference", tmp_path / "out"
    reference.mkdir()
    out.mkdir()
    _train_reference(reference, ("adam",), env)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER.replace("workers: 1", "workers: 2") + "    ps: 1\n")
    train = ["--", sys.executable, os.path.join(PROGRAMS, "train_kparallax.py"), str(out), "adam"]
    launchers = _start_hosts(hosts, cluster, tmp_path, ["--timeout", "300"] + train, env=env)
    outputs = _wait_all(launchers, 360)
    assert [p.returncode for p in launchers] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    _assert_matches_reference(out, reference, names=("adam",))
    info = json.loads((out / "adam.json").read_text())
    assert info["push_counts"] == {"adam_embedding/embeddings": 2 * common.STEPS}, info  # 2 hosts, not 4 workers


@pytest.mark.multiprocess
def test_ssh_mode_starts_every_host_and_forwards_env(hosts, reference, tmp_path):
    cluster, out = _cluster_file(tmp_path), tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PATH=os.path.join(PROGRAMS, "fake_ssh") + os.pathsep + os.environ["PATH"],
               KP_FAKE_SSH_NETNS=f"{ADDRESSES[0]}={hosts.names[0]},{ADDRESSES[1]}={hosts.names[1]}",
               KP_TEST_FORWARDED="from-the-launching-host")
    done = subprocess.run(LAUNCH + ["--cluster", cluster, "-x", "KP_TEST_FORWARDED", "--ssh-port", "22",
                                    "--log_dir", str(tmp_path / "logs"), "--timeout", "240", "--",
                                    sys.executable, os.path.join(PROGRAMS, "train_kparallax.py"), str(out),
                                    ",".join(NAMES)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _assert_matches_reference(out, reference)
    assert json.loads((out / "adam.json").read_text())["forwarded"] == "from-the-launching-host"
    assert "[worker 0] momentum: trained 12 steps" in done.stdout


@pytest.mark.multiprocess
def test_killing_a_ps_on_one_host_stops_both_hosts(hosts, tmp_path):
    cluster = _cluster_file(tmp_path)
    train = ["--", sys.executable, os.path.join(os.path.dirname(__file__), "..", "examples", "demo.py"),
             "--epochs", "50"]
    launchers = _start_hosts(hosts, cluster, tmp_path, ["--quiet", "--timeout", "240"] + train, order=(0, 1))
    log = tmp_path / "host0" / "worker-0.log"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "Epoch 2/" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.5)
    ps_pid = testing.pid_of_task(str(tmp_path / "host0"), "ps")
    assert ps_pid, "PS task not found"
    listening = subprocess.run(hosts.command(0, ["ss", "-Hltn"]), capture_output=True, text=True, check=True).stdout
    ps_sockets = [line.split()[3] for line in listening.splitlines() if line.split()[3].endswith(":2222")]
    assert ps_sockets and all(ADDRESSES[0] in a for a in ps_sockets), f"PS must listen on {ADDRESSES[0]} only"
    os.kill(ps_pid, signal.SIGKILL)
    killed = time.monotonic()
    outputs = _wait_all(launchers, 60)
    elapsed = time.monotonic() - killed
    assert elapsed < 30, f"the run took {elapsed:.0f} s to stop"
    assert all(p.returncode != 0 for p in launchers), outputs
    assert "ps 0 exited unexpectedly with code -9" in outputs[0]
    assert "ps 0 on host 0 (10.77.0.1) exited unexpectedly" in outputs[1] or "worker" in outputs[1], outputs[1][-2000:]


@pytest.mark.multiprocess
def test_the_worker_whose_error_stopped_the_run_is_named_on_every_host(hosts, tmp_path):
    """Worker 1 (host 1) fails on an id past its table; worker 0 (host 0), whose collective Horovod shut down, may
    exit first: host 0's launcher names worker 1 on host 1, not its own worker."""
    launchers = _start_hosts(hosts, _cluster_file(tmp_path), tmp_path, [
        "--quiet", "--timeout", "120", "--", sys.executable, os.path.join(PROGRAMS, "worker_behaviour.py"),
        "bad_id_rank1"], order=(0, 1))
    outputs = _wait_all(launchers, 180)
    assert all(p.returncode == 1 for p in launchers), outputs
    assert "worker 1 failed with exit code 1" in outputs[1], outputs[1][-3000:]
    assert "The input holds id 70, outside an embedding table of 60 rows" in outputs[1], outputs[1][-3000:]
    assert f"worker 1 on host 1 ({ADDRESSES[1]}) failed with exit code 1" in outputs[0], outputs[0][-3000:]
    assert "This worker stopped because another worker failed" in (tmp_path / "host0" / "worker-0.log").read_text()


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["per-host", "ssh"])
def test_max_restarts_across_two_hosts_resumes_to_the_unbroken_run(hosts, tmp_path, mode):
    """Worker 1 (host 1) SIGKILLs itself at step 12 (checkpoints every 5) under --max_restarts 2: the hosts agree on
    the restart through the coordinator, start again on the cluster file's ports, resume from step 10 and end with
    the weights of an unbroken run of the same program."""
    resume = os.path.join(PROGRAMS, "train_resume.py")
    unbroken_out = tmp_path / "unbroken"
    unbroken_out.mkdir()
    unbroken = testing.run_local([sys.executable, resume, str(unbroken_out), str(tmp_path / "ckpt_u"), "20"],
                                 log_dir=str(tmp_path / "logs_u"), workers=2, ps=1, timeout=240)
    assert unbroken.returncode == 0, unbroken.report()
    cluster, out = _cluster_file(tmp_path), tmp_path / "out"
    out.mkdir()
    train = ["--max_restarts", "2", "--timeout", "240", "--", sys.executable, resume, str(out), str(tmp_path / "ckpt"),
             "20", "12"]
    if mode == "per-host":
        launchers = _start_hosts(hosts, cluster, tmp_path, train)
        outputs = _wait_all(launchers, 300)
        assert [p.returncode for p in launchers] == [0, 0], "\n".join(o[-3000:] for o in outputs)
        assert "kparallax-run (host 1): restart 1/2 after worker 1 failed with exit code -9" in outputs[0], outputs[0]
        assert "kparallax-run (host 0): restart 1/2 after" in outputs[1], outputs[1]
        logs = [tmp_path / "host0", tmp_path / "host1"]
    else:
        env = dict(os.environ, PATH=os.path.join(PROGRAMS, "fake_ssh") + os.pathsep + os.environ["PATH"],
                   KP_FAKE_SSH_NETNS=f"{ADDRESSES[0]}={hosts.names[0]},{ADDRESSES[1]}={hosts.names[1]}")
        done = subprocess.run(LAUNCH + ["--cluster", cluster, "--ssh-port", "22", "--log_dir", str(tmp_path / "logs")]
                              + train, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "kparallax-run (host 1): restart 1/2 after worker 1 failed with exit code -9" in done.stdout, done.stdout
        logs = [tmp_path / "logs", tmp_path / "logs"]
    assert "resumed from step 10" in (logs[0] / "worker-0.log").read_text()
    assert (logs[1] / "attempt-1" / "worker-1.log").exists() and (logs[0] / "attempt-1" / "ps-0.log").exists()
    got, want = np.load(out / "final.npz"), np.load(unbroken_out / "final.npz")
    assert int(got["iterations"]) == int(want["iterations"]) == 20
    for key in [k for k in want.files if k.startswith("arr_")]:
        np.testing.assert_allclose(got[key], want[key], rtol=RTOL, atol=ATOL, err_msg=key)


@pytest.mark.multiprocess
def test_tf_config_job_without_launcher(reference, tmp_path):
    """Kubernetes TFJob style: a chief, a worker and a ps, each started with its own TF_CONFIG."""
    ps, chief, worker = (f"127.0.0.1:{net.free_port()}" for _ in range(3))
    spec = {"ps": [ps], "chief": [chief], "worker": [worker]}
    out = tmp_path / "out"
    out.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "KPARALLAX_"))}

    def start(task_type, index, argv):
        env = dict(base, TF_CONFIG=json.dumps({"cluster": spec, "task": {"type": task_type, "index": index}}))
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    train = [sys.executable, os.path.join(PROGRAMS, "train_kparallax.py"), str(out), ",".join(NAMES)]
    ps_process = start("ps", 0, [sys.executable, "-m", "kparallax.cluster.ps_server"])
    try:
        workers = [start("chief", 0, train), start("worker", 0, train)]
        outputs = _wait_all(workers, 300)
        assert [p.returncode for p in workers] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    finally:
        ps_process.send_signal(signal.SIGTERM)
        ps_process.wait(timeout=30)
    _assert_matches_reference(out, reference)
