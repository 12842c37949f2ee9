"""Smoke test of the benchmark suite (scripts/benchmark.py = kparallax_bench.benchmark): tiny model, one timed step per variant; checks the report's shape."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")


@pytest.mark.multiprocess
def test_benchmark_runs_every_variant_and_reports_bytes(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "benchmark.py"), "--model", "lm1b_tiny",
                           "--workers", "1,2", "--steps", "1", "--warmup", "1", "--repeats", "1", "--batch_size", "4",
                           "--json", str(out), "--markdown", str(tmp_path / "bench.md"), "--png",
                           str(tmp_path / "bench.png")], capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())["variants"]
    expected = {f"{v}@{n}" for n in (1, 2) for v in ("kparallax-hybrid", "kparallax-hybrid-async", "kparallax-allreduce",
                                                      "kparallax-allreduce-dense", "kparallax-ps", "horovod",
                                                      "horovod-dense", "tf-pss")} | {"single@1"}
    assert set(report) == expected
    for key, entry in report.items():
        for field in ("throughput", "throughput_min", "throughput_max", "ms_per_step", "bytes_per_step",
                      "floor_bytes_per_step"):
            assert entry[field] >= 0, (key, field)
        assert entry["throughput"] > 0
        cpu = entry["cpu_seconds_per_step"]      # the profile by role, from /proc at the marks
        assert set(cpu) >= {"worker", "chief", "ps", "kernel", "total"} and min(cpu.values()) >= 0, (key, cpu)
    assert sum(e["cpu_seconds_per_step"]["worker"] for e in report.values()) > 0
    assert report["horovod@2"]["bytes_per_step"] > 0 and report["kparallax-hybrid@2"]["bytes_per_step"] > 0
    assert (tmp_path / "bench.png").stat().st_size > 1000 and "| kparallax-hybrid | 2 |" in (tmp_path / "bench.md").read_text()


@pytest.mark.multiprocess
def test_emulated_network_measures_link_bytes_and_feeds_the_projection(tmp_path):
    """Two emulated hosts on 1 Gbit links (namespaces + tc): every variant family runs there, bytes come from the
    links, and project_scaling.py reads the report (validation and projection)."""
    out = tmp_path / "net.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "benchmark.py"), "--model", "lm1b_tiny",
                           "--workers", "2", "--steps", "2", "--warmup", "1", "--repeats", "1", "--batch_size", "4",
                           "--variants", "kparallax-hybrid,horovod,tf-pss", "--emulate-network", "1gbit",
                           "--json", str(out)], capture_output=True, text=True, timeout=900, check=False)
    if done.returncode == 2 and "needs network namespaces" in done.stderr:
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["emulate_network"] == "1gbit" and set(report["variants"]) == {
        "kparallax-hybrid@2", "horovod@2", "tf-pss@2"}
    for entry in report["variants"].values():   # host 0 -> host 1 traffic is on the links (not loopback)
        assert entry["bytes_per_step"] > 0.5 * entry["floor_bytes_per_step"] > 0, entry
        # Of 2 hosts' links (one counter snapshot per mark), the busier sending direction carries at least half of
        # all bytes sent; a receiving direction carries what the other host sent, plus a little from this machine.
        total = entry["bytes_per_step"] * entry["workers"]
        assert total / 2 <= entry["busiest_link_bytes_per_step"] <= 1.05 * total, entry
    projected = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "project_scaling.py"), "--bench",
                                str(out), "--validate", str(out), "--json", str(tmp_path / "p.json")],
                               capture_output=True, text=True, timeout=300, check=False)
    assert projected.returncode == 0, projected.stderr[-3000:]
    assert "| horovod@2 |" in projected.stdout and "Parallax hybrid 277,000" in projected.stdout
    written = json.loads((tmp_path / "p.json").read_text())
    rows = written["validation"]["net.json"]
    assert {row[0] for row in rows} == {"kparallax-hybrid@2", "horovod@2", "tf-pss@2"}, rows
    for key, measured, predicted, error in rows:  # the model predicts each measured step time from the bytes
        assert measured > 0 and predicted > 0 and abs(error) < 10, (key, measured, predicted, error)
    result = written["projection"]
    assert result["workers"] == 48
    # The projection's claim for LM1B at 48 workers: Horovod's allgather moves more per step than the hybrid.
    assert result["comm_ms"]["horovod"] > result["comm_ms"]["kparallax-hybrid"] > 0, result["comm_ms"]


@pytest.mark.multiprocess
def test_steps_per_execution_applies_to_every_variant(tmp_path):
    """--steps_per_execution 2: Keras' compile option in every variant; each call's two steps are timed. The
    kparallax variants also run with local aggregation forced on (two workers of one host)."""
    out = tmp_path / "spe.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "benchmark.py"), "--model", "lm1b_tiny",
                           "--workers", "2", "--steps", "4", "--warmup", "2", "--repeats", "1", "--batch_size", "4",
                           "--steps_per_execution", "2", "--local_aggregation", "on",
                           "--variants", "kparallax-hybrid,kparallax-ps,horovod,tf-pss",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["steps_per_execution"] == 2 and report["local_aggregation"] == "on"
    assert set(report["variants"]) == {"kparallax-hybrid@2", "kparallax-ps@2", "horovod@2", "tf-pss@2"}
    for key, entry in report["variants"].items():
        assert entry["throughput"] > 0 and entry["bytes_per_step"] > 0, (key, entry)


@pytest.mark.multiprocess
def test_a_json_config_and_placement_rules_reach_the_kparallax_variants(tmp_path):
    """--model takes a JSON config (here LM1B with its own softmax weights), --placement kparallax's rules (one of
    them kept replicated): the report records them, gives no floor for the kparallax variant (the analytic one
    assumes the default placement), and every variant reports its peak memory."""
    config = json.loads(open(os.path.join(ROOT, "configs", "lm1b_tiny.json"), encoding="utf-8").read())
    (tmp_path / "weights.json").write_text(json.dumps({**config, "softmax": "weights"}))
    out = tmp_path / "placed.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "benchmark.py"), "--model",
                           str(tmp_path / "weights.json"), "--workers", "2", "--steps", "2", "--warmup", "1",
                           "--repeats", "1", "--batch_size", "4", "--variants", "kparallax-hybrid,horovod",
                           "--placement", '{"lm1b/softmax_b": "replicated"}', "--json", str(out)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["placement"] == '{"lm1b/softmax_b": "replicated"}'
    hybrid, horovod = report["variants"]["kparallax-hybrid@2"], report["variants"]["horovod@2"]
    assert hybrid["floor_bytes_per_step"] is None and horovod["floor_bytes_per_step"] > 0
    assert hybrid["peak_rss_bytes"]["worker"] > 100e6 and hybrid["peak_rss_bytes"]["ps"] > 100e6, hybrid
    assert horovod["peak_rss_bytes"]["worker"] > 100e6 and horovod["peak_rss_bytes"]["ps"] == 0, horovod


@pytest.mark.multiprocess
def test_several_workers_per_emulated_host(tmp_path):
    """--workers_per_host 2: 4 workers on 2 emulated 1 Gbit/s hosts (ranks 0-1 on host 0, 2-3 on host 1). kparallax's
    cluster file lists two workers per host, Horovod's rendezvous two slots per host; only what crosses hosts is
    counted, so no per-worker floor is given, and project_scaling.py refuses the report."""
    out = tmp_path / "hosts.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "benchmark.py"), "--model", "lm1b_tiny",
                           "--workers", "4", "--workers_per_host", "2", "--steps", "2", "--warmup", "1",
                           "--repeats", "1", "--batch_size", "4", "--variants", "kparallax-hybrid,horovod",
                           "--emulate-network", "1gbit", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, check=False)
    if done.returncode == 2 and "needs network namespaces" in done.stderr:
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["workers_per_host"] == 2 and set(report["variants"]) == {"kparallax-hybrid@4", "horovod@4"}
    for key, entry in report["variants"].items():
        assert entry["throughput"] > 0 and entry["bytes_per_step"] > 0, (key, entry)
        assert entry["floor_bytes_per_step"] is None, (key, entry)
        total = entry["bytes_per_step"] * entry["workers"]   # two links: the busier sending one has at least half
        assert total / 2 <= entry["busiest_link_bytes_per_step"] <= 1.05 * total, (key, entry)
    assert "| kparallax-hybrid | 4 |" in done.stdout and " MB | - | - | " in done.stdout   # no floor, no ratio
    refused = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "project_scaling.py"), "--bench",
                              str(out)], capture_output=True, text=True, timeout=300, check=False)
    assert refused.returncode != 0 and "Received: workers_per_host=2" in refused.stderr, refused.stderr[-2000:]


def test_bad_arguments_are_named():
    for argv, message in ((["--emulate-network", "fast"], "Received: 'fast'"),
                          (["--variants", "tf-ps"], "unknown variant 'tf-ps'"),
                          (["--emulate-network", "1gbit", "--ps", "3", "--workers", "2"], "Received: --ps=3"),
                          (["--steps_per_execution", "3", "--steps", "4"], "Received: --steps_per_execution=3"),
                          (["--workers_per_host", "2", "--workers", "4"], "Received: --workers_per_host=2"),
                          (["--emulate-network", "1gbit", "--workers_per_host", "2", "--workers", "3"],
                           "--workers=3, --workers_per_host=2"),
                          (["--emulate-network", "1gbit", "--workers_per_host", "2", "--workers", "4", "--ps", "3"],
                           "Received: --ps=3"),
                          (["--json", "/nonexistent-dir/b.json"], "Received: --json=/nonexistent-dir/b.json"),
                          (["--placement", "{ps}"], "--placement must be a JSON object"),
                          (["--placement", '["ps"]'], "Received: --placement=[\"ps\"]"),
                          (["--warmup", "0"], "Received: --warmup=0"),
                          (["--workers", "2,0"], "Received: --workers=2,0"),
                          (["--batch_size", "0"], "Received: --batch_size=0"),
                          (["--model", "resnet51"], "--model: Unknown preset 'resnet51'")):
        done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "benchmark.py"), *argv],
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.multiprocess
def test_link_check_bursts_are_limited_by_the_emulated_links(tmp_path):
    """kparallax_bench.link_check on 3 emulated 1 Gbit/s hosts: raw TCP (one flow, an incast of two, all to all) and
    TensorFlow's push and pull to two PS servers, each burst no faster than its bytes allow at the link rate."""
    out = tmp_path / "links.json"
    done = subprocess.run([sys.executable, "-m", "kparallax_bench.link_check", "--hosts", "3", "--rate", "1gbit",
                           "--mb", "4", "--rounds", "2", "--idle", "0.2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, check=False, cwd=ROOT)
    if done.returncode == 2 and "needs an emulated network" in done.stderr:
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    patterns = json.loads(out.read_text())["patterns"]
    assert [p["pattern"].split(",")[0] for p in patterns] == ["tcp", "tcp", "tcp", "tf-push", "tf-pull"], patterns
    for pattern in patterns:  # 4 MB at 1 Gbit/s is 32 ms: a burst cannot beat its link, nor should it take ages
        assert 0.9 < pattern["ratio"] < 10, pattern
    assert "| tf-push, host 0 <-> 2 PS tasks | 4.0 |" in done.stdout


def test_link_check_refuses_a_host_count_below_two():
    done = subprocess.run([sys.executable, "-m", "kparallax_bench.link_check", "--hosts", "1"], capture_output=True,
                          text=True, timeout=120, check=False, cwd=ROOT)
    assert done.returncode == 2 and "Received: --hosts=1" in done.stderr, done.stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("process_sets", ["static", "dynamic"])
def test_horovod_idle_reports_every_worker(process_sets, tmp_path):
    done = subprocess.run([sys.executable, "-m", "kparallax.launch", "--workers", "2", "--ps", "0", "--timeout", "120",
                           "--log_dir", str(tmp_path), "--", sys.executable, "-m", "kparallax_bench.horovod_idle",
                           "--process_sets", process_sets, "--idle_seconds", "1", "--allreduces", "3"],
                          capture_output=True, text=True, timeout=180, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line.split("] ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("[worker 0] {")]
    assert [r["rank"] for r in rows] == [0, 1] and {r["process_sets"] for r in rows} == {process_sets}, done.stdout
    assert all(r["idle_cpu_s_per_s"] > 0 and r["cpu_ms_per_allreduce_4mb"] > 0 for r in rows), rows
