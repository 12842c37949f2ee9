import subprocess
import sys

import pytest

from kparallax.launch import cluster_file
from kparallax.cluster import coordinator as rendezvous


def test_yaml_cluster_assigns_ranks_and_ports_host_by_host():
    plan = cluster_file.parse("""
rendezvous_port: 30000
hosts:
  - {host: 10.0.0.1, workers: 2, ps: 1, interface: eth0}
  - {host: 10.0.0.2, workers: 1, ps: 2, ps_port: 4000}
""")
    assert plan.num_workers == 3 and plan.num_ps == 3
    assert plan.worker_addresses == ["10.0.0.1:2300", "10.0.0.1:2301", "10.0.0.2:2300"]
    assert plan.ps_addresses == ["10.0.0.1:2222", "10.0.0.2:4000", "10.0.0.2:4001"]
    assert plan.worker_ranks(1) == [2] and plan.ps_indices(1) == [1, 2]
    assert plan.coordinator == "10.0.0.1:30000" and plan.hosts[0].interface == "eth0"
    assert cluster_file.ClusterPlan.from_json(plan.to_json()) == plan


def test_parallax_resource_info_form():
    plan = cluster_file.parse("# parallax\nhost-a: 0,1\nhost-b: 0,1,2,3\n")
    assert [(h.host, h.workers, h.ps) for h in plan.hosts] == [("host-a", 2, 1), ("host-b", 4, 1)]


@pytest.mark.parametrize("text, message", [
    ("hosts:\n  - {host: a, workers: 1}\n  - {host: a, workers: 2}\n", r"host a is listed twice"),
    ("hosts:\n  - {host: a, workers: 0, ps: 0}\n", r"host a has zero slots.*Received: workers=0, ps=0"),
    ("hosts:\n  - {host: a, workers: 1, ps_port: 70000}\n", r"host a: ps_port must be a port number in 1..65535. "
                                                            r"Received: ps_port=70000"),
    ("hosts:\n  - {host: a, workers: 1, gpus: 2}\n", r"hosts\[0\]: unknown key\(s\) \['gpus'\]"),
    ("hosts: []\n", r"'hosts' must be a non-empty list"),
    ("nodes: [a]\n", r"must be a mapping with a 'hosts' list"),
    ("hosts:\n  - {host: 'a b', workers: 1}\n", r"host must be an IP address or host name. Received: host='a b'"),
    ("hosts:\n  - {host: a, workers: -1}\n", r"workers must be an integer >= 0. Received: workers=-1"),
    ("hosts:\n  - {host: a, workers: 2, ps: 1, ps_port: 2300, worker_port: 2300}\n", r"ports overlap"),
])
def test_cluster_file_errors_name_the_problem(text, message):
    with pytest.raises(ValueError, match=message):
        cluster_file.parse(text, source="c.yaml")


def test_hosts_argument_horovodrun_style():
    plan = cluster_file.from_hosts_arg("h1:2,h2:1", ps_per_host=1)
    assert plan.num_workers == 3 and plan.num_ps == 2
    with pytest.raises(ValueError, match=r"-H expects host:slots entries"):
        cluster_file.from_hosts_arg("h1", 1)


def test_slot_plan_matches_horovod_conventions():
    slots = rendezvous.slot_plan_for_hosts(["a", "b", "a"])
    assert [(s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == [
        (0, 0, 2, 0, 2), (1, 0, 1, 1, 2), (2, 1, 2, 0, 1)]


def _launch(*args):
    return subprocess.run([sys.executable, "-m", "kparallax.launch", *args], capture_output=True, text=True,
                          timeout=60, check=False)


def test_launcher_rejects_bad_cluster_files_and_mismatched_counts(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("hosts:\n  - {host: a, workers: 1}\n  - {host: a, workers: 1}\n")
    done = _launch("--cluster", str(bad), "--", "true")
    assert done.returncode == 2 and "host a is listed twice" in done.stderr
    good = tmp_path / "good.yaml"
    good.write_text("hosts:\n  - {host: 127.0.0.1, workers: 2, ps: 1}\n")
    done = _launch("--cluster", str(good), "--workers", "3", "--host-index", "0", "--", "true")
    assert done.returncode == 2 and "--workers=3 does not match the cluster (2 workers in total)" in done.stderr
    done = _launch("--cluster", str(good), "--host-index", "5", "--", "true")
    assert done.returncode == 2 and "--host-index must be in 0..0" in done.stderr
    done = _launch("--cluster", str(tmp_path / "missing.yaml"), "--", "true")
    assert done.returncode == 2 and "Cannot read cluster file" in done.stderr


def test_a_port_already_in_use_is_named_before_anything_starts(tmp_path):
    import socket  # pylint: disable=import-outside-toplevel
    from kparallax.cluster import net  # pylint: disable=import-outside-toplevel
    port = net.free_port()
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    try:
        cluster = tmp_path / "c.yaml"
        cluster.write_text(f"rendezvous_port: {net.free_port()}\n"
                           f"hosts:\n  - {{host: 127.0.0.1, workers: 1, ps: 1, ps_port: {port}, "
                           f"worker_port: {net.free_port()}}}\n")
        done = _launch("--cluster", str(cluster), "--host-index", "0", "--log_dir", str(tmp_path / "logs"), "--", "true")
    finally:
        holder.close()
    assert done.returncode == 2, done.stderr
    assert f"port {port} on 127.0.0.1 (ps_port) cannot be used (Address already in use)" in done.stderr


def test_a_launcher_reads_every_hosts_status_in_one_request():
    """Before: one request per host and poll, from every launcher (~130 a second at host 0 with 8 hosts, growing
    with the square of the hosts); a status key ``..._host_1`` must not be read as host 10's or the reverse."""
    import types  # pylint: disable=import-outside-toplevel
    from kparallax.cluster import net  # pylint: disable=import-outside-toplevel
    from kparallax.launch import multihost  # pylint: disable=import-outside-toplevel
    server = rendezvous.Coordinator("127.0.0.1", net.free_port(),
                                    rendezvous.slot_plan([("127.0.0.1", 1)]))
    try:
        for key, value in [("a0_host_1", "running"), ("a0_host_10", "done"), ("a1_host_1", "done")]:
            rendezvous.put(server.address, key, value)
        assert rendezvous.get_prefixed(server.address, "a0_host_1") == {"a0_host_1": "running", "a0_host_10": "done"}
        assert rendezvous.get_prefixed(server.address, "nothing_") == {}
        assert rendezvous.get(server.address, "a0_host_10") == "done"   # Horovod's own reads still answered
        plan = types.SimpleNamespace(hosts=[types.SimpleNamespace(host=f"h{j}") for j in range(12)])
        watcher = multihost._Watcher(server.address, plan, 0)  # pylint: disable=protected-access
        before = server.requests
        statuses, failure = watcher.poll(force=True)
        assert server.requests - before == 1
        assert failure is None
        assert statuses == {j: {1: "running", 10: "done"}.get(j) for j in range(12)}
        rendezvous.put(server.address, "a0_host_11", "failed|3|0|worker 5|exited with code 3")
        _, failure = watcher.poll(force=True)
        assert failure is not None and "worker 5 on host 11 (h11)" in failure.name and failure.code == 3
    finally:
        server.stop()
